"""The rules that accept a tree's candidates, in one place: greedy (`accept_greedy`), exact (`accept_exact`)
and typical (`accept_typical`) acceptance; `accept` picks the one the sampling settings name. `Acceptance` records
what they accepted.

Greedy acceptance walks down from the root, accepting the child that holds the base model's own prediction at its
parent, and adds the prediction after the last accepted node: the base model's greedy output, token for token
(siblings hold distinct tokens, so at most one child is right).

Exact acceptance (the default) keeps the base model's output distribution. At a tree node whose processed
target distribution is p (the base model's next-token distribution after temperature, top-k and top-p), the
node's children x1, x2, ... (the heads' top guesses, in rank order, fixed before the base model ran) are tried
in turn: child xj is accepted with probability p(xj) (p renormalised after each rejection, with the rejected
token's mass set to 0), which makes the walk one draw from p without replacement. The chance to emit xj is
(1 - p(x1) - ... - p(xj-1)) * p(xj) / (1 - p(x1) - ... - p(xj-1)) = p(xj), and a token y that is no child is
emitted, after every child is rejected, with (1 - sum of the children's p) * p(y) / (1 - sum of the children's
p) = p(y). So every emitted token has exactly p's distribution, whatever the heads guessed. An accepted child
is then a node whose own p the same verification pass computed (with the child in its context), and the walk
goes on from there; at a leaf, the bonus token is drawn from the leaf's p.

Typical acceptance (Medusa's rule, opt-in) accepts a candidate x if q(x) > min(epsilon, delta * exp(-H(q)))
at its parent, with q = softmax(logits / T) (top-k and top-p play no part in it) and H(q) its entropy; of the
longest such paths it keeps the one with the highest summed log q of its candidates, and draws the next token
from the processed p at the path's last node. It is faster on flat distributions, but it does NOT keep the base
model's distribution: the output is a different, if plausible, sample.
"""

from dataclasses import dataclass, field

import torch

from mtp.decoding.sampling import Sampling
from mtp.decoding.tree import Tree


@dataclass
class Acceptance:
    """What verification passes accepted, over one answer or, added up with `+`, over many: the one record the
    decoder fills (`GenerationResult.acceptance`) and the bench, `decode.py --json`, the demo and the notebook
    report, as serving engines keep one record of drafts and accepted tokens per position for their metrics."""

    lengths: list[int] = field(default_factory=list)
    """Tokens each verification pass settled, in order: its accepted candidates and its bonus token."""
    by_source: dict[str, int] = field(default_factory=dict)
    """Accepted candidates by the drafter that proposed them (`heads`, `eagle`, `lookup`, ...): a candidate that two
    drafters proposed counts for the first."""

    def add(self, settled: int, by_source: dict[str, int]) -> None:
        """One pass that settled `settled` tokens, its accepted candidates proposed as `by_source` says."""
        self.lengths.append(settled)
        for name, count in by_source.items():
            self.by_source[name] = self.by_source.get(name, 0) + count

    def __add__(self, other: "Acceptance") -> "Acceptance":
        sources = {
            name: self.by_source.get(name, 0) + other.by_source.get(name, 0)
            for name in {**self.by_source, **other.by_source}
        }
        return Acceptance(self.lengths + other.lengths, sources)

    @property
    def passes(self) -> int:
        return len(self.lengths)

    @property
    def accepted(self) -> int:
        """Accepted candidates, bonus tokens left out."""
        return sum(self.lengths) - self.passes

    def at_depth(self) -> list[int]:
        """Passes that accepted a candidate at depth d (d candidates or more), for d = 1 to the deepest accepted."""
        return [sum(n - 1 >= depth for n in self.lengths) for depth in range(1, max(self.lengths, default=1))]

    def report(self) -> dict:
        """The record's figures as plain values (JSON): passes, accepted candidates, tokens per pass, passes and
        their share that accepted a candidate at each depth, accepted candidates by drafter."""
        deep = self.at_depth()
        return {
            "passes": self.passes,
            "accepted": self.accepted,
            "tokens_per_pass": round(sum(self.lengths) / max(self.passes, 1), 4),
            "at_depth": deep,
            "rate_at_depth": [round(n / self.passes, 4) for n in deep],
            "by_source": dict(self.by_source),
        }


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from `probs` (V,)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def coin(probability: float, generator: torch.Generator) -> bool:
    """True with `probability`."""
    return float(torch.rand((), generator=generator)) < probability


