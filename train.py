"""Train heads: `python train.py fit --config configs/<recipe>.yaml [--key value ...]`."""

import torch
from lightning.pytorch.cli import LightningCLI

from mtp.tools.cli import user_errors
from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule


class DrafterCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("model.base_model", "data.base_model")
        parser.link_arguments("trainer.precision", "model.precision")  # the base loads in its compute dtype


@user_errors
def main(args=None) -> DrafterCLI:
    precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    return DrafterCLI(DrafterModule, DrafterDataModule, trainer_defaults={"precision": precision}, args=args)


if __name__ == "__main__":
    main()
