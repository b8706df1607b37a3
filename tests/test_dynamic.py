"""Dynamic trees (`mtp.decoding.tree.DynamicTree`): each step's tree grown from the drafter's own draft probabilities, a
tree per row, as lossless as a static one."""

import pytest
import torch
from transformers import DynamicCache

from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.pacing import Plan
from mtp.decoding.proposer import TreeProposer
from mtp.decoding.target import Target
from mtp.decoding.tree import DynamicTree, named_tree
from mtp.drafters.contract import Drafter
from mtp.drafters.heads import HeadsProposer
from tests.conftest import PROMPT, TINY_BASE, OracleHeads, random_heads, reference, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_BASE)


class RandomDrafter(TreeProposer):
    """Random children with random draft probabilities, recording every expansion: (nodes, tokens, log-probs)."""

    def __init__(self, seed: int, vocab: int = 50):
        self.generator, self.vocab, self.expansions = torch.Generator().manual_seed(seed), vocab, []

    def expand(self, draft, nodes, depth, k):
        batch, count = nodes.shape
        best = torch.randint(self.vocab, (batch, count, k), generator=self.generator)
        logits = torch.randn(batch, count, self.vocab, generator=self.generator) * 3
        logp = logits.log_softmax(-1).topk(k, dim=-1).values  # (B, P, k) most probable first
        self.expansions.append((nodes.clone(), best, logp))
        return best, logp


def drafted(expansions, row: int, root: int) -> list[dict]:
    """Every node that `expansions` drafted in `row`, in the order a grown draft indexes them (the root, then each
    level's children, parent by parent, rank by rank): its token, parent, rank and joint log-probability."""
    nodes = [{"token": root, "parent": -1, "rank": -1, "joint": 0.0}]
    for parents, best, logp in expansions:
        for p, parent in enumerate(parents[row].tolist()):
            for r in range(best.shape[-1]):
                joint = nodes[parent]["joint"] + float(logp[row, p, r])
                nodes.append({"token": int(best[row, p, r]), "parent": parent, "rank": r, "joint": joint})
    return nodes


def test_a_grown_tree_holds_the_most_probable_drafted_nodes_with_their_ancestors():
    plan, drafter, roots = DynamicTree(nodes=9, depth=4, top_k=3), RandomDrafter(seed=0), torch.tensor([[5], [7]])
    trees, tokens = drafter.grow(plan, roots, depth=4)
    for row, (tree, row_tokens) in enumerate(zip(trees, tokens, strict=True)):
        nodes = drafted(drafter.expansions, row, int(roots[row, 0]))
        level = {0: [0]}  # each level expands the k most probable nodes of the one before
        for depth, (parents, _, _) in enumerate(drafter.expansions, 1):
            ranked = sorted(level[depth - 1], key=lambda n: -nodes[n]["joint"])
            assert sorted(parents[row].tolist()) == sorted(ranked[:3])
            level[depth] = [i for i, node in enumerate(nodes) if node["parent"] in parents[row].tolist()]
        # each tree node is the drafted node reached from the root by the ranks of its path, with its token
        index = [0]
        for node in range(1, tree.size):
            parent = index[int(tree.parents[node])]
            rank = int(tree.ranks[node])
            index.append(next(i for i, n in enumerate(nodes) if n["parent"] == parent and n["rank"] == rank))
            assert row_tokens[node] == nodes[index[-1]]["token"]
        assert tree.size == 9 and row_tokens[0] == roots[row, 0] and len(set(index)) == 9
        best = sorted((n["joint"] for n in nodes[1:]), reverse=True)[:8]
        assert sorted((nodes[i]["joint"] for i in index[1:]), reverse=True) == pytest.approx(best)
    assert not torch.equal(tokens[0], tokens[1])  # rows grow trees of their own


def test_a_row_without_room_gets_the_root_alone():
    trees, tokens = RandomDrafter(seed=1).grow(DynamicTree(8, 3, 2), torch.tensor([[4]]), depth=0)
    assert trees[0].size == 1 and tokens[0].tolist() == [4]


@pytest.mark.parametrize("head_type", Drafter.kinds)
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3", "gpt_neox"])
def test_random_drafters_on_dynamic_trees_give_the_base_models_greedy_output(model_type, head_type, tokenizer):
    model = tiny_model(model_type)
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    decoder = Decoder(model, tokenizer, random_heads(model, head_type=head_type), DynamicTree(8, 4, 3))
    result = decoder.generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == reference(model, input_ids, 40) and result.finish_reason == "length"


