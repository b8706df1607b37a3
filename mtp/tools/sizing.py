"""Measure what a drafter's trees accept, and size the tree to this machine: grow it from the heads' calibrated
rank accuracies, time a decoding step for each tree size on this device, keep the size with the highest expected
speedup, save it with the heads. With held-out answers (--data), prompt lookup's lengths are chosen with it, and
what every candidate tree and lookup accepts per step is saved too (`DrafterConfig.acceptance`): `mtp.load` chooses
among those on the machine it runs on, by that machine's step costs (`mtp.decoding.pacing`).

    python -m mtp.tools.sizing --drafter DRAFTER [--data TRAINING_DATA [--val-data ANSWERS]] [--device cpu]
        [--max-nodes 64] [--remeasure]

Expected tau (tokens per verification pass) of a tree is 1 (the bonus token) plus, over its candidate nodes,
the probability that the node's whole path is right, taken as the product of the rank accuracies along it
(heads treated as independent). At most one node per depth can be right, so this sum is the expected number
of accepted candidates. Expected speedup over plain decoding is tau(N) * step(1) / step(N), with step(N) the
measured time of a decoding step that verifies N tree tokens (step(1): the fastest plain one-token step, see
`measure_steps`).

With --data (the heads' training data, which decides the prompts they did not train on; --val-data: read these
answers to them, as training's data.val_data), decoding the base model's own answers to the held-out prompts is
simulated instead, step by step: at each root, the heads' tree accepts the true path as deep as it holds it
(teacher-forced guesses), prompt lookup (`mtp.decoding.lookup`) its right leading tokens, the step the longer of the two
plus the bonus token, and it costs step(N + lookup's tokens that are new nodes). Heads and lookup are measured
together on the same answers, so their overlap is counted once. For every tree size, the lookup lengths (tokens
after a match of 1, 2, 3 tokens) with the most tokens per second are searched (on a compiled pass, among those
that fit beside the tree in its largest size: it verifies no more), and the best pair is saved.
"""

import argparse
from functools import partial

import torch

from mtp.decoding.compiled import compile_pass
from mtp.decoding.costs import SIZES, cut_lookup, machine_key, measure_steps, step_costs, timed, timed_sizes
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import FULL_REACH, MAX_NGRAM, Lookup
from mtp.decoding.pacing import Plan
from mtp.decoding.sampling import GREEDY
from mtp.decoding.tree import DynamicTree, Path, Tree, grow_tree
from mtp.drafters.contract import Drafter, load_with_base
from mtp.machine import measured
from mtp.quantized import add_weights_argument
from mtp.tools.cli import user_errors
from mtp.tools.simulate import (
    LOOKUP_LENGTHS,
    acceptance,
    best_lookup,
    evenly_spaced,
    grown_accepts,
    held_out_roots,
    simulate,
)
from mtp.training.data import add_held_out_arguments, held_out

DYNAMIC_DEPTHS, DYNAMIC_TOP_K = (2, 3, 4, 5), (2, 3, 4)  # the dynamic trees sizing simulates
DYNAMIC_ANSWERS = 24  # distinct held-out answers they are simulated on (every root drafts a tree), beside static trees


