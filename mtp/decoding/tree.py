"""Candidate trees: which top-k ranks of which heads a decoding step verifies, in one forward pass.

A tree is given by its paths (the Medusa "choices" format): a path `(r1, r2, ..., rd)` is the node reached
by taking rank r1 of head 0, then rank r2 of head 1, and so on. Node 0 is the root: the token the base model
itself chose last. A node at depth d holds a guess for the token d positions after the root.
"""

import heapq
from dataclasses import dataclass, replace
from functools import cached_property

import torch

Path = tuple[int, ...]


@dataclass(frozen=True)
class Tree:
    paths: tuple[Path, ...]
    """The N non-root nodes in breadth-first order (by depth, then by ranks): node i + 1 is paths[i]."""
    parents: torch.Tensor
    """(N+1,) index of each node's parent; -1 for the root."""
    depths: torch.Tensor
    """(N+1,) depth of each node (root 0); also each node's position offset from the root."""
    ranks: torch.Tensor
    """(N+1,) rank of each node's token in its head's top-k (-1: the root, and grafted nodes, which have none)."""
    sources: torch.Tensor
    """(N+1,) which drafter of the step proposed each node (`mtp.decoding.proposer`): 0 for the nodes of the paths,
    the grafting one's number for grafted nodes; -1 for the root."""
    mask: torch.Tensor
    """(N+1, N+1) bool: mask[i, j] iff node j is node i or one of its ancestors."""
    retrieve: torch.Tensor
    """(L, D+1) node indices of the L root-to-leaf paths, each padded with -1 after its leaf."""
    scores: torch.Tensor | None = None
    """(N+1,) for a tree grown by its drafter (`DynamicTree`): each node's joint draft log-probability."""

    @classmethod
    def from_paths(cls, paths, num_heads: int | None = None, top_k: int | None = None) -> "Tree":
        """Build a tree, checking that every prefix of a path is a path too and that ranks and depths fit.

        Args:
            paths: iterable of rank tuples; order and duplicates do not matter.
            num_heads: if given, no path may be deeper than this (head d-1 guesses depth d).
            top_k: if given, every rank must be below this.
        """
        ordered = tuple(sorted({tuple(int(r) for r in path) for path in paths}, key=lambda p: (len(p), p)))
        index = {(): 0} | {path: i + 1 for i, path in enumerate(ordered)}
        for path in ordered:
            if not path:
                raise ValueError("The empty path is the root and is always there: leave it out.")
            if path[:-1] not in index:
                raise ValueError(f"Path {path} has no parent path {path[:-1]}: add it, every prefix must be a path.")
            if min(path) < 0 or (top_k is not None and max(path) >= top_k):
                raise ValueError(f"Path {path} has a rank outside 0..{(top_k or 1) - 1}: use ranks below top_k.")
            if num_heads is not None and len(path) > num_heads:
                raise ValueError(f"Path {path} is {len(path)} deep, but there are only {num_heads} heads.")
        parents = torch.tensor([-1] + [index[path[:-1]] for path in ordered])  # (N+1,)
        sources = torch.tensor([-1] + [0] * len(ordered))
        return cls._build(ordered, parents, torch.tensor([-1] + [path[-1] for path in ordered]), sources)

    @classmethod
    def from_parents(cls, parents: list[int], ranks: list[int], scores: torch.Tensor) -> "Tree":
        """The tree whose node i has parent parents[i] (< i; -1 for the root, node 0), is its parent's child of
        rank ranks[i] and has joint draft log-probability scores[i]: one grown for a single step
        (`mtp.decoding.proposer`); nodes keep their order."""
        paths = [()]
        for parent, rank in zip(parents[1:], ranks[1:], strict=True):
            paths.append(paths[parent] + (rank,))
        sources = torch.tensor([-1] + [0] * (len(parents) - 1))
        tree = cls._build(tuple(paths[1:]), torch.tensor(parents), torch.tensor(ranks), sources)
        return replace(tree, scores=scores)

    @classmethod
    def _build(cls, paths: tuple[Path, ...], parents: torch.Tensor, ranks: torch.Tensor, sources) -> "Tree":
        """The tree whose node i has parent parents[i] (< i; the root's -1)."""
        size = len(parents)
        mask = torch.eye(size, dtype=torch.bool)  # (N+1, N+1)
        for node in range(1, size):  # parents come first, so their rows are complete
            mask[node] |= mask[parents[node]]
        depths = mask.sum(-1) - 1  # (N+1,): a node sees itself and its ancestors
        leaves = sorted(set(range(size)) - set(parents.tolist()))  # a root-only tree: the root is the leaf
        retrieve = torch.full((len(leaves), int(depths.max()) + 1), -1)  # (L, D+1)
        for row, leaf in enumerate(leaves):  # a leaf's ancestors, by index: root first, as parents come first
            path = mask[leaf].nonzero()[:, 0]
            retrieve[row, : len(path)] = path
        return cls(paths, parents, depths, ranks, sources, mask, retrieve)

    def graft(self, tokens: torch.Tensor, chain: list[int], source: int) -> tuple["Tree", torch.Tensor]:
        """This tree, whose nodes hold `tokens` (N+1,), with `chain` (tokens proposed after the root, by drafter
        `source`, such as prompt lookup) hung from the root: the chain follows the nodes whose tokens it repeats, so
        that no candidate is verified twice, and its rest becomes new nodes (rank -1) below the last one it followed.

        Returns the tree (on this tree's device) and its tokens (N'+1,), the new nodes' last."""
        children, values, node, i = self.children, tokens.tolist(), 0, 0
        while i < len(chain) and (match := [c for c in children[node] if values[c] == chain[i]]):
            node, i = match[0], i + 1
        rest = chain[i:]
        if not rest:
            return self, tokens
        shape = node, len(rest), source
        if shape not in self._grafted:
            new = torch.arange(self.size, self.size + len(rest))  # (M,)
            parents = torch.cat([self.parents.cpu(), torch.tensor([node]), new[:-1]])  # (N'+1,)
            path = self.paths[node - 1] if node else ()
            paths = self.paths + tuple(path + (-1,) * j for j in range(1, len(rest) + 1))
            ranks = torch.cat([self.ranks.cpu(), torch.full((len(rest),), -1)])
            sources = torch.cat([self.sources.cpu(), torch.full((len(rest),), source)])
            self._grafted[shape] = Tree._build(paths, parents, ranks, sources).to(self.parents.device)
        return self._grafted[shape], torch.cat([tokens, torch.tensor(rest, device=tokens.device)])

    @cached_property
    def _grafted(self) -> dict[tuple[int, int, int], "Tree"]:
        """The trees `graft` made of this one, by (the node the new nodes hang from, their number, their source):
        the same static tree grafts the same few shapes step after step, each built once."""
        return {}

    def head(self, size: int) -> "Tree":
        """The tree of its first `size` nodes (a node's parent comes before it); itself if it has no more."""
        if size >= self.size:
            return self
        parents, ranks, sources = (t[:size].cpu() for t in (self.parents, self.ranks, self.sources))
        return Tree._build(self.paths[: size - 1], parents, ranks, sources).to(self.parents.device)

    @property
    def size(self) -> int:
        """Number of nodes, root included: the tokens one verification pass feeds the base model."""
        return len(self.paths) + 1

    @cached_property
    def depth(self) -> int:
        """The deepest node's depth (0: the root alone)."""
        return int(self.depths.max())

    @cached_property
    def top_k(self) -> int:
        """The highest rank of a head's guess in the tree + 1: how many guesses per head a step needs."""
        return int(self.ranks.max()) + 1

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i]: node i's children, in rank order (nodes are breadth-first by ranks)."""
        children = [[] for _ in range(self.size)]
        for node, parent in enumerate(self.parents.tolist()[1:], 1):
            children[parent].append(node)
        return children

    @cached_property
    def levels(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per depth d = 1 .. D, for heads that read the path: (the nodes of depth d (M,), each one's parent as a
        row of the next (M,), the paths of their distinct parents (P, d): node ids from the root to the parent)."""
        levels = []
        for depth in range(1, self.depth + 1):
            nodes = (self.depths == depth).nonzero()[:, 0]  # (M,)
            parents, rows = self.parents[nodes].unique(return_inverse=True)  # (P,), (M,)
            paths = self.mask[parents].nonzero()[:, 1].view(len(parents), depth)  # (P, d): ancestors by index = depth
            levels.append((nodes, rows, paths))
        return levels

    def within(self, depth: int) -> "Tree":
        """The tree without the nodes deeper than `depth`; the nodes kept are the first ones, in the same order."""
        return Tree.from_paths([path for path in self.paths if len(path) <= depth])

    def to(self, device: torch.device | str) -> "Tree":
        names = ("parents", "depths", "ranks", "sources", "mask", "retrieve")
        names += ("scores",) if self.scores is not None else ()
        return replace(self, **{name: getattr(self, name).to(device) for name in names})


@dataclass(frozen=True)
class DynamicTree:
    """A tree chosen every step from the drafter's own confidence (as EAGLE-2 does): `depth` levels, each drafting
    the `top_k` most probable children of the `top_k` most probable nodes of the level before (by joint draft
    probability, the product of the draft probabilities along the node's path), then the `nodes` - 1 most probable
    nodes drafted, with the root. A child is never more probable than its parent, so every chosen node's
    ancestors are chosen too. Written `dynamic:NODES:DEPTH:TOP_K`."""

    nodes: int
    depth: int
    top_k: int

    def __post_init__(self):
        if self.nodes < 1 or self.depth < 1 or self.top_k < 1:
            raise ValueError(f"{self}: a dynamic tree has at least 1 node, 1 level and 1 child per node.")

    @property
    def size(self) -> int:
        """The most nodes of a step's tree, root included."""
        return self.nodes

    @property
    def deepest(self) -> int:
        """The levels a step drafts: `depth`, but no more than a tree of `nodes` can hold (a chain of `nodes` - 1)."""
        return min(self.depth, self.nodes - 1)

    @classmethod
    def parse(cls, name: str) -> "DynamicTree":
        parts = name.split(":")
        if len(parts) != 4 or parts[0] != "dynamic" or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"Tree {name!r}: write a dynamic tree as dynamic:NODES:DEPTH:TOP_K, e.g. dynamic:8:4:3.")
        return cls(*(int(p) for p in parts[1:]))

    def __str__(self) -> str:
        return f"dynamic:{self.nodes}:{self.depth}:{self.top_k}"


def grow_tree(calibration: list[list[float]], max_nodes: int) -> tuple[list[Path], list[float]]:
    """Grow a tree greedily, node by node, by the candidate with the highest probability of being accepted.

    Args:
        calibration: calibration[k][r], the probability that head k's rank-r guess is right.
        max_nodes: the largest tree size, root included.

    Returns:
        (paths, expected_tau): paths in the order they were added, so `paths[: n - 1]` is the tree of n nodes,
        and expected_tau[n - 1], the expected tokens per verification pass of that tree (n = 1: the root alone).
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes}: a tree has at least the root.")
    frontier = [(-p, 1, (r,)) for r, p in enumerate(calibration[0])]  # children of the root
    heapq.heapify(frontier)  # ties: shallower first, then lower ranks; a child enters once its parent is in
    paths, expected = [], [1.0]
    while frontier and len(paths) < max_nodes - 1:
        gain, _, path = heapq.heappop(frontier)
        paths.append(path)
        expected.append(expected[-1] - gain)
        if len(path) < len(calibration):  # its children: the next head's guesses after this one
            for r, p in enumerate(calibration[len(path)]):
                heapq.heappush(frontier, (gain * p, len(path) + 1, path + (r,)))
    return paths, expected


# Hand-made trees for 4 heads, from a chain to 32 nodes; each is the same tree at every smaller size plus
# the next most likely guesses (top ranks of the first heads first). On a CPU a 64-token pass costs about 4
# plain steps, so the small ones are the CPU defaults.
_SMALL = [(0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]
_MEDIUM = _SMALL + [(3,), (0, 2), (2, 0), (1, 1), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 1)]
_LARGE = _MEDIUM + [
    (4,),
    (0, 3),
    (3, 0),
    (1, 2),
    (2, 1),
    (0, 0, 2),
    (0, 2, 0),
    (1, 0, 1),
    (1, 1, 0),
    (2, 0, 0),
    (0, 1, 1),
    (0, 0, 1, 0),
    (0, 1, 0, 0),
    (1, 0, 0, 0),
    (0, 0, 0, 2),
    (2, 2),
]
NAMED_TREES: dict[str, list[Path]] = {
    "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "small": _SMALL,
    "medium": _MEDIUM,
    "large": _LARGE,
}
DEFAULT_TREE = "small"
TREE_HELP = (
    f"one of {sorted(NAMED_TREES)}, a number N (the N-node tree grown from the heads' calibration), or "
    "dynamic:NODES:DEPTH:TOP_K (a tree grown every step from the drafter's probabilities); default: the tree "
    "saved with the heads"
)


def named_tree(name: str, num_heads: int, calibration: list[list[float]] | None = None) -> Tree | DynamicTree:
    """A shipped tree without the nodes deeper than `num_heads`; for a number N, the N-node tree grown from the
    heads' `calibration` (see `grow_tree`); or a `DynamicTree` (`dynamic:NODES:DEPTH:TOP_K`)."""
    if name.startswith("dynamic"):
        return DynamicTree.parse(name)
    if name.isdigit():
        if calibration is None:
            raise ValueError(
                f"Tree {name!r}: a tree grown to a size needs heads with calibration; name a tree instead."
            )
        return Tree.from_paths(grow_tree(calibration, int(name))[0], num_heads=num_heads)
    if name not in NAMED_TREES:
        raise ValueError(f"Unknown tree {name!r}: choose one of {sorted(NAMED_TREES)} or a number of nodes.")
    return Tree.from_paths([path for path in NAMED_TREES[name] if len(path) <= num_heads], num_heads=num_heads)
