"""Sampling settings: temperature, top-k, top-p, the acceptance rule and the seed, and the distribution they make
of the base model's logits (`Sampling.probabilities`). The rules that accept candidates: `mtp.decoding.acceptance`."""

import argparse
import hashlib
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
    """Seed of the random generators: the same seed, prompt and settings give the same output (prompt i of a list
    draws from its own generator, seeded from the seed and i)."""
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

    def generator(self, number: int = 0) -> torch.Generator:
        """The random generator of prompt `number`: seeded from `seed` and `number` (mixed, so that no two pairs of
        small seeds and numbers share a stream, as seed + number would), or at random without a seed."""
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()  # a fresh random seed
        else:
            mixed = hashlib.sha256(f"{self.seed} {number}".encode()).digest()
            generator.manual_seed(int.from_bytes(mixed[:8], "little"))
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


GREEDY = Sampling()


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling options of decode.py and mtp.tools.bench."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy, the base's own output")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the top-p probability mass (1: all)")
    parser.add_argument("--seed", type=int, help="random seed: the same seed gives the same output")
    parser.add_argument(
        "--acceptance",
        choices=ACCEPTANCE,
        default="exact",
        help="exact (default): samples keep the base model's distribution; typical: Medusa's "
        "typical acceptance, often faster but NOT the base model's distribution",
    )


def sampling_from(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_k, args.top_p, args.seed, args.acceptance)