@torch.no_grad()
def measure_drafting(model, tokenizer, heads: Drafter, plans: list, context: int, steps: int = 6) -> list[float]:
    """Seconds the drafters take to propose one step's tree, for each plan (a static `Tree` or a `DynamicTree`),
    after a prompt of `context` random tokens: the median of `steps` proposals after a warm-up step, without
    gradients, as decoding proposes (with them, the heads' float products are recorded for autograd, many times
    slower)."""
    prompt = torch.randint(len(tokenizer), (1, context), generator=torch.Generator().manual_seed(0))
    seconds = []
    for plan in plans:
        rows = Decoder(model, tokenizer, heads, plan).batch(GREEDY)
        rows.add(prompt)
        rows.step()
        spent = []
        for _ in range(steps):
            spent.append(timed(partial(rows.propose, Plan(plan)), model.device))
        seconds.append(sorted(spent)[len(spent) // 2])
    return seconds


def expected_speedups(
    heads_path: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_nodes: int = 64,
    context: int = 256,
    remeasure: bool = False,
    held_out: list | None = None,
    weights: str = "float",
) -> dict:
    """Per tree size 1..max_nodes: expected tau, step seconds on this device (timed once, then cached in
    `$MTP_CACHE/step_seconds.json`) and expected speedup; `chosen` is the size with the highest speedup. With
    `held_out` (answers of the base model to prompts the heads did not train on, as (ids, mask, ...)), decoding
    them is simulated (`simulate`) for every size with the heads alone (`measured`) and beside the best lookup
    lengths (`lookup`), and the best of those chooses the size and `chosen_lookup`. `weights`: the base's weights
    (`mtp.quantized`), whose steps are timed."""
    if Drafter.from_pretrained(heads_path).config.calibration is None:  # said before the base loads
        raise ValueError(
            f"{heads_path} has no calibration (rank accuracies): train with a validation split "
            f"(data.val_fraction > 0); the last validation run records them."
        )
    heads, model, tokenizer = load_with_base(heads_path, device=device, dtype=dtype, weights=weights)
    paths, expected = grow_tree(heads.config.calibration, max_nodes)
    compiled = compile_pass(model, every_layer=bool(heads.config.feature_layers))  # the steps as `mtp.load` runs them

    def room(size: int) -> int | None:
        """The lookup tokens that the compiled pass verifies beside a tree of `size` nodes, those that fit in its
        largest size (`mtp.decoding.batch.Batch.propose`); None: every one (eager passes)."""
        return None if compiled is None else max(compiled.buckets[-1] - size, 0)

    key = machine_key(model, heads, compiled, context)
    name = f"{key} | sizes {timed_sizes(paths, 1)}"
    timed_costs = measured(
        "step_seconds.json",
        name,
        lambda: measure_steps(model, tokenizer, heads, paths, context, compiled=compiled),
        again=remeasure,
    )
    costs = step_costs(timed_costs, len(expected) + max(LOOKUP_LENGTHS))
    speedups = [tau * costs[0] / cost for tau, cost in zip(expected, costs, strict=False)]
    table = {
        "size": list(range(1, len(expected) + 1)),
        "expected_tau": expected,
        "step_seconds": costs[: len(expected)],
        "expected_speedup": speedups,
        "chosen": max(range(len(speedups)), key=speedups.__getitem__) + 1,
        "paths": paths,
        "device": key,
        "chosen_lookup": [],
    }
    if held_out is None:
        return table
    roots = held_out_roots(model, heads, paths, held_out, Lookup((max(LOOKUP_LENGTHS),) * MAX_NGRAM))
    table["measured"], table["lookup"] = [], []
    for size in table["size"]:
        tokens, steps, seconds = simulate(roots, size, [], costs)
        table["measured"].append({"tau": tokens / steps, "speedup": tokens * costs[0] / seconds})
        lengths, (tokens, steps, seconds) = best_lookup(roots, size, costs, most=room(size))
        table["lookup"].append({"lengths": lengths, "tau": tokens / steps, "speedup": tokens * costs[0] / seconds})
    best = max(table["lookup"], key=lambda row: row["speedup"])
    table["chosen"] = table["lookup"].index(best) + 1
    table["chosen_lookup"] = best["lengths"] if any(best["lengths"]) else []
    table["roots"] = {
        "count": len(roots["match"]),
        "matched": [float((roots["match"] == n).float().mean()) for n in range(1, MAX_NGRAM + 1)],
    }
    table["acceptance"] = []  # the candidates mtp.load weighs on the machine it runs on: per timed size, no
    for size in timed_sizes(paths, 1):  # lookup, the lookup that paid most here, and the longest, the longest also
        depth = max(map(len, paths[: size - 1]), default=0)  # as the compiled pass verifies it (`room`)
        settings = {(), tuple(table["lookup"][size - 1]["lengths"]), (FULL_REACH,) * MAX_NGRAM}
        if room(size) is not None:  # simulated as cut: lookup's first tokens accept most, so the share of its
            # nodes that fit (`mtp.decoding.costs.fit_to_pass`) undervalues it (10 / 10 / 10 cut to 4 beside the 4-node
            # tree: 0.54 accepted a step expected, 0.85 simulated on the held-out answers)
            settings |= {cut_lookup(lengths, room(size)) for lengths in settings}
        for lengths in sorted({lengths if any(lengths) else () for lengths in settings}):
            table["acceptance"].append(acceptance(roots, size, list(lengths), depth))
    table["dynamic"] = dynamic_trees(model, tokenizer, heads, paths, held_out, costs, context)
    return table


def dynamic_trees(
    model, tokenizer, heads: Drafter, paths: list[Path], examples: list, costs: list[float], context: int
) -> list[dict]:
    """Per timed size n > 1: the dynamic tree of n nodes (of DYNAMIC_DEPTHS x DYNAMIC_TOP_K) with the most tokens
    per second on DYNAMIC_ANSWERS of `examples` (`evenly_spaced`), with and without the best lookup, beside the static
    n-node tree on the same answers. A dynamic step costs the static one's step (`costs`) with the static tree's
    drafting time replaced by its own (both timed)."""
    examples = evenly_spaced(examples, DYNAMIC_ANSWERS)
    roots = held_out_roots(model, heads, paths, examples, Lookup((max(LOOKUP_LENGTHS),) * MAX_NGRAM))
    sizes = [size for size in timed_sizes(paths, 1) if size > 1]
    static = [Tree.from_paths(paths[: size - 1]) for size in timed_sizes(paths, 1)]
    static_drafting = step_costs(measure_drafting(model, tokenizer, heads, static, context), len(costs))
    depths = [depth for depth in DYNAMIC_DEPTHS if heads.max_depth is None or depth <= heads.max_depth]
    plans = [DynamicTree(max(sizes), depth, k) for depth in depths for k in DYNAMIC_TOP_K]
    drafting = measure_drafting(model, tokenizer, heads, plans, context)
    found = {size: [] for size in sizes}
    for plan, seconds in zip(plans, drafting, strict=True):
        accepts = grown_accepts(model, heads, examples, plan)  # (R, N)
        for size in sizes:
            extra = seconds - static_drafting[size - 1]  # drafting a dynamic step costs this more than a static one
            own = [cost + extra for cost in costs]
            tokens, steps, _ = simulate(roots, size, [], own, heads=accepts[:, size - 1])
            lengths, (with_tokens, with_steps, with_seconds) = best_lookup(roots, size, own, heads=accepts[:, size - 1])
            found[size].append(
                {
                    "plan": str(DynamicTree(size, plan.depth, plan.top_k)),
                    "tau": tokens / steps,
                    "lookup_tau": with_tokens / with_steps,
                    "lengths": lengths if any(lengths) else [],
                    "speedup": with_tokens * costs[0] / with_seconds,
                    "drafting": seconds,
                }
            )
    rows = []
    for size in sizes:
        row = max(found[size], key=lambda trial: trial["speedup"])
        tokens, steps, _ = simulate(roots, size, [], costs)
        _, (with_tokens, with_steps, with_seconds) = best_lookup(roots, size, costs)
        rows.append(
            row
            | {
                "size": size,
                "static_tau": tokens / steps,
                "static_lookup_tau": with_tokens / with_steps,
                "static_speedup": with_tokens * costs[0] / with_seconds,
            }
        )
    return rows


def size_tree(heads_path: str, **options) -> dict:
    """Save the tree and lookup with the highest expected speedup on this device into the heads' config, and with
    held-out answers what every candidate accepts (`DrafterConfig.acceptance`: `mtp.load` chooses among them by the
    step costs of the machine it runs on); options: those of `expected_speedups`. Returns the table."""
    table = expected_speedups(heads_path, **options)
    heads = Drafter.from_pretrained(heads_path)
    heads.config.tree = [list(path) for path in table["paths"][: table["chosen"] - 1]]
    heads.config.lookup = table["chosen_lookup"]
    heads.config.dynamic_tree = None
    if "acceptance" in table:  # without held-out answers, what was measured with them stays
        heads.config.acceptance = [candidate.as_dict() for candidate in table["acceptance"]]
    heads.save_config(heads_path)
    return table


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--drafter", "--heads", required=True, help="drafter folder; its config.json gets the chosen tree"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_weights_argument(parser)
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    parser.add_argument("--remeasure", action="store_true", help="time the steps again, even if cached")
    add_held_out_arguments(parser, required=False)
    args = parser.parse_args()
    base_model = Drafter.from_pretrained(args.drafter).config.base_model
    examples = held_out(args, base_model).val_examples if args.data else None
    table = size_tree(
        args.drafter,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        weights=args.weights,
        max_nodes=args.max_nodes,
        context=args.context,
        remeasure=args.remeasure,
        held_out=examples,
    )
    simulated = "measured" in table
    print(
        f"{table['device']}\n  size  expected tau  step ms  expected speedup"
        + ("  held-out tau / speedup  with lookup: tau / speedup, lengths" if simulated else "")
    )
    columns = zip(*(table[k] for k in ("size", "expected_tau", "step_seconds", "expected_speedup")), strict=True)
    for n, tau, cost, speedup in columns:
        chosen = "  <- chosen" if n == table["chosen"] else ""
        if n in SIZES or chosen:
            row = f"  {n:4d}  {tau:12.2f}  {cost * 1e3:7.1f}  {speedup:16.2f}"
            if simulated:
                alone, both = table["measured"][n - 1], table["lookup"][n - 1]
                row += f"  {alone['tau']:14.2f} / {alone['speedup']:.2f}  {both['tau']:17.2f} / {both['speedup']:.2f}"
                row += f", {both['lengths']}"
            print(row + chosen)
    costs = dict(zip(table["size"], table["step_seconds"], strict=True))
    ratios = ", ".join(f"{n} nodes {costs[n] / costs[1]:.2f}x" for n in (2, 3, 4, 8) if n in costs)
    print(f"A step's cost against the fastest plain step ({costs[1] * 1e3:.1f} ms): {ratios}")
    if simulated:
        roots = table["roots"]
        shares = ", ".join(f"{n} tokens {share:.1%}" for n, share in enumerate(roots["matched"], 1))
        print(f"{roots['count']} held-out answer tokens as roots; lookup's longest match: {shares}")
        print(
            f"Dynamic trees on {DYNAMIC_ANSWERS} distinct held-out answers spread over them, against the static "
            "tree of as many nodes there (tau alone / with lookup, speedup with lookup):"
        )
        for row in table["dynamic"]:
            print(
                f"  {row['size']:4d}  {row['plan']:>15}  tau {row['tau']:.2f} / {row['lookup_tau']:.2f}, "
                f"{row['speedup']:.2f}x; static tau {row['static_tau']:.2f} / {row['static_lookup_tau']:.2f}, "
                f"{row['static_speedup']:.2f}x"
            )
    lookup = table["chosen_lookup"] or "no"
    saved = f" and what {len(table['acceptance'])} candidates accept" if simulated else ""
    print(f"Saved the {table['chosen']}-node tree, {lookup} lookup tokens{saved} to {args.drafter}/config.json")


if __name__ == "__main__":
    main()
