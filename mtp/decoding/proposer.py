"""The drafter seam: what every drafter does over the rows of a batch (`Proposer`), so that the verifier
(`mtp.decoding.batch`) names none of them.

A proposer starts a row from its prefill, proposes candidates on each row's tree, takes what the base model
accepted and drops rows that leave. Proposers run in turn each step: the first lays out a tree from the root
(heads, a feature-level drafter), later ones graft onto it (prompt lookup); each node records which proposer put
it there (`Tree.sources`).
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mtp.decoding.pacing import Plan
from mtp.decoding.target import PassStates, Target
from mtp.decoding.tree import DynamicTree, Tree
from mtp.linears import proposing


class Proposer:
    """One drafter's state over the rows of a batch."""

    name = "drafter"
    layers: list[int] = []
    """The base model's hidden states (transformers' `hidden_states` indices) it reads; []: the last ones only."""
    grafts = False
    """It hangs its candidates on a tree that another laid out (prompt lookup) rather than laying out one."""

    def add(self, input_ids: torch.Tensor, states: PassStates, root: int) -> None:
        """A row joins as the last: its prompt input_ids (T,), the prefill's states (of one row, T queries) and
        the first new token, `root`."""

    def propose(self, plan: Plan, trees: list[Tree], tokens: list[torch.Tensor], rooms: list[int], source: int):
        """Each row's tree and its tokens (N_b+1,) so far -> with this drafter's candidates as the step's `plan`
        says, its new nodes marked `source`; no node deeper than the row's room."""
        raise NotImplementedError

    def accept(self, states: PassStates, nodes: list[torch.Tensor], settled: list[list[int]]) -> None:
        """After a verification pass: per row, the accepted nodes (A_b+1,) of the pass (`states`), root first,
        and the tokens they settled (the accepted candidates, then the bonus token)."""

    def keep(self, rows: list[bool]) -> None:
        """Keep the rows marked True, in order."""

    def at_roots(self, input_ids: torch.Tensor, states: PassStates, roots: list[int]) -> None:
        """Rows join for steps at the positions `roots` of one sequence `input_ids` (T,), as if each were a prompt
        `input_ids[:p]` with the first new token `input_ids[p]`, from `states` of one pass over the whole sequence
        (for `mtp.tools.sizing`'s simulation of decoding)."""
        for p in roots:
            self.add(input_ids[:p], states.prefix(p), int(input_ids[p]))


class DrafterProtocol(Protocol):
    """What decoding needs of a drafter, declared here so that decoding names no drafter: its proposer over the rows
    of a batch, the deepest tree node it can fill, and its config (its kind, for the step costs' key). The drafters
    (`mtp.drafters.contract.Drafter`) implement it."""

    config: Any
    max_depth: int | None

    def proposer(self, target: Target, cut: dict) -> Proposer:
        """This drafter over the rows of a batch, on the trees of each step's plan (`cut`: the static trees cut so
        far, kept by the caller across batches)."""


@dataclass
class DraftTree:
    """What a drafter drafted so far this step, per row: node 0 the root, a node's parent before it."""

    tokens: torch.Tensor
    """(B, M) each node's token."""
    parents: torch.Tensor
    """(B, M) each node's parent (-1: the root)."""
    ancestors: torch.Tensor
    """(B, M, M) bool: ancestors[b, i, j] iff node j is node i or one of its ancestors in row b."""

    def paths(self, nodes: torch.Tensor) -> torch.Tensor:
        """The tokens of the paths from the root down to `nodes` (B, P), all of one depth d: (B, P, d + 1)."""
        rows = self.ancestors.gather(1, nodes[..., None].expand(-1, -1, self.tokens.shape[1]))  # (B, P, M)
        index = rows.nonzero()[:, 2].view(*nodes.shape, -1)  # (B, P, d+1) ancestors by index: root first
        return self.tokens.gather(1, index.flatten(1)).view(index.shape)


