"""Self-distillation: the base model answers prompts; its answers become the drafter's training data.

Every process of a run answers its own share of the prompts (those at its rank's places, every `world_size`-th,
after they are ordered by length, so each share holds as many short and long prompts), on its own device in the
compute dtype, into its own shard `rank-NNNNN/` of the output folder; training reads every shard. A rerun (after a
crash, or with another number of processes) first reads what every shard already holds and answers only the rest.
"""

import gzip
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from mtp.base import eos_ids, load_base, load_tokenizer
from mtp.training.rows import read_rows, to_example


@dataclass
class Distill:
    """The base model answers the first user turn of each row of `prompts` (any format `mtp.training.data` reads)."""

    prompts: str
    """File, dataset folder or `datasets` id with the prompts."""
    limit: int | None = None
    """Answer only the first `limit` prompts that are not too long."""
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are skipped."""
    batch_size: int = 16
    temperature: float = 0.0
    """0 for greedy answers; above 0 samples (each prompt seeded by `seed` + its index)."""
    seed: int = 0
    part_size: int = 1000
    """Answers per part: a full part is gzip-compressed (`part-00000.jsonl.gz`, ...), small enough to commit."""

    def __post_init__(self):
        if min(self.max_new_tokens, self.batch_size, self.part_size) < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens}, batch_size={self.batch_size}, part_size={self.part_size}: "
                f"each must be >= 1."
            )
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy).")


def open_part(folder: Path) -> Path:
    """The part that answers are appended to (plain JSON lines): the one after the compressed parts. A plain part
    left beside its own compressed copy (by a crash while compressing it) is removed."""
    packed = sorted(folder.glob("part-*.jsonl.gz"))
    for part in packed:
        part.with_suffix("").unlink(missing_ok=True)  # part-N.jsonl.gz -> part-N.jsonl
    return folder / f"part-{len(packed):05d}.jsonl"


def pack(part: Path) -> None:
    """Compress a full part into `part-N.jsonl.gz` (written aside, then renamed), then remove the plain one."""
    packed, staging = part.with_suffix(".jsonl.gz"), part.with_suffix(".gz.tmp")
    with part.open("rb") as source, staging.open("wb") as target:
        with gzip.GzipFile(fileobj=target, mode="wb", mtime=0) as compressed:  # mtime 0: the same bytes every time
            shutil.copyfileobj(source, compressed)
    os.replace(staging, packed)
    part.unlink()


def read_done(folder: Path, shard: Path, world_size: int) -> set[int]:
    """Indices of prompts already answered in the parts under `folder`, every shard's, for the process of `shard`
    among `world_size`. A torn last line (a crash mid-write) is cut off where no other process of this run writes:
    in this process's shard and in those of ranks from `world_size` up (an earlier run on more processes), so that
    training reads every shard whole; in the open part of another running process (being written now) it only
    ends the reading of that part. A cut answer is not done: it is answered again."""
    writing = {folder / f"rank-{rank:05d}" for rank in range(world_size)} - {shard}
    done = {row["index"] for part in sorted(folder.rglob("part-*.jsonl.gz")) for row in read_rows(str(part))}
    for part in sorted(folder.rglob("part-*.jsonl")):
        good_bytes = 0
        with part.open("rb") as file:
            for line in file:
                try:
                    done.add(json.loads(line)["index"])
                except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                    break
                good_bytes += len(line)
        if part.parent not in writing and good_bytes < part.stat().st_size:
            os.truncate(part, good_bytes)
    return done


def run_distill(distill: Distill, base_model: str, out: str | Path, rank: int = 0, world_size: int = 1,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
    """Answer this process's share of the prompts that no shard of the folder `out` answered yet, with the base
    model on `device` in `dtype`, appending each answer as it ends to the open part of the shard `rank-NNNNN/`
    (JSON lines of `{index, messages}`) and compressing each part once it holds `part_size` answers. `rank` of
    `world_size` processes: the share is every `world_size`-th of the prompts ordered by length, from `rank`."""
    out = Path(out)
    if out.is_file() or out.name.endswith((".json", ".jsonl", ".gz")):
        raise ValueError(f"Distilled answers go to a folder of parts, not to the file {str(out)!r}: drop the suffix.")
    tokenizer = load_tokenizer(base_model)
    prompts = {}  # index of the row in the prompt file -> (first user turn, chat-templated prompt ids)
    for index, row in enumerate(read_rows(distill.prompts)):
        example = to_example(row)
        users = [m["content"] for m in example if m["role"] == "user"] if isinstance(example, list) else [example]
        if users and users[0]:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": users[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if len(ids) <= distill.max_prompt_tokens:
                prompts[index] = (users[0], ids)
    ordered = sorted(list(prompts)[: distill.limit], key=lambda i: (len(prompts[i][1]), i))  # similar lengths meet
    shard = out / f"rank-{rank:05d}"
    done = read_done(out, shard, world_size)
    todo = [i for i in ordered[rank::world_size] if i not in done]
    if not todo:
        return
    model, _ = load_base(base_model, device=device, dtype=dtype, fast=False)  # the tokenizer is already loaded
    shard.mkdir(parents=True, exist_ok=True)
    part = open_part(shard)
    count = part.read_bytes().count(b"\n") if part.is_file() else 0  # answers in the open part
    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(todo), desc=f"self-distilling (rank {rank} of {world_size})", unit="prompt") as bar:
        for i, answer in continuous_batching(model, [(i, prompts[i][1]) for i in todo], distill):
            text = tokenizer.decode(answer, skip_special_tokens=True).strip()
            messages = [{"role": "user", "content": prompts[i][0]}, {"role": "assistant", "content": text}]
            with part.open("a", encoding="utf-8") as file:
                file.write(json.dumps({"index": i, "messages": messages}, ensure_ascii=False) + "\n")
                file.flush()
                os.fsync(file.fileno())
            count += 1
            if count == distill.part_size:
                pack(part)
                part, count = open_part(shard), 0
            tokens += len(answer)
            bar.set_postfix(answer_tokens_per_s=f"{tokens / (time.perf_counter() - start):.1f}")
            bar.update()


@torch.no_grad()
def continuous_batching(model, prompts: list[tuple[int, list[int]]], distill: Distill) -> Iterator[tuple[int, list]]:
    """Answer `prompts` ((index, prompt ids), in this order), `distill.batch_size` at a time; yield (index, answer
    ids) as each answer ends, at an EOS (left out) or at `max_new_tokens`.

    A finished row does not wait for the rest of its batch (as with `generate`): its slot takes the next prompt
    at once, so every row of every step computes a token that is kept. The rows share one KV cache whose
    columns are time slots: a new prompt is prefilled (with the other prompts that start at that step,
    left-padded) and its keys and values are written right-aligned into its row, the columns before them masked
    out. Each row has its own position ids, so a row computes what it would compute alone. Columns that no row
    sees any more are cut from the left.
    """
    eos, device = eos_ids(model), model.device
    queue = iter(prompts)
    rows: list[tuple[int, list[int]] | None] = []  # per row: (prompt index, answer so far), None when free
    cache, seen = None, torch.zeros(0, 0, dtype=torch.bool)  # seen (B, L): the cache columns each row attends to
    positions, last = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)  # (B,) next position, token
    generators = {}  # prompt index -> its own seeded generator, so a sample does not depend on its batch

    def choose(logits: torch.Tensor, indices: list[int]) -> list[int]:  # logits (n, V): the rows' next tokens
        if distill.temperature == 0:
            return logits.argmax(-1).tolist()
        probs = (logits.float() / distill.temperature).softmax(-1).cpu()  # (n, V): drawn on the CPU, on any device
        for index in indices:
            if index not in generators:
                generators[index] = torch.Generator().manual_seed(distill.seed + index)
        return [int(torch.multinomial(p, 1, generator=generators[i])) for p, i in zip(probs, indices, strict=True)]

    def settle(row: int, token: int):  # the row's next token: kept, or the end of its answer
        index, answer = rows[row]
        if token not in eos:
            answer.append(token)
            last[row] = token
        if token in eos or len(answer) == distill.max_new_tokens:
            rows[row] = None
            seen[row] = False
            generators.pop(index, None)
            return index, answer
        return None

    while True:
        free = [row for row, state in enumerate(rows) if state is None]
        new = list(itertools.islice(queue, distill.batch_size if cache is None else len(free)))
        finished = []
        if new:  # prefill the prompts that start now, left-padded together, then give each a free row
            width = max(len(ids) for _, ids in new)
            mask = torch.tensor([[False] * (width - len(ids)) + [True] * len(ids) for _, ids in new], device=device)
            ids = torch.tensor([[0] * (width - len(ids)) + ids for _, ids in new], device=device)  # (n, W) twice
            fresh = DynamicCache()
            logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                           cache=fresh, use_cache=True, logits_to_keep=1).logits[:, -1]  # (n, V)  # fmt: skip
            if cache is None:  # the first prompts: their cache is the batch's
                cache, seen, rows = fresh, mask, [None] * len(new)
                positions, last = mask.sum(1), torch.zeros(len(new), dtype=torch.long, device=device)
                slots = list(range(len(new)))
            else:
                slots, grow = free[: len(new)], max(width - seen.shape[1], 0)  # columns to add on the left
                seen = torch.nn.functional.pad(seen, (grow, 0))  # (B, L); a free row sees nothing (settle)
                seen[slots, seen.shape[1] - width :] = mask
                for layer, added in zip(cache.layers, fresh.layers, strict=True):
                    for name in ("keys", "values"):  # (B, heads, L, head dim)
                        states = getattr(layer, name)
                        if grow:  # a copy of the whole cache: only when the new prompt is longer than it
                            states = torch.nn.functional.pad(states, (0, 0, grow, 0))
                            setattr(layer, name, states)
                        states[slots, :, states.shape[2] - width :] = getattr(added, name)
                positions[slots] = mask.sum(1)
            indices = [index for index, _ in new]
            for row, index, token in zip(slots, indices, choose(logits, indices), strict=True):
                rows[row] = (index, [])
                finished.append(settle(row, token))
        else:
            active = [row for row, state in enumerate(rows) if state is not None]
            if not active:
                return
            if len(active) < len(rows):  # no prompt left to fill the free rows: drop them
                cache.batch_select_indices(torch.tensor(active, device=device))
                seen, positions, last = seen[active], positions[active], last[active]
                rows = [rows[row] for row in active]
            column = torch.ones(len(rows), 1, dtype=torch.bool, device=device)  # (B, 1) the new token's
            seen = torch.cat([seen, column], 1)  # (B, L+1)
            logits = model(input_ids=last[:, None], attention_mask=seen.long(), position_ids=positions[:, None],
                           cache=cache, use_cache=True).logits[:, -1]  # (B, V)  # fmt: skip
            positions += 1
            for row, token in enumerate(choose(logits, [index for index, _ in rows])):
                finished.append(settle(row, token))
            unused = int(seen.any(0).int().argmax())  # leading columns that no row sees any more
            if unused:
                seen = seen[:, unused:]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]
        yield from (answer for answer in finished if answer is not None)
