"""Self-distillation throughput, in one run over the same prompts: answer tokens/s of plain single-prompt greedy
`generate`, of `generate` over length-sorted left-padded batches (a finished row keeps its slot until the longest
answer of its batch ends), and of `mtp.training.distill.answer_all`, the project's decoder (a finished row takes the
next prompt at once), with the base model alone and, with --drafter, with a drafter's tree and lookup; the ratios
to single-prompt `generate`. Every batched answer is checked against the base alone's (greedy: the same tokens).

    python benchmarks/distill_throughput.py --prompts 64 --max-new-tokens 256 --batch-sizes 64 --single 2 \
        --drafter heads/smollm2-135m-instruct
"""

import argparse
import time

import torch

import mtp
from mtp.base import DEFAULT_BASE, load_base
from mtp.decoding.decoder import Decoder
from mtp.training.distill import Distill, answer_all
from mtp.training.rows import read_rows, to_example


def answer_length(new_tokens: list[int], eos: int) -> int:
    return new_tokens.index(eos) if eos in new_tokens else len(new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/sharegpt_prompts.json", help="prompts (any format mtp reads)")
    parser.add_argument("--prompts", type=int, default=64, help="the first N prompts of at most --max-prompt-tokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="16,32")
    parser.add_argument("--single", type=int, default=3, help="prompts timed with single-prompt generate")
    parser.add_argument("--drafter", help="also answer with this drafter's folder (for the default base)")
    args = parser.parse_args()
    model, tokenizer = load_base(DEFAULT_BASE)
    eos = tokenizer.eos_token_id
    prompts = []  # (ids, the first user turn)
    for row in read_rows(args.data):
        first = to_example(row)[0]
        ids = tokenizer.apply_chat_template([first], add_generation_prompt=True, return_dict=False)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append((ids, first["content"]))
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=lambda prompt: len(prompt[0]))
    texts = [(index, text) for index, (_, text) in enumerate(prompts)]
    prompts = [ids for ids, _ in prompts]
    decoders = {"the base alone": Decoder(model, tokenizer)}
    if args.drafter:
        decoders[f"with {args.drafter}"] = mtp.load(args.drafter, compile=False)
    lengths = [len(ids) for ids in prompts]
    print(
        f"{len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens (mean {sum(lengths) / len(lengths):.0f}), "
        f"answers of at most {args.max_new_tokens} tokens"
    )

    tokens, start = 0, time.perf_counter()
    for ids in prompts[:: len(prompts) // args.single][: args.single]:  # spread over the prompt lengths
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
        tokens += answer_length(out[0, len(ids) :].tolist(), eos)
    single = tokens / (time.perf_counter() - start)
    print(f"single-prompt generate: {single:.1f} answer tokens/s ({tokens} tokens)")

    tokenizer.padding_side = "left"
    for batch_size in map(int, args.batch_sizes.split(",")):
        tokens = slots = 0
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            inputs = tokenizer.pad({"input_ids": prompts[first : first + batch_size]}, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(
                    **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            out = out[:, inputs["input_ids"].shape[1] :]  # (B, new tokens)
            tokens += sum(answer_length(row, eos) for row in out.tolist())
            slots += out.numel()
        batched = tokens / (time.perf_counter() - start)
        print(
            f"batched generate, batch {batch_size}: {batched:.1f} answer tokens/s ({batched / single:.1f}x single), "
            f"{tokens} of {slots} slots computed were answer tokens ({tokens / slots:.0%})"
        )

        distill = Distill(prompts="", max_new_tokens=args.max_new_tokens, batch_size=batch_size)
        answers = {}
        for name, decoder in decoders.items():
            start = time.perf_counter()
            answers[name] = dict(answer_all(decoder, texts, distill))
            seconds = time.perf_counter() - start
            tokens = sum(len(result.token_ids) for result in answers[name].values())
            same = sum(answers[name][i].token_ids == answers["the base alone"][i].token_ids for i in answers[name])
            speed = tokens / seconds
            print(
                f"mtp's decoder, {name}, batch {batch_size}: {speed:.1f} answer tokens/s "
                f"({speed / single:.1f}x single, {speed / batched:.2f}x batched generate), "
                f"{tokens} tokens in {seconds:.0f} s; {same} of {len(answers[name])} answers the base alone's"
            )


if __name__ == "__main__":
    main()
