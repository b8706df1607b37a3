"""Chat and text datasets -> token ids with a loss mask, length-bucketed batches, and the LightningDataModule."""

import json
import random
import secrets
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import PreTrainedTokenizerBase

from mtp.base import DEFAULT_BASE, compute_dtype, load_tokenizer
from mtp.training.distill import Distill, run_distill
from mtp.training.features import DTYPE, Features, key
from mtp.training.rows import FORMATS, hub_id, read_rows, to_example


def encode(tokenizer: PreTrainedTokenizerBase, example: list[dict] | str, max_length: int):
    """Token ids and loss mask (assistant tokens of a chat, every token of a text), truncated to max_length.

    Returns (ids, loss_mask) as 1D tensors, or a string saying why the example has nothing to learn.
    """
    if isinstance(example, str):
        ids = tokenizer(example, add_special_tokens=True, truncation=True, max_length=max_length).input_ids
        return (torch.tensor(ids), torch.ones(len(ids), dtype=torch.bool)) if len(ids) > 1 else "empty text"
    if not any(m["role"] == "assistant" and m["content"] for m in example):
        return "no assistant turn"
    if tokenizer.chat_template is None:
        raise ValueError("The base tokenizer has no chat template: give plain `text` rows instead of chats.")
    text = tokenizer.apply_chat_template(example, tokenize=False)
    spans = []  # character spans of assistant answers, each with its end-of-turn marker
    for i, message in enumerate(example):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(example[:i], tokenize=False, add_generation_prompt=True)
            answered = tokenizer.apply_chat_template(example[: i + 1], tokenize=False)
            if not (text.startswith(answered) and answered.startswith(prompt)):
                raise ValueError("The chat template renders a conversation unlike its prefixes: use `text` rows.")
            spans.append((len(prompt), len(answered)))
    encoded = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_length
    )
    mask = [any(start <= first < end for start, end in spans) for first, _ in encoded.offset_mapping]
    if not any(mask):
        return "no assistant token within max_length"
    return torch.tensor(encoded.input_ids), torch.tensor(mask)


def prompt_of(example: list[dict] | str) -> str:
    """What an example answers: its messages before the first assistant turn (a text is its own prompt)."""
    if isinstance(example, str):
        return example
    first = next(i for i, message in enumerate(example) if message["role"] == "assistant")
    return json.dumps(example[:first])


