"""Size the decoding tree to the hardware: grow it from the heads' calibrated rank accuracies, time a decoding
step for each tree size on this device, keep the size with the highest expected speedup, save it with the heads.
With --lookup-data, the number of prompt-lookup tokens verified beside the tree is chosen with it.

    python -m mtp.sizing --heads HEADS [--lookup-data ANSWERS] [--device cpu] [--max-nodes 64] [--remeasure]

Expected tau (tokens per verification pass) of a tree is 1 (the bonus token) plus, over its candidate nodes,
the probability that the node's whole path is right, taken as the product of the rank accuracies along it
(heads treated as independent). At most one node per depth can be right, so this sum is the expected number
of accepted candidates. Expected speedup over plain decoding is tau(N) * step(1) / step(N), with step(N) the
measured time of a decoding step that verifies N tree tokens (step(1): plain one-token decoding, no heads).

Prompt lookup (`mtp.lookup`) is measured on the base model's own answers (ANSWERS: chats or a folder of them,
LOOKUP_SAMPLE of them, spread over the file): at every answer token taken as the root, how often lookup proposes and how
many tokens, and the probability L(d) that its first d tokens are the answer's next ones. With lookup, the chance
that depth d is reached is 1 - (1 - T(d)) (1 - L(d)), T(d) the tree's own (the two treated as independent),
and a step costs step(N + the tokens lookup adds) when it proposes, step(N) when it does not.
"""

import argparse
import json
import math
import os
import platform
import time

import torch

