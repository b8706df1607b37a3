"""Step costs of this machine, measured once: the seconds of a decoding step that verifies n tree nodes over B
rows, for the base model and drafter at hand, cached per machine (`mtp.machine.measured`: device, threads, torch,
dtype, base model and drafter); and the pacing they give a drafter's candidates (`machine_pacer`, see
`mtp.decoding.pacing`)."""

import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from statistics import median

import torch

from mtp.decoding.compiled import CompiledPass
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import Lookup
from mtp.decoding.pacing import Candidate, Pacer, Plan, fastest
from mtp.decoding.proposer import DrafterProtocol
from mtp.decoding.sampling import GREEDY
from mtp.decoding.tree import Path, Tree
from mtp.linears import usual_linears
from mtp.machine import cache_dir, device_name, measured
from mtp.quantized import blocks_of

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes (root included) timed on the device
BATCH_MAX_NODES = 16  # the largest tree timed for a step over several rows (a batch pays each node B times)
ROUNDS = 4  # every size is timed once a round, in turn, forward then backward: the median of its steps is then
# taken at the same moment for all sizes when the host's speed drifts steadily
CONTEXT = 256  # prompt tokens before the timed steps
STEPS = 9  # the version of a step's code and its timing, in the costs' key: raised when a change makes steps cheaper
# or dearer, or times them otherwise, so that costs measured before it are measured again


def timed_sizes(paths: list[Path], batch: int) -> list[int]:
    """The sizes in SIZES that `paths` can fill, up to BATCH_MAX_NODES when batch > 1."""
    return [s for s in SIZES if s <= len(paths) + 1 and (batch == 1 or s <= BATCH_MAX_NODES)]


def timed(call, device: torch.device) -> float:
    """Seconds that `call()` takes on `device` (waiting for a GPU to finish)."""
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_steps(
    model,
    tokenizer,
    heads: DrafterProtocol,
    paths: list[Path],
    context: int = CONTEXT,
    steps: int = 3,
    batch: int = 1,
    bound: float | None = None,
    compiled: CompiledPass | None = None,
) -> list[float]:
    """Seconds per decoding step of `batch` rows for each of `timed_sizes`, after prompts of `context` random tokens:
    the median of its steps over ROUNDS rounds, each timing every size in turn (`steps` steps of fresh rows after a
    warm-up one), in one order and then the other, so that the host's speed, which drifts over seconds, weighs on
    every size alike. Size 1 is the fastest plain step: without the drafter, with the products mtp chose
    (`mtp.linears`) or the usual ones, whichever ran faster. With `bound`, the first round stops at the first size
    whose step costs more than `bound` plain steps, and later rounds time no larger one (no larger tree can pay).
    With `compiled`, one row's steps run compiled (`mtp.decoding.compiled`), and size 1 is the fastest of the
    compiled plain step and the eager ones."""
    prompts = torch.randint(len(tokenizer), (batch, 1, context), generator=torch.Generator().manual_seed(0))

    def time_steps(size: int, usual: bool = False, eager: bool = False) -> list[float]:
        decoder = Decoder(
            model,
            tokenizer,
            heads if size > 1 else None,
            Tree.from_paths(paths[: size - 1]),
            compiled=None if eager else compiled,
        )
        with usual_linears(model) if usual else nullcontext():
            rows = decoder.batch(GREEDY)
            for prompt in prompts:
                rows.add(prompt)
            rows.step()  # warm-up
            return [timed(rows.step, model.device) for _ in range(steps)]

    plain = [(1, False, True), (1, True, True)] + ([(1, False, False)] if compiled is not None else [])
    ways = plain + [(size, False, False) for size in timed_sizes(paths, batch)[1:]]
    spent = {way: [] for way in ways}
    for turn in range(ROUNDS):
        for index, way in enumerate(ways if turn % 2 == 0 else ways[::-1]):
            spent[way] += time_steps(*way)
            if turn == 0 and bound is not None and way[0] > 1:  # (the plain steps timed first)
                if median(spent[way]) > bound * min(median(spent[each]) for each in plain):
                    ways = ways[: index + 1]  # the first size past the bound: no larger one is timed
                    break
    return [min(median(spent[way]) for way in plain)] + [median(spent[way]) for way in ways[len(plain) :]]


