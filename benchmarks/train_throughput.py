"""Training throughput and memory, online against offline features, measured in one run: tokens/s of a training
epoch that runs the base model in every step (online) against one that reads the base's hidden states from disk
(`--model.features`, offline), over the same batches, and the time to write those states; then the peak resident
memory of an offline run (a fresh process each) over 1x and 4x the batches.

    python benchmarks/train_throughput.py --data data/distilled --head_type eagle
"""

import argparse
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from train_memory import resident  # beside this script

from mtp.base import DEFAULT_BASE
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Loss


class StepTimer(Callback):
    """Seconds and tokens of the training steps of each epoch, its first (warm-up) step left out."""

    def __init__(self):
        self.seconds, self.tokens = defaultdict(float), defaultdict(int)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx > 0:
            self.seconds[trainer.current_epoch] += time.perf_counter() - self.start
            self.tokens[trainer.current_epoch] += int(batch["attention_mask"].sum())


class Batches(DrafterDataModule):
    """The data module over its first `count` training batches only (offline features are written for them), which
    both runs read in the same order (a first epoch's)."""

    def __init__(self, count: int, **kwargs):
        super().__init__(**kwargs)
        self.count = count

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_batches = self.train_batches[: self.count]
        self.train_examples = [example for batch in self.train_batches for example in batch]
        self.val_examples = []


def fit(args, count: int, features: str | None) -> tuple[float, float, int]:
    """One epoch over `count` batches: (seconds of the setup, that is writing the features; seconds of the steps but
    the first; tokens of the steps but the first)."""
    data = Batches(
        count,
        data=args.data,
        base_model=args.base_model,
        batch_size=args.batch_size,
        max_length=args.max_length,
        val_fraction=0,
    )
    drafting = DrafterSettings(args.head_type, args.num_heads, draft_vocab=args.draft_vocab)
    module = DrafterModule(args.base_model, drafting, Loss(teacher=True), features=features)
    timer, setup_s = StepTimer(), []

    class SetupTimer(Callback):
        def on_fit_start(self, trainer, pl_module):  # after every setup: the module's writes the features
            setup_s.append(time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(
            max_epochs=1,
            callbacks=[timer, SetupTimer()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=folder,
            limit_val_batches=0,
        )
        start = time.perf_counter()
        trainer.fit(module, data)
    return setup_s[0], timer.seconds[0], timer.tokens[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_model", default=DEFAULT_BASE)
    parser.add_argument("--data", required=True)
    parser.add_argument("--head_type", default="eagle", choices=["medusa", "hydra", "eagle"])
    parser.add_argument("--num_heads", type=int, default=3)
    parser.add_argument("--draft_vocab", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=20, help="timed batches (one more warms up)")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument(
        "--memory",
        type=int,
        help="only: write the states of this many batches to --features and "
        "train one offline epoch on them, then print this process's peak resident bytes",
    )
    parser.add_argument("--features", help="with --memory: the folder for the states")
    args = parser.parse_args()
    if args.memory:
        fit(args, args.memory, args.features)
        print(resident("VmHWM"))  # this program's peak (ru_maxrss would count the parent's memory at the fork)
        return

    count = args.batches + 1
    with tempfile.TemporaryDirectory() as folder:
        _, online_s, tokens = fit(args, count, None)
        write_s, _, _ = fit(args, count, folder)  # writes the features (its epoch reads the page cache's copy)
        _, offline_s, _ = fit(args, count, folder)  # reads them, written already
    peaks = {}
    for times in (1, 4):
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, __file__, *sys.argv[1:], "--memory", str(times * count), "--features", folder]
            peaks[times] = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])
    print(
        f"{args.head_type}, {args.batches} batches of {args.batch_size}, {tokens} tokens, "
        f"threads={torch.get_num_threads()}"
    )
    print(f"online epoch (the base in every step): {tokens / online_s:8.0f} tokens/s ({online_s:.1f} s)")
    print(f"offline epoch (states from disk):      {tokens / offline_s:8.0f} tokens/s ({offline_s:.1f} s)")
    print(f"offline epoch time over online:        {offline_s / online_s:.2f}")
    print(f"writing the states (setup, all {count} batches): {write_s:.1f} s")
    print(
        f"peak resident memory, offline, {count} / {4 * count} batches: {peaks[1] / 2**30:.2f} / "
        f"{peaks[4] / 2**30:.2f} GiB ({peaks[4] / peaks[1]:.2f}x)"
    )


if __name__ == "__main__":
    main()