from mtp.base import cache_dir, load_base
from mtp.cli import user_errors
from mtp.data import encode
from mtp.decoding import Decoder
from mtp.heads import Heads
from mtp.lookup import Lookup
from mtp.rows import read_rows, to_example
from mtp.tree import Path, Tree, grow_tree

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes (root included) timed on the device
LOOKUP_LENGTHS = (0, 2, 4, 6, 8, 10)  # prompt-lookup tokens per step that sizing chooses from
LOOKUP_SAMPLE = 200  # answers that measure prompt lookup


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measure_steps(model, tokenizer, heads: Heads, paths: list[Path], context: int, steps: int = 4,
                  rounds: int = 3) -> list[float]:  # fmt: skip
    """Seconds per decoding step for each size in SIZES that `paths` can fill, after a prompt of `context`
    random tokens; size 1 is plain decoding, without heads. Sizes are timed in turn, `rounds` times over
    (so that a slow spell of the machine does not fall on one size), `steps` steps each after a warm-up
    step; the median of each size's steps is its cost."""
    prompt = torch.randint(len(tokenizer), (1, context), generator=torch.Generator().manual_seed(0))
    sizes = [s for s in SIZES if s <= len(paths) + 1]
    times = {size: [] for size in sizes}
    for _ in range(rounds):
        for size in sizes:
            decoder = Decoder(model, tokenizer, heads if size > 1 else None, Tree.from_paths(paths[: size - 1]))
            loop = decoder.steps(prompt)
            next(loop)  # prefill
            next(loop)  # warm-up
            for _ in range(steps):
                start = time.perf_counter()
                next(loop)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                times[size].append(time.perf_counter() - start)
    return [sorted(times[size])[len(times[size]) // 2] for size in sizes]


def step_costs(measured: list[float], max_nodes: int) -> list[float]:
    """Seconds per step for every size 1..max_nodes: linear between the timed sizes, and past the last one along
    the last two's line; never decreasing (a bigger tree never costs less; a dip is timing noise)."""
    sizes = SIZES[: len(measured)]
    costs = []
    for n in range(1, max_nodes + 1):
        i = max(j for j, s in enumerate(sizes) if s <= n)
        j = min(i, len(sizes) - 2)  # past the last timed size: the line through the last two
        if j < 0:
            costs.append(measured[0])
        else:
            frac = (n - sizes[j]) / (sizes[j + 1] - sizes[j])
            costs.append(measured[j] + frac * (measured[j + 1] - measured[j]))
        costs[-1] = max(costs[-1], costs[-2] if len(costs) > 1 else 0.0)
    return costs


def lookup_acceptance(tokenizer, answers: str, length: int = max(LOOKUP_LENGTHS)) -> dict:
    """Prompt lookup (default settings, at most `length` tokens) at every answer token that another follows, in
    LOOKUP_SAMPLE chats spread evenly over `answers`, taken as the root: `proposes`, the share of roots where it
    proposes; `tokens[l]`, the mean number it proposes then when capped at l; `right[d - 1]`, the share of roots
    where its first d are right (against the answer's own next tokens)."""
    lookup, roots, proposed, right = Lookup(length), 0, [0] * (length + 1), [0] * length
    rows = read_rows(answers)
    for row in rows[:: max(len(rows) // LOOKUP_SAMPLE, 1)][:LOOKUP_SAMPLE]:  # spread over the file
        example = to_example(row)
        encoded = None if example is None else encode(tokenizer, example, max_length=4096)
        if not isinstance(encoded, tuple):
            continue
        ids, mask = encoded
        for t in (mask[:-1] & mask[1:]).nonzero()[:, 0].tolist():  # roots that an answer token follows
            chain, truth = lookup.propose(ids[: t + 1]), ids[t + 1 : t + 1 + length]
            truth = truth[: int(mask[t + 1 : t + 1 + length].int().cumprod(0).sum())].tolist()  # the answer's own
            roots += 1
            for cap in range(1, length + 1):
                proposed[cap] += min(len(chain), cap)
            for d, (guess, token) in enumerate(zip(chain, truth, strict=False)):
                if guess != token:
                    break
                right[d] += 1
            proposed[0] += bool(chain)
    if not roots:
        raise ValueError(f"{answers!r} has no answer tokens: give chats with assistant answers.")
    return {"proposes": proposed[0] / roots, "tokens": [0.0] + [n / max(proposed[0], 1) for n in proposed[1:]],
            "right": [n / roots for n in right]}  # fmt: skip


def depth_reached(calibration: list[list[float]], paths: list[Path]) -> list[float]:
    """T(d) for d = 1, 2, ...: the probability that the tree of `paths` has its depth-d node right."""
    reached = [0.0] * max(map(len, paths), default=0)
    for path in paths:
        reached[len(path) - 1] += math.prod(calibration[k][r] for k, r in enumerate(path))
    return reached


def expected_speedups(heads_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, max_nodes: int = 64,
                      context: int = 256, remeasure: bool = False, lookup_data: str | None = None) -> dict:  # fmt: skip
    """Per tree size 1..max_nodes: expected tau, step seconds on this device (timed once, then cached in
    `$MTP_CACHE/step_seconds.json`) and expected speedup; `chosen` is the size with the highest speedup. With
    `lookup_data`, `lookup[l]` holds the expected tau and speedup of each size with l lookup tokens, and
    `chosen_lookup` the l of the best (size, l) pair (`chosen` its size)."""
    heads = Heads.from_pretrained(heads_path)
    if heads.config.calibration is None:
        raise ValueError(
            f"{heads_path} has no calibration (rank accuracies): train with a validation split "
            f"(data.val_fraction > 0); the last validation run records them."
        )
    paths, expected = grow_tree(heads.config.calibration, max_nodes)
    model, tokenizer = load_base(heads.config.base_model, device=device, dtype=dtype)
    heads.check_base(heads.config.base_model, model, tokenizer)
    config = heads.config
    heads_kind = f"{config.num_heads} {config.head_type} heads"
    key = " | ".join([device_name(device), str(dtype), config.identity(), heads_kind, config.lm_head,
                      f"context {context}"])  # fmt: skip
    store = cache_dir() / "step_seconds.json"
    cached = json.loads(store.read_text()) if store.is_file() else {}
    if remeasure or len(cached.get(key, [])) < len([s for s in SIZES if s <= len(paths) + 1]):
        cached[key] = measure_steps(model, tokenizer, heads.to(device=device, dtype=dtype).eval(), paths, context)
        store.parent.mkdir(parents=True, exist_ok=True)
        store.with_suffix(".tmp").write_text(json.dumps(cached, indent=1))
        os.replace(store.with_suffix(".tmp"), store)
    costs = step_costs(cached[key], len(expected) + max(LOOKUP_LENGTHS))
    speedups = [tau * costs[0] / cost for tau, cost in zip(expected, costs, strict=False)]
    table = {"size": list(range(1, len(expected) + 1)), "expected_tau": expected,
             "step_seconds": costs[: len(expected)], "expected_speedup": speedups,
             "chosen": max(range(len(speedups)), key=speedups.__getitem__) + 1,
             "paths": paths, "device": key, "chosen_lookup": 0}  # fmt: skip
    if lookup_data is None:
        return table
    measured = lookup_acceptance(tokenizer, lookup_data)
    table["lookup"], best = {}, max(speedups)
    for length in LOOKUP_LENGTHS[1:]:
        taus, lookup_speedups = [], []
        for n in table["size"]:
            tree = depth_reached(heads.config.calibration, paths[: n - 1])
            tree += [0.0] * (length - len(tree))
            lookup = measured["right"][:length] + [0.0] * (len(tree) - length)
            taus.append(1 + sum(1 - (1 - t) * (1 - q) for t, q in zip(tree, lookup, strict=True)))
            added = n + round(measured["tokens"][length])  # nodes when lookup proposes
            cost = measured["proposes"] * costs[added - 1] + (1 - measured["proposes"]) * costs[n - 1]
            lookup_speedups.append(taus[-1] * costs[0] / cost)
        table["lookup"][length] = {"expected_tau": taus, "expected_speedup": lookup_speedups}
        if max(lookup_speedups) > best:
            best, table["chosen_lookup"] = max(lookup_speedups), length
            table["chosen"] = lookup_speedups.index(best) + 1
    table["lookup_measured"] = measured
    return table


def size_tree(heads_path: str, **options) -> dict:
    """Save the tree with the highest expected speedup on this device into the heads' config (options: those
    of `expected_speedups`); returns the table it was chosen from."""
    table = expected_speedups(heads_path, **options)
    heads = Heads.from_pretrained(heads_path)
    heads.config.tree = [list(path) for path in table["paths"][: table["chosen"] - 1]]
    heads.config.lookup = table["chosen_lookup"]
    heads.save_config(heads_path)
    return table


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="heads folder; its config.json gets the chosen tree")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    parser.add_argument("--remeasure", action="store_true", help="time the steps again, even if cached")
    parser.add_argument("--lookup-data", help="the base model's answers (chats) that measure prompt lookup; "
                        "without it, no lookup tokens are chosen")  # fmt: skip
    args = parser.parse_args()
    table = size_tree(args.heads, device=args.device, dtype=getattr(torch, args.dtype), max_nodes=args.max_nodes,
                      context=args.context, remeasure=args.remeasure, lookup_data=args.lookup_data)  # fmt: skip
    lookup = table.get("lookup", {})
    print(f"{table['device']}\n  size  expected tau  step ms  expected speedup"
          + "".join(f"  tau / speedup, lookup {length}" for length in lookup))  # fmt: skip
    columns = zip(*(table[k] for k in ("size", "expected_tau", "step_seconds", "expected_speedup")), strict=True)
    for n, tau, cost, speedup in columns:
        chosen = "  <- chosen" if n == table["chosen"] else ""
        if n in SIZES or chosen:
            with_lookup = "".join(f"  {v['expected_tau'][n - 1]:13.2f} / {v['expected_speedup'][n - 1]:.2f}"
                                  for v in lookup.values())  # fmt: skip
            print(f"  {n:4d}  {tau:12.2f}  {cost * 1e3:7.1f}  {speedup:16.2f}{with_lookup}{chosen}")
    if lookup:
        measured = table["lookup_measured"]
        right = ", ".join(f"{measured['right'][d - 1]:.1%}" for d in (1, 2, 4))
        print(f"Prompt lookup proposes at {measured['proposes']:.1%} of answer tokens; its first 1, 2, 4 tokens are "
              f"right at {right}")  # fmt: skip
    print(
        f"Saved the {table['chosen']}-node tree and {table['chosen_lookup']} lookup tokens to {args.heads}/config.json"
    )


if __name__ == "__main__":
    main()
