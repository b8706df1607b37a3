"""Train heads: `python train.py fit --config configs/<recipe>.yaml [--key value ...]`."""

import torch
from lightning.pytorch.cli import LightningCLI

from mtp.cli import user_errors
from mtp.data import HeadsDataModule
from mtp.module import HeadsModule


class HeadsCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("model.base_model", "data.base_model")


@user_errors
def main(args=None) -> HeadsCLI:
    precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    return HeadsCLI(HeadsModule, HeadsDataModule, trainer_defaults={"precision": precision}, args=args)


if __name__ == "__main__":
    main()
