"""Sampling settings and the rules that accept sampled candidates from the tree.

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

import argparse
from dataclasses import dataclass

import torch

ACCEPTANCE = ("exact", "typical")


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy decoding (lossless token for token)."""

    temperature: float = 0.0
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the fewest most likely tokens whose probabilities sum to at least top_p; 1 keeps all."""
    seed: int | None = None
    """Seed of the random generator: the same seed, prompt and settings give the same output."""
    acceptance: str = "exact"
    """`exact` keeps the base model's distribution; `typical` (Medusa's rule) does not."""
    epsilon: float = 0.09
    """Typical acceptance: the hard probability threshold."""
    delta: float = 0.3
    """Typical acceptance: the entropy-scaled threshold, delta * exp(-entropy)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: use 0 (greedy) or a positive temperature.")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: use 0 (off) or a positive number of tokens.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: use a probability in (0, 1]; 1 is off.")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance={self.acceptance!r}: choose one of {ACCEPTANCE}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()  # a fresh random seed
        else:
            generator.manual_seed(self.seed)
        return generator

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distributions (..., V) after temperature, then top-k, then top-p, in float32."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
            drop = (before >= self.top_p).scatter(-1, order, before >= self.top_p)  # back to vocabulary order
            probs = probs.masked_fill(drop, 0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


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


GREEDY = Sampling()


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling options of decode.py and mtp.bench."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, the base's own output")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the top-p probability mass (1: all)")
    parser.add_argument("--seed", type=int, help="random seed: the same seed gives the same output")
    parser.add_argument("--acceptance", choices=ACCEPTANCE, default="exact",
                        help="exact (default): samples keep the base model's distribution; typical: Medusa's "
                        "typical acceptance, often faster but NOT the base model's distribution")  # fmt: skip


def sampling_from(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.seed, args.acceptance)
