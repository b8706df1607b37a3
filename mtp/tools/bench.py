"""Benchmark mtp against the fastest plain decoder and Hugging Face prompt-lookup decoding (when mtp's own prompt
lookup is on, against mtp with its heads alone too; with --against, against other drafters), interleaved prompt
by prompt in one process: tau, tokens/s, speedups and the accepted candidates that came from the heads and from
lookup, per category; when greedy, a check that every mtp output equals plain `generate`'s. With --temperature > 0
all sample (the same temperature, top-k and top-p).

Plain decoding is timed twice over when the products mtp measured fastest for one row (`mtp.linears`) are not the
usual ones: `plain`, `generate` as users run it, and `plain_fast`, `generate` with mtp's products; `vs fastest
plain` is against the faster of the two in each row of the table. Where mtp chose the usual product for one row,
the two are the same computation and `plain` alone is timed. Prompt lookup runs with mtp's products.

    python -m mtp.tools.bench --drafter DRAFTER --questions data/mt_bench.jsonl --limit 16 --max-new-tokens 128

With --batch-size B [B ...]: total tokens/s of mtp and of plain `generate` answering B prompts at a time, against
one at a time (see `bench_batches`).
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import mtp
from mtp.base import eos_ids
from mtp.decoding.costs import describe
from mtp.decoding.decoder import Decoder
from mtp.decoding.lookup import add_lookup_arguments, lookup_from
from mtp.decoding.sampling import Sampling, add_sampling_arguments, sampling_from
from mtp.decoding.tree import TREE_HELP
from mtp.linears import narrow_counts, usual_linears
from mtp.machine import device_name
from mtp.tools.cli import user_errors
from mtp.training.rows import read_rows

# heads: mtp without its prompt lookup, when that is on; the drafters of --against follow as against_1, against_2, ...
METHODS = ("plain", "plain_fast", "plain_compiled", "lookup", "heads", "mtp")
# plain `generate` with the usual products, with mtp's (when they differ), and mtp's compiled plain step (when on)
PLAIN = ("plain", "plain_fast", "plain_compiled")


def timed_generate(model, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling, batch_size: int = 1,
                   **options) -> tuple[list[list[int]], float]:  # fmt: skip
    """Plain `generate` (or prompt lookup with options) of `prompts` (each (1, T)), `batch_size` at a time, left-
    padded: each prompt's new tokens without the EOS, and the seconds of all."""
    if not sampling.greedy:
        options |= dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    eos = eos_ids(model)
    pad_id = next((t for t in [model.generation_config.pad_token_id, *eos] if t is not None), 0)
    outputs, start = [], time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        length = max(input_ids.shape[1] for input_ids in chunk)
        lefts = [length - ids.shape[1] for ids in chunk]  # padding before each prompt
        input_ids = torch.cat([F.pad(ids, (left, 0), value=pad_id) for ids, left in zip(chunk, lefts, strict=True)])
        attention_mask = (torch.arange(length) >= torch.tensor(lefts)[:, None]).long().to(input_ids.device)  # (B, T)
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, **({"do_sample": False} | options))[:, length:]  # fmt: skip
        outputs += [row[: next((i for i, t in enumerate(row) if t in eos), len(row))] for row in out.tolist()]
    return outputs, time.perf_counter() - start


def decoders_in(row: dict) -> list[str]:
    """The decoders timed in a row of results: those of METHODS that ran, in that order, then the --against ones."""
    names = [key.removesuffix("_seconds") for key in row if key.endswith("_seconds")]
    return [name for name in METHODS if name in names] + [name for name in names if name.startswith("against_")]


def summarise(rows: list[dict]) -> dict:
    """Totals over questions: each method's tokens/s counts its own tokens; mismatches count the questions where
    mtp's output differs from plain `generate`'s (greedy only; None when sampling)."""
    tokens, passes = sum(row["mtp_tokens"] for row in rows), sum(row["forward_passes"] for row in rows)
    speed = {name: sum(row[f"{name}_tokens"] for row in rows) / sum(row[f"{name}_seconds"] for row in rows)
             for name in decoders_in(rows[0])}  # fmt: skip
    candidates = sum(sum(row["accept_lengths"]) for row in rows) - passes  # accepted, bonus tokens left out
    from_lookup = sum(row["lookup_accepted"] for row in rows)
    return {
        "questions": len(rows), "tokens": tokens, "tau": tokens / max(passes, 1),
        **{f"{name}_tokens_per_second": value for name, value in speed.items()},
        **{f"speedup_vs_{name}": speed["mtp"] / value for name, value in speed.items() if name != "mtp"},
        "speedup_vs_fastest_plain": speed["mtp"] / max(speed[name] for name in PLAIN if name in speed),
        "accepted_from_heads": candidates - from_lookup, "accepted_from_lookup": from_lookup,
        "mismatches": None if rows[0]["matches_plain"] is None else sum(not row["matches_plain"] for row in rows),
    } | against(rows)  # fmt: skip