def step_costs(timed: list[float], max_nodes: int) -> list[float]:
    """Seconds per step for every size 1..max_nodes: linear between the timed sizes (SIZES[: len(timed)]), and
    past the last one along the last two's line; never decreasing (a bigger tree never costs less): timed sizes out
    of order are timing noise, and take their mean (`monotone`), not the larger of them."""
    sizes, timed = SIZES[: len(timed)], monotone(timed)
    costs = []
    for n in range(1, max_nodes + 1):
        i = max(j for j, s in enumerate(sizes) if s <= n)
        j = min(i, len(sizes) - 2)  # past the last timed size: the line through the last two
        if j < 0:
            costs.append(timed[0])
        else:
            frac = (n - sizes[j]) / (sizes[j + 1] - sizes[j])
            costs.append(timed[j] + frac * (timed[j + 1] - timed[j]))
    return costs


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in squares: each run out of order pooled into its mean: two sizes
    of one compiled bucket cost the same, and timing noise must not make the larger one look cheaper."""
    runs = []  # [mean, count] of each pooled run
    for value in values:
        runs.append([value, 1])
        while len(runs) > 1 and runs[-2][0] > runs[-1][0]:
            (first, n), (second, m) = runs.pop(-2), runs.pop()
            runs.append([(first * n + second * m) / (n + m), n + m])
    return [mean for mean, count in runs for _ in range(count)]


def machine_key(model, heads: DrafterProtocol, compiled: CompiledPass | None = None, context: int = CONTEXT) -> str:
    """What step costs depend on: the device (and threads), torch, the dtype and weights (`blocks_of`), the base
    model, the drafter's kind, the compiled pass's buckets, mtp's step code (STEPS)."""
    config = heads.config
    vocabulary = len(config.draft_vocab or []) or "full"
    steps = f"compiled {list(compiled.buckets)}, {compiled.length} slots" if compiled is not None else "eager"
    return " | ".join(
        [
            device_name(model.device),
            f"torch {torch.__version__}",
            str(model.dtype),
            blocks_of(model),
            config.identity(),
            f"{config.num_heads} {config.head_type} heads",
            config.lm_head,
            f"draft vocabulary {vocabulary}",
            f"context {context}",
            steps,
            f"steps v{STEPS}",
        ]
    )


def candidates(config, paths: list[Path], expected: list[float]) -> list[Candidate]:
    """A drafter's candidates: those its folder saved (`DrafterConfig.acceptance`), else the trees of every timed
    size grown from its calibration (`paths`, with the `expected` tau of each size: `mtp.decoding.tree.grow_tree`)."""
    if config.acceptance:
        return [Candidate.from_dict(saved) for saved in config.acceptance]
    return [
        Candidate(size, (), expected[size - 1] - 1.0, depth=max(map(len, paths[: size - 1]), default=0))
        for size in timed_sizes(paths, 1)
    ]


