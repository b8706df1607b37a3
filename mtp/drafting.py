"""The drafter seam: what every drafter does over the rows of a batch (`Proposer`), so that the verifier
(`mtp.batch`) names none of them.

A proposer starts a row from its prefill, proposes candidates on each row's tree, takes what the base model
accepted and drops rows that leave. Proposers run in turn each step: the first lays out a tree from the root
(heads, a feature-level drafter), later ones graft onto it (prompt lookup); each node records which proposer put
it there (`Tree.sources`).
"""

import torch

from mtp.target import States, Target
from mtp.tree import Tree


class Proposer:
    """One drafter's state over the rows of a batch."""

    name = "drafter"
    layers: list[int] = []
    """The base model's hidden states (transformers' `hidden_states` indices) it reads; []: the last ones only."""

    def add(self, input_ids: torch.Tensor, states: States, root: int) -> None:
        """A row joins as the last: its prompt input_ids (T,), the prefill's states (of one row, T queries) and
        the first new token, `root`."""

    def propose(self, trees: list[Tree], tokens: list[torch.Tensor], rooms: list[int], source: int):
        """Each row's tree and its tokens (N_b+1,) so far -> with this drafter's candidates, its new nodes marked
        `source`; no node deeper than the row's room."""
        raise NotImplementedError

    def accept(self, states: States, nodes: list[torch.Tensor], settled: list[list[int]]) -> None:
        """After a verification pass: per row, the accepted nodes (A_b+1,) of the pass (`states`), root first,
        and the tokens they settled (the accepted candidates, then the bonus token)."""

    def keep(self, rows: list[bool]) -> None:
        """Keep the rows marked True, in order."""


class TreeProposer(Proposer):
    """A drafter that fills a static tree (`plans`: the tree for steps over at least B rows, by B) from the root:
    the tree of the step's batch size, cut to the room of the row with the least (`cut`: those trees by (B, depth),
    kept by the caller across batches: cutting one costs more than a small step)."""

    def __init__(self, target: Target, plans: dict[int, Tree], cut: dict):
        self.target, self.plans, self._trees = target, plans, cut

    def tree(self, rows: int, depth: int) -> Tree:
        batch = max(b for b in self.plans if b <= rows)
        depth = min(depth, self.plans[batch].depth)
        if (batch, depth) not in self._trees:  # each plan's tree cut at each depth, on the model's device
            self._trees[batch, depth] = self.plans[batch].within(depth).to(self.target.device)
        return self._trees[batch, depth]

    def propose(self, trees, tokens, rooms, source):
        tree = self.tree(len(tokens), min(rooms))
        roots = torch.stack([row[:1] for row in tokens])  # (B, 1)
        filled = self.tokens(tree, roots) if tree.size > 1 else roots  # (B, N+1)
        return [tree] * len(tokens), list(filled)

    def tokens(self, tree: Tree, roots: torch.Tensor) -> torch.Tensor:
        """The token of every node of `tree` in each row: roots (B, 1) -> (B, N+1)."""
        raise NotImplementedError
