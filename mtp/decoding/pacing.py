"""Pacing: which tree and prompt lookup each step verifies, chosen by expected speed on the machine at hand.

A drafter's folder saves what its candidates accept (`DrafterConfig.acceptance`, written by `mtp.tools.sizing` from
decoding simulated on held-out answers; without it, the trees grown from the heads' calibration): per candidate,
a tree of `size` nodes (the first `size` - 1 paths grown from the calibration) and prompt-lookup lengths, the
candidates it accepts per step from the tree and from lookup, and how many nodes its steps verify. `mtp.decoding.costs`
measures, once per machine, what a step of n nodes over B rows costs. A candidate's expected speed is its
expected tokens per step over its expected seconds per step, and the plain step (the root alone, no lookup) is
a candidate: where no tree pays, mtp decodes plainly.

Each row keeps a running skill per drafter (its accepted candidates over those the step's candidate expects,
smoothed over about the last 20 steps); each step takes the candidate with the most expected tokens per second for
the rows at hand. A prompt whose guesses are rarely right shrinks its tree, down to plain steps; while a drafter
sits out, its skill drifts back to the average, so the tree grows back to try again, ever more rarely while its
tries keep failing. Lossless either way: the tree changes between steps, never the acceptance rule.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

from mtp.decoding.lookup import Lookup
from mtp.decoding.tree import DynamicTree, Tree

RATE = 0.05  # the weight of a step's acceptance in a row's running skill (about the last 20 steps count: at 0.3, a
# few steps that accepted nothing, common for any drafter, dropped the tree)
RETRY_WEIGHT = 0.3  # the weight of a try after sitting out: one that fails puts the drafter out again for a while
RETURN_RATE = 0.02  # per step a drafter sits out, its skill moves this share of the way back to 1 (the average): a
# drafter dropped for a prompt is tried again after a few steps, not every other one
MIN_RETURN_RATE = RETURN_RATE / 8  # each failed try of a drafter halves its return (`Skill`), down to this
MAX_SKILL = 4.0  # a step's acceptance counts at most this many times what the candidate expects
BATCH_SIZES = (2, 4, 8, 16)  # steps over at least this many rows get plans of their own


@dataclass(frozen=True)
class Candidate:
    """A tree and lookup setting, with what it accepts per step on held-out answers."""

    size: int
    """Tree nodes, root included: the first size - 1 paths grown from the calibration (1: the root alone)."""
    lookup: tuple[int, ...] = ()
    """Prompt-lookup lengths (`mtp.decoding.lookup.Lookup`); (): none."""
    from_tree: float = 0.0
    """Accepted candidates per step that the tree proposed."""
    from_lookup: float = 0.0
    """Accepted candidates per step that lookup proposed past the tree's."""
    nodes: tuple[float, ...] = (1.0,)
    """nodes[i]: the share of steps that verify size + i nodes (lookup's tokens that are new nodes)."""
    depth: int = 0
    """The tree's depth: the most candidates it can accept."""

    @property
    def tau(self) -> float:
        """Expected tokens per step on the held-out answers (the bonus token included)."""
        return 1.0 + self.from_tree + self.from_lookup

    @cached_property
    def reach(self) -> int:
        """The most candidates lookup can add."""
        return max(self.lookup, default=0)

    def expected(self, tree_skill: float, lookup_skill: float) -> float:
        """Tokens per step for a row whose drafters accept `tree_skill` and `lookup_skill` times the average."""
        return 1.0 + min(self.from_tree * tree_skill, self.depth) + min(self.from_lookup * lookup_skill, self.reach)

    def seconds(self, costs: list[float], rows: int = 1) -> float:
        """Expected seconds of a step over `rows` rows, costs[n - 1] being a step of n nodes per row: every row's
        tree is padded to the largest, so a step costs its rows' most nodes."""
        total, below, steps = 0.0, 0.0, sum(self.nodes)
        for extra, at_most in enumerate(accumulate(self.nodes)):  # P(the most of `rows` steps is size + extra)
            at_most = min(at_most / steps, 1.0)
            total += (at_most**rows - below**rows) * costs[min(self.size + extra, len(costs)) - 1]
            below = at_most
        return total

    def as_dict(self) -> dict:
        """As `DrafterConfig.acceptance` saves it."""
        return {
            "size": self.size,
            "lookup": list(self.lookup),
            "from_tree": round(self.from_tree, 5),
            "from_lookup": round(self.from_lookup, 5),
            "nodes": [round(n, 5) for n in self.nodes],
            "depth": self.depth,
        }

    @classmethod
    def from_dict(cls, saved: dict) -> "Candidate":
        return cls(
            saved["size"],
            tuple(saved["lookup"]),
            saved["from_tree"],
            saved["from_lookup"],
            tuple(saved["nodes"]),
            saved["depth"],
        )


