"""The three acceptance rules on hand-made logits, each pinned exactly: greedy (leading right nodes), exact
(the output distribution, enumerated, equals the base model's) and Medusa's typical acceptance (thresholds that
depend on the entropy)."""

import itertools
import math
from collections import defaultdict

import pytest
import torch

import mtp.decoding.acceptance
from mtp.decoding.acceptance import Acceptance, accept_exact, accept_greedy, accept_typical
from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import Tree

# Root; its children 1, 2, 3; node 1's children 4, 5; node 2's child 6.
TREE = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])


def test_greedy_acceptance_counts_the_leading_right_nodes_not_all_right_ones():
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6])  # node i holds token i (the root: 9)
    # the base model's prediction after each node: after the root 2 (node 2 right, nodes 1 and 3 wrong); after
    # node 1, 4 (node 4 right, but node 1 itself was wrong); after node 2, 0 (node 6 wrong)
    predictions = torch.tensor([2, 4, 0, 7, 7, 7, 0])
    nodes, bonus = accept_greedy(tokens.tolist(), TREE.children, one_hot(predictions))
    assert nodes == [0, 2] and bonus == 0  # not [0, 1, 4]: a wrong node ends its path


def test_greedy_acceptance_takes_a_whole_right_path_and_the_prediction_after_it():
    tokens = torch.tensor([9, 1, 2, 3, 4, 5, 6])
    predictions = torch.tensor([1, 5, 6, 7, 7, 8, 7])  # root -> node 1 -> node 5 right; after node 5: 8
    nodes, bonus = accept_greedy(tokens.tolist(), TREE.children, one_hot(predictions))
    assert nodes == [0, 1, 5] and bonus == 8


def one_hot(predictions: torch.Tensor) -> torch.Tensor:
    """Logits (N+1, 10) whose argmax after node i is predictions[i]."""
    return torch.nn.functional.one_hot(predictions, 10).float()


# --- exact acceptance: enumerate every outcome of the walk with its exact probability ---------------------------

VOCAB = 5
TABLE = torch.randn(1 + VOCAB + VOCAB**2, VOCAB, generator=torch.Generator().manual_seed(0))


def target_logits(context: tuple[int, ...]) -> torch.Tensor:
    """The hand-made 'base model': next-token logits after the root and the tokens in `context` (at most 2)."""
    return TABLE[sum(token * VOCAB**i for i, token in enumerate(context)) + sum(VOCAB**i for i in range(len(context)))]


class Branch(Exception):
    """A random choice past the scripted ones: its options' probabilities."""


def outcomes(run) -> dict:
    """Every result of `run(choose)` with its exact probability: `run` is replayed once per sequence of random
    choices, where choose(probabilities) returns the index of the option taken."""
    found, pending = defaultdict(float), [((), 1.0)]
    while pending:
        script, weight = pending.pop()
        scripted = iter(script)

        def choose(probabilities, scripted=scripted):
            option = next(scripted, None)
            if option is None:
                raise Branch(probabilities)
            return option

        try:
            found[run(choose)] += weight
        except Branch as branch:
            (probabilities,) = branch.args
            pending += [(script + (i,), weight * p) for i, p in enumerate(probabilities) if p > 0]
    return found


def three_token_distribution(rule, tokens: torch.Tensor, sampling: Sampling, monkeypatch) -> dict:
    """The distribution of the first three tokens: one step's output by `rule` (accepted candidates and the
    next token), then, while shorter than 3, tokens drawn from the target, as the next steps would."""
    logits = torch.stack([target_logits(tuple(tokens[n].tolist() for n in path[1:])) for path in paths_to_nodes()])

    def run(choose):
        monkeypatch.setattr(mtp.decoding.acceptance, "coin", lambda p, generator: choose([1 - p, p]) == 1)
        monkeypatch.setattr(
            mtp.decoding.acceptance, "draw", lambda probs, generator: choose((probs / probs.sum()).tolist())
        )
        nodes, bonus = rule(tokens, TREE.children, logits, sampling, None)
        out = [int(tokens[n]) for n in nodes[1:]] + [bonus]
        while len(out) < 3:
            out.append(choose(sampling.probabilities(target_logits(tuple(out))).tolist()))
        return tuple(out[:3])

    return outcomes(run)


def paths_to_nodes() -> list[list[int]]:
    """For each node, the nodes from the root to it."""
    paths = [[0]]
    for parent in TREE.parents.tolist()[1:]:
        paths.append(paths[parent] + [len(paths)])
    return paths


def target_distribution(sampling: Sampling) -> dict:
    joint = {}
    for sequence in itertools.product(range(VOCAB), repeat=3):
        joint[sequence] = math.prod(
            float(sampling.probabilities(target_logits(sequence[:i]))[sequence[i]]) for i in range(3)
        )
    return joint


def distance(found: dict, joint: dict) -> float:
    """Total variation distance."""
    return sum(abs(found.get(x, 0.0) - p) for x, p in joint.items()) / 2


def accept_with_p_not_the_residual(tokens, children, logits, sampling, generator):
    """Wrong: later children are tried against p as it was, not renormalised after a rejection."""
    nodes = [0]
    while True:
        p = sampling.probabilities(logits[nodes[-1]])
        for child in children[nodes[-1]]:
            if mtp.decoding.acceptance.coin(float(p[tokens[child]]), generator):
                nodes.append(child)
                break
        else:
            rejected = [int(tokens[child]) for child in children[nodes[-1]]]
            p[rejected] = 0
            return nodes, mtp.decoding.acceptance.draw(p, generator)