class TreeProposer(Proposer):
    """A drafter that lays out each step's tree from the root, level by level (`expand`): the plan's static tree,
    cut to the room of the row with the least (`cut`: trees by (id of the plan's tree, depth), kept by the caller
    across batches: cutting one costs more than a small step), or a `DynamicTree`, grown every step from the
    drafter's draft probabilities, a tree of its own per row."""

    def __init__(self, target: Target, cut: dict):
        self.target, self._trees = target, cut

    def tree(self, plan: Tree, depth: int) -> Tree:
        depth = min(depth, plan.depth)
        if (id(plan), depth) not in self._trees:  # the plan's tree cut at each depth, on the model's device
            self._trees[id(plan), depth] = plan.within(depth).to(self.target.device)
        return self._trees[id(plan), depth]

    def propose(self, plan, trees, tokens, rooms, source):
        roots = torch.stack([row[:1] for row in tokens])  # (B, 1)
        with proposing():  # (on a CPU from int8 rows: `mtp.linears.uses_int8_rows`)
            if isinstance(plan.tree, DynamicTree):
                return self.grow(plan.tree, roots, min(plan.tree.deepest, min(rooms)))
            tree = self.tree(plan.tree, min(rooms))
            filled = self.tokens(tree, roots) if tree.size > 1 else roots  # (B, N+1)
        return [tree] * len(tokens), list(filled)

    def tokens(self, tree: Tree, roots: torch.Tensor) -> torch.Tensor:
        """The token of every node of the static `tree` in each row: roots (B, 1) -> (B, N+1)."""
        batch = len(roots)
        tokens = torch.cat([roots, roots.new_zeros(batch, tree.size - 1)], 1)  # (B, N+1) filled level by level
        draft = DraftTree(tokens, tree.parents[None].expand(batch, -1), tree.mask[None].expand(batch, -1, -1))
        for depth, (nodes, rows, paths) in enumerate(tree.levels, 1):
            parents = paths[:, -1][None].expand(batch, -1)  # (B, P) the nodes whose children are drafted now
            best, _ = self.expand(draft, parents, depth, tree.top_k)  # (B, P, k)
            tokens[:, nodes] = best[:, rows, tree.ranks[nodes]]  # (B, M)
        return tokens

    def grow(self, plan: DynamicTree, roots: torch.Tensor, depth: int) -> tuple[list[Tree], list[torch.Tensor]]:
        """Each row's tree for this step, grown by `plan` to `depth` levels, and its tokens."""
        batch, device, k = len(roots), roots.device, plan.top_k
        draft = DraftTree(roots, torch.full_like(roots, -1), torch.ones(batch, 1, 1, dtype=torch.bool, device=device))
        scores = torch.zeros(batch, 1, device=device)  # (B, M) each node's joint draft log-probability
        ranks = torch.full_like(roots, -1)  # (B, M) each node's rank among its parent's children
        frontier = torch.zeros_like(roots)  # (B, P) the nodes whose children are drafted next
        for level in range(1, depth + 1):
            best, logp = self.expand(draft, frontier, level, k)  # (B, P, k)
            size, count = draft.tokens.shape[1], frontier.shape[1] * k
            joint = (scores.gather(1, frontier)[..., None] + logp.float()).flatten(1)  # (B, P k)
            parents = frontier[..., None].expand(-1, -1, k).flatten(1)  # (B, P k)
            inherited = draft.ancestors.gather(1, parents[..., None].expand(-1, -1, size))  # (B, P k, M)
            itself = torch.eye(count, dtype=torch.bool, device=device).expand(batch, -1, -1)
            ancestors = torch.cat([F.pad(draft.ancestors, (0, count)), torch.cat([inherited, itself], -1)], 1)
            draft = DraftTree(
                torch.cat([draft.tokens, best.flatten(1)], 1), torch.cat([draft.parents, parents], 1), ancestors
            )
            scores = torch.cat([scores, joint], 1)
            ranks = torch.cat([ranks, torch.arange(k, device=device).repeat(count // k).expand(batch, -1)], 1)
            frontier = size + joint.topk(min(k, count), dim=-1).indices  # (B, k)
        # the most probable nodes; ties go to the lower index, so a parent comes before its child
        order = scores.sort(dim=-1, descending=True, stable=True).indices[:, : plan.nodes]  # (B, N) root first
        chosen = order.sort(dim=-1).values  # (B, N) by index: parents first
        trees, tokens = [], []
        for row, nodes in enumerate(chosen.tolist()):
            place = {node: i for i, node in enumerate(nodes)}
            parents = [-1] + [place[p] for p in draft.parents[row, nodes[1:]].tolist()]
            trees.append(Tree.from_parents(parents, ranks[row, nodes].tolist(), scores[row, nodes]).to(device))
            tokens.append(draft.tokens[row, nodes])
        return trees, tokens

    def expand(self, draft: DraftTree, nodes: torch.Tensor, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k children of `nodes` (B, P) of each row's `draft`, all of depth `depth` - 1 (depth 1: the root,
        a new step): their token ids (B, P, k) and draft log-probabilities (B, P, k), most probable first."""
        raise NotImplementedError


class LookupProposer(Proposer):
    """Prompt lookup over the rows of a batch: each row's text so far (prompt and settled tokens), and the chain of
    the step's lookup grafted onto each row's tree."""

    name, grafts = "lookup", True

    def __init__(self):
        self.sequences = []  # per row, (T,) the prompt and every settled token

    def add(self, input_ids, states, root):
        self.sequences.append(torch.cat([input_ids.cpu(), torch.tensor([root])]))

    def propose(self, plan, trees, tokens, rooms, source):
        lookup = plan.lookup
        if lookup is None:
            return trees, tokens
        chains = [lookup.propose(sequence)[:room] for sequence, room in zip(self.sequences, rooms, strict=True)]
        grafts = [tree.graft(row, chain, source) for tree, row, chain in zip(trees, tokens, chains, strict=True)]
        return [tree for tree, _ in grafts], [row for _, row in grafts]

    def accept(self, states, nodes, settled):
        self.sequences = [torch.cat([seq, torch.tensor(new)]) for seq, new in zip(self.sequences, settled, strict=True)]

    def keep(self, rows):
        self.sequences = [sequence for sequence, kept in zip(self.sequences, rows, strict=True) if kept]
