import json
import types

import pytest
import torch

import mtp
import mtp.decoding.batch
import mtp.decoding.costs
import mtp.tools.sizing
from mtp.base import load_tokenizer
from mtp.decoding.costs import SIZES, step_costs
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import FULL_REACH, Lookup
from mtp.decoding.pacing import Candidate
from mtp.decoding.tree import DynamicTree, Tree, grow_tree, named_tree
from mtp.drafters.contract import Drafter
from mtp.drafters.heads import MedusaHeads
from mtp.tools.simulate import acceptance, evenly_spaced, grown_accepts, held_out_roots, simulate
from mtp.tools.sizing import size_tree
from tests.conftest import PROMPT, TINY_BASE, random_heads, reference, save_random_heads, tiny_model

# Two heads, three ranks: head 0 is right at rank 0 60% of the time, and so on.
CALIBRATION = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]


def test_greedy_growth_gives_the_hand_computed_tree_and_expected_tau():
    paths, expected = grow_tree(CALIBRATION, max_nodes=7)
    # node probabilities: (0) .6, (0,0) .3, (1) .2, (0,1) .18, then a tie at .1 between (2) and (1,0): the
    # shallower first; (0,2) = (1,1) = .06 come later
    assert paths == [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0)]
    assert expected == pytest.approx([1, 1.6, 1.9, 2.1, 2.28, 2.38, 2.48])
    assert grow_tree(CALIBRATION, max_nodes=100)[0][-1] == (2, 2)  # all 3 + 9 nodes, the least likely last
    assert len(grow_tree(CALIBRATION, max_nodes=100)[0]) == 12
    assert named_tree("4", num_heads=2, calibration=CALIBRATION).paths == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="needs heads with calibration"):
        named_tree("4", num_heads=2)


def test_the_cost_model_never_decreases_with_the_tree_size():
    noisy = [0.05, 0.049, 0.06, 0.058, 0.07, 0.09, 0.1, 0.12, 0.16, 0.2, 0.3, 0.4]  # dips: timing noise
    costs = step_costs(noisy, 80)
    assert len(costs) == 80 and all(a <= b for a, b in zip(costs, costs[1:], strict=False))
    assert costs[:4] == pytest.approx([0.0495, 0.0495, 0.059, 0.059])  # a dip: both sizes their mean
    assert costs[6] == pytest.approx(0.08)  # size 7: halfway
    assert costs[-1] == pytest.approx(0.5)  # past size 64: the line through 48 (0.3) and 64 (0.4)
    assert step_costs([0.05], 3) == [0.05] * 3  # one timed size: flat


def test_sizing_times_the_device_and_saves_the_best_tree_which_load_then_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    path, _, _ = save_random_heads(tmp_path, "shared")
    with pytest.raises(ValueError, match="no calibration"):
        size_tree(path, max_nodes=8)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = [[0.9, 0.05] + [0.0] * 8] + [[0.8, 0.1] + [0.0] * 8] * (heads.config.num_heads - 1)
    heads.save_config(path)
    table = size_tree(path, max_nodes=8, context=32)
    assert table["size"] == list(range(1, 9)) and table["expected_tau"][0] == 1
    assert all(a <= b for a, b in zip(table["step_seconds"], table["step_seconds"][1:], strict=False))
    best = max(table["size"], key=lambda n: table["expected_speedup"][n - 1])
    assert table["chosen"] == best
    cached = json.loads((tmp_path / "cache" / "step_seconds.json").read_text())
    assert [len(v) for v in cached.values()] == [len([s for s in SIZES if s <= 8])]  # one device entry
    saved = MedusaHeads.from_pretrained(path).config
    assert saved.tree == [list(path) for path in grow_tree(heads.config.calibration, best)[0]]
    assert saved.acceptance == []  # without held-out answers, load weighs the trees grown from the calibration
    size_tree(path, max_nodes=8, context=32)  # the second time, the cached timings: nothing new is measured
    assert json.loads((tmp_path / "cache" / "step_seconds.json").read_text()) == cached


