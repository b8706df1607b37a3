"""Data-parallel training: 2 CPU processes (gloo), each taking every other batch of the data module's own order,
reach the weights that 1 process reaches on the same batches accumulated two at a time, for every kind of drafter,
with the teacher loss and a draft vocabulary (chosen on each process from the same data), and with hidden states that
both processes wrote to disk before training."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, TINY_BASE, TINY_CHAT

# Run as a script: Lightning's DDP launcher starts the second process by running it again.
SCRIPT = """
import sys

import lightning as L
import torch

from mtp.training.data import DrafterDataModule
from mtp.training.module import DrafterModule
from mtp.training.settings import DrafterSettings, Loss, Optim


base, chat, devices, out, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
draft_vocab, teacher = (0, False) if kind == "medusa" else (60, kind == "hydra")
L.seed_everything(0)
module = DrafterModule(base, DrafterSettings(kind.split("-")[0], 3, draft_vocab=draft_vocab), Loss(teacher=teacher),
                       Optim(lr=1e-2, warmup_steps=0), features=out + "/features" if kind == "eagle-features" else None)
module.drafter.save_pretrained(out + "/start")  # the same on both processes: seeded
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=2,
                    accumulate_grad_batches=3 - devices, limit_val_batches=0, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
trainer.fit(module, DrafterDataModule(chat, base, batch_size=2, val_fraction=0))
if torch.distributed.is_initialized():  # as train.py: left to the interpreter's exit, gloo's threads could abort it
    torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle-features"])  # features: written by 2, then read
def test_two_processes_reach_the_weights_one_process_reaches_on_the_same_batches(tmp_path, kind):
    script = tmp_path / "train_tiny.py"
    script.write_text(SCRIPT)
    found = {}
    for devices in (1, 2):
        out = tmp_path / f"devices-{devices}"
        command = [sys.executable, str(script), TINY_BASE, TINY_CHAT, str(devices), str(out), kind]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        found[devices] = load_file(out / "heads" / "model.safetensors")
    start = load_file(tmp_path / "devices-1" / "start" / "model.safetensors")
    assert found[1].keys() == found[2].keys()
    for name, weight in found[1].items():
        torch.testing.assert_close(found[2][name], weight, rtol=1e-4, atol=1e-5, msg=name)
    trained = [name for name, weight in found[1].items() if name in start and not torch.equal(weight, start[name])]
    assert len(trained) >= 2, trained  # the steps moved the drafter
    if kind.endswith("features"):  # each process wrote its share
        assert len(list((tmp_path / "devices-2" / "features").glob("rank-0000[01]/part-*.safetensors"))) == 2
