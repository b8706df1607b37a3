"""Train heads: `python train.py fit --config configs/<recipe>.yaml [--key value ...]`."""

import os
import sys

import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from mtp.tools.cli import user_errors
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule


class DrafterCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("model.base_model", "data.base_model")
        parser.link_arguments("trainer.precision", "model.precision")  # the base loads in its compute dtype


def launched_nodes() -> int:
    """The nodes torchrun or SLURM's srun started this run on (its processes over those of one node), else 1: a
    recipe's command runs unchanged on one node and on several."""
    if "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    return int(os.environ.get("SLURM_STEP_NUM_NODES", 1))  # set for the processes of an srun step only


# a recipe's `model:` keys that now sit in a group of their own (`model.<group>.<key>`)
MOVED = {
    "head_type": "drafter.head_type",
    "num_heads": "drafter.num_heads",
    "num_layers": "drafter.num_layers",
    "lm_head": "drafter.lm_head",
    "feature_layers": "drafter.feature_layers",
    "draft_vocab": "drafter.draft_vocab",
    "init_heads": "drafter.init",
    "loss_decay": "loss.decay",
    "loss_weights": "loss.weights",
    "teacher": "loss.teacher",
    "feature_noise": "loss.feature_noise",
    "feature_loss": "loss.feature_loss",
    "loss_chunk": "loss.chunk",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "warmup_steps": "optim.warmup_steps",
}


def moved_keys(args: list[str]) -> list[str]:
    """`model.<key>` of the command line and its config files that moved into a group, as `old -> new`."""
    found = [arg.removeprefix("--model.").split("=")[0] for arg in args if arg.startswith("--model.")]
    for at, arg in enumerate(args):
        path = arg.removeprefix("--config=") if arg.startswith("--config=") else None
        path = args[at + 1] if arg == "--config" and at + 1 < len(args) else path
        if path and os.path.isfile(path):
            model = (yaml.safe_load(open(path)) or {}).get("model") or {}
            found += list(model) if isinstance(model, dict) else []
    return [f"model.{key} -> model.{MOVED[key]}" for key in found if key in MOVED]


@user_errors
def main(args=None) -> DrafterCLI:
    defaults = {"precision": "bf16-mixed" if torch.cuda.is_available() else "32-true", "num_nodes": launched_nodes()}
    if moved := moved_keys(sys.argv[1:] if args is None else list(args)):
        raise ValueError(
            f"the drafter's, the loss's and the optimizer's settings are groups of model: now; "
            f"rename {', '.join(moved)} (as in configs/tiny.yaml)."
        )
    cli = DrafterCLI(DrafterModule, DrafterDataModule, trainer_defaults=defaults, args=args)
    if torch.distributed.is_initialized():  # left to the interpreter's exit, gloo's threads could abort it (SIGABRT)
        torch.distributed.destroy_process_group()
    return cli


if __name__ == "__main__":
    main()