def test_the_expected_speedup_is_tau_times_the_plain_step_over_the_tree_step(tmp_path, monkeypatch):
    """Fixed step timings instead of measured ones, and figures computed by hand from them."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    measured = [0.04, 0.05, 0.06, 0.08, 0.10]  # seconds per step of sizes 1, 2, 3, 4, 6
    monkeypatch.setattr(mtp.tools.sizing, "measure_steps", lambda *args, **kwargs: measured)
    path, _, _ = save_random_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = CALIBRATION + [[0.0, 0.0, 0.0]]  # the third head never right: no node below it
    heads.save_config(path)
    table = size_tree(path, max_nodes=7)
    assert table["expected_tau"] == pytest.approx([1, 1.6, 1.9, 2.1, 2.28, 2.38, 2.48])  # as in the test above
    # size 5: halfway; size 7, past the last timed size: on the line through sizes 4 and 6
    assert table["step_seconds"] == pytest.approx([0.04, 0.05, 0.06, 0.08, 0.09, 0.10, 0.11])
    # tau(N) * 0.04 / step(N): 1, 1.6 * 0.8, 1.9 * 2/3, 2.1 / 2, 2.28 * 4/9, 2.38 * 0.4, 2.48 * 4/11
    assert table["expected_speedup"] == pytest.approx([1, 1.28, 1.266667, 1.05, 1.013333, 0.952, 0.901818], abs=1e-6)
    assert table["chosen"] == 2 and MedusaHeads.from_pretrained(path).config.tree == [[0]]


# Held-out roots by hand (see held_out_roots): an answer of 6 tokens (roots 0-4) and one of 3 (roots 5-6); paths
# (0,), (0, 0), (1,), ...: order[:, d] < size - 1 where the size-node tree holds the true path to depth d + 1.
ROOTS = {
    "left": torch.tensor([5, 4, 3, 2, 1, 2, 1]),
    "order": torch.tensor([[0, 1], [2, 3], [3, 3], [0, 3], [0, 1], [0, 1], [3, 3]]),
    "match": torch.tensor([0, 1, 2, 0, 0, 1, 0]),  # lookup's match length: none, 1 token, 2 tokens
    "chain": torch.tensor([0, 3, 2, 0, 0, 4, 0]),
    "right": torch.tensor([0, 3, 0, 0, 0, 2, 0]),
}


def test_the_simulated_decoding_of_held_out_answers_counted_by_hand():
    costs = [float(n) for n in range(1, 20)]  # a step of n nodes: n seconds
    # size 3 (paths (0,), (0, 0)), lookup 2 after 1 token, 5 after 2: root 0 takes 2 + bonus -> root 3 takes 1 +
    # bonus -> root 5: heads 2 and lookup 2 (merged: no new node) -> the answer ends
    assert simulate(ROOTS, 3, [2, 5], costs) == (7, 3, 3 + 3 + 3)
    # size 2: root 0 -> 2: lookup's 2 wrong tokens are 2 more nodes -> 3 -> 5: 2 lookup tokens, the first the
    # heads' too: 1 new node, both right -> the end
    assert simulate(ROOTS, 2, [2, 5], costs) == (7, 4, 2 + 4 + 2 + 3)
    # the root alone: 0 -> 1: lookup's first 2 right (3 proposed, capped at 2) -> 4 -> 5: 2 right -> the end
    assert simulate(ROOTS, 1, [2, 5], costs) == (7, 4, 1 + 3 + 1 + 3)
    assert simulate(ROOTS, 1, [], costs) == (7, 7, 7)  # plain decoding
    assert simulate(ROOTS, 4, [10], costs) == (7, 3, 4 + 4 + 6)  # no length for 2-token matches: none


def test_what_each_candidate_accepts_per_step_counted_by_hand():
    # as above, size 3: the heads' 2, their 1, then 1 (the answer's end) with lookup's 2 merged: 3 nodes each step
    def saved(candidate: Candidate) -> dict:  # rounded as the folder keeps it
        return candidate.as_dict()

    assert saved(acceptance(ROOTS, 3, [2, 5], depth=2)) == saved(Candidate(3, (2, 5), 4 / 3, 0.0, (1.0,), 2))
    # the root alone: 0, lookup's 2 (3 nodes), 0, lookup's 1 at the answer's end (3 nodes)
    assert saved(acceptance(ROOTS, 1, [2, 5], depth=0)) == saved(Candidate(1, (2, 5), 0.0, 0.75, (0.5, 0.0, 0.5)))
    assert saved(acceptance(ROOTS, 1, [0, 0], depth=0)) == saved(Candidate(1))  # plain decoding
    # size 2: the heads' 1 at roots 0, 3 and 5 (where lookup's 2 are cut to 1 by the answer's end), none at root
    # 2, whose 2 wrong lookup tokens are new nodes: steps of 2, 4, 2 and 3 nodes
    candidate = acceptance(ROOTS, 2, [2, 5], depth=1)
    assert saved(candidate) == saved(Candidate(2, (2, 5), 0.75, 0.0, (0.5, 0.25, 0.25), 1))
    # two rows at once: a step pads both rows to the larger: 2 nodes with probability 1/4, 3 with 9/16 - 1/4, 4
    # with 1 - 9/16
    costs = [float(n) for n in range(1, 20)]
    assert candidate.seconds(costs, 2) == pytest.approx(2 / 4 + 3 * 5 / 16 + 4 * 7 / 16)
    assert candidate.seconds(costs) == pytest.approx((2 + 4 + 2 + 3) / 4)


def test_sizing_with_held_out_answers_simulates_each_size_and_saves_the_best_tree_and_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mtp.tools.sizing, "measure_steps", lambda *args, **kwargs: [0.04, 0.05, 0.06, 0.08, 0.10])
    # an answer of 9 tokens that copies earlier text: at each root, a 2-token match whose chain is right to the
    # end; the heads never right
    left = torch.arange(8, 0, -1)
    copy = {
        "left": left,
        "order": torch.full((8, 2), 6),
        "match": torch.full((8,), 2),
        "chain": torch.full((8,), 10),
        "right": left,
    }
    monkeypatch.setattr(mtp.tools.sizing, "held_out_roots", lambda *args: copy)
    dynamic = [{"plan": "dynamic:4:2:2", "speedup": 1.5, "static_speedup": 1.6, "lengths": [1]}]  # static wins
    monkeypatch.setattr(mtp.tools.sizing, "dynamic_trees", lambda *args: dynamic)
    path, _, _ = save_random_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = CALIBRATION + [[0.0, 0.0, 0.0]]
    heads.save_config(path)
    table = size_tree(path, max_nodes=7, held_out=["answers"])
    costs = step_costs([0.04, 0.05, 0.06, 0.08, 0.10], 17)  # 0.04, 0.05, 0.06, 0.08, 0.09, 0.10, ...
    for size in table["size"]:
        tokens, steps, seconds = simulate(copy, size, [], costs)
        assert table["measured"][size - 1] == pytest.approx({"tau": tokens / steps, "speedup": 8 * 0.04 / seconds})
        tokens, steps, seconds = simulate(copy, size, table["lookup"][size - 1]["lengths"], costs)
        assert table["lookup"][size - 1]["speedup"] == pytest.approx(8 * 0.04 / seconds)
    assert [row["speedup"] for row in table["measured"]] == pytest.approx([1, 0.8, 2 / 3, 0.5, 4 / 9, 0.4, 4 / 11])
    # the root alone and 7 lookup tokens after a 2-token match: with the bonus token, the whole answer in one step
    # of 8 nodes (0.12 s) against 8 plain steps; more tokens would cost more for nothing
    chosen = table["lookup"][0]
    assert chosen["lengths"] == [0, 7] and chosen["tau"] == 8 and chosen["speedup"] == pytest.approx(0.32 / 0.12)
    assert table["chosen"] == 1 and table["chosen_lookup"] == [0, 7]
    # what each candidate accepts is saved, and load weighs them by this machine's step costs (here the same
    # fixed ones): the same choice; a tree or lookup the caller gives holds for every step
    saved = MedusaHeads.from_pretrained(path).config.acceptance
    assert {(row["size"], tuple(row["lookup"])) for row in saved} >= {(1, ()), (1, (0, 7)), (1, (FULL_REACH,) * 3)}
    assert {row["size"] for row in saved} == {1, 2, 3, 4, 6}
    monkeypatch.setattr(mtp.decoding.costs, "measure_steps", lambda *args, **kwargs: [0.04, 0.05, 0.06, 0.08, 0.10])
    decoder = mtp.load(path)
    assert decoder.tree.size == 1 and decoder.lookup.lengths == (0, 7)
    assert [len(options) for options in mtp.load(path, tree="chain").pacer.plans.values()] == [1]
    assert mtp.load(path, lookup=mtp.Lookup((0,))).lookup is None  # the caller can turn it off
    # a dynamic tree in the folder's config is taken as the caller's would be
    heads = MedusaHeads.from_pretrained(path)
    heads.config.dynamic_tree = "dynamic:4:2:2"
    heads.save_config(path)
    assert mtp.load(path).tree == DynamicTree(4, 2, 2)
    assert mtp.load(path, tree="chain").tree.size == 4  # the caller's tree still comes first


def test_on_a_compiled_pass_sizing_simulates_lookup_as_that_pass_verifies_it(tmp_path, monkeypatch):
    """The compiled pass verifies no lookup token past its largest size (8): sizing searches lookups that fit
    beside each tree and saves every candidate's lookup also cut to that room, simulated as such, not estimated."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mtp.tools.sizing, "measure_steps", lambda *args, **kwargs: [0.04, 0.05, 0.06, 0.08, 0.10])
    compiled = types.SimpleNamespace(buckets=(1, 4, 8), length=64)  # what sizing reads of a compiled pass
    monkeypatch.setattr(mtp.tools.sizing, "compile_pass", lambda *args, **kwargs: compiled)
    left = torch.arange(8, 0, -1)  # as above: a 2-token match at every root, right to the answer's end
    copy = {
        "left": left,
        "order": torch.full((8, 2), 6),
        "match": torch.full((8,), 2),
        "chain": torch.full((8,), 10),
        "right": left,
    }
    monkeypatch.setattr(mtp.tools.sizing, "held_out_roots", lambda *args: copy)
    monkeypatch.setattr(mtp.tools.sizing, "dynamic_trees", lambda *args: [])
    path, _, _ = save_random_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = CALIBRATION + [[0.0, 0.0, 0.0]]
    heads.save_config(path)
    table = size_tree(path, max_nodes=7, held_out=["answers"])
    assert table["chosen"] == 1 and table["chosen_lookup"] == [0, 7]  # 7 tokens fit beside the root
    assert all(max(row["lengths"]) <= 8 - size for size, row in enumerate(table["lookup"], 1))  # within the room
    saved = {(row["size"], tuple(row["lookup"])): row for row in MedusaHeads.from_pretrained(path).config.acceptance}
    for size, cut in ((1, (7, 7, 7)), (4, (4, 4, 4)), (6, (2, 2, 2))):
        assert (size, (FULL_REACH,) * 3) in saved  # kept whole for a pass that verifies more
        depth = saved[size, ()]["depth"]
        assert saved[size, cut] == acceptance(copy, size, list(cut), depth).as_dict()
    # the 4-node tree's lookup cut to 4: 4 right at the first root, then 2 before the answer's last token (the
    # bonus): 3 a step, where the whole lookup accepts 7 in one step and the share of its new nodes that fit
    # (`within`: 4 of 10) estimated 2.8
    assert saved[4, (4, 4, 4)]["from_lookup"] == 3.0 and saved[4, (FULL_REACH,) * 3]["from_lookup"] == 7.0


