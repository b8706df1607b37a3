"""Pacing: each step's tree and lookup chosen by expected speed from this machine's step costs (faked here, so that
the right choice is known), measured once per machine; and per prompt as it goes, without changing the output."""

import types

import pytest
import torch

import mtp
import mtp.decoding.costs
from mtp.base import load_tokenizer
from mtp.decoding.batch import Row
from mtp.decoding.costs import machine_pacer, measure_steps
from mtp.decoding.decoder import Decoder
from mtp.decoding.pacing import MIN_RETURN_RATE, RETURN_RATE, Candidate, Pacer, Plan
from mtp.decoding.tree import Tree, grow_tree
from mtp.drafters.heads import MedusaHeads
from tests.conftest import PROMPT, TINY_BASE, OracleHeads, random_heads, reference, save_random_heads, tiny_model

CALIBRATION = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]
PATHS = grow_tree(CALIBRATION, 64)[0]
# the root alone, and trees of 2, 4 and 8 nodes that accept more as they grow
CANDIDATES = [
    Candidate(1),
    Candidate(2, (), 0.6, depth=1),
    Candidate(4, (), 1.0, depth=2),
    Candidate(8, (), 1.3, depth=3),
]
CHEAP = [0.1] * 6  # sizes 1, 2, 3, 4, 6, 8 cost one plain step: the biggest tree pays most
DEAR = [0.1, 0.2, 0.3, 0.4, 0.6, 0.8]  # every node costs a plain step: no tree pays
COMPILED = types.SimpleNamespace(buckets=(1, 4, 8), length=64)  # what pacing reads of a compiled pass
TEN_OR_NONE = (0.5,) + (0.0,) * 9 + (0.5,)  # the share of steps with 0, 1, ..., 10 new lookup nodes


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


def fake_timings(monkeypatch, timings: dict[int, list[float]]) -> list[int]:
    """measure_steps returns `timings[batch]`; returns the batch sizes it is asked for, in order."""
    asked = []

    def measure(*args, batch: int = 1, **kwargs):
        asked.append(batch)
        return timings[batch]

    monkeypatch.setattr(mtp.decoding.costs, "measure_steps", measure)
    return asked


def test_cheap_rows_take_the_biggest_tree_and_dear_rows_plain_steps(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model = tiny_model()
    heads = random_heads(model, num_heads=3)
    asked = fake_timings(monkeypatch, {1: CHEAP, 2: DEAR, 4: CHEAP})
    pacer = machine_pacer(model, tokenizer, heads, CANDIDATES, PATHS)
    assert pacer.best(1).tree.size == 8 and pacer.best(1).tree.paths == Tree.from_paths(PATHS[:7]).paths
    assert asked == [1]  # batch sizes are timed when a batch first needs them
    pacer.prepare(3)
    assert asked == [1, 2] and pacer.best(3).tree.size == 1  # a step over 2 or 3 rows: plain
    pacer.prepare(4)
    assert asked == [1, 2, 4] and pacer.best(4).tree.size == 8
    # in between: tokens per second 1 / 0.1 = 10 plain, 1.6 / 0.15 = 10.7 with 2 nodes, 2 / 0.2 = 10 with 4, 2.3 /
    # 0.35 = 6.6 with 8
    fake_timings(monkeypatch, {1: [0.1, 0.15, 0.18, 0.2, 0.28, 0.35]})
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "another"))
    assert machine_pacer(model, tokenizer, heads, CANDIDATES, PATHS).best(1).tree.size == 2


def test_on_the_compiled_pass_lookup_expects_only_the_tokens_that_fit_beside_the_tree(tmp_path, monkeypatch, tokenizer):
    """The largest compiled pass (8 nodes) verifies no lookup token beside an 8-node tree and at most 4 beside a
    4-node one: pacing expects and proposes no more (`within`), so the 4-node tree with lookup wins; eagerly
    (no compiled pass) the 8-node tree with lookup verifies everything and wins."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model = tiny_model()
    heads = random_heads(model, num_heads=3)
    fake_timings(monkeypatch, {1: CHEAP})
    candidates = [Candidate(1), Candidate(4, (0, 5, 10), 0.7, 1.0, depth=2), Candidate(8, (10,) * 3, 1.0, 1.2, depth=3)]
    eager = machine_pacer(model, tokenizer, heads, candidates, PATHS).best(1)
    assert eager.tree.size == 8 and eager.lookup.lengths == (10, 10, 10)
    pacer = machine_pacer(model, tokenizer, heads, candidates, PATHS, COMPILED)
    best = pacer.best(1)
    assert best.tree.size == 4 and best.lookup.lengths == (0, 4, 4) and best.candidate.from_lookup == 1.0
    eight = next(plan for plan, _ in pacer.options(1) if plan.tree.size == 8)
    assert eight.lookup is None and eight.candidate.from_lookup == 0.0


def test_lookup_cut_to_the_room_beside_the_tree_expects_the_share_of_its_new_nodes_that_fit(
    tmp_path, monkeypatch, tokenizer
):
    """Half the steps propose 10 new lookup nodes, half none: beside a 4-node tree the largest compiled pass keeps 4
    of them, beside a 6-node tree 2, so lookup expects 0.4 and 0.2 of its saved acceptance. Kept whole, the 6-node
    tree's lookup (1.30 expected) made that tree the fastest at these costs; cut, the 4-node tree is."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model = tiny_model()
    heads = random_heads(model, num_heads=3)
    fake_timings(monkeypatch, {1: CHEAP})
    candidates = [
        Candidate(1),
        Candidate(4, (10,) * 3, 0.7, 1.28, TEN_OR_NONE, depth=2),
        Candidate(6, (10,) * 3, 0.87, 1.30, TEN_OR_NONE, depth=3),
    ]
    pacer = machine_pacer(model, tokenizer, heads, candidates, PATHS, COMPILED)
    cut = {
        plan.tree.size: (plan.lookup.lengths, plan.candidate.from_lookup) for plan, _ in pacer.options(1) if plan.lookup
    }
    assert cut == {4: ((4, 4, 4), pytest.approx(0.4 * 1.28)), 6: ((2, 2, 2), pytest.approx(0.2 * 1.30))}
    assert pacer.best(1).tree.size == 4