def collate(
    examples: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0, features: Features | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad a batch of (ids, loss mask): input_ids, attention_mask, loss_mask (B, T); with `features`, also the
    examples' hidden states read from them, `features` (B, T, W), zero past each example's end."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.bool)  # (B, T)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = mask
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if features is not None:
        batch["features"] = torch.zeros(len(examples), length, features.width, dtype=DTYPE)  # (B, T, W)
        for row, (ids, _) in enumerate(examples):
            batch["features"][row, : len(ids)] = features[key(ids)]
    return batch


def bucket(lengths: list[int], batch_size: int, seed: int = 0) -> list[list[int]]:
    """Batches of indices of similar length (sorted within shuffled windows of 50 batches): little padding."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    window = 50 * batch_size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lengths.__getitem__)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


class EpochOrder(DistributedSampler):
    """This process's share of the training batches, in an order fixed by the seed and the epoch, from `skip` batches
    into epoch `epoch`: where a run resumed from a checkpoint taken that far into that epoch goes on (Lightning sets
    the epochs after it, and makes a resumed epoch's iterator before it sets that one). Process r of w takes the r-th,
    (r + w)-th, .. batch of the order (the first ones again to fill the last round)."""

    def __init__(self, batches: list, num_replicas: int, rank: int, seed: int, epoch: int = 0, skip: int = 0):
        super().__init__(batches, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.epoch = self.start = epoch
        self.skip = skip

    def __iter__(self):
        order = list(super().__iter__())
        return iter(order[self.skip :] if self.epoch == self.start else order)


def require_shared(trainer: L.Trainer, folders: list[str | Path]) -> None:
    """Stop every process of a run, before any work, unless each sees what process 0 writes in every one of
    `folders`: on disks local to each node, a node would train on its own shards of the distilled answers or the
    features only, or resume from a checkpoint the others do not see."""
    if trainer.world_size == 1 or not folders:
        return
    token = trainer.strategy.broadcast(secrets.token_hex(8))
    marks = [Path(folder) / f".shared-{token}" for folder in folders]
    if trainer.global_rank == 0:
        for mark in marks:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
    trainer.strategy.barrier("shared folders marked")
    unseen = [str(mark.parent) for mark in marks if not mark.is_file()]
    everywhere = trainer.strategy.reduce_boolean_decision(not unseen, all=True)
    if trainer.global_rank == 0:
        for mark in marks:
            mark.unlink()
    if not everywhere:
        who = f"process {trainer.global_rank} does not see {unseen}" if unseen else "a process on another node does not"
        raise ValueError(
            f"The run's folders {[str(folder) for folder in folders]} are not shared by its {trainer.num_nodes} nodes: "
            f"{who} as process 0 wrote it. Every node writes and reads them: put them on a filesystem every node "
            f"mounts, or train on one node."
        )


class DrafterDataModule(L.LightningDataModule):
    def __init__(
        self,
        data: str,
        base_model: str = DEFAULT_BASE,
        distill: Distill | None = None,
        split: str = "train",
        max_length: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        val_data: str | None = None,
        seed: int = 0,
    ):
        """Training data for the heads.

        Args:
            data: a .json/.jsonl file, a dataset folder or a `datasets` id, in one of the formats ShareGPT,
                chat `messages`, Alpaca or `text`. With `distill`, the JSON-lines file that the base model's
                answers are written to (and resumed from) before training.
            base_model: whose tokenizer and chat template to apply (linked to the model's base_model).
            distill: self-distillation: the base model answers these prompts, and the drafter learns its answers;
                every process answers its share on its own device, in the compute dtype, before training.
            split: split of a `datasets` id or dataset folder.
            max_length: tokens per example; longer ones are truncated.
            batch_size: examples per batch, grouped by length.
            val_fraction: share of prompts held out for validation, with every answer to them.
            val_data: validate on this file or folder's answers to the held-out prompts (and to prompts `data`
                lacks) instead of on `data`'s: for example on the greedy answers only, when `data` also holds
                sampled ones and decoding is greedy.
            seed: for the validation split, batch grouping and each epoch's order of the batches.
        """
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1).")
        self.data, self.base_model, self.distill, self.split = data, base_model, distill, split
        self.max_length, self.batch_size, self.val_fraction, self.seed = max_length, batch_size, val_fraction, seed
        self.val_data = val_data
        self.train_batches = self.val_batches = None
        self.resume = {}  # from a checkpoint: its epoch, how many of its batches had trained, on how many processes
        self.features: Features | None = None  # hidden states on disk, put in every batch (`read_features`)

    def prepare_data(self) -> None:
        """Download the `datasets` ids among the prompts and the data once per node: Lightning runs this on one
        process of each node before `setup`, where every process then reads the local copy."""
        sources = [(self.distill.prompts, "train")] if self.distill else [(self.data, self.split)]  # else: answers
        for source, split in [*sources, (self.val_data, self.split)]:
            if source is not None and hub_id(source):
                read_rows(source, split)

    def setup(self, stage: str) -> None:
        if self.train_batches is not None:
            return
        trainer = self.trainer
        if trainer:  # what every node writes and every node reads: distilled answers, features, checkpoints
            features = trainer.lightning_module.hparams.get("features")
            checkpoints = [callback.dirpath for callback in trainer.checkpoint_callbacks if callback.dirpath]
            require_shared(
                trainer, [*([self.data] if self.distill else []), *([features] if features else []), *checkpoints]
            )
        if self.distill is not None:  # every process answers its share on its own device, then all read every shard
            rank, world_size = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
            device = trainer.strategy.root_device if trainer else torch.device("cpu")
            run_distill(
                self.distill,
                self.base_model,
                self.data,
                rank,
                world_size,
                device,
                compute_dtype(trainer.precision if trainer else "32-true"),
            )
            if trainer:
                trainer.strategy.barrier("distilled")
        tokenizer = load_tokenizer(self.base_model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        examples, prompts = self._read(tokenizer, self.data)
        order = list(range(len(examples)))
        random.Random(self.seed).shuffle(order)
        examples = [examples[i] for i in order]
        prompts = [prompts[i] for i in order]
        # Whole prompts are held out: a second answer to a validation prompt (a sampled one beside the greedy
        # one) must not be trained on.
        distinct = list(dict.fromkeys(prompts))  # in the shuffled order
        num_val = max(round(self.val_fraction * len(distinct)), 1) if self.val_fraction > 0 and len(distinct) > 1 else 0
        held_out = set(distinct[:num_val])
        self.train_examples = [ex for ex, prompt in zip(examples, prompts, strict=True) if prompt not in held_out]
        if self.val_data is None:
            self.val_examples = [ex for ex, prompt in zip(examples, prompts, strict=True) if prompt in held_out]
        else:
            trained = set(prompts) - held_out
            val_examples, val_prompts = self._read(tokenizer, self.val_data)
            self.val_examples = [
                example for example, prompt in zip(val_examples, val_prompts, strict=True) if prompt not in trained
            ]
        self.train_batches = self._batches(self.train_examples)
        self.val_batches = self._batches(self.val_examples)

    def _read(self, tokenizer: PreTrainedTokenizerBase, data: str) -> tuple[list, list[str]]:
        """The usable examples of `data`, encoded, and the prompt each answers; a warning counts the rest."""
        rows = read_rows(data, self.split)
        examples, prompts, skipped = [], [], Counter()
        for row in rows:
            example = to_example(row)
            encoded = f"not {FORMATS}" if example is None else encode(tokenizer, example, self.max_length)
            if isinstance(encoded, str):
                skipped[encoded] += 1
            else:
                examples.append(encoded)
                prompts.append(prompt_of(example))
        if not examples:
            raise ValueError(f"No usable row in {data!r} ({len(rows)} rows; skipped: {dict(skipped)}).")
        if skipped:
            warnings.warn(
                f"Skipped {sum(skipped.values())} of {len(rows)} rows of {data!r}: {dict(skipped)}", stacklevel=3
            )
        return examples, prompts

    def _batches(self, examples):
        return [
            [examples[i] for i in batch]
            for batch in bucket([len(ids) for ids, _ in examples], self.batch_size, self.seed)
        ]

    def state_dict(self) -> dict:
        """For checkpoints taken while fitting: the epoch training was in, how many of its batches each of how many
        processes had trained on (an epoch's end counts as the next one's start)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        epoch, done = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches": done, "processes": self._shares()["num_replicas"]}

    def load_state_dict(self, state: dict) -> None:
        self.resume = state

    def train_dataloader(self) -> DataLoader:
        shares = self._shares()
        epoch, skip = self.resume.get("epoch", 0), self.resume.get("batches", 0)
        if skip and self.resume["processes"] != shares["num_replicas"]:
            raise ValueError(
                f"The checkpoint was taken {skip} batches into epoch {epoch} on {self.resume['processes']} processes; "
                f"this run has {shares['num_replicas']}: resume it on as many (devices x nodes), or from a checkpoint "
                "taken at an epoch's end."
            )
        self.resume = {}  # once: a later fit of this data module starts afresh
        # Each item is one pre-grouped batch (batch_size=None), so the sampler deals out whole batches.
        order = EpochOrder(self.train_batches, shares["num_replicas"], shares["rank"], self.seed, epoch, skip)
        return DataLoader(self.train_batches, batch_size=None, sampler=order, **self._loading())

    def read_features(self, features: Features) -> None:
        """Put in every batch its examples' hidden states from `features` (the drafter's module opens them in its
        `setup`, before the loaders are made), read by a worker process a few batches ahead of the steps."""
        self.features = features

    def _loading(self) -> dict:
        """How batches are made: collated in this process, or with hidden states from disk, in a worker's."""
        loading = {"collate_fn": partial(collate, pad_id=self.pad_id, features=self.features)}
        if self.features is not None:
            loading |= {"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True}
        return loading

    def _shares(self) -> dict:  # how many processes share the batches, and which one this is
        return (self.trainer.distributed_sampler_kwargs if self.trainer else None) or {"num_replicas": 1, "rank": 0}

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_batches, batch_size=None, **self._loading())


def add_held_out_arguments(parser, required: bool = True) -> None:
    """Options naming the held-out answers of a training run: its data (which decides the held-out prompts), the
    answers to read for them, its val_fraction and seed."""
    parser.add_argument("--data", required=required, help="the training data (it decides the held-out prompts)")
    parser.add_argument("--val-data", help="read these answers to the held-out prompts (default: --data's)")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (it shuffles the split)")


def held_out(args, base_model: str) -> DrafterDataModule:
    """The data module of `add_held_out_arguments`' options, set up: its `val_examples` are the held-out answers."""
    data = DrafterDataModule(
        args.data,
        base_model,
        max_length=args.max_length,
        val_fraction=args.val_fraction,
        val_data=args.val_data,
        seed=args.seed,
    )
    data.setup("validate")
    return data