def against(rows: list[dict]) -> dict:
    """The tau and mismatches of each --against drafter."""
    summary = {}
    for name in [name for name in decoders_in(rows[0]) if name.startswith("against_")]:
        passes = sum(row[f"{name}_passes"] for row in rows)
        matches = [row[f"{name}_matches_plain"] for row in rows]
        summary[f"{name}_tau"] = sum(row[f"{name}_tokens"] for row in rows) / max(passes, 1)
        summary[f"{name}_mismatches"] = None if matches[0] is None else matches.count(False)
    return summary


def markdown(summary: dict[str, dict]) -> str:
    speeds = [key.removesuffix("_tokens_per_second") for key in summary["overall"] if key.endswith("_per_second")]
    others = [name for name in speeds if name != "mtp"]  # in `timed`'s order
    drafters = [name for name in others if name.startswith("against_")]
    ratios = (["fastest_plain"] if len(set(PLAIN) & set(others)) > 1 else []) + others  # vs the fastest plain first
    columns = ["category", "questions", "tau", *(f"{name.replace('_', ' ')} tok/s" for name in ["mtp", *others])]
    columns += [*(f"vs {name.replace('_', ' ')}" for name in ratios), "accepted from heads / lookup", "mismatches"]
    columns += [f"{name.replace('_', ' ')} {figure}" for name in drafters for figure in ("tau", "mismatches")]
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for name, s in summary.items():
        figures = [s["questions"], f"{s['tau']:.2f}"]
        figures += [f"{s[f'{method}_tokens_per_second']:.1f}" for method in ["mtp", *others]]
        figures += [f"{s[f'speedup_vs_{method}']:.2f}x" for method in ratios]
        figures += [f"{s['accepted_from_heads']} / {s['accepted_from_lookup']}"]
        figures += ["n/a (sampling)" if s["mismatches"] is None else s["mismatches"]]
        for drafter in drafters:
            mismatches = s[f"{drafter}_mismatches"]
            figures += [f"{s[f'{drafter}_tau']:.2f}", "n/a (sampling)" if mismatches is None else mismatches]
        lines.append(f"| {name} | " + " | ".join(str(figure) for figure in figures) + " |")
    slower = [name for name, s in summary.items() if s["speedup_vs_fastest_plain"] < 1]
    if slower:
        lines.append(f"\nSlower than the fastest plain decoder here: {', '.join(slower)}.")
    return "\n".join(lines)


def bench_batches(decoder: Decoder, chats: list, sizes: list[int], max_new_tokens: int, sampling: Sampling):
    """Per batch size B: total tokens/s of plain `generate` and of mtp, B prompts at a time, against one at a time;
    tau (each row's tokens per verification pass, over all rows); when greedy, how many outputs differ: mtp's
    from each prompt decoded alone by plain `generate` and from plain batched `generate`, and plain batched
    `generate`'s own from alone. Plain and mtp one at a time run first, then each size's two in turn. Plain
    `generate` of B rows is the faster of its usual products and mtp's (`mtp.linears`), when those differ for B."""
    model = decoder.base_model
    prompts = [decoder.encode(messages).to(model.device) for messages in chats]

    def fastest_plain(size: int) -> tuple[list[list[int]], float]:
        with usual_linears(model):
            found = timed_generate(model, prompts, max_new_tokens, sampling, size)
        if size in narrow_counts(model):
            found = min(found, timed_generate(model, prompts, max_new_tokens, sampling, size), key=lambda f: f[1])
        return found

    plain_alone, plain_alone_seconds = fastest_plain(1)
    start = time.perf_counter()
    alone = decoder.generate(chats, max_new_tokens, sampling=sampling, batch_size=1)
    alone_seconds = time.perf_counter() - start

    def differ(outputs: list[list[int]], others: list[list[int]]) -> int | None:
        return sum(a != b for a, b in zip(outputs, others, strict=True)) if sampling.greedy else None

    rows = []
    for size in tqdm(sizes, desc="batch sizes"):
        plain, plain_seconds, results, seconds = plain_alone, plain_alone_seconds, alone, alone_seconds
        if size > 1:
            plain, plain_seconds = fastest_plain(size)
            start = time.perf_counter()
            results = decoder.generate(chats, max_new_tokens, sampling=sampling, batch_size=size)
            seconds = time.perf_counter() - start
        ours = [result.token_ids for result in results]
        speed = {"mtp": sum(map(len, ours)) / seconds, "plain": sum(map(len, plain)) / plain_seconds,
                 "mtp_alone": sum(len(r.token_ids) for r in alone) / alone_seconds}  # fmt: skip
        rows.append({
            "batch_size": size, **{f"{name}_tokens_per_second": value for name, value in speed.items()},
            "speedup_vs_plain": speed["mtp"] / speed["plain"],
            "speedup_vs_mtp_alone": speed["mtp"] / speed["mtp_alone"],
            "tau": sum(map(len, ours)) / max(sum(result.forward_passes for result in results), 1),
            "mismatches_vs_alone": differ(ours, plain_alone), "mismatches_vs_plain_batched": differ(ours, plain),
            "plain_batched_mismatches_vs_alone": differ(plain, plain_alone),
        })  # fmt: skip
    return rows


