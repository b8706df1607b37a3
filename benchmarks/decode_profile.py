"""Where a decoding step's time goes: heads and candidate building, the base model's pass over the tree,
acceptance, cache bookkeeping, and the rest (Python, stop checks, detokenising), over a few MT-Bench questions.

    python benchmarks/decode_profile.py --heads HEADS --questions data/mt_bench.jsonl
"""

import argparse
import time

from torch.profiler import ProfilerActivity, profile

import mtp
from mtp.rows import read_rows
from mtp.tree import NAMED_TREES

PHASES = ("mtp.candidates", "mtp.verify", "mtp.accept", "mtp.cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=1, help="questions (the profiler holds every op: keep it small)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", help=f"one of {sorted(NAMED_TREES)} or a number of nodes (default: the heads' tree)")
    args = parser.parse_args()
    decoder = mtp.load(args.heads, tree=args.tree)
    prompts = [[{"role": "user", "content": row["turns"][0]}] for row in read_rows(args.questions)[: args.limit]]
    decoder.generate(prompts[0], max_new_tokens=8)  # warm-up
    passes = tokens = 0
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for prompt in prompts:
            result = decoder.generate(prompt, max_new_tokens=args.max_new_tokens)
            passes, tokens = passes + result.forward_passes, tokens + len(result.token_ids)
        wall = time.perf_counter() - start
    spent = {event.key: event.cpu_time_total / 1e6 for event in profiler.key_averages() if event.key in PHASES}
    print(f"tree of {decoder.tree.size} nodes: {tokens} tokens, {passes} passes, tau {tokens / passes:.2f}, "
          f"{tokens / wall:.1f} tokens/s (profiler on)")  # fmt: skip
    for phase in PHASES:
        print(f"{phase:16s} {1000 * spent.get(phase, 0) / passes:7.1f} ms/step {spent.get(phase, 0) / wall:6.1%}")
    rest = wall - sum(spent.values())
    print(f"{'rest (prefill, Python, stop checks)':16s} {1000 * rest / passes:7.1f} ms/step {rest / wall:6.1%}")


if __name__ == "__main__":
    main()
