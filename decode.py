"""Generate with trained heads: by default the heads shipped in heads/ for the packaged SmolLM2; with
--base-model and no --drafter, plain one-token decoding of that model.

python decode.py --prompt "Explain KV caches."
python decode.py --drafter runs/.../heads --prompts-file questions.jsonl --json > answers.jsonl
python decode.py --prompts-file data/mt_bench.jsonl --batch-size 4   # 4 prompts per verification pass
python decode.py --temperature 0.7 --seed 0       # interactive chat, sampling
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import mtp
from mtp.base import DEFAULT_BASE, load_base
from mtp.decoding.compiled import compile_pass
from mtp.decoding.decoder import Decoder, GenerationResult
from mtp.decoding.lookup import add_lookup_arguments, lookup_from
from mtp.decoding.sampling import add_sampling_arguments, sampling_from
from mtp.decoding.tree import TREE_HELP
from mtp.quantized import add_weights_argument
from mtp.tools.cli import user_errors
from mtp.training.rows import read_rows

SHIPPED_HEADS = Path(__file__).parent / "heads" / "smollm2-135m-instruct"  # trained by configs/smollm2-sharegpt.yaml


def conversations(args) -> list[list[str]]:
    """User turns of each conversation: --prompt, or each row of --prompts-file (`turns`, `prompt`, `text`)."""
    if args.prompt is not None:
        return [[args.prompt]]
    found = []
    for number, row in enumerate(read_rows(args.prompts_file), 1):
        turns = row.get("turns", row.get("prompt", row.get("text"))) if isinstance(row, dict) else None
        turns = [turns] if isinstance(turns, str) else turns
        if not (isinstance(turns, list) and turns and all(isinstance(turn, str) and turn for turn in turns)):
            raise SystemExit(f"{args.prompts_file}: row {number} has no `turns`, `prompt` or `text`: fix or remove it.")
        found.append(turns)
    return found


def typed_turns():
    """Lines typed at the prompt, until an empty line or the end of input."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line:
            return
        yield line


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--drafter",
        "--heads",
        help="drafter folder or Hub repository id (default: "
        f"{SHIPPED_HEADS.relative_to(Path(__file__).parent)}, unless --base-model is given: then "
        "decoding of it without heads)",
    )
    parser.add_argument("--base-model", help=f"base model to use (default: the heads' own, else {DEFAULT_BASE})")
    parser.add_argument("--prompt", help="one prompt (sent as a user message when the model has a chat template)")
    parser.add_argument("--prompts-file", help="JSON lines with `turns` (MT-Bench), `prompt` or `text`")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--tree", help=TREE_HELP)
    add_sampling_arguments(parser)
    add_lookup_arguments(parser)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="answer B prompts of --prompts-file together, "
        "one verification pass over all their trees per step (turn k of every conversation, then "
        "turn k + 1)",
    )
    parser.add_argument("--stream", action="store_true", help="print text as it is accepted")
    parser.add_argument("--json", action="store_true", help="one JSON object per answer on stdout")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_weights_argument(parser)
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        default=None,
        help="eager verification passes: no compiling at load (see mtp.decoding.compiled; "
        "--batch-size above 1 never compiles)",
    )
    args = parser.parse_args()
    interactive = args.prompt is None and args.prompts_file is None
    if args.batch_size < 1 or (args.batch_size > 1 and (args.stream or interactive)):
        raise SystemExit(
            f"--batch-size {args.batch_size}: give B >= 1; B > 1 answers a --prompts-file or --prompt, "
            "without --stream."
        )
    dtype = getattr(torch, args.dtype)
    sampling = sampling_from(args)
    if args.batch_size > 1:  # batches of several prompts run eager passes: nothing to compile for
        args.compile = False
    if args.drafter is None and args.base_model is None:
        args.drafter = str(SHIPPED_HEADS)
    if args.drafter:
        decoder = mtp.load(
            args.drafter,
            args.device,
            dtype,
            args.tree,
            args.base_model,
            lookup_from(args),
            compile=args.compile,
            weights=args.weights,
        )
    else:
        model, tokenizer = load_base(args.base_model or DEFAULT_BASE, args.device, dtype, weights=args.weights)
        lookup = lookup_from(args)  # without it, plain decoding: passes over one node
        compiled = compile_pass(model, args.compile, nodes=1 + (lookup.reach if lookup else 0))
        decoder = Decoder(model, tokenizer, lookup=lookup, compiled=compiled)
    chat = decoder.tokenizer.chat_template is not None
    totals = [0, 0, 0.0]  # tokens, verification passes, seconds
    if args.batch_size > 1:
        answer_in_batches(decoder, conversations(args), chat, args, sampling, totals)
    one_by_one = [] if args.batch_size > 1 else [typed_turns()] if interactive else conversations(args)
    for c, turns in enumerate(one_by_one):
        messages = []
        for k, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            prompt = messages if chat else turn
            result = GenerationResult()
            for text in decoder.stream(prompt, args.max_new_tokens, args.stop, result, sampling):
                if args.stream or interactive:
                    print(text, end="", flush=True)
            if args.stream or interactive:
                print()
            messages.append({"role": "assistant", "content": result.text})
            report((c, k, turn), result, args, totals, result.seconds, streamed=args.stream or interactive)
    tokens, passes, seconds = totals
    print(
        f"tau {tokens / max(passes, 1):.2f} ({tokens} tokens, {passes} verification passes), "
        f"{tokens / max(seconds, 1e-9):.1f} tokens/s",
        file=sys.stderr,
    )


def answer_in_batches(decoder: Decoder, conversations: list[list[str]], chat: bool, args, sampling, totals) -> None:
    """Answer turn k of every conversation together, `args.batch_size` at a time, then turn k + 1 (which follows
    each conversation's answer to turn k); print each round's answers in file order."""
    histories = [[] for _ in conversations]
    for k in range(max((len(turns) for turns in conversations), default=0)):
        asked = [c for c, turns in enumerate(conversations) if k < len(turns)]
        for c in asked:
            histories[c].append({"role": "user", "content": conversations[c][k]})
        prompts = [histories[c] if chat else conversations[c][k] for c in asked]
        start = time.perf_counter()
        results = decoder.generate(prompts, args.max_new_tokens, args.stop, sampling, args.batch_size)
        seconds = time.perf_counter() - start
        for c, result in zip(asked, results, strict=True):
            histories[c].append({"role": "assistant", "content": result.text})
            report((c, k, conversations[c][k]), result, args, totals, seconds / len(asked), streamed=False)


def report(
    asked: tuple[int, int, str], result: GenerationResult, args, totals: list, seconds: float, streamed: bool
) -> None:
    """Print the answer to `asked` (conversation and turn, from 0, and the turn's text) as a JSON line with --json,
    as text unless it was streamed, and add it to `totals`; `seconds`: its share of the wall-clock time."""
    conversation, turn_number, turn = asked
    totals[:] = [totals[0] + len(result.token_ids), totals[1] + result.forward_passes, totals[2] + seconds]
    if args.json:
        print(
            json.dumps(
                {
                    "conversation": conversation,
                    "turn": turn_number,
                    "prompt": turn,
                    "text": result.text,
                    "tokens": len(result.token_ids),
                    "forward_passes": result.forward_passes,
                    "tau": round(result.tau, 3),
                    "acceptance": result.acceptance.report(),
                    "finish_reason": result.finish_reason,
                    "stop_sequence": result.stop_sequence,
                    "tokens_per_second": round(result.tokens_per_second, 2),
                }
            ),
            flush=True,
        )
    elif not streamed:
        print(result.text)


if __name__ == "__main__":
    main()