@dataclass(frozen=True)
class Plan:
    """What one step verifies: the drafter's tree and prompt lookup (None: off)."""

    tree: Tree | DynamicTree
    lookup: Lookup | None = None
    candidate: Candidate | None = None
    """What it is expected to accept (None: a plan the caller fixed, which never changes)."""


@dataclass
class Pacer:
    """Each step's plan for the rows at hand: `plans[B]`, the plans of steps over at least B rows (up to the next
    key), each with its expected seconds of a step over B rows; `measure(B)` gives them for a B not there yet
    (`prepare`). One plan for a B is fixed, never adapted."""

    plans: dict[int, list[tuple[Plan, float]]] = field(default_factory=dict)
    measure: Callable[[int], list[tuple[Plan, float]]] | None = None

    @classmethod
    def fixed(cls, plan: Plan) -> "Pacer":
        """Every step verifies `plan`."""
        return cls({1: [(plan, 1.0)]})

    def prepare(self, rows: int) -> None:
        """Have the plans of steps over up to `rows` rows (measured now if they are not yet)."""
        if self.measure is not None:
            for batch in BATCH_SIZES:
                if batch <= rows and batch not in self.plans:
                    self.plans[batch] = self.measure(batch)

    def plan(self, rows: list) -> Plan:
        """The plan with the most expected tokens per second over `rows` (each with its `tree_skill` and
        `lookup_skill`, `Skill`s)."""
        options = self.options(len(rows))
        if len(options) == 1:
            return options[0][0]
        return fastest(options, [(row.tree_skill.value, row.lookup_skill.value) for row in rows])[0]

    def best(self, rows: int) -> Plan:
        """The plan with the most expected tokens per second for `rows` rows of average skill."""
        return fastest(self.options(rows), [(1.0, 1.0)] * rows)[0]

    def options(self, rows: int) -> list[tuple[Plan, float]]:
        """The plans of a step over `rows` rows, each with its expected seconds."""
        return self.plans[max(b for b in self.plans if b <= rows)]

    @staticmethod
    def update(row, plan: Plan, from_tree: int, from_lookup: int) -> None:
        """A row's skills after a step of `plan` that accepted these candidates from the tree and from lookup."""
        if plan.candidate is not None:
            row.tree_skill.update(from_tree, plan.candidate.from_tree)
            row.lookup_skill.update(from_lookup, plan.candidate.from_lookup)


def fastest(options: list[tuple[Plan, float]], skills: list[tuple[float, float]]) -> tuple[Plan, float]:
    """The option (a plan and its expected seconds) with the most expected tokens per second for rows of these
    (tree, lookup) skills; a lone option, whatever it expects."""
    if len(options) == 1:
        return options[0]
    return max(options, key=lambda option: sum(option[0].candidate.expected(*skill) for skill in skills) / option[1])


@dataclass
class Skill:
    """How many times the average a drafter's candidates are accepted in one row of late (`value`), and the share
    of the way back to the average it drifts each step the drafter sits out (`back`): halved by each try after
    sitting out that accepts none of its candidates (down to MIN_RETURN_RATE), so that a drafter whose tries keep
    failing is tried ever more rarely; back to RETURN_RATE when a step accepts any. A step in play weighs RATE, a try
    after sitting out RETRY_WEIGHT."""

    value: float = 1.0
    back: float = RETURN_RATE
    resting: bool = False
    """The drafter sat out the last step."""

    def update(self, accepted: int, expected: float) -> None:
        """After a step whose candidate expected `expected` accepted candidates from the drafter (0: it sat out)."""
        if expected <= 0:
            self.value += self.back * (1.0 - self.value)
            self.resting = True
            return
        self.value += (RETRY_WEIGHT if self.resting else RATE) * (min(accepted / expected, MAX_SKILL) - self.value)
        if accepted:
            self.back = RETURN_RATE
        elif self.resting:
            self.back = max(self.back / 2, MIN_RETURN_RATE)
        self.resting = False
