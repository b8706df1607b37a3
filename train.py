"""Train heads: `python train.py fit --config configs/<recipe>.yaml [--key value ...]`."""

import os

import torch
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


@user_errors
def main(args=None) -> DrafterCLI:
    defaults = {"precision": "bf16-mixed" if torch.cuda.is_available() else "32-true", "num_nodes": launched_nodes()}
    cli = DrafterCLI(DrafterModule, DrafterDataModule, trainer_defaults=defaults, args=args)
    if torch.distributed.is_initialized():  # left to the interpreter's exit, gloo's threads could abort it (SIGABRT)
        torch.distributed.destroy_process_group()
    return cli


if __name__ == "__main__":
    main()
