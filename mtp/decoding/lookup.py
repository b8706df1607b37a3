"""Prompt lookup: candidates copied from earlier text. When the last n tokens of the prompt and output occurred
before, the tokens that followed them then are a guess for the tokens that follow now: right for long runs when
an answer copies, quotes or edits its prompt, which no head can guess. The decoder hangs them from the root of
the heads' tree (`Tree.graft`, by `mtp.decoding.proposer.LookupProposer`) and verifies both in the same forward pass.

A longer match predicts better, so how many tokens are worth verifying depends on it: `Lookup.lengths[n - 1]`
is the number proposed after a match of n tokens (`mtp.tools.sizing` chooses them from measured acceptance and step
costs)."""

import argparse
from dataclasses import dataclass

import torch

MAX_NGRAM = 3  # the longest match of `--lookup L` given as one number
FULL_REACH = 10  # a match proposes from its latest occurrence that this many tokens follow (else from its latest)


@dataclass(frozen=True)
class Lookup:
    lengths: tuple[int, ...] = (10,) * MAX_NGRAM
    """lengths[n - 1]: tokens proposed at most after a match of the last n tokens (0: none). Matches of
    len(lengths) tokens down to 1 are tried, longest first: only the longest match proposes."""

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 0:
            raise ValueError(
                f"Lookup(lengths={self.lengths}): give the tokens to propose after a match of 1, 2, ... tokens, "
                "each >= 0 (0: none)."
            )

    @property
    def reach(self) -> int:
        """The most tokens proposed after any match."""
        return max(self.lengths)

    def match(self, ids: torch.Tensor) -> tuple[int, list[int]]:
        """(n, chain): the longest suffix of `ids` (1D), n <= len(lengths) tokens, that occurred before, and up to
        `reach` tokens that followed it there: at its latest occurrence followed by FULL_REACH tokens, else at its
        latest one (which of them does not depend on `lengths`). (0, []) if no suffix occurred before."""
        for n in range(min(len(self.lengths), len(ids) - 1), 0, -1):
            starts = (ids.unfold(0, n, 1)[:-1] == ids[-n:]).all(1).nonzero()[:, 0]  # earlier windows equal to it
            if len(starts):
                after = starts + n  # (M,) where each occurrence's continuation begins
                full = after[after + FULL_REACH <= len(ids)]
                begin = int(full[-1] if len(full) else after[-1])
                return n, ids[begin : begin + self.reach].tolist()
        return 0, []

    def propose(self, ids: torch.Tensor) -> list[int]:
        """The candidates after `ids`: the first lengths[n - 1] tokens of the chain of the longest match."""
        n, chain = self.match(ids)
        return chain[: self.lengths[n - 1]] if n else []


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt-lookup option of decode.py and mtp.tools.bench."""
    parser.add_argument(
        "--lookup",
        type=int,
        nargs="+",
        metavar="L",
        help="prompt lookup: verify tokens copied from earlier text beside the heads' guesses each "
        f"step, at most L after a match of 1, 2, ... tokens (longest match first; one L: the same "
        f"after matches of 1 to {MAX_NGRAM}; 0: off); default: what mtp.tools.sizing chose for the "
        "heads, else off",
    )


def lookup_from(args: argparse.Namespace) -> Lookup | None:
    """--lookup's settings; None without it."""
    if args.lookup is None:
        return None
    return Lookup(tuple(args.lookup) * (MAX_NGRAM if len(args.lookup) == 1 else 1))
