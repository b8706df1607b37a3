"""Benchmark mtp against plain `generate` and Hugging Face prompt-lookup decoding (and, when mtp's own prompt
lookup is on, against mtp with its heads alone), interleaved prompt by prompt in one process: tau, tokens/s,
speedups and the accepted candidates that came from the heads and from lookup, per category; when greedy, a
check that every mtp output equals plain `generate`'s. With --temperature > 0 all sample (the same temperature,
top-k and top-p).

    python -m mtp.bench --heads HEADS --questions data/mt_bench.jsonl --limit 16 --max-new-tokens 128
"""

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

import mtp
from mtp.cli import user_errors
from mtp.decoding import Decoder
from mtp.lookup import add_lookup_arguments, lookup_from
from mtp.rows import read_rows
from mtp.sampling import Sampling, add_sampling_arguments, sampling_from
from mtp.tree import NAMED_TREES

METHODS = ("plain", "lookup", "heads", "mtp")  # heads: mtp without its prompt lookup, when that is on


def timed_generate(model, input_ids, max_new_tokens, sampling: Sampling, **options) -> tuple[list[int], float]:
    """Plain `generate` (or prompt lookup with options): new tokens without the EOS, and seconds."""
    if not sampling.greedy:
        options |= dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         **({"do_sample": False} | options))[0, input_ids.shape[1] :].tolist()  # fmt: skip
    seconds = time.perf_counter() - start
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return (out[: next((i for i, t in enumerate(out) if t in eos), len(out))], seconds)


def summarise(rows: list[dict]) -> dict:
    """Totals over questions: each method's tokens/s counts its own tokens; mismatches count the questions where
    mtp's output differs from plain `generate`'s (greedy only; None when sampling)."""
    tokens, passes = sum(row["mtp_tokens"] for row in rows), sum(row["forward_passes"] for row in rows)
    speed = {name: sum(row[f"{name}_tokens"] for row in rows) / sum(row[f"{name}_seconds"] for row in rows)
             for name in METHODS if f"{name}_seconds" in rows[0]}  # fmt: skip
    candidates = sum(sum(row["accept_lengths"]) for row in rows) - passes  # accepted, bonus tokens left out
    from_lookup = sum(row["lookup_accepted"] for row in rows)
    return {
        "questions": len(rows), "tokens": tokens, "tau": tokens / max(passes, 1),
        **{f"{name}_tokens_per_second": value for name, value in speed.items()},
        **{f"speedup_vs_{name}": speed["mtp"] / value for name, value in speed.items() if name != "mtp"},
        "accepted_from_heads": candidates - from_lookup, "accepted_from_lookup": from_lookup,
        "mismatches": None if rows[0]["matches_plain"] is None else sum(not row["matches_plain"] for row in rows),
    }  # fmt: skip


def markdown(summary: dict[str, dict]) -> str:
    others = [name for name in METHODS[:-1] if f"speedup_vs_{name}" in summary["overall"]]
    columns = ["category", "questions", "tau", *(f"{name} tok/s" for name in ["mtp", *others])]
    columns += [*(f"vs {name}" for name in others), "accepted from heads / lookup", "mismatches"]
    lines = ["| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for name, s in summary.items():
        figures = [s["questions"], f"{s['tau']:.2f}"]
        figures += [f"{s[f'{method}_tokens_per_second']:.1f}" for method in ["mtp", *others]]
        figures += [f"{s[f'speedup_vs_{method}']:.2f}x" for method in others]
        figures += [f"{s['accepted_from_heads']} / {s['accepted_from_lookup']}"]
        figures += ["n/a (sampling)" if s["mismatches"] is None else s["mismatches"]]
        lines.append(f"| {name} | " + " | ".join(str(figure) for figure in figures) + " |")
    return "\n".join(lines)


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True)
    parser.add_argument("--questions", required=True, help="JSON lines with `turns` (first turn used) or `prompt`")
    parser.add_argument("--limit", type=int, help="the first N questions, spread over categories in file order")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--tree",
        help=f"one of {sorted(NAMED_TREES)}, or a number N: the N-node tree grown from "
        "the heads' calibration (default: the tree saved with the heads)",
    )
    add_sampling_arguments(parser)
    add_lookup_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default="runs/bench/bench.json", help="JSON out; the Markdown table goes beside it")
    args = parser.parse_args()
    sampling = sampling_from(args)
    if args.seed is not None:
        torch.manual_seed(args.seed)  # plain generate and prompt lookup sample with torch's global generator
    decoder = mtp.load(args.heads, args.device, getattr(torch, args.dtype), tree=args.tree, lookup=lookup_from(args))
    heads_alone = decoder.lookup and Decoder(decoder.base_model, decoder.tokenizer, decoder.heads, decoder.tree)
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
    if heads_alone:
        heads_alone.generate(warm_up, max_new_tokens=8, sampling=sampling)
    timed_generate(model, decoder.encode(warm_up).to(args.device), 8, sampling, prompt_lookup_num_tokens=10)
    timed_generate(model, decoder.encode(warm_up).to(args.device), 8, sampling)
    rows = []
    for question, messages in zip(tqdm(questions, desc="benchmark", unit="question"), chats, strict=True):
        input_ids = decoder.encode(messages).to(args.device)
        plain, plain_seconds = timed_generate(model, input_ids, args.max_new_tokens, sampling)
        lookup, lookup_seconds = timed_generate(model, input_ids, args.max_new_tokens, sampling,
                                                prompt_lookup_num_tokens=10)  # fmt: skip
        result = decoder.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
        rows.append({
            "category": question.get("category", "all"), "forward_passes": result.forward_passes,
            "accept_lengths": result.accept_lengths, "lookup_accepted": result.lookup_accepted,
            "mtp_tokens": len(result.token_ids), "plain_tokens": len(plain),
            "lookup_tokens": len(lookup), "plain_seconds": plain_seconds, "lookup_seconds": lookup_seconds,
            "mtp_seconds": result.seconds,
            "matches_plain": result.token_ids == plain if sampling.greedy else None,  # samples differ by chance
        })  # fmt: skip
        if heads_alone:
            alone = heads_alone.generate(messages, max_new_tokens=args.max_new_tokens, sampling=sampling)
            rows[-1] |= {"heads_tokens": len(alone.token_ids), "heads_seconds": alone.seconds}
    summary = {
        c: summarise([r for r in rows if r["category"] == c]) for c in dict.fromkeys(r["category"] for r in rows)
    }
    summary["overall"] = summarise(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"tree_size": decoder.tree.size,
                "threads": torch.get_num_threads()}  # fmt: skip
    out.write_text(json.dumps({"settings": settings, "summary": summary, "questions": rows}, indent=1))
    table = markdown(summary)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
