"""Prompt lookup: candidates copied from earlier text. When the last n tokens of the prompt and output occurred
before, the tokens that followed them then are a guess for the tokens that follow now: right for long runs when
an answer copies, quotes or edits its prompt, which no head can guess. The decoder hangs them from the root of
the heads' tree (`mtp.tree.Tree.graft`) and verifies both in the same forward pass."""

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Lookup:
    length: int = 10
    """Tokens proposed at most (0: no lookup)."""
    max_ngram: int = 3
    """Longest suffix matched; a longer match is tried first, as it predicts better."""
    min_ngram: int = 1
    """Shortest suffix matched."""

    def __post_init__(self):
        if self.length < 0 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"Lookup(length={self.length}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram}): need "
                f"length >= 0 and 1 <= min_ngram <= max_ngram."
            )

    def propose(self, ids: torch.Tensor) -> list[int]:
        """The tokens that followed an earlier occurrence of the last n tokens of `ids` (1D), n from max_ngram
        down to min_ngram: the latest occurrence followed by `length` tokens, else the latest one; none if no
        suffix occurred before."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            starts = (ids.unfold(0, n, 1)[:-1] == ids[-n:]).all(1).nonzero()[:, 0]  # earlier windows equal to it
            if len(starts):
                after = starts + n  # (M,) where each occurrence's continuation begins
                full = after[after + self.length <= len(ids)]
                begin = int(full[-1] if len(full) else after[-1])
                return ids[begin : begin + self.length].tolist()
        return []


def add_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt-lookup options of decode.py and mtp.bench."""
    default = Lookup()
    parser.add_argument("--lookup", type=int, metavar="L",
                        help="prompt lookup: verify up to L tokens copied from earlier text beside the heads' guesses "
                        "each step (default: the number mtp.sizing chose for the heads, else 0: off)")  # fmt: skip
    parser.add_argument("--lookup-ngram", type=int, nargs=2, default=[default.min_ngram, default.max_ngram],
                        metavar=("MIN", "MAX"), help="with --lookup: suffix lengths, longest first")  # fmt: skip


def lookup_from(args: argparse.Namespace) -> Lookup | None:
    """--lookup's settings; None without it."""
    if args.lookup is None:
        return None
    return Lookup(args.lookup, min_ngram=args.lookup_ngram[0], max_ngram=args.lookup_ngram[1])
