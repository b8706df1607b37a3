"""Training throughput: tokens/s of a Lightning training step of the heads against a plain no-grad forward
of the base model over the same batches, measured in one run; and a second epoch over the same batches
with the base model's hidden states cached (`--model.cache_hidden true`), against the first.

    python benchmarks/train_throughput.py --data data/distilled/sharegpt-greedy-256
"""

import argparse
import tempfile
import time
from collections import defaultdict
from itertools import islice

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from mtp.base import DEFAULT_BASE
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule


class StepTimer(Callback):
    """Seconds of the training steps of each epoch, its first (warm-up) step left out."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx > 0:
            self.seconds[trainer.current_epoch] += time.perf_counter() - self.start


def fit_seconds(module, batches, epochs) -> dict[int, float]:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(max_epochs=epochs, callbacks=[timer], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder)  # fmt: skip
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch))
    return timer.seconds


def timed(function, batches) -> float:
    """Seconds for `function` over batches[1:] (batches[0] warms up)."""
    function(batches[0])
    start = time.perf_counter()
    for batch in batches[1:]:
        function(batch)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_model", default=DEFAULT_BASE)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batches", type=int, default=20, help="timed batches (one more warms up)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--lm_head", default="shared", choices=["shared", "own"])
    args = parser.parse_args()

    data = DrafterDataModule(args.data, args.base_model, batch_size=args.batch_size, max_length=args.max_length,
                           val_fraction=0)  # fmt: skip
    data.setup("fit")
    batches = list(islice(iter(data.train_dataloader()), args.batches + 1))
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches[1:])
    module = DrafterModule(args.base_model, num_heads=args.num_heads, lm_head=args.lm_head)
    base = module.base_model

    @torch.no_grad()
    def forward(batch):  # what plain inference costs: the whole base model, logits included
        base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)

    @torch.no_grad()
    def backbone(batch):  # the part of a training step that cached hidden states would skip
        base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)

    forward_s, backbone_s = timed(forward, batches), timed(backbone, batches)
    train_s = fit_seconds(module, batches, epochs=1)[0]
    cached = DrafterModule(args.base_model, num_heads=args.num_heads, lm_head=args.lm_head, cache_hidden=True)
    cached_s = fit_seconds(cached, batches, epochs=2)

    print(f"{args.batches} batches of {args.batch_size}, {tokens} tokens, threads={torch.get_num_threads()}")
    print(f"plain no-grad base forward:        {tokens / forward_s:8.0f} tokens/s")
    print(f"training step (Lightning):         {tokens / train_s:8.0f} tokens/s")
    print(f"training / forward throughput ratio: {forward_s / train_s:.2f}")
    print(f"base forward share of a training step: {backbone_s / train_s:.0%}")
    first, second = tokens / cached_s[0], tokens / cached_s[1]
    print(f"cache_hidden, epoch 1 / epoch 2:   {first:8.0f} / {second:.0f} tokens/s")
    print(f"cache_hidden epoch 2 over plain training: {train_s / cached_s[1]:.2f}x")


if __name__ == "__main__":
    main()
