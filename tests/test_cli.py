import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import ROOT
from train import main

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(config), "--print_config"])
    assert done.value.code == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"]["base_model"] and "base_model" not in resolved["data"]  # linked from the model


def test_an_unknown_config_key_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("num_layers:", "num_layayers:"))
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(config)])
    assert done.value.code != 0
    assert "num_layayers" in capsys.readouterr().err


def tiny_run(tmp_path, *overrides):
    main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.logger.init_args.save_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false", *overrides])  # fmt: skip
    (run,) = (tmp_path / "lightning_logs").iterdir()
    return run


def test_tiny_recipe_trains_20_steps_and_exports_heads_without_base_weights(tmp_path):
    run = tiny_run(tmp_path)
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 20  # resolved config saved
    assert sorted(p.name for p in (run / "heads").iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(run / "heads" / "model.safetensors")
    assert all(name.startswith(("blocks.", "projections.")) for name in tensors)
    assert next((run / "checkpoints").glob("*step=20.ckpt"))
    logged = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {f"{stage}/head{k}_top{top}" for stage in ("train", "val") for k in range(4) for top in (1, 5)} <= set(
        logged
    )


def test_fast_dev_run_of_the_tiny_recipe(tmp_path):
    main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.fast_dev_run", "true",
          "--trainer.logger.init_args.save_dir", str(tmp_path),
          "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert not any(tmp_path.iterdir())  # a smoke run writes no logs, checkpoints or heads


def test_command_line_overrides_reach_the_model(tmp_path):
    run = tiny_run(tmp_path, "--trainer.max_steps", "2", "--model.num_heads", "2", "--model.lm_head", "shared")
    heads = yaml.safe_load((run / "heads" / "config.json").read_text())
    assert (
        heads["num_heads"] == 2
        and heads["lm_head"] == "shared"
        and heads["base_model"] == "configs/models/tiny-llama/config.json"
    )


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_the_base_loads_in_the_precisions_compute_dtype_and_the_drafter_trains_in_float32(tmp_path, precision, dtype):
    cli = main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.precision", precision,
                "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
                "--trainer.enable_progress_bar", "false"])  # fmt: skip
    assert {p.dtype for p in cli.model.base_model.parameters()} == {dtype}
    assert {p.dtype for p in cli.model.heads.parameters()} == {torch.float32} and cli.trainer.global_step == 2


@pytest.mark.parametrize("lora", [[], ["--model.lora.r", "4", "--model.lora.target_modules", "[q_proj, v_proj]"]],
                         ids=["frozen-base", "lora"])  # fmt: skip
def test_two_process_ddp_on_cpu(tmp_path, lora):
    command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
               "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
               "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path), *lora]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world_size: 2" in done.stderr or "MEMBER: 2/2" in done.stderr
    (run,) = Path(tmp_path, "lightning_logs").iterdir()
    assert (run / "heads" / "model.safetensors").is_file()
    assert (run / "heads" / "adapter_model.safetensors").is_file() == bool(lora)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("gpu-*.yaml")), ids=lambda path: path.name)
def test_every_gpu_recipe_instantiates_and_runs_a_step_with_the_tiny_model_swapped_in(config, tmp_path):
    """Everything a GPU recipe sets but the hardware, the model and the data: heads, loss, optimizer, schedule."""
    recipe = yaml.safe_load(config.read_text())
    assert recipe["trainer"]["precision"] == "bf16-mixed" and recipe["trainer"]["devices"] >= 2
    assert recipe["data"]["distill"]["prompts"]  # self-distilled, by a datasets id
    cli = main(["fit", "--config", str(config), "--model.base_model", str(ROOT / "configs" / "models" / "tiny-llama" /
                "config.json"), "--data.data", str(ROOT / "data" / "tiny_chat.jsonl"), "--data.distill", "null",
                "--data.val_fraction", "0.125", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                "--trainer.strategy", "auto", "--trainer.precision", "32-true", "--trainer.fast_dev_run", "true",
                "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert cli.trainer.state.finished and cli.trainer.global_step == 1
    heads = cli.model.heads.config
    assert heads.num_heads == recipe["model"]["num_heads"] and heads.lm_head == recipe["model"]["lm_head"]
    assert heads.head_type == recipe["model"].get("head_type", "medusa")


def test_the_gpu_check_runs_in_its_cpu_mode(tmp_path):
    """scripts/gpu_check.sh with MTP_DEVICE=cpu: the same five steps as on a GPU, smaller, so it cannot rot."""
    env = os.environ | {"MTP_DEVICE": "cpu", "OUT": str(tmp_path), "MTP_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "A step's cost against the fastest plain step" in done.stdout and "| overall | 1 |" in done.stdout
    assert "Memory per device (estimate)" in done.stdout and "measured / estimate" in done.stdout
    assert "| nodes | eager ms | compiled ms |" in done.stdout and "\n| 4 | " in done.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["summary"]["overall"]["mismatches"] == 0
    assert (tmp_path / "tiny" / "lightning_logs" / "version_0" / "heads" / "config.json").is_file()
