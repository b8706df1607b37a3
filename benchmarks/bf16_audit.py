"""Every greedy answer in bfloat16 (or float16) that differs from plain `generate`'s, explained: the first position
where it differs, plain decoding's two best tokens there and the gap between their logits, in units of the format's
spacing at that magnitude (a gap of 1 is the smallest a rounding can flip), and the rank mtp's token had in plain
decoding's logits. The claim it checks: in a 16-bit format every difference is a near tie, flipped by a pass over
more tokens rounding otherwise than plain decoding's pass over one.

    python benchmarks/bf16_audit.py --drafter heads/smollm2-135m-instruct --questions data/mt_bench.jsonl \
        --out runs/bench/bf16_audit.json

Beside each: how far one causal pass over the same prefix (no cache: a pass over many tokens, as a tree's) moves
the logits at that position from plain decoding's, in the same units: the rounding noise that a flip needs.
"""

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

import mtp
from mtp.base import eos_ids
from mtp.linears import usual_linears
from mtp.training.rows import read_rows


def spacing(value: float, dtype: torch.dtype) -> float:
    """The distance from |value| to the next larger number of `dtype` (its unit in the last place there)."""
    mantissa = torch.finfo(dtype).eps  # the spacing at 1.0
    return mantissa * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


def audit(decoder, messages: list[dict], max_new_tokens: int) -> dict:
    """mtp's and plain greedy decoding's answers to `messages`, and where they first differ."""
    model = decoder.base_model
    input_ids = decoder.encode(messages).to(model.device)
    with usual_linears(model):  # plain decoding as users run it
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    eos = eos_ids(model)
    plain = out.sequences[0, input_ids.shape[1] :].tolist()  # up to its first EOS, which it keeps
    plain = plain[: next((i + 1 for i, t in enumerate(plain) if t in eos), len(plain))]
    result = decoder.generate(messages, max_new_tokens=max_new_tokens)
    logits = torch.stack(out.logits)[:, 0].float()  # (N, V) plain decoding's logits at each new token, as made
    ours = list(result.token_ids)
    if result.finish_reason == "stop":  # it drew an EOS there: the one plain decoding ranked highest
        ours.append(max(eos, key=lambda t: logits[len(ours), t]) if len(ours) < len(logits) else min(eos))
    row = {"mtp_tokens": len(result.token_ids), "plain_tokens": len(plain), "differs": ours != plain}
    if ours == plain:
        return row
    at = next(i for i, (a, b) in enumerate(zip(ours, plain, strict=False)) if a != b)  # both end at EOS or the limit
    top, unit = logits[at].topk(2), spacing(float(logits[at].max()), model.dtype)
    with torch.no_grad(), usual_linears(model):  # the same position's logits from one pass over the whole prefix
        prefix = torch.cat([input_ids[0], torch.tensor(plain[:at], device=model.device)])[None]
        whole = model(prefix, use_cache=False).logits[0, -1].float()  # (V,)
    return row | {
        "one_pass_max_difference_in_spacings": float((whole - logits[at]).abs().max()) / unit,
        "one_pass_plain_vs_mtp_token_in_spacings": float(whole[plain[at]] - whole[ours[at]]) / unit,
        "first_difference": at,
        "plain_token": plain[at],
        "mtp_token": ours[at],
        "plain_top2": top.indices.tolist(),
        "mtp_token_rank": int((logits[at] > logits[at, ours[at]]).sum()),
        "top1_logit": float(top.values[0]),
        "gap_in_spacings": float(top.values[0] - top.values[1]) / unit,
        "plain_vs_mtp_token_in_spacings": float(logits[at, plain[at]] - logits[at, ours[at]]) / unit,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--questions", required=True, help="JSON lines with `turns` (first turn used) or `prompt`")
    parser.add_argument("--limit", type=int, help="the first N questions")
    parser.add_argument("--question-ids", type=int, nargs="+", help="only these questions (`question_id`)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/bench/bf16_audit.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    decoder = mtp.load(args.drafter, args.device, dtype)
    questions = [
        q
        for q in read_rows(args.questions)[: args.limit]
        if not args.question_ids or q.get("question_id") in args.question_ids
    ]
    rows = []
    for question in tqdm(questions, desc="audit", unit="question"):
        prompt = question["turns"][0] if "turns" in question else question["prompt"]
        rows.append(
            {"question_id": question.get("question_id")}
            | audit(decoder, [{"role": "user", "content": prompt}], args.max_new_tokens)
        )
    tokens = [row for row in rows if row["differs"]]
    near = [row for row in tokens if row["plain_vs_mtp_token_in_spacings"] <= 2]
    summary = {
        "questions": len(rows),
        "differing": len(tokens),
        "flipped_within_2_spacings": len(near),
        "largest_flip_in_spacings": max((row["plain_vs_mtp_token_in_spacings"] for row in tokens), default=None),
        "largest_top2_gap_in_spacings": max((row["gap_in_spacings"] for row in tokens), default=None),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "summary": summary, "questions": rows}, indent=1))
    print(
        f"{args.dtype}: {len(tokens)} of {len(rows)} answers differ from plain greedy; in {len(near)} of them the "
        f"first differing token's logit was within 2 spacings of plain decoding's token in plain decoding's own "
        f"pass (largest {summary['largest_flip_in_spacings']}; top-2 gaps at most "
        f"{summary['largest_top2_gap_in_spacings']} spacings)"
    )
    for row in tokens:
        print(
            f"question {row['question_id']}: new token {row['first_difference']}: plain {row['plain_token']}, mtp "
            f"{row['mtp_token']} (rank {row['mtp_token_rank']} in plain's logits), "
            f"{row['plain_vs_mtp_token_in_spacings']:.2f} spacings apart at {row['top1_logit']:.4g}; "
            f"plain's top-2 {row['plain_top2']}, {row['gap_in_spacings']:.2f} spacings apart; one pass over the "
            f"prefix moves logits there by up to {row['one_pass_max_difference_in_spacings']:.2f} spacings and puts "
            f"plain's token {row['one_pass_plain_vs_mtp_token_in_spacings']:.2f} spacings above mtp's"
        )


if __name__ == "__main__":
    main()