def test_drafting_is_timed_as_decoding_drafts_without_gradients(monkeypatch):
    model = tiny_model()
    heads = random_heads(model, num_heads=2)
    grads, propose = [], mtp.decoding.batch.Batch.propose

    def recording(self, plan):
        grads.append(torch.is_grad_enabled())
        return propose(self, plan)

    monkeypatch.setattr(mtp.decoding.batch.Batch, "propose", recording)
    trees = [Tree.from_paths([(0,)]), DynamicTree(4, 2, 2)]
    seconds = mtp.tools.sizing.measure_drafting(model, load_tokenizer(TINY_BASE), heads, trees, context=8, steps=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert len(grads) == 2 * 3 and not any(grads)  # the warm-up step's proposal and two timed ones, each tree


def test_dynamic_trees_are_simulated_on_distinct_answers_spread_over_the_held_out_set():
    """A held-out set that begins with many copies of one short answer (the distilled one begins with greetings):
    the sample takes it once and reaches the last answers."""
    greeting = (torch.tensor([5, 6, 7, 8]), torch.tensor([False, True, True, True]))
    others = [(torch.tensor([5, 9, i, i + 1]), torch.tensor([False, False, True, True])) for i in range(10, 39)]
    examples = [greeting] * 20 + others
    sample = evenly_spaced(examples, 6)
    answers = [tuple(ids[mask].tolist()) for ids, mask in sample]
    assert len(sample) == 6 and len(set(answers)) == 6
    assert answers[0] == (6, 7, 8) and answers[1:] == [(i, i + 1) for i in (14, 19, 24, 29, 34)]
    assert len(evenly_spaced(examples[:23], 6)) == 4  # fewer distinct answers than asked: all of them


@pytest.mark.parametrize("head_type", Drafter.kinds)
def test_the_simulation_takes_the_steps_that_decoding_takes(head_type):
    """held_out_roots on the tiny model's own greedy answers, then simulate: the same passes and tokens as the
    decoder with those heads, tree and lookup. The random heads guess among the answers' own tokens (a draft
    vocabulary), so that they are right now and then."""
    tokenizer, model = load_tokenizer(TINY_BASE), tiny_model()
    heads = random_heads(model, head_type=head_type)
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]
    prompts = [PROMPT, "Repeat after me: one two three, one two three, one two", "Tell me a story."]
    examples = []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        ids = torch.tensor(input_ids[0].tolist() + reference(model, input_ids, 30))
        examples.append((ids, torch.arange(len(ids)) >= input_ids.shape[1]))
    heads.set_draft_vocab(sorted({token for ids, mask in examples for token in ids[mask].tolist()}), model)
    roots = held_out_roots(model, heads, paths, examples, Lookup((FULL_REACH,) * 3))
    for size, lengths in [(1, [2, 4, 6]), (4, [0, 3, 10]), (9, [1, 1, 1]), (9, [])]:
        decoder = Decoder(model, tokenizer, heads, Tree.from_paths(paths[: size - 1]), Lookup(tuple(lengths) or (0,)))
        results = [decoder.generate(prompt, max_new_tokens=30) for prompt in prompts]
        tokens, steps, _ = simulate(roots, size, lengths, [1.0] * 30)
        assert steps == sum(result.forward_passes for result in results)
        assert tokens == sum(len(result.token_ids) - 1 for result in results)  # the prefill's root is no step's
        if size == 9 and lengths:  # both drafters had candidates accepted
            accepted = sum(sum(result.acceptance.lengths) - result.forward_passes for result in results)
            assert 0 < sum(result.acceptance.by_source.get("lookup", 0) for result in results) < accepted
    # dynamic trees: the draft grown at every root, its n most probable nodes for n nodes
    accepts = grown_accepts(model, heads, examples, DynamicTree(9, 4, 2))  # (R, 9)
    assert accepts.shape == (len(roots["left"]), 9) and accepts[:, -1].sum() > 0
    for size, lengths in [(3, []), (9, []), (9, [0, 3, 10])]:
        decoder = Decoder(model, tokenizer, heads, DynamicTree(size, 4, 2), Lookup(tuple(lengths) or (0,)))
        results = [decoder.generate(prompt, max_new_tokens=30) for prompt in prompts]
        tokens, steps, _ = simulate(roots, size, lengths, [1.0] * 30, heads=accepts[:, size - 1])
        assert steps == sum(result.forward_passes for result in results)
        assert tokens == sum(len(result.token_ids) - 1 for result in results)