def test_a_cut_lookup_that_sizing_simulated_comes_before_the_estimate_of_a_longer_one(tmp_path, monkeypatch, tokenizer):
    """Sizing saves lookups also cut to the room beside their tree (`mtp.tools.sizing`): on the compiled pass the
    4-node tree's 10 / 10 / 10, cut to 4 / 4 / 4, gives way to the simulated 4 / 4 / 4 (0.85 accepted a step against
    0.51 estimated), and then wins over the 6-node tree; a cut with no simulated twin keeps its estimate, and one
    cut to nothing gives way to the tree alone."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model = tiny_model()
    heads = random_heads(model, num_heads=3)
    fake_timings(monkeypatch, {1: CHEAP})
    candidates = [
        Candidate(1),
        Candidate(4, (10,) * 3, 0.7, 1.28, TEN_OR_NONE, depth=2),
        Candidate(4, (4,) * 3, 0.7, 0.85, (0.5,) + (0.0,) * 3 + (0.5,), depth=2),
        Candidate(6, (10,) * 3, 0.87, 1.30, TEN_OR_NONE, depth=3),
        Candidate(8, (), 0.95, depth=3),
        Candidate(8, (10,) * 3, 0.95, 1.30, TEN_OR_NONE, depth=3),
    ]
    pacer = machine_pacer(model, tokenizer, heads, candidates, PATHS, COMPILED)
    options = [(plan.tree.size, plan.candidate.lookup, plan.candidate.from_lookup) for plan, _ in pacer.options(1)]
    assert options == [(1, (), 0.0), (4, (4, 4, 4), 0.85), (6, (2, 2, 2), pytest.approx(0.2 * 1.30)), (8, (), 0.0)]
    best = pacer.best(1)
    assert best.tree.size == 4 and best.lookup.lengths == (4, 4, 4) and best.candidate.from_lookup == 0.85
    assert machine_pacer(model, tokenizer, heads, candidates, PATHS).best(1).lookup.lengths == (10,) * 3  # eager


def test_sizes_are_timed_in_turn_so_that_a_host_whose_speed_drifts_weighs_on_every_size_alike(monkeypatch, tokenizer):
    """Every size is timed once a round, forward then backward: with the host slowing down or speeding up steadily
    (here a step takes less time with every step timed), the costs keep the true ratios between sizes; timed one
    size after another, or in turn always in one order, the later sizes would seem cheaper than they are."""
    model = tiny_model()
    heads = random_heads(model, num_heads=3)
    built, clock = [], []

    class Recorded(Decoder):  # the size whose steps are timed next
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.tree.size)

    def drifting(call, device):  # 1 + 0.25 per node beyond the root, at the host's speed of the moment
        clock.append(built[-1])
        return (1 + 0.25 * (built[-1] - 1)) * (2 - len(clock) / 200)

    monkeypatch.setattr(mtp.decoding.costs, "Decoder", Recorded)
    monkeypatch.setattr(mtp.decoding.costs, "timed", drifting)
    costs = measure_steps(model, tokenizer, heads, PATHS[:7], context=8)  # sizes 1, 2, 3, 4, 6, 8
    forward = [1, 1, 2, 3, 4, 6, 8]  # the plain step with mtp's products and with the usual ones, then the trees
    assert built == forward + forward[::-1] + forward + forward[::-1] and len(clock) == 4 * 7 * 3
    assert [cost / costs[0] for cost in costs] == pytest.approx([1, 1.25, 1.5, 1.75, 2.25, 2.75])
    built.clear(), clock.clear()
    costs = measure_steps(model, tokenizer, heads, PATHS[:7], context=8, bound=1.6)
    forward = [1, 1, 2, 3, 4]  # the first round stops at the first size dearer than 1.6 plain steps
    assert built == forward + forward[::-1] + forward + forward[::-1]
    assert [cost / costs[0] for cost in costs] == pytest.approx([1, 1.25, 1.5, 1.75])


def test_costs_are_measured_once_per_machine_and_the_first_time_said_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    path, _, _ = save_random_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = CALIBRATION
    heads.save_config(path)
    asked = fake_timings(monkeypatch, {1: CHEAP})
    first = mtp.load(path)
    said = capsys.readouterr().err.strip().splitlines()
    assert asked == [1] and len(said) == 1 and said[0].startswith("mtp: timed decoding steps on ")
    assert "chose the 8-node tree with no lookup" in said[0]  # the calibration's trees: the biggest timed
    second = mtp.load(path)
    assert asked == [1] and capsys.readouterr().err == ""  # read from the cache: silent, the same choice
    assert second.tree.paths == first.tree.paths and second.lookup is first.lookup is None
    # the caller's tree wins: nothing measured, nothing chosen
    chosen = mtp.load(path, tree="chain")
    assert asked == [1] and chosen.tree.size == 4 and list(chosen.pacer.plans) == [1]
    assert len(chosen.pacer.plans[1]) == 1
    # another machine (or thread count) is timed anew
    monkeypatch.setattr(mtp.decoding.costs, "device_name", lambda device: "Another CPU x3 threads")
    mtp.load(path)
    assert asked == [1, 1] and "Another CPU x3 threads" in capsys.readouterr().err


class Recorded(Pacer):
    """A pacer that keeps every step's plan."""

    def plan(self, rows):
        chosen = super().plan(rows)
        self.chosen.append(chosen.tree.size)
        return chosen


