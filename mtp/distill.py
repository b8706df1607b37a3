"""Self-distillation: the base model answers prompts; its answers become the heads' training data."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtp.base import load_base, load_tokenizer
from mtp.rows import read_rows, to_example


@dataclass
class Distill:
    """The base model answers the first user turn of each row of `prompts` (any format `mtp.data` reads)."""

    prompts: str
    """File, dataset folder or `datasets` id with the prompts."""
    limit: int | None = None
    """Answer only the first `limit` prompts that are not too long."""
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
    tokenizer = load_tokenizer(base_model)
    prompts = {}  # index of the row in the prompt file -> chat-templated prompt ids
    for index, row in enumerate(read_rows(distill.prompts)):
        example = to_example(row)
        users = [m["content"] for m in example if m["role"] == "user"] if isinstance(example, list) else [example]
        if users and users[0]:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": users[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if len(ids) <= distill.max_prompt_tokens:
                prompts[index] = (users[0], ids)
    selected = list(prompts)[: distill.limit]
    done = read_done(out)
    todo = sorted((i for i in selected if i not in done), key=lambda i: len(prompts[i][1]))  # batch similar lengths
    if not todo:
        return
    model, _ = load_base(base_model)  # the tokenizer is already loaded
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as file, tqdm(total=len(todo), desc="self-distilling", unit="prompt") as bar:
        for start in range(0, len(todo), distill.batch_size):
            batch = todo[start : start + distill.batch_size]
            inputs = tokenizer.pad({"input_ids": [prompts[i][1] for i in batch]}, return_tensors="pt")
            torch.manual_seed(distill.seed + batch[0])  # reproducible whatever was done before
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
            for i, answer in zip(batch, answers, strict=True):
                messages = [
                    {"role": "user", "content": prompts[i][0]},
                    {"role": "assistant", "content": answer.strip()},
                ]
                file.write(json.dumps({"index": i, "messages": messages}, ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
            bar.update(len(batch))
