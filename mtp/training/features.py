"""The base model's hidden states on disk (offline features): written once per example, each process its share into
a shard of its own, then read by training, which needs only the base's embeddings, final norm and lm_head.

A folder holds `features.json` (what was written: the base model, the hidden states, their width and dtype) and
one shard per writing process, `rank-NNNNN/part-NNNNN.safetensors`. A part holds one bfloat16 tensor `states`
(tokens, width), its examples' rows one after another, and in its metadata their keys and lengths: the index. An
example's key is a digest of its token ids, so a change of data, split or seed writes only the examples it adds.
"""

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from mtp.base import load_base

DTYPE = torch.bfloat16
PART_BYTES = 256 * 2**20  # a part is written once its states reach this size


def key(ids: torch.Tensor) -> str:
    """An example's key: a digest of its token ids (T,)."""
    return hashlib.sha256(ids.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:32]


def backbone(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: list[int]
) -> torch.Tensor:
    """The base model's hidden states at `layers` (0: the input embeddings, i: decoder layer i - 1's output), then
    its last ones (after the final norm): (B, T, (len(layers) + 1) H)."""
    out = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=bool(layers)
    )
    return torch.cat([*(out.hidden_states[i] for i in layers), out.last_hidden_state], -1)


class Features:
    """The hidden states in a folder, read one example at a time through a memory map of its part (safetensors'
    `safe_open`): what was read stays in the system's file cache, not in the process, so memory is flat however many
    there are, and reading cached states again costs no disk access. The data loader's worker reads them ahead of
    the steps (`mtp.training.data.collate`)."""

    def __init__(self, folder: str | Path, manifest: dict):
        """`manifest`: what the states must be (`manifest` below); a folder written for another base model or other
        hidden states is refused."""
        self.folder = Path(folder)
        found = self.folder / "features.json"
        if found.is_file():
            written = json.loads(found.read_text())
            if written != manifest:
                differ = sorted(k for k in manifest.keys() | written.keys() if manifest.get(k) != written.get(k))
                was = ", ".join(f"{k} {written.get(k)!r}" for k in differ)
                needed = ", ".join(f"{k} {manifest.get(k)!r}" for k in differ)
                raise ValueError(
                    f"The features in {str(self.folder)!r} were written for {was}; this run needs "
                    f"{needed}: give another folder (model.features) or delete this one."
                )
        self.width = manifest["width"]
        self.row_bytes = self.width * DTYPE.itemsize
        self.where: dict[str, tuple[Path, int, int]] = {}  # key -> (part, its first row, rows)
        for part in sorted(self.folder.glob("rank-*/part-*.safetensors")):
            with part.open("rb") as file:
                index = json.loads(file.read(int.from_bytes(file.read(8), "little")))["__metadata__"]
            first = 0
            for example, length in zip(json.loads(index["keys"]), json.loads(index["lengths"]), strict=True):
                self.where.setdefault(example, (part, first, length))
                first += length
        self._parts = {}  # part -> its open memory map, opened on the first read (in the process that reads)

    def __getstate__(self) -> dict:  # to a loader's worker: without open maps
        return {**self.__dict__, "_parts": {}}

    def __contains__(self, example: str) -> bool:
        return example in self.where

    def __getitem__(self, example: str) -> torch.Tensor:
        """The states (T, width) of the example with this key."""
        if example not in self.where:
            raise KeyError(
                f"No hidden states for this example in {str(self.folder)!r}: run training with the same "
                "data once more to write them."
            )
        part, first, length = self.where[example]
        if part not in self._parts:
            self._parts[part] = safe_open(part, framework="pt")
        return self._parts[part].get_slice("states")[first : first + length]


def manifest(identity: dict, layers: list[int]) -> dict:
    """What a folder's states are: the base model (`base_identity`'s fields), the hidden states' layers, then the
    last ones, their width and dtype."""
    width = (len(layers) + 1) * identity["hidden_size"]
    return {**identity, "layers": list(layers), "width": width, "dtype": str(DTYPE).removeprefix("torch.")}


def write_features(
    folder: str | Path,
    base_model: str,
    wanted: dict,
    examples: list[torch.Tensor],
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 8,
) -> None:
    """Write this process's share of the examples (token ids, (T,) each) whose states no shard of `folder` holds
    yet: the base model on `device` in `dtype` runs over them `batch_size` at a time, and its states go, in bfloat16,
    to parts of the shard `rank-NNNNN/`, each written whole (a killed run loses at most the part it was filling).
    `rank` of `world_size` processes: the share is every `world_size`-th example ordered by length, from `rank`, so
    that a rerun on another number of processes writes what is missing once. `wanted`: `manifest`'s."""
    folder = Path(folder)
    done = Features(folder, wanted)
    unique = {key(ids): ids for ids in examples}
    ordered = sorted(unique, key=lambda k: (len(unique[k]), k))  # similar lengths share a batch
    missing = [k for k in ordered if k not in done]
    todo = [k for k in ordered[rank::world_size] if k not in done]  # shares of all: the same whatever others wrote
    if rank == 0:
        tokens, per_token = sum(len(unique[k]) for k in missing), done.row_bytes
        print(
            f"Features: {done.width} values a token in {wanted['dtype']}, {per_token:,} bytes a token; "
            f"{len(missing):,} of {len(unique):,} examples to write, {tokens:,} tokens, "
            f"{tokens * per_token / 1e9:.3f} GB, over {world_size} process(es), to {folder}",
            flush=True,
        )
    if not todo:
        return
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"features.json.{rank}").write_text(json.dumps(wanted, indent=1))  # each its own, then one rename
    os.replace(folder / f"features.json.{rank}", folder / "features.json")
    model, _ = load_base(base_model, device=device, dtype=dtype, fast=False)
    shard = folder / f"rank-{rank:05d}"
    shard.mkdir(exist_ok=True)
    number = max((int(p.stem.removeprefix("part-")) + 1 for p in shard.glob("part-*.safetensors")), default=0)
    rows: list[torch.Tensor] = []
    names: list[str] = []

    def write() -> None:
        nonlocal number
        states = torch.cat(rows)
        index = {"keys": json.dumps(names), "lengths": json.dumps([len(r) for r in rows])}
        staging = shard / f"part-{number:05d}.safetensors.tmp"
        save_file({"states": states}, staging, metadata=index)
        os.replace(staging, shard / f"part-{number:05d}.safetensors")
        number += 1
        rows.clear()
        names.clear()

    with torch.no_grad(), tqdm(total=len(todo), desc=f"features (rank {rank} of {world_size})", unit="example") as bar:
        for start in range(0, len(todo), batch_size):
            batch = [unique[k] for k in todo[start : start + batch_size]]
            input_ids = torch.zeros(len(batch), len(batch[-1]), dtype=torch.long)  # (B, T), the longest last
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = ids, 1
            states = backbone(model, input_ids.to(model.device), attention_mask.to(model.device), wanted["layers"])
            for row, ids in enumerate(batch):
                rows.append(states[row, : len(ids)].to("cpu", DTYPE))
            names += todo[start : start + batch_size]
            if sum(len(r) for r in rows) * done.row_bytes >= PART_BYTES:
                write()
            bar.update(len(batch))
    if rows:
        write()