def paced(candidates: list[Candidate], seconds: list[float]) -> Recorded:
    pacer = Recorded(
        {
            1: [
                (Plan(Tree.from_paths(PATHS[: c.size - 1]), None, c), s)
                for c, s in zip(candidates, seconds, strict=True)
            ]
        }
    )
    pacer.chosen = []
    return pacer


def test_a_prompt_whose_guesses_are_never_right_ends_at_plain_steps_with_the_same_output(tokenizer):
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    # at the average skill the 4-node tree pays (2 tokens for 1.3 plain steps); random heads are never right
    pacer = paced([Candidate(1), Candidate(4, (), 1.0, depth=2)], [1.0, 1.3])
    decoder = Decoder(model, tokenizer, random_heads(model, num_heads=3), pacer=pacer)
    result = decoder.generate(PROMPT, max_new_tokens=60)
    assert result.token_ids == reference(model, input_ids, 60)
    assert pacer.chosen[0] == 4 and result.acceptance.by_source.get("heads", 0) <= 3  # by chance, if ever
    later = pacer.chosen[30:]  # (in play, a step weighs RATE: about 20 steps that accept nothing drop the tree)
    assert later.count(1) >= 0.75 * len(later)  # plain steps, with a rare try of the tree
    # guesses always right keep the tree every step
    run = torch.cat([input_ids[0], torch.tensor(reference(model, input_ids, 60))])
    pacer = paced([Candidate(1), Candidate(4, (), 1.0, depth=2)], [1.0, 1.3])
    decoder = Decoder(model, tokenizer, OracleHeads(model, run, 3), pacer=pacer)
    result = decoder.generate(PROMPT, max_new_tokens=60)
    assert result.token_ids == reference(model, input_ids, 60)
    assert set(pacer.chosen) == {4} and result.tau > 2.5


def test_skills_scale_what_a_candidate_expects_up_to_what_it_can_accept():
    candidate = Candidate(4, (0, 4), 1.0, 0.5, depth=2)
    assert candidate.tau == 2.5 and candidate.expected(1.0, 1.0) == 2.5
    assert candidate.expected(0.0, 0.0) == 1.0
    assert candidate.expected(4.0, 4.0) == 1 + 2 + 2  # at most the tree's depth, and lookup's 2


def test_a_drafter_whose_tries_keep_failing_is_tried_ever_more_rarely_and_one_hit_restores_it():
    pacer = paced([Candidate(1), Candidate(4, (), 1.0, depth=2)], [1.0, 1.3])
    row = Row(prefix_len=0, root=0, max_length=10_000)

    def tries(steps: int, hit: bool = False) -> list[int]:
        chosen = []
        for step in range(steps):
            plan = pacer.plan([row])
            if plan.tree.size > 1:
                chosen.append(step)
            pacer.update(row, plan, int(hit and plan.tree.size > 1), 0)
        return chosen

    failed = tries(600)
    assert failed[:20] == list(range(20))  # in play, each step that accepts nothing weighs RATE
    retries = [
        step for step in failed[20:] if step - 1 not in failed
    ]  # tries after sitting out, each weighing RETRY_WEIGHT
    gaps = [later - earlier for earlier, later in zip(retries, retries[1:], strict=False)]
    assert len(gaps) >= 5 and gaps[0] < gaps[1] < gaps[2] and gaps[2] >= 3 * gaps[0]  # backing off
    assert abs(gaps[-1] - gaps[-2]) <= 1 and row.tree_skill.back == MIN_RETURN_RATE  # to a floor
    tries(gaps[-1] + 1, hit=True)  # the next try accepts a candidate: tried again as soon as at first
    assert row.tree_skill.back == RETURN_RATE