def bonus_from_p_not_the_residual(tokens, children, logits, sampling, generator):
    """Wrong: after the children are rejected, the next token is drawn from p, rejected tokens included."""
    nodes, _ = accept_exact(tokens, children, logits, sampling, generator)
    return nodes, mtp.decoding.acceptance.draw(sampling.probabilities(logits[nodes[-1]]), generator)


SETTINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=3),
    Sampling(temperature=1.3, top_p=0.8),
    Sampling(temperature=0.8, top_k=4, top_p=0.95),
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=["t1", "t0.7-k3", "t1.3-p0.8", "t0.8-k4-p0.95"])
def test_exact_acceptance_emits_exactly_the_target_distribution(sampling, monkeypatch):
    after_root = sampling.probabilities(target_logits(()))
    order = after_root.argsort(descending=True).tolist()
    likely, unlikely = order[0], order[-1]  # the root's likeliest token, and one top-k/top-p may have removed
    # nodes 1 and 2 the same token (duplicate siblings), node 3 a token of probability 0 when filtered
    tokens = torch.tensor([0, likely, likely, unlikely, order[1], likely, order[2]])
    joint = target_distribution(sampling)
    found = three_token_distribution(accept_exact, tokens, sampling, monkeypatch)
    assert sum(found.values()) == pytest.approx(1.0, abs=1e-6)  # float32 probabilities
    assert distance(found, joint) < 1e-6
    for wrong in (accept_with_p_not_the_residual, bonus_from_p_not_the_residual):  # separated by a wide margin
        assert distance(three_token_distribution(wrong, tokens, sampling, monkeypatch), joint) > 0.15, wrong.__name__


# --- typical acceptance -----------------------------------------------------------------------------------------

FLAT = [0.2, 0.2, 0.2, 0.2, 0.13, 0.07]  # entropy 1.7389: threshold min(0.09, 0.3 * exp(-1.7389)) = 0.0527
PEAKED = [0.8, 0.12, 0.05, 0.03, 0.0, 0.0]  # entropy 0.6879: 0.3 * exp(-0.6879) = 0.1508, threshold 0.09
CHAIN = Tree.from_paths([(0,)])


def typical(tree: Tree, rows: list[list[float]], tokens: list[int], sampling: Sampling):
    """accept_typical on logits T * log(q), so that softmax(logits / T) is exactly the hand-made q."""
    logits = sampling.temperature * torch.tensor(rows).log()
    return accept_typical(torch.tensor(tokens), tree.retrieve, logits, sampling, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "parent, child, candidate, accepted",
    [
        (FLAT, PEAKED, 5, True),  # q 0.07 > 0.0527: only a threshold below epsilon, read at the parent, takes it
        (FLAT, PEAKED, 4, True),  # 0.13 > 0.0527
        (PEAKED, FLAT, 1, True),  # 0.12 > 0.09 = epsilon, though below 0.3 * exp(-H) = 0.1508
        (PEAKED, FLAT, 2, False),  # 0.05 < 0.09
        (PEAKED, FLAT, 4, False),  # probability 0
    ],
)
def test_typical_acceptance_thresholds_depend_on_the_parents_entropy(parent, child, candidate, accepted):
    # T = 0.5 and top-k 2 change the processed distribution (top-k 2 would drop every candidate above but 0),
    # but not the rule: q is softmax(logits / T) with no top-k or top-p
    sampling = Sampling(temperature=0.5, top_k=2)
    nodes, _ = typical(CHAIN, [parent, child], [0, candidate], sampling)
    assert nodes == ([0, 1] if accepted else [0])


def test_typical_acceptance_keeps_the_likeliest_of_the_longest_paths_and_draws_after_its_last_node():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (1, 0)])  # root -> 1 -> 3 and root -> 2 -> 4
    only_5 = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    rows = [
        [0.4, 0.3, 0.1, 0.1, 0.1, 0.0],  # after the root: node 1 (token 0) 0.4, node 2 (token 1) 0.3
        [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],  # after node 1: node 3 (token 2) 0.2 > threshold 0.06
        [0.1, 0.1, 0.1, 0.5, 0.2, 0.0],  # after node 2: node 4 (token 3) 0.5
        only_5,
        only_5,  # after node 4 the next token can only be 5, which the root's distribution never gives
    ]
    for _ in range(5):
        nodes, bonus = typical(tree, rows, [9, 0, 1, 2, 3], Sampling(temperature=1.0))
        assert nodes == [0, 2, 4] and bonus == 5  # log(0.3 * 0.5) > log(0.4 * 0.2): the second path, not the first


def test_the_acceptance_record_counts_passes_depths_and_sources_and_adds_up():
    one, other = Acceptance(), Acceptance()
    one.add(3, {"heads": 2})  # two candidates and the bonus token
    one.add(1, {})
    other.add(4, {"heads": 1, "lookup": 2})
    both = one + other
    assert both.lengths == [3, 1, 4] and both.passes == 3 and both.accepted == 5
    assert both.by_source == {"heads": 3, "lookup": 2} and one.by_source == {"heads": 2}  # adding changes neither
    assert both.at_depth() == [2, 2, 1]  # a candidate at depth 1 in two passes, at depth 3 in one
    assert both.report() == {
        "passes": 3,
        "accepted": 5,
        "tokens_per_pass": round(8 / 3, 4),
        "at_depth": [2, 2, 1],
        "rate_at_depth": [0.6667, 0.6667, 0.3333],
        "by_source": {"heads": 3, "lookup": 2},
    }
    assert Acceptance().report()["at_depth"] == [] and Acceptance().report()["tokens_per_pass"] == 0
