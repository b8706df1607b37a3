"""Peak memory of training against the estimate that training prints before its first step, measured in one run:
a few steps on the longest batches of the data (every sequence cut at max_length, the estimate's batch), then the
peak: on a GPU the largest allocation by torch, on a CPU the peak resident memory of the process less what it held
before the model was made (so that the interpreter, the libraries and the data are left out).

    python benchmarks/train_memory.py --data data/distilled --head_type hydra --batch_size 8 --max_length 256
"""

import argparse
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from mtp.base import DEFAULT_BASE
from mtp.training.data import DrafterDataModule
from mtp.training.memory import estimate, memory_line
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Loss


class Longest(DrafterDataModule):
    """The data module over its `steps` batches of the longest examples only."""

    def __init__(self, steps: int, **kwargs):
        super().__init__(**kwargs)
        self.steps = steps

    def setup(self, stage: str) -> None:
        super().setup(stage)
        longest = sorted(self.train_examples, key=lambda example: -len(example[0]))[: self.steps * self.batch_size]
        self.train_batches = [longest[i : i + self.batch_size] for i in range(0, len(longest), self.batch_size)]
        self.train_examples, self.val_examples = longest, []


class StepTimer(Callback):
    """Seconds and tokens of the training steps but the first (it warms up)."""

    seconds, tokens = 0.0, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx > 0:
            self.seconds += time.perf_counter() - self.start
            self.tokens += int(batch["attention_mask"].sum())


def resident(field: str = "VmRSS") -> int:
    """The process's resident memory now (`VmRSS`) or at its peak (`VmHWM`: this program's own, where `ru_maxrss`
    would also count the parent's memory that a child had before it ran this program), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_model", default=DEFAULT_BASE)
    parser.add_argument("--data", required=True)
    parser.add_argument("--head_type", default="hydra", choices=["medusa", "hydra", "eagle"])
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--draft_vocab", type=int, default=8192)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="the first warms up the step timer")
    parser.add_argument("--features", action="store_true", help="train on hidden states written to disk first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    data = Longest(
        args.steps,
        data=args.data,
        base_model=args.base_model,
        batch_size=args.batch_size,
        max_length=args.max_length,
        val_fraction=0,
    )
    data.setup("fit")
    data.setup = lambda stage: None  # set up once, before the baseline
    cuda = args.device.startswith("cuda")
    before = resident()
    with tempfile.TemporaryDirectory() as folder:
        drafting = DrafterSettings(args.head_type, args.num_heads, draft_vocab=args.draft_vocab)
        features = folder if args.features else None
        module = DrafterModule(
            args.base_model, drafting, Loss(teacher=True), features=features, precision=args.precision
        )
        timer = StepTimer()
        trainer = L.Trainer(
            max_steps=args.steps,
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            logger=False,
            callbacks=[timer],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=folder,
            precision=args.precision,
        )
        trainer.fit(module, data)
        found = estimate(module, args.batch_size, args.max_length)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resident("VmHWM") - before
    print(memory_line(found, args.batch_size, args.max_length))
    print(
        f"measured peak ({'torch allocations' if cuda else 'resident memory over the baseline'}): "
        f"{peak / 1e6:,.0f} MB; measured / estimate: {peak / found['total']:.2f}"
    )
    if timer.seconds:
        print(f"training steps but the first: {timer.tokens / timer.seconds:.0f} tokens/s")


if __name__ == "__main__":
    main()
