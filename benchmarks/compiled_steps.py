"""The base model's verification pass over n tree nodes after a prompt, eager (a dynamic cache, as a batch of
several rows runs it) against compiled (`mtp.decoding.compiled`, as one row runs it), in one process: the median
milliseconds of each and their ratios to the eager and the compiled one-node pass, and the compile time. Every pass
is timed in turn, round after round, so that a change in the host's speed (a one-node pass swings between 13 and
20 ms on the 2-core Zen 4 EPYC) falls on every node count alike.

    python benchmarks/compiled_steps.py --nodes 1 2 4 8 16 --dtype float32
    python benchmarks/compiled_steps.py --nodes 1 4 8 --weights float gguf int8
"""

import argparse
import statistics
import time
from functools import partial

import torch
from transformers import DynamicCache

from mtp.base import DEFAULT_BASE, load_base
from mtp.decoding.cache import grouped_keys, tree_attention_mask
from mtp.decoding.compiled import CompiledPass
from mtp.decoding.target import Target
from mtp.machine import device_name
from mtp.quantized import WEIGHTS


def medians_ms(calls: list, device: torch.device, repeats: int) -> list[float]:
    """Each of `calls` timed once per round, `repeats` rounds: the median milliseconds of each."""
    spent = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, spent, strict=True):
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return [1e3 * statistics.median(times) for times in spent]


def passes(args, weights: str) -> tuple[list, float, int]:
    """The eager and compiled passes over each of `args.nodes` for the base in `weights` (calls to time), the
    seconds its compiling took and its cache's slots."""
    model, _ = load_base(args.base_model, args.device, getattr(torch, args.dtype), weights=weights)
    target = Target(model)
    vocab = target.embed.num_embeddings
    prompt = torch.randint(vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(model.device)
    prefill = DynamicCache()
    target.run(False, input_ids=prompt, cache=prefill)
    slots = torch.arange(args.context, device=model.device)[None]  # (1, T)
    start = time.perf_counter()
    compiled = CompiledPass(target, buckets=tuple(sorted(args.nodes)), templates=args.templates)
    compiled.warm_up()
    compile_seconds = time.perf_counter() - start

    def inputs(nodes: int):  # a chain of `nodes` tokens: (1, n) tokens and positions, (1, n, n) mask
        tokens = torch.randint(vocab, (1, nodes), device=model.device)
        positions = args.context + torch.arange(nodes, device=model.device)[None]
        return tokens, positions, torch.ones(1, nodes, nodes, dtype=torch.bool, device=model.device).tril()

    def eager(nodes: int) -> None:
        tokens, positions, tree_mask = inputs(nodes)
        cache = DynamicCache()
        for index, layer in enumerate(prefill.layers):  # the prompt's cache, as a step finds it
            cache.update(layer.keys, layer.values, index)
        mask = tree_attention_mask(tree_mask, positions, slots, target.windows, target.dtype)
        with grouped_keys(model.device.type == "cpu" and nodes > 1):
            target.logits(
                target.run(False, input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache).last
            )

    compiled.load(prefill)  # once: a pass writes its nodes after the prompt's slots, and the next one overwrites them

    def compiled_pass(nodes: int) -> None:
        for layer in compiled.cache.layers:  # each pass after the prompt alone, as a step after the cache's compaction
            layer.cumulative_length.fill_(args.context)
        compiled.run(*inputs(nodes), slots)

    calls = [partial(run, nodes) for nodes in args.nodes for run in (eager, compiled_pass)]
    return calls, compile_seconds, compiled.length


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default=DEFAULT_BASE)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["float"],
        choices=WEIGHTS,
        help="the base's weights, each timed in the same rounds (see mtp.quantized)",
    )
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the pass")
    parser.add_argument("--repeats", type=int, default=30, help="rounds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--no-templates",
        dest="templates",
        action="store_false",
        help="compile the products as ATen's, not inductor's C++ GEMM templates (CPU)",
    )
    args = parser.parse_args()
    made = {weights: passes(args, weights) for weights in args.weights}
    calls = [call for each, _, _ in made.values() for call in each]
    for call in calls:  # warm-up
        call()
    spent = iter(medians_ms(calls, torch.device(args.device), args.repeats))
    print(
        f"{device_name(torch.device(args.device))}, {args.dtype}, {args.context} tokens of context, "
        f"{made[args.weights[0]][2]} slots; compiling {len(args.nodes)} node counts "
        f"{'with' if args.templates else 'without'} GEMM templates took "
        + ", ".join(f"{seconds:.0f} s ({weights})" for weights, (_, seconds, _) in made.items())
    )
    print(
        "| weights | nodes | eager ms | compiled ms | compiled / eager | eager / eager 1 | compiled / compiled 1 | "
        f"compiled / {args.weights[0]} compiled |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = {(weights, nodes): (next(spent), next(spent)) for weights in made for nodes in args.nodes}
    for (weights, nodes), (eager_ms, compiled_ms) in rows.items():
        eager_one, compiled_one = rows[weights, args.nodes[0]]
        first = rows[args.weights[0], nodes][1]
        print(
            f"| {weights} | {nodes} | {eager_ms:.1f} | {compiled_ms:.1f} | {compiled_ms / eager_ms:.2f}x | "
            f"{eager_ms / eager_one:.2f}x | {compiled_ms / compiled_one:.2f}x | {compiled_ms / first:.2f}x |"
        )


if __name__ == "__main__":
    main()
