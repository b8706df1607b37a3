"""Prompt lookup: its candidates, their place in the tree, and decoding with them that stays lossless."""

import pytest
import torch

from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import FULL_REACH, Lookup
from mtp.decoding.tree import Tree
from mtp.drafters.contract import Drafter
from tests.conftest import PROMPT, TINY_BASE, TREE, random_heads, reference, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_its_latest_full_occurrence():
    ids = torch.tensor([5, 6, 7, 1, 9, 6, 7, 2, 3, 4, 8, 6, 7])
    # "6 7" occurred at 1 and 5: the one at 1 is the latest that FULL_REACH = 10 tokens follow
    assert Lookup((3, 3)).match(ids) == (2, [1, 9, 6])
    assert Lookup((3, 3, 3)).propose(ids) == [1, 9, 6]  # "8 6 7" never occurred: falls back to "6 7"
    assert Lookup((4, 10)).propose(ids) == [1, 9, 6, 7, 2, 3, 4, 8, 6, 7]
    assert Lookup((4, 2)).propose(ids) == [1, 9]  # the same occurrence, whatever the length: cut to 2
    assert Lookup((9, 0)).propose(ids) == []  # the longest match proposes: 0 after 2 tokens, none
    assert Lookup((2,)).propose(torch.tensor([4, 4, 4])) == [4]  # none with 10 after it: the latest
    assert Lookup((2,)).propose(torch.tensor([6, 1] + [5] * 10 + [1])) == [5, 5]  # "1" with 10 after it
    assert Lookup((2, 2)).propose(torch.tensor([7])) == [] and Lookup((2, 2)).match(torch.tensor([7, 8])) == (0, [])


def test_the_match_is_the_longest_earlier_occurrence_on_random_texts():
    """`Lookup.match` against its definition written out over lists, on texts of few distinct tokens (many matches)."""

    def defined(ids: list[int], longest: int, reach: int) -> tuple[int, list[int]]:
        for n in range(min(longest, len(ids) - 1), 0, -1):
            after = [s + n for s in range(len(ids) - n) if ids[s : s + n] == ids[-n:]]  # earlier occurrences' ends
            if after:
                full = [a for a in after if a + FULL_REACH <= len(ids)]
                begin = (full or after)[-1]
                return n, ids[begin : begin + reach]
        return 0, []

    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        length = int(torch.randint(1, 40, (), generator=generator))
        ids = torch.randint(0, 2 + trial % 5, (length,), generator=generator)
        lookup = Lookup((7,) * (1 + trial % 4))
        assert lookup.match(ids) == defined(ids.tolist(), len(lookup.lengths), 7), ids.tolist()


def test_bad_lookup_settings_are_refused_with_what_they_need():
    for lengths in [(), (2, -1)]:
        with pytest.raises(ValueError, match="each >= 0"):
            Lookup(lengths)


def test_a_graft_follows_the_heads_nodes_its_tokens_repeat_and_adds_the_rest_as_one_branch():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1)])  # nodes 1: (0,), 2: (1,), 3: (0, 0), 4: (0, 1)
    tokens = torch.tensor([10, 20, 21, 30, 31])
    grafted, new_tokens = tree.graft(tokens, [20, 31, 40, 41], source=1)  # follows nodes 1 and 4, then adds 40, 41
    assert new_tokens.tolist() == [10, 20, 21, 30, 31, 40, 41]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 1, 4, 5] and grafted.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert grafted.ranks.tolist()[5:] == [-1, -1] and grafted.sources.tolist() == [-1, 0, 0, 0, 0, 1, 1]
    for node in range(grafted.size):  # the mask: the node and its ancestors, read off the parents
        ancestors, walk = {node}, node
        while grafted.parents[walk] >= 0:
            walk = int(grafted.parents[walk])
            ancestors.add(walk)
        assert set(grafted.mask[node].nonzero()[:, 0].tolist()) == ancestors
    assert sorted(row[row >= 0].tolist() for row in grafted.retrieve) == [[0, 1, 3], [0, 1, 4, 5, 6], [0, 2]]
    assert tree.graft(tokens, [20, 30], source=1) == (tree, tokens)  # nothing new: nothing verified twice
    alone, alone_tokens = Tree.from_paths([]).graft(torch.tensor([10]), [11, 12], source=1)
    assert alone.parents.tolist() == [-1, 0, 1] and alone_tokens.tolist() == [10, 11, 12]


def test_a_tree_grafted_again_in_the_same_shape_is_reused_and_in_another_shape_built_anew():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1)])
    tokens = torch.tensor([10, 20, 21, 30, 31])
    first, _ = tree.graft(tokens, [20, 31, 40, 41], source=1)
    again, again_tokens = tree.graft(torch.tensor([10, 22, 23, 32, 33]), [22, 33, 50, 51], source=1)
    assert again is first and again_tokens.tolist() == [10, 22, 23, 32, 33, 50, 51]
    shapes = [([21, 40, 41], 1), ([20, 31, 40], 1), ([20, 31, 40, 41], 2)]  # another node, length and source
    for chain, source in shapes:
        other, _ = tree.graft(tokens, chain, source)
        assert other is not first
    below_two, _ = tree.graft(tokens, [21, 40, 41], source=1)
    assert below_two.parents.tolist() == [-1, 0, 0, 1, 1, 2, 5]
    assert tree.graft(tokens, [20, 31, 40, 41], source=2)[0].sources.tolist()[5:] == [2, 2]


class OracleLookup(Lookup):
    """Proposes the true continuation (right=True), or tokens that are never the next one (right=False)."""

    def __init__(self, sequence: list[int], right: bool):
        super().__init__((6,))
        object.__setattr__(self, "sequence", sequence)
        object.__setattr__(self, "right", right)

    def propose(self, ids):
        truth = self.sequence[len(ids) : len(ids) + self.reach]
        return truth if self.right else [(token + 1) % 512 for token in truth]


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_lookup_that_is_always_right_or_always_wrong_changes_the_passes_never_the_output(right, tokenizer):
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 40)
    lookup = OracleLookup(input_ids[0].tolist() + expected, right)
    result = Decoder(model, tokenizer, lookup=lookup).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == expected
    if right:  # six candidates and the bonus token each pass, all from lookup
        assert result.acceptance.lengths[:-1] == [7] * (len(result.acceptance.lengths) - 1)
        assert result.acceptance.by_source == {"lookup": result.acceptance.accepted}
    else:
        assert result.acceptance.lengths == [1] * 39 and result.acceptance.by_source.get("lookup", 0) == 0


@pytest.mark.parametrize("head_type", [None, *Drafter.kinds])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3", "gpt_neox"])
def test_heads_and_lookup_together_give_the_base_models_greedy_output(model_type, head_type, tokenizer):
    model = tiny_model(model_type)
    expected = reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 60)
    heads = None if head_type is None else random_heads(model, head_type=head_type)
    result = Decoder(model, tokenizer, heads, TREE, Lookup((8, 8, 8))).generate(PROMPT, max_new_tokens=60)
    assert result.token_ids == expected
    assert result.acceptance.by_source.get("lookup", 0) > 0  # random models repeat themselves: lookup's were accepted


def test_lookup_candidates_near_the_end_of_the_output_stop_at_its_last_position(tokenizer):
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 11)
    lookup = OracleLookup(input_ids[0].tolist() + expected + [1] * 20, right=True)
    result = Decoder(model, tokenizer, lookup=lookup).generate(PROMPT, max_new_tokens=11)
    assert result.token_ids == expected and result.acceptance.lengths == [7, 3]  # 1 + 7 + 3: nothing past the end
