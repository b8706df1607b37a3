"""Size the decoding tree to the hardware: grow it from the heads' calibrated rank accuracies, time a decoding
step for each tree size on this device, keep the size with the highest expected speedup, save it with the heads.

    python -m mtp.sizing --heads HEADS [--device cpu] [--dtype float32] [--max-nodes 64] [--remeasure]

Expected tau (tokens per verification pass) of a tree is 1 (the bonus token) plus, over its candidate nodes,
the probability that the node's whole path is right, taken as the product of the rank accuracies along it
(heads treated as independent). At most one node per depth can be right, so this sum is the expected number
of accepted candidates. Expected speedup over plain decoding is tau(N) * step(1) / step(N), with step(N) the
measured time of a decoding step that verifies N tree tokens (step(1): plain one-token decoding, no heads).
"""

import argparse
import json
import os
import platform
import time

import torch

from mtp.base import cache_dir, load_base
from mtp.cli import user_errors
from mtp.decoding import Decoder
from mtp.heads import Heads
from mtp.tree import Path, Tree, grow_tree

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes (root included) timed on the device


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
    """Seconds per step for every size 1..max_nodes: linear between the timed sizes, flat past the last one,
    and never decreasing (a bigger tree never costs less; a dip is timing noise)."""
    sizes = SIZES[: len(measured)]
    costs = []
    for n in range(1, max_nodes + 1):
        i = max(j for j, s in enumerate(sizes) if s <= n)
        if i + 1 < len(sizes):
            frac = (n - sizes[i]) / (sizes[i + 1] - sizes[i])
            costs.append(measured[i] + frac * (measured[i + 1] - measured[i]))
        else:
            costs.append(measured[i])
        costs[-1] = max(costs[-1], costs[-2] if len(costs) > 1 else 0.0)
    return costs


def expected_speedups(heads_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, max_nodes: int = 64,
                      context: int = 256, remeasure: bool = False) -> dict:  # fmt: skip
    """Per tree size 1..max_nodes: expected tau, step seconds on this device (timed once, then cached in
    `$MTP_CACHE/step_seconds.json`) and expected speedup; `chosen` is the size with the highest speedup."""
    heads = Heads.from_pretrained(heads_path)
    if heads.config.calibration is None:
        raise ValueError(
            f"{heads_path} has no calibration (rank accuracies): train with a validation split "
            f"(data.val_fraction > 0); the last validation run records them."
        )
    paths, expected = grow_tree(heads.config.calibration, max_nodes)
    model, tokenizer = load_base(heads.config.base_model, device=device, dtype=dtype)
    heads.check_base(heads.config.base_model, model, tokenizer)
    key = " | ".join([device_name(device), str(dtype), heads.config.identity(), f"{heads.config.num_heads} heads",
                      heads.config.lm_head, f"context {context}"])  # fmt: skip
    store = cache_dir() / "step_seconds.json"
    cached = json.loads(store.read_text()) if store.is_file() else {}
    if remeasure or len(cached.get(key, [])) < len([s for s in SIZES if s <= len(paths) + 1]):
        cached[key] = measure_steps(model, tokenizer, heads.to(device=device, dtype=dtype).eval(), paths, context)
        store.parent.mkdir(parents=True, exist_ok=True)
        store.with_suffix(".tmp").write_text(json.dumps(cached, indent=1))
        os.replace(store.with_suffix(".tmp"), store)
    costs = step_costs(cached[key], len(expected))
    speedups = [tau * costs[0] / cost for tau, cost in zip(expected, costs, strict=True)]
    return {"size": list(range(1, len(expected) + 1)), "expected_tau": expected, "step_seconds": costs,
            "expected_speedup": speedups, "chosen": max(range(len(speedups)), key=speedups.__getitem__) + 1,
            "paths": paths, "device": key}  # fmt: skip


def size_tree(heads_path: str, **options) -> dict:
    """Save the tree with the highest expected speedup on this device into the heads' config (options: those
    of `expected_speedups`); returns the table it was chosen from."""
    table = expected_speedups(heads_path, **options)
    heads = Heads.from_pretrained(heads_path)
    heads.config.tree = [list(path) for path in table["paths"][: table["chosen"] - 1]]
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
    args = parser.parse_args()
    table = size_tree(args.heads, device=args.device, dtype=getattr(torch, args.dtype), max_nodes=args.max_nodes,
                      context=args.context, remeasure=args.remeasure)  # fmt: skip
    print(f"{table['device']}\n  size  expected tau  step ms  expected speedup")
    columns = zip(*(table[k] for k in ("size", "expected_tau", "step_seconds", "expected_speedup")), strict=True)
    for n, tau, cost, speedup in columns:
        chosen = "  <- chosen" if n == table["chosen"] else ""
        if n in SIZES or chosen:
            print(f"  {n:4d}  {tau:12.2f}  {cost * 1e3:7.1f}  {speedup:16.2f}{chosen}")
    print(f"Saved the {table['chosen']}-node tree to {args.heads}/config.json")


if __name__ == "__main__":
    main()
