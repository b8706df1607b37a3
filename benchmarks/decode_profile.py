"""Where a decoding step's time goes, a tree step beside a plain one: the heads' drafting (candidates), the base
model's pass (verify), acceptance (with the lm_head's logits), cache bookkeeping and the rest (prefill, Python,
stop checks), then the operators that take the most time per step, over a few MT-Bench questions.

    python benchmarks/decode_profile.py --drafter DRAFTER --questions data/mt_bench.jsonl

The plain step is the same loop without heads or lookup: one token per pass, on the same pass as the tree step
(compiled unless MTP_COMPILE=0; eager, the base model's own attention path).
"""

import argparse
import time

from torch.profiler import ProfilerActivity, profile

import mtp
from mtp.decoding.decoder import Decoder
from mtp.decoding.tree import NAMED_TREES
from mtp.quantized import add_weights_argument
from mtp.training.rows import read_rows

PHASES = ("mtp.candidates", "mtp.verify", "mtp.accept", "mtp.cache")


def profiled(decoder: Decoder, prompts: list, max_new_tokens: int) -> tuple[dict[str, float], int, int, float]:
    """(seconds per profiler key, passes, tokens, wall seconds) of decoding `prompts`."""
    decoder.generate(prompts[0], max_new_tokens=8)  # warm-up
    passes = tokens = 0
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for prompt in prompts:
            result = decoder.generate(prompt, max_new_tokens=max_new_tokens)
            passes, tokens = passes + result.forward_passes, tokens + len(result.token_ids)
        wall = time.perf_counter() - start
    spent = {event.key: event.self_cpu_time_total / 1e6 for event in profiler.key_averages()}
    spent |= {event.key: event.cpu_time_total / 1e6 for event in profiler.key_averages() if event.key in PHASES}
    return spent, passes, tokens, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=1, help="questions (the profiler holds every op: keep it small)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", help=f"one of {sorted(NAMED_TREES)} or a number of nodes (default: the heads' tree)")
    add_weights_argument(parser)
    parser.add_argument("--ops", type=int, default=10, help="operators listed, by their time in the tree step")
    args = parser.parse_args()
    decoder = mtp.load(args.drafter, tree=args.tree, weights=args.weights)
    plain = Decoder(decoder.base_model, decoder.tokenizer, compiled=decoder.compiled)
    prompts = [[{"role": "user", "content": row["turns"][0]}] for row in read_rows(args.questions)[: args.limit]]
    found = {name: profiled(d, prompts, args.max_new_tokens) for name, d in (("plain", plain), ("tree", decoder))}
    print(f"{'ms per step (profiler on)':36s} {'plain':>8s} {'tree':>8s}")
    for name, (_, passes, tokens, wall) in found.items():
        print(
            f"  {name}: {tokens} tokens, {passes} passes, tau {tokens / passes:.2f}, {tokens / wall:.1f} tokens/s, "
            f"{1e3 * wall / passes:.1f} ms a step in all"
        )
    per_step = {
        name: {key: 1e3 * value / passes for key, value in spent.items()}
        for name, (spent, passes, _, _) in found.items()
    }
    for name, (spent, passes, _, wall) in found.items():
        per_step[name]["rest (prefill, Python, stop checks)"] = 1e3 * (wall - sum(spent[p] for p in PHASES)) / passes
    ops = sorted(
        (key for key in per_step["tree"] if key not in PHASES and key.startswith("aten::")),
        key=lambda key: -per_step["tree"][key],
    )[: args.ops]
    for key in [*PHASES, "rest (prefill, Python, stop checks)", *ops]:
        plain_ms, tree_ms = per_step["plain"].get(key, 0.0), per_step["tree"].get(key, 0.0)
        print(f"{key[:36]:36s} {plain_ms:8.2f} {tree_ms:8.2f}")


if __name__ == "__main__":
    main()
