"""Heads side by side on the same held-out answers: per-head top-1 / top-5 (teacher forcing, the training
module's own validation step) and the expected tau of the tree grown from those rank accuracies at 4 .. 64
nodes (see `mtp.sizing`). The held-out prompts are those a training run with the same data, val_fraction and
seed held out.

    python benchmarks/heads_accuracy.py --heads heads/smollm2-135m-instruct runs/.../heads \
        --data data/distilled --val-data data/distilled/sharegpt-greedy-256
"""

import argparse

import lightning as L
import torch

from mtp.base import load_tokenizer
from mtp.data import HeadsDataModule, add_held_out_arguments, held_out
from mtp.folder import Drafter
from mtp.module import HeadsModule
from mtp.tree import grow_tree

SIZES = (4, 8, 16, 32, 64)


def rank_accuracy(heads_path: str, data: HeadsDataModule) -> torch.Tensor:
    """(K, RANKS): how often head k's rank-r guess is the target, over `data`'s validation answers."""
    heads = Drafter.from_pretrained(heads_path)
    config = heads.config
    module = HeadsModule(
        config.base_model, config.num_heads, config.num_layers, config.lm_head, head_type=config.head_type
    )
    heads.check_base(config.base_model, module.base_model, load_tokenizer(config.base_model))
    module.heads = heads  # its draft vocabulary, if any, comes with its config
    L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
        module, datamodule=data, verbose=False
    )
    return module.rank_accuracy.compute()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, help="heads folders")
    add_held_out_arguments(parser)
    args = parser.parse_args()
    first = Drafter.from_pretrained(args.heads[0]).config
    base, num_heads = first.base_model, first.num_heads
    data = held_out(args, base)
    tokens = sum(int(mask.sum()) for _, mask, _ in data.val_examples)
    print(f"{len(data.val_examples)} held-out answers, {tokens} answer tokens")
    print("| heads | " + " | ".join(f"head {k} top-1 / top-5" for k in range(num_heads)) + " | "
          + " | ".join(f"tau @ {n}" for n in SIZES) + " |")  # fmt: skip
    print("| --- " * (1 + num_heads + len(SIZES)) + "|")
    for path in args.heads:
        accuracy = rank_accuracy(path, data)
        _, expected = grow_tree(accuracy.tolist(), max(SIZES))
        heads = " | ".join(f"{a[0]:.3f} / {a[:5].sum():.3f}" for a in accuracy)
        print(f"| {path} | {heads} | " + " | ".join(f"{expected[n - 1]:.2f}" for n in SIZES) + " |")


if __name__ == "__main__":
    main()
