"""Self-distillation: the base model answers prompts; its answers become the drafter's training data.

Every process of a run answers its own share of the prompts (those at its rank's places, every `world_size`-th,
after they are ordered by length, so each share holds as many short and long prompts), on its own device in the
compute dtype, into its own shard `rank-NNNNN/` of the output folder; training reads every shard. A rerun (after a
crash, or with another number of processes) first reads what every shard already holds and answers only the rest.
"""

import gzip
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtp.base import load_base, load_tokenizer
from mtp.decoding.decoder import Decoder, GenerationResult
from mtp.decoding.sampling import Sampling
from mtp.loading import load
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
    """0 for greedy answers; above 0 samples (each prompt's generator seeded from `seed` and its index)."""
    seed: int = 0
    part_size: int = 1000
    """Answers per part: a full part is gzip-compressed (`part-00000.jsonl.gz`, ...), small enough to commit."""
    drafter: str | None = None
    """A drafter's folder for this base model: the answers come faster (its tree and prompt lookup, paced to the
    machine) and are the same (greedy) or have the same distribution (sampled). None: the base model alone."""

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


def run_distill(
    distill: Distill,
    base_model: str,
    out: str | Path,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> None:
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
    decoder = answering_decoder(distill, base_model, device, dtype)
    shard.mkdir(parents=True, exist_ok=True)
    part = open_part(shard)
    count = part.read_bytes().count(b"\n") if part.is_file() else 0  # answers in the open part
    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(todo), desc=f"self-distilling (rank {rank} of {world_size})", unit="prompt") as bar:
        for i, answer in answer_all(decoder, [(i, prompts[i][0]) for i in todo], distill):
            messages = [
                {"role": "user", "content": prompts[i][0]},
                {"role": "assistant", "content": answer.text.strip()},
            ]
            with part.open("a", encoding="utf-8") as file:
                file.write(json.dumps({"index": i, "messages": messages}, ensure_ascii=False) + "\n")
                file.flush()
                os.fsync(file.fileno())
            count += 1
            if count == distill.part_size:
                pack(part)
                part, count = open_part(shard), 0
            tokens += len(answer.token_ids)
            bar.set_postfix(answer_tokens_per_s=f"{tokens / (time.perf_counter() - start):.1f}")
            bar.update()


def answering_decoder(distill: Distill, base_model: str, device: str | torch.device, dtype: torch.dtype) -> Decoder:
    """The decoder that answers: the base model alone (plain steps), or with the drafter `distill.drafter` (its
    tree and lookup paced to this machine), loaded on `device` in `dtype`."""
    if distill.drafter is not None:
        return load(distill.drafter, device, dtype, base_model=base_model, compile=False)  # batches: eager passes
    model, tokenizer = load_base(base_model, device=device, dtype=dtype)
    return Decoder(model, tokenizer)


def answer_all(
    decoder: Decoder, prompts: list[tuple[int, str]], distill: Distill
) -> Iterator[tuple[int, GenerationResult]]:
    """Answer `prompts` ((index, first user turn), in this order) with `decoder`, `distill.batch_size` at a time (a
    finished answer's row taken at once by the next prompt: `Decoder.answers`); yield (index, result) as each answer
    ends, at an EOS (left out) or at `max_new_tokens`. Sampled, prompt `index` draws from its own generator seeded
    from `distill.seed` and `index`: its answer does not depend on its batch, nor on what an earlier run answered."""
    sampling = Sampling(temperature=distill.temperature, seed=distill.seed)
    chats = [[{"role": "user", "content": text}] for _, text in prompts]
    numbers = [index for index, _ in prompts]
    for place, result in decoder.answers(chats, distill.max_new_tokens, sampling, distill.batch_size, numbers):
        yield prompts[place][0], result