def test_oracle_heads_on_a_dynamic_tree_go_deep_and_lookup_grafts_onto_it(tokenizer):
    model = tiny_model()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = reference(model, input_ids, 48)
    oracle = OracleHeads(model, torch.cat([input_ids[0], torch.tensor(expected)]), num_heads=4)
    result = Decoder(model, tokenizer, oracle, DynamicTree(6, 4, 2)).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == expected[:40] and result.tau > 3.5  # the sure chain is chosen before any sibling
    with_lookup = Decoder(
        model, tokenizer, random_heads(model, head_type="hydra"), DynamicTree(4, 2, 2), Lookup((3, 3))
    ).generate(PROMPT, max_new_tokens=40)
    assert with_lookup.token_ids == expected[:40]


def test_dynamic_trees_are_written_as_nodes_depth_top_k_and_checked(tokenizer):
    assert named_tree("dynamic:8:4:3", num_heads=4) == DynamicTree(8, 4, 3)
    assert str(DynamicTree(8, 4, 3)) == "dynamic:8:4:3"
    for bad in ("dynamic:8:4", "dynamic:8:x:3", "dynamic"):
        with pytest.raises(ValueError, match="dynamic:NODES:DEPTH:TOP_K"):
            named_tree(bad, num_heads=4)
    with pytest.raises(ValueError, match="at least 1 node"):
        DynamicTree(8, 0, 3)
    model = tiny_model()
    with pytest.raises(ValueError, match="5 levels deep, but the drafter fills only 4 levels"):
        Decoder(model, tokenizer, random_heads(model), DynamicTree(8, 5, 3))
    Decoder(model, tokenizer, random_heads(model, head_type="eagle"), DynamicTree(8, 9, 3))  # drafts as deep as asked


def test_a_dynamic_tree_drafts_no_level_its_node_budget_cannot_hold(tokenizer, monkeypatch):
    """N nodes reach N - 1 levels at most (a chain): 1 node drafts nothing, 3 nodes two levels, whatever the depth
    asked, and neither is refused for asking deeper than the 4 heads (a root alone once raised IndexError)."""
    model, levels = tiny_model(), []
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expand = HeadsProposer.expand
    monkeypatch.setattr(HeadsProposer, "expand", lambda self, *args: levels.append(args[2]) or expand(self, *args))
    for nodes, deepest in [(1, 0), (3, 2)]:
        levels.clear()
        result = Decoder(model, tokenizer, random_heads(model), DynamicTree(nodes, 6, 2)).generate(PROMPT, 12)
        assert DynamicTree(nodes, 6, 2).deepest == deepest and set(levels) == set(range(1, deepest + 1))
        assert result.token_ids == reference(model, input_ids, 12)
        assert max(result.acceptance.lengths) <= deepest + 1


@pytest.mark.parametrize("head_type", ["hydra", "eagle"])
@torch.no_grad()
def test_rows_at_many_roots_of_one_sequence_draft_as_rows_added_one_by_one(head_type):
    """Sizing's simulation starts a row at every root of an answer from one pass over it (`at_roots`): the same
    drafts as a row added for each prefix alone."""
    model = tiny_model()
    drafter, target = random_heads(model, head_type=head_type), Target(model)
    ids = torch.randint(1, 500, (30,), generator=torch.Generator().manual_seed(0))
    states = target.run(bool(drafter.config.feature_layers), input_ids=ids[None], cache=DynamicCache())
    roots, plan = [5, 11, 29], DynamicTree(8, 3, 3)
    fast, alone = drafter.proposer(target, {}), drafter.proposer(target, {})
    fast.at_roots(ids, states, roots)
    for p in roots:
        alone.add(
            ids[:p],
            target.run(bool(drafter.config.feature_layers), input_ids=ids[None, :p], cache=DynamicCache()),
            int(ids[p]),
        )
    first = [ids[p : p + 1] for p in roots]
    (fast_trees, fast_tokens), (trees, tokens) = (
        fast.propose(Plan(plan), None, first, [3] * 3, 0),
        alone.propose(Plan(plan), None, first, [3] * 3, 0),
    )
    for a, b, tree_a, tree_b in zip(fast_tokens, tokens, fast_trees, trees, strict=True):
        assert torch.equal(a, b) and torch.equal(tree_a.parents, tree_b.parents)
        torch.testing.assert_close(tree_a.scores, tree_b.scores)
