"""Drafters side by side on the same held-out answers: per-head (per-depth) top-1 / top-5 (teacher forcing, the
training module's own validation step; a feature-level drafter unrolled to --depths on its own features) and the
expected tau of the tree grown from those rank accuracies at 4 .. 64
nodes (see `mtp.tools.sizing`). The held-out prompts are those a training run with the same data, val_fraction and
seed held out.

    python benchmarks/heads_accuracy.py --drafter heads/smollm2-135m-instruct runs/.../heads \
        --data data/distilled --val-data data/distilled/sharegpt-greedy-256
"""

import argparse

import lightning as L
import torch

from mtp.base import load_tokenizer
from mtp.decoding.tree import grow_tree
from mtp.drafters.contract import Drafter
from mtp.training.data import DrafterDataModule, add_held_out_arguments, held_out
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings

SIZES = (4, 8, 16, 32, 64)


def rank_accuracy(heads_path: str, data: DrafterDataModule, depths: int) -> torch.Tensor:
    """(K, RANKS): how often head k's rank-r guess is the target, over `data`'s validation answers; a drafter that
    drafts as deep as asked (`eagle`) is scored at `depths` depths."""
    heads = Drafter.from_pretrained(heads_path)
    config = heads.config
    if heads.max_depth is None:
        config.num_heads = depths
    drafting = DrafterSettings(
        config.head_type,
        config.num_heads,
        config.num_layers,
        config.lm_head,
        feature_layers=config.feature_layers or None,
    )
    module = DrafterModule(config.base_model, drafting)
    heads.check_base(config.base_model, module.base_model, load_tokenizer(config.base_model))
    module.drafter = heads  # its draft vocabulary, if any, comes with its config
    L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
        module, datamodule=data, verbose=False
    )
    return module.rank_accuracy.compute()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", nargs="+", required=True, help="drafter folders")
    parser.add_argument("--depths", type=int, default=5, help="depths a feature-level drafter is scored at")
    add_held_out_arguments(parser)
    args = parser.parse_args()
    drafters = [Drafter.from_pretrained(path) for path in args.drafter]
    base = drafters[0].config.base_model
    num_heads = max(args.depths if d.max_depth is None else d.config.num_heads for d in drafters)
    data = held_out(args, base)
    tokens = sum(int(mask.sum()) for _, mask in data.val_examples)
    print(f"{len(data.val_examples)} held-out answers, {tokens} answer tokens")
    print(
        "| heads | "
        + " | ".join(f"head {k} top-1 / top-5" for k in range(num_heads))
        + " | "
        + " | ".join(f"tau @ {n}" for n in SIZES)
        + " |"
    )
    print("| --- " * (1 + num_heads + len(SIZES)) + "|")
    for path in args.drafter:
        accuracy = rank_accuracy(path, data, args.depths)
        _, expected = grow_tree(accuracy.tolist(), max(SIZES))
        heads = " | ".join([f"{a[0]:.3f} / {a[:5].sum():.3f}" for a in accuracy] + ["-"] * (num_heads - len(accuracy)))
        print(f"| {path} | {heads} | " + " | ".join(f"{expected[n - 1]:.2f}" for n in SIZES) + " |")


if __name__ == "__main__":
    main()
