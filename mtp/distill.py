"""Self-distillation: the base model answers prompts; its answers become the heads' training data."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtp.base import load_base
from mtp.rows import read_rows, to_example


@dataclass
class Distill:
    """The base model answers the first user turn of each row of `prompts` (any format `mtp.data` reads)."""

    prompts: str
    """File, dataset folder or `datasets` id with the prompts."""
    limit: int | None = None
    """Answer only the first `limit` usable prompts."""
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are skipped."""
    batch_size: int = 16
    temperature: float = 0.0
    """0 for greedy answers; above 0 samples (seeded by `seed`)."""
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}, batch_size={self.batch_size}: both must be >= 1.")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy).")


def read_done(out: Path) -> set[int]:
    """Indices of prompts already answered in `out`; a torn last line (from a crash) is cut off."""
    done, good_bytes = set(), 0
    if out.is_file():
        with out.open("rb") as file:
            for line in file:
                try:
                    done.add(json.loads(line)["index"])
                except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                    break
                good_bytes += len(line)
        if good_bytes < out.stat().st_size:
            os.truncate(out, good_bytes)
    return done


def run_distill(distill: Distill, base_model: str, out: str | Path) -> None:
    """Answer every prompt not yet in `out` (JSON lines of `{index, messages}`), appending as batches finish."""
    out = Path(out)
    prompts = []
    for row in read_rows(distill.prompts):
        example = to_example(row)
        users = [m["content"] for m in example if m["role"] == "user"] if isinstance(example, list) else [example]
        if users and users[0]:
            prompts.append(users[0])
    prompts = prompts[: distill.limit]
    done = read_done(out)
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return
    model, tokenizer = load_base(base_model)
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = {
        i: tokenizer.apply_chat_template(
            [{"role": "user", "content": prompts[i]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for i in todo
    }
    todo = [i for i in todo if len(encoded[i]) <= distill.max_prompt_tokens]
    todo.sort(key=lambda i: len(encoded[i]))  # similar lengths batch with little padding
    out.parent.mkdir(parents=True, exist_ok=True)
    generator_seed = distill.seed
    with out.open("a", encoding="utf-8") as file, tqdm(total=len(todo), desc="self-distilling", unit="prompt") as bar:
        for start in range(0, len(todo), distill.batch_size):
            batch = todo[start : start + distill.batch_size]
            inputs = tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
            torch.manual_seed(generator_seed + start)
            with torch.no_grad():
                output = model.generate(
                    **inputs,
                    max_new_tokens=distill.max_new_tokens,
                    do_sample=distill.temperature > 0,
                    temperature=distill.temperature or None,
                    top_k=None,
                    top_p=None,
                    pad_token_id=pad_id,
                )
            answers = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, answer in zip(batch, answers):
                messages = [{"role": "user", "content": prompts[i]}, {"role": "assistant", "content": answer.strip()}]
                file.write(json.dumps({"index": i, "messages": messages}, ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
            bar.update(len(batch))