def accept_exact(tokens: torch.Tensor, children: list[list[int]], logits, sampling: Sampling, generator):
    """The walk in the module docstring: returns (accepted nodes from the root, next token).

    Args:
        tokens: (N+1,) the tree's tokens (on the CPU).
        children: children[i], node i's children in rank order.
        logits: (N+1, V) the base model's next-token logits after each node; a node's distribution is computed
            only once the walk reaches it.
    """
    nodes = [0]
    p = sampling.probabilities(logits[0]).cpu()
    while True:
        for child in children[nodes[-1]]:
            x = int(tokens[child])
            if coin(float(p[x]), generator):
                nodes.append(child)
                p = sampling.probabilities(logits[child]).cpu()
                break
            p[x] = 0  # p is this walk's own tensor, fresh from `probabilities`: changed in place
            p /= p.sum()
        else:  # every child rejected, or a leaf
            return nodes, draw(p, generator)


def accept_typical(tokens, paths, logits, sampling: Sampling, generator):
    """Medusa's typical acceptance (module docstring): returns (accepted nodes from the root, next token).

    Args:
        tokens: (N+1,) the tree's tokens; paths: (L, D+1) retrieve indices (-1 padded), on the logits' device.
        logits: (N+1, V) the base model's next-token logits after each node.
    """
    q = (logits.float() / sampling.temperature).softmax(-1)  # (N+1, V)
    entropy = -(q * q.clamp(min=1e-30).log()).sum(-1)  # (N+1,)
    threshold = torch.clamp(sampling.delta * torch.exp(-entropy), max=sampling.epsilon)  # (N+1,)
    parents, children = paths[:, :-1].clamp(min=0), paths[:, 1:]  # (L, D)
    likelihood = q[parents, tokens[children.clamp(min=0)]]  # (L, D) each candidate's q at its parent
    accepted = ((children >= 0) & (likelihood > threshold[parents])).int().cumprod(1)  # (L, D) leading accepted
    lengths = accepted.sum(1)  # (L,)
    score = (accepted * likelihood.clamp(min=1e-30).log()).sum(1)  # (L,) summed log q of the accepted candidates
    best = int(score.masked_fill(lengths < lengths.max(), float("-inf")).argmax())  # the likeliest longest path
    nodes = paths[best, : int(lengths[best]) + 1].tolist()
    return nodes, draw(sampling.probabilities(logits[nodes[-1]]).cpu(), generator)


def accept_greedy(tokens: list[int], children: list[list[int]], logits: torch.Tensor) -> tuple[list[int], int]:
    """The walk down from the root: the child of the last accepted node whose token is the base model's prediction
    there (the argmax of its logits) is accepted next, until none is; that prediction is the bonus. Returns
    (accepted nodes from the root, bonus). A node's prediction is taken only once the walk reaches it, so a step reads
    the logits of the accepted path alone (an argmax over every node's logits costs a vocabulary's worth of reads a
    node).

    Args:
        tokens: the tree's tokens (N+1,), as a list; children: children[i], node i's children.
        logits: (N+1, V) the base model's next-token logits after each node.
    """
    nodes = [0]
    while True:
        prediction = int(logits[nodes[-1]].argmax())
        right = [child for child in children[nodes[-1]] if tokens[child] == prediction]
        if not right:
            return nodes, prediction
        nodes.append(right[0])


def accept(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, sampling: Sampling, generator):
    """The accepted nodes (A+1,) of one row's tree holding `tokens` (N+1,), root first, and the bonus token, by
    the base model's `logits` (N+1, V) after each node: greedy, exact or typical acceptance (see above)."""
    if sampling.greedy:
        return accept_greedy(tokens.tolist(), tree.children, logits)
    if sampling.acceptance == "exact":
        return accept_exact(tokens.cpu(), tree.children, logits, sampling, generator)
    return accept_typical(tokens, tree.retrieve, logits, sampling, generator)
