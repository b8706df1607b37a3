import json
import types

import pytest

import mtp
import mtp.sizing
from mtp.heads import MedusaHeads
from mtp.sizing import SIZES, size_tree, step_costs
from mtp.tree import grow_tree, named_tree
from tests.test_stopping import save_random_heads

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
    assert costs[0] == 0.05 and costs[2] == 0.06 and costs[6] == pytest.approx(0.08)  # size 7: halfway
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
    decoder = mtp.load(path)
    assert decoder.tree.size == best
    assert decoder.tree.paths == tuple(sorted(grow_tree(heads.config.calibration, best)[0], key=lambda p: (len(p), p)))
    size_tree(path, max_nodes=8, context=32)  # the second time, the cached timings: nothing new is measured
    assert json.loads((tmp_path / "cache" / "step_seconds.json").read_text()) == cached


def test_the_expected_speedup_is_tau_times_the_plain_step_over_the_tree_step(tmp_path, monkeypatch):
    """Fixed step timings instead of measured ones, and figures computed by hand from them."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    measured = [0.04, 0.05, 0.06, 0.08, 0.10]  # seconds per step of sizes 1, 2, 3, 4, 6
    monkeypatch.setattr(mtp.sizing, "measure_steps", lambda *args, **kwargs: measured)
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


def test_sizing_with_lookup_adds_its_measured_depths_and_costs_and_picks_the_best_pair(tmp_path, monkeypatch):
    """Fixed timings and lookup figures, the expected tau and speedups by hand; load then uses the pair."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mtp.sizing, "measure_steps", lambda *args, **kwargs: [0.04, 0.05, 0.06, 0.08, 0.10])
    # lookup proposes at half the roots, two tokens at most whatever the cap; first right 50%, both 30%
    measured = {"proposes": 0.5, "tokens": [0.0, 1.0] + [2.0] * 9, "right": [0.5, 0.3] + [0.0] * 8}
    monkeypatch.setattr(mtp.sizing, "lookup_acceptance", lambda tokenizer, answers: measured)
    path, _, _ = save_random_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(path)
    heads.config.calibration = CALIBRATION + [[0.0, 0.0, 0.0]]
    heads.save_config(path)
    table = size_tree(path, max_nodes=7, lookup_data="answers")
    two = table["lookup"][2]
    # size 1: tau 1 + .5 + .3; a step costs .5 * step(1 + 2) + .5 * step(1) = .05
    # size 2, tree (0,): depth 1 reached with 1 - .4 * .5, depth 2 with .3; .5 * step(4) + .5 * step(2) = .065
    # size 3, + (0, 0): depth 2 reached with 1 - .7 * .7; .5 * step(5) + .5 * step(3) = .075
    assert two["expected_tau"][:3] == pytest.approx([1.8, 2.1, 2.31])
    assert two["expected_speedup"][:3] == pytest.approx([1.8 * 0.8, 2.1 * 0.04 / 0.065, 2.31 * 0.04 / 0.075])
    assert table["lookup"][10] == two  # never more than 2 tokens, none right past 2: longer caps change nothing
    assert table["chosen"] == 1 and table["chosen_lookup"] == 2  # 1.44 beats the heads alone (1.28 at size 2)
    decoder = mtp.load(path)
    assert decoder.tree.size == 1 and decoder.lookup.length == 2
    assert mtp.load(path, lookup=mtp.Lookup(0)).lookup is None  # the caller can turn it off


def test_lookup_is_measured_right_more_often_on_answers_that_copy_their_prompt(tmp_path):
    from mtp.base import load_tokenizer
    from tests.conftest import TINY_BASE

    text = "the quick brown fox jumps over the lazy dog while seven small birds sing in the old oak tree"
    chats = {
        "copy": [{"role": "user", "content": f"Repeat: {text}"}, {"role": "assistant", "content": text}],
        "new": [{"role": "user", "content": f"Repeat: {text}"}, {"role": "assistant", "content": "No, I will not."}],
    }
    tokenizer, found = load_tokenizer(TINY_BASE), {}
    for name, chat in chats.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
        found[name] = mtp.sizing.lookup_acceptance(tokenizer, str(tmp_path / f"{name}.jsonl"))
    copy, new = found["copy"], found["new"]
    assert copy["right"][0] > 0.7 and copy["right"][3] > 0.5 and new["right"][0] < 0.3


class WordTokenizer:
    """Text "1 2 3" -> token ids [1, 2, 3]: figures that can be counted by hand."""

    def __call__(self, text, **kwargs):
        return types.SimpleNamespace(input_ids=[int(word) for word in text.split()])


def test_lookup_figures_counted_by_hand(tmp_path):
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "1 2 3 1 2 3 1 2"}) + "\n")  # every token answers
    found = mtp.sizing.lookup_acceptance(WordTokenizer(), str(tmp_path / "text.jsonl"))
    # roots t = 0..6; lookup proposes from t = 3 on: [2 3 1] (after "1"), [3 1 2] (after "1 2"), [1 2 3] (after
    # "1 2 3") and [2 3 1] (after "2 3 1"); right against what follows: 3 tokens, 3, 2 (the text ends), 1
    assert found["proposes"] == pytest.approx(4 / 7)
    assert found["tokens"][:4] == pytest.approx([0, 1, 2, 3]) and found["tokens"][10] == pytest.approx(3)
    assert found["right"][:4] == pytest.approx([4 / 7, 3 / 7, 2 / 7, 0])