def batch_markdown(rows: list[dict], questions: int) -> str:
    lines = [f"| B | plain batched tok/s | mtp batched tok/s | mtp one at a time tok/s | vs plain batched | vs mtp one "
             f"at a time | tau | mtp outputs unlike alone / unlike plain batched (of {questions}) | plain batched "
             "unlike alone |", "| ---: |" + " ---: |" * 8]  # fmt: skip
    for r in rows:
        speeds = [f"{r[f'{name}_tokens_per_second']:.1f}" for name in ("plain", "mtp", "mtp_alone")]
        figures = [r["batch_size"], *speeds, f"{r['speedup_vs_plain']:.2f}x", f"{r['speedup_vs_mtp_alone']:.2f}x"]
        figures += [f"{r['tau']:.2f}", f"{r['mismatches_vs_alone']} / {r['mismatches_vs_plain_batched']}"]
        figures += [r["plain_batched_mismatches_vs_alone"]]
        lines.append("| " + " | ".join(str(figure) for figure in figures) + " |")
    return "\n".join(lines)


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True)
    parser.add_argument("--against", metavar="HEADS", action="append", default=[],
                        help="also decode with this drafter folder (for the same base, with its own saved tree "
                        "and lookup), interleaved in the same run; repeat it for more (against 1, 2, ...)")  # fmt: skip
    parser.add_argument("--against-tree", metavar="TREE", action="append", default=[],
                        help="the --against drafters' trees instead of their saved ones (as --tree), one per "
                        "--against in order; with one folder twice: two trees of one drafter side by side")  # fmt: skip
    parser.add_argument("--questions", required=True, help="JSON lines with `turns` (first turn used) or `prompt`")
    parser.add_argument("--limit", type=int, help="the first N questions, spread over categories in file order")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", help=TREE_HELP)
    add_sampling_arguments(parser)
    add_lookup_arguments(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", metavar="B",
                        help="instead: total tokens/s of mtp and plain `generate` answering B prompts at a time, "
                        "for each B, against one at a time")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="time each decoder N times per question, in turn, and keep its fastest time (greedy "
                        "only): steadier figures from few questions on a noisy machine")  # fmt: skip
    parser.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                        help="eager verification passes (see mtp.decoding.compiled), and no compiled plain decoder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default="runs/bench/bench.json", help="JSON out; the Markdown table goes beside it")
    args = parser.parse_args()
    sampling = sampling_from(args)
    if args.against_tree and len(args.against_tree) != len(args.against):
        raise ValueError(
            f"--against-tree given {len(args.against_tree)} times for {len(args.against)} --against "
            "drafters: give one tree per --against, in the same order (a number N for the grown tree)."
        )
    if args.repeat < 1 or (args.repeat > 1 and (not sampling.greedy or args.batch_size)):
        raise ValueError(f"--repeat {args.repeat}: give 1 or more, and more than 1 only for greedy decoding of "
                         "questions one at a time (samples differ from one time to the next).")  # fmt: skip
    if args.batch_size and min(args.batch_size) < 1:
        raise ValueError(f"--batch-size {args.batch_size}: give batch sizes of 1 or more.")
    if args.seed is not None:
        torch.manual_seed(args.seed)  # plain generate and prompt lookup sample with torch's global generator
    decoder = mtp.load(args.drafter, args.device, getattr(torch, args.dtype), tree=args.tree, lookup=lookup_from(args),
                       compile=False if args.batch_size else args.compile)  # batches run eager passes  # fmt: skip
    alone = decoder.lookup and not args.batch_size  # mtp with its heads alone, beside mtp with its lookup
    heads_alone = alone and Decoder(decoder.base_model, decoder.tokenizer, decoder.drafter, decoder.tree,
                                    compiled=decoder.compiled)  # fmt: skip
    plain_compiled = decoder.compiled and Decoder(decoder.base_model, decoder.tokenizer, compiled=decoder.compiled)
    trees = args.against_tree or [None] * len(args.against)
    others = [mtp.load(path, args.device, getattr(torch, args.dtype), tree=tree)
              for path, tree in zip(args.against, trees, strict=True)]  # fmt: skip
    model = decoder.base_model
    questions = read_rows(args.questions)
    if args.limit:  # round-robin over categories, so a small limit still covers them all
        by_category = defaultdict(list)
        for question in questions:
            by_category[question.get("category", "all")].append(question)
        questions = [q for group in zip(*by_category.values(), strict=False) for q in group][: args.limit]
    chats = [[{"role": "user", "content": q["turns"][0] if "turns" in q else q["prompt"]}] for q in questions]
    for messages in chats:  # every question fits the context, before any runs
        decoder.check_length(decoder.encode(messages).shape[1], args.max_new_tokens)
    warm_up = [{"role": "user", "content": "Hello"}]
    decoder.generate(warm_up, max_new_tokens=8, sampling=sampling)
    for extra in (heads_alone, plain_compiled, *others):
        if extra:
            extra.generate(warm_up, max_new_tokens=8, sampling=sampling)
    plain_fast = 1 in narrow_counts(model)  # else plain generate with mtp's products is plain generate itself
    timed_generate(model, [decoder.encode(warm_up).to(args.device)], 8, sampling, prompt_lookup_num_tokens=10)
    timed_generate(model, [decoder.encode(warm_up).to(args.device)], 8, sampling)
    with usual_linears(model):
        timed_generate(model, [decoder.encode(warm_up).to(args.device)], 8, sampling)
    paced = len(decoder.pacer.options(1)) > 1
    plan = ("paced per prompt, from " if paced else "") + describe(decoder.pacer.best(1))
    print(f"mtp decodes with {plan}", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"plan": plan,
                "threads": torch.get_num_threads(), "device_name": device_name(args.device),
                "plain_fast": plain_fast}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.batch_size:
        rows = bench_batches(decoder, chats, args.batch_size, args.max_new_tokens, sampling)
        out.write_text(json.dumps({"settings": settings, "batches": rows}, indent=1))
        table = batch_markdown(rows, len(chats))
        out.with_suffix(".md").write_text(table + "\n")
        print(table)
        return

    def answer(question: dict, messages: list[dict]) -> dict:  # each decoder in turn, once
        input_ids = decoder.encode(messages).to(args.device)
        with usual_linears(model):  # as users run it
            (plain,), plain_seconds = timed_generate(model, [input_ids], args.max_new_tokens, sampling)
        if plain_fast:
            (fast,), fast_seconds = timed_generate(model, [input_ids], args.max_new_tokens, sampling)
        (lookup,), lookup_seconds = timed_generate(model, [input_ids], args.max_new_tokens, sampling,
                                                   prompt_lookup_num_tokens=10)  # fmt: skip
        result = decoder.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
        row = {
            "category": question.get("category", "all"), "forward_passes": result.forward_passes,
            "accept_lengths": result.accept_lengths, "lookup_accepted": result.lookup_accepted,
            "mtp_tokens": len(result.token_ids), "plain_tokens": len(plain),
            "lookup_tokens": len(lookup), "plain_seconds": plain_seconds, "lookup_seconds": lookup_seconds,
            "mtp_seconds": result.seconds,
            "matches_plain": result.token_ids == plain if sampling.greedy else None,  # samples differ by chance
        }  # fmt: skip
        if plain_fast:
            row |= {"plain_fast_tokens": len(fast), "plain_fast_seconds": fast_seconds}
        if plain_compiled:
            steps = plain_compiled.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
            row |= {"plain_compiled_tokens": len(steps.token_ids), "plain_compiled_seconds": steps.seconds}
        if heads_alone:
            alone = heads_alone.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
            row |= {"heads_tokens": len(alone.token_ids), "heads_seconds": alone.seconds}
        for number, other in enumerate(others, 1):
            theirs = other.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
            name = f"against_{number}"
            row |= {
                f"{name}_tokens": len(theirs.token_ids),
                f"{name}_seconds": theirs.seconds,
                f"{name}_passes": theirs.forward_passes,
                f"{name}_matches_plain": theirs.token_ids == plain if sampling.greedy else None,
            }
        return row

    rows = []
    for question, messages in zip(tqdm(questions, desc="benchmark", unit="question"), chats, strict=True):
        runs = [answer(question, messages) for _ in range(args.repeat)]  # greedy: the same tokens every time
        rows.append(runs[0] | {key: min(run[key] for run in runs) for key in runs[0] if key.endswith("_seconds")})
    summary = {
        c: summarise([r for r in rows if r["category"] == c]) for c in dict.fromkeys(r["category"] for r in rows)
    }
    summary["overall"] = summarise(rows)
    out.write_text(json.dumps({"settings": settings, "summary": summary, "questions": rows}, indent=1))
    table = markdown(summary)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