def machine_pacer(
    model,
    tokenizer,
    heads: DrafterProtocol,
    candidates: list[Candidate],
    paths: list[Path],
    compiled: CompiledPass | None = None,
) -> Pacer:
    """The pacing of `candidates` (trees of the first size - 1 of `paths`) on this machine: step costs for one row
    measured now (or read from the cache), those of B rows when a batch first needs them (`Pacer.prepare`); the
    first measurement on a machine says in one line what it found and chose."""
    trees = {size: Tree.from_paths(paths[: size - 1]) for size in {c.size for c in candidates}}
    best = max(candidate.tau for candidate in candidates)
    bound = round(1.5 * best * 2 + 0.5) / 2  # past this many plain steps, no candidate pays, even for good prompts
    key = machine_key(model, heads, compiled)

    def plans(batch: int) -> list[tuple[Plan, float]]:
        sizes = timed_sizes(paths, batch)
        name = f"{key} | sizes {sizes} | bound {bound}" + (f" | batch {batch}" if batch > 1 else "")
        fresh = []
        timed_costs = measured(
            "step_seconds.json",
            name,
            lambda: measure_steps(model, tokenizer, heads, paths, batch=batch, bound=bound, compiled=compiled),
            fresh=fresh.append,
        )
        last = SIZES[len(timed_costs) - 1]  # the largest size timed
        costs = step_costs(timed_costs, last + max(len(c.nodes) for c in candidates))
        cut = compiled is not None and batch == 1  # lookup's nodes past the largest compiled pass are dropped
        largest = compiled.buckets[-1] if cut else len(costs)  # (`mtp.decoding.batch.Batch.propose`)
        verified = [c for c in candidates if c.size <= last]
        if cut:  # a candidate sized as this pass verifies it comes before another's cut estimated to the same
            fits = {(c.size, c.lookup) for c in verified if fit_to_pass(c, largest) is c}
            verified = [w for c in verified if (w := fit_to_pass(c, largest)) is c or (w.size, w.lookup) not in fits]
        options = [
            (
                Plan(trees[c.size], Lookup(c.lookup) if any(c.lookup) else None, c),
                c.seconds(costs[: max(c.size, largest)], batch),
            )
            for c in verified
        ]
        if fresh:
            plan, seconds = fastest(options, [(1.0, 1.0)] * batch)
            ratios = ", ".join(f"{n} nodes {costs[n - 1] / costs[0]:.2f}x" for n in (2, 3, 4, 8) if n <= last)
            rows = f"{batch} prompts at once" if batch > 1 else "one prompt"
            print(
                f"mtp: timed decoding steps on {device_name(model.device)}, {model.dtype}, {rows} (once; kept in "
                f"{cache_dir() / 'step_seconds.json'}): plain {costs[0] * 1e3:.1f} ms, {ratios}; chose "
                f"{describe(plan)}, expected {plan.candidate.tau * costs[0] / seconds:.2f}x plain",
                file=sys.stderr,
            )
        return options

    return Pacer({1: plans(1)}, measure=plans)


def fit_to_pass(candidate: Candidate, largest: int) -> Candidate:
    """`candidate` as a pass of at most `largest` nodes verifies it: prompt lookup proposes no more tokens than fit
    beside the tree (the pass would drop the rest), and expects accepted the share of its saved acceptance that its
    new nodes keep (`Candidate.nodes`: steps with i new nodes keep min(i, room)); with no room left, none. Without
    this, pacing expected lookup's saved acceptance from an 8-node tree whose compiled pass verifies none of
    lookup's tokens, and chose it. An estimate still: lookup's first tokens accept most, so the share undervalues a
    cut lookup, and `machine_pacer` takes a candidate that sizing simulated cut so instead."""
    room = max(largest - candidate.size, 0)
    if candidate.reach <= room:
        return candidate
    lookup = cut_lookup(candidate.lookup, room)
    proposed = sum(i * share for i, share in enumerate(candidate.nodes))
    fitting = sum(min(i, room) * share for i, share in enumerate(candidate.nodes))
    kept = fitting / proposed if proposed else float(room > 0)
    return replace(candidate, lookup=lookup, from_lookup=candidate.from_lookup * kept)


def cut_lookup(lookup: tuple[int, ...], room: int) -> tuple[int, ...]:
    """Lookup lengths `lookup` proposing at most `room` tokens (those that fit beside a tree in the largest compiled
    pass); () where none remain."""
    lookup = tuple(min(length, room) for length in lookup)
    return lookup if any(lookup) else ()


def describe(plan: Plan) -> str:
    """`plan` in a few words: its tree and lookup."""
    tree = plan.tree if not isinstance(plan.tree, Tree) else f"the {plan.tree.size}-node tree"
    tree = "plain steps" if plan.tree.size == 1 else tree
    lookup = f"lookup {list(plan.lookup.lengths)}" if plan.lookup is not None else "no lookup"
    return f"{tree} with {lookup}"
