import json
import os
import socket
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
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            *overrides,
        ]
    )
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


def test_fast_dev_run_of_the_tiny_recipe_trains_and_validates_one_batch_and_writes_nothing(tmp_path):
    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.fast_dev_run",
            "true",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    trained = [p for p in cli.model.drafter.parameters() if p.requires_grad]
    assert cli.trainer.global_step == 1 and len(cli.trainer.optimizers[0].state) == len(trained)  # one AdamW update
    # of every trainable parameter (a training step that returned no loss would still count a step, but update none)
    metrics = cli.trainer.callback_metrics
    assert {"train/loss", "val/loss"} <= set(metrics) and all(bool(value.isfinite()) for value in metrics.values())
    assert not any(tmp_path.iterdir())  # a smoke run writes no logs, checkpoints or heads


def test_command_line_overrides_reach_the_model(tmp_path):
    shared = ["--model.drafter.num_heads", "2", "--model.drafter.lm_head", "shared"]
    run = tiny_run(tmp_path, "--trainer.max_steps", "2", *shared)
    heads = yaml.safe_load((run / "heads" / "config.json").read_text())
    assert (
        heads["num_heads"] == 2
        and heads["lm_head"] == "shared"
        and heads["base_model"] == "configs/models/tiny-llama/config.json"
    )


def trained_parameters(cli) -> list[torch.Tensor]:
    """What the optimizer updates, after it checked that each is one of the drafter's trainable parameters."""
    trained = [p for optimizer in cli.trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in trained} == {id(p) for p in cli.model.drafter.parameters() if p.requires_grad}
    return trained


@pytest.mark.parametrize(
    "precision, kind, draft_vocab",
    [
        ("32-true", "medusa", None),
        ("bf16-mixed", "medusa", None),
        ("bf16-mixed", "hydra", 64),
        ("bf16-mixed", "eagle", None),
        ("bf16-mixed", "eagle", 64),
    ],
)
def test_the_base_loads_in_the_precisions_compute_dtype_and_the_drafter_trains_in_float32(
    tmp_path, precision, kind, draft_vocab
):
    """Every parameter the optimizer holds is float32, the draft vocabulary's lm_head (made in setup) included."""
    vocab = ["--model.drafter.draft_vocab", str(draft_vocab)] if draft_vocab else []
    cli = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--trainer.precision",
            precision,
            "--model.drafter.head_type",
            kind,
            *vocab,
            "--trainer.max_steps",
            "2",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    assert {p.dtype for p in cli.model.base_model.parameters()} == {dtype}
    assert {p.dtype for p in trained_parameters(cli)} == {torch.float32} and cli.trainer.global_step == 2


@pytest.mark.parametrize(
    "lora",
    [[], ["--model.lora.r", "4", "--model.lora.target_modules", "[q_proj, v_proj]"]],
    ids=["frozen-base", "lora"],
)
@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path, lora):
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.strategy",
        "ddp",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.max_steps",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        *lora,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world_size: 2" in done.stderr or "MEMBER: 2/2" in done.stderr
    (run,) = Path(tmp_path, "lightning_logs").iterdir()
    assert (run / "heads" / "model.safetensors").is_file()
    assert (run / "heads" / "adapter_model.safetensors").is_file() == bool(lora)


def two_process_run(folder: Path, *callbacks: dict) -> subprocess.CompletedProcess:
    """The tiny recipe on 2 CPU processes for 8 steps (4 batches an epoch each), restartable as the GPU recipes are:
    a checkpoint every 2 steps in `folder`/checkpoints, `ckpt_path: last`; with `callbacks` besides."""
    folder.mkdir(exist_ok=True)
    checkpoints = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(folder / "checkpoints"), "every_n_train_steps": 2, "save_last": True},
    }
    (folder / "restart.yaml").write_text(
        yaml.safe_dump({"ckpt_path": "last", "trainer": {"callbacks": [checkpoints, *callbacks]}})
    )
    command = [
        sys.executable,
        "train.py",
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--config",
        str(folder / "restart.yaml"),
        "--trainer.strategy",
        "ddp",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.max_steps",
        "8",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(folder),
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def heads_of(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "heads" / "model.safetensors")


@pytest.mark.slow
def test_a_two_process_run_killed_mid_epoch_resumes_by_itself_and_reaches_the_weights_of_one_never_stopped(tmp_path):
    """Killed (SIGKILL, every process) as step 7 starts, 3 batches into the second epoch, the last checkpoint at
    step 6; the same command again resumes there and ends with the weights of a run that was never stopped."""
    never = two_process_run(tmp_path / "never")
    assert never.returncode == 0, never.stderr[-3000:]
    killed = two_process_run(tmp_path / "killed", {"class_path": "tests.conftest.Killed", "init_args": {"step": 7}})
    assert killed.returncode != 0 and not (tmp_path / "killed" / "lightning_logs" / "version_0" / "heads").exists()
    assert torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    again = two_process_run(tmp_path / "killed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Restoring states from the checkpoint path" in again.stdout + again.stderr
    expected = heads_of(tmp_path / "never" / "lightning_logs" / "version_0")
    resumed = heads_of(tmp_path / "killed" / "lightning_logs" / "version_1")
    assert expected.keys() == resumed.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=1e-6, msg=name)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(folders: list[Path]) -> list[subprocess.CompletedProcess]:
    """The tiny recipe with the eagle drafter and features on disk, 3 steps, launched as on two nodes of one process
    each (two torchrun agents on this machine), node n writing in `folders[n]` (the same folder for both: one both
    nodes see)."""
    port, agents = free_port(), []
    for node, folder in enumerate(folders):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "train.py",
            "fit",
            "--config",
            "configs/tiny.yaml",
            "--model.drafter.head_type",
            "eagle",
            "--model.features",
            str(folder / "features"),
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.strategy",
            "ddp",
            "--trainer.max_steps",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(folder),
        ]
        agents.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    return done


@pytest.mark.slow
def test_two_nodes_train_as_two_processes_on_one_and_stop_at_once_on_node_local_folders(tmp_path):
    """torchrun on two "nodes" (the node count from its environment, as the recipes' commands run): on a shared
    folder, the heads of 2 processes on one node; on a folder of each node's own, every process stops before any
    work with one line naming the folders (it used to abort one node and leave the other waiting 300 s)."""
    together = two_nodes([tmp_path / "together"] * 2)
    assert all(node.returncode == 0 for node in together), together[1].stderr[-3000:]
    command = [
        sys.executable,
        "train.py",
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--model.drafter.head_type",
        "eagle",
        "--model.features",
        str(tmp_path / "one" / "features"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.max_steps",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "one"),
    ]
    one = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    expected = heads_of(tmp_path / "one" / "lightning_logs" / "version_0")
    for name, weight in heads_of(tmp_path / "together" / "lightning_logs" / "version_0").items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6, msg=name)

    local = two_nodes([tmp_path / "node0", tmp_path / "node1"])
    for node, folder in zip(local, ["node0", "node1"], strict=True):
        assert node.returncode != 0 and "are not shared by its 2 nodes" in node.stderr, node.stderr[-3000:]
        assert not list((tmp_path / folder).rglob("*.safetensors"))  # no features, no heads


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("gpu-*.yaml")), ids=lambda path: path.name)
def test_every_gpu_recipe_instantiates_and_runs_a_step_with_the_tiny_model_swapped_in(config, tmp_path):
    """Everything a GPU recipe sets but the hardware, the model and the data: heads, loss, optimizer, schedule,
    precision."""
    recipe = yaml.safe_load(config.read_text())
    assert recipe["trainer"]["precision"] == "bf16-mixed" and recipe["trainer"]["devices"] >= 2
    callbacks = recipe["trainer"]["callbacks"]
    (checkpoints,) = [c["init_args"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
    assert recipe["ckpt_path"] == "last" and checkpoints["save_last"] and checkpoints["every_n_train_steps"] >= 100
    assert checkpoints["dirpath"].startswith(recipe["trainer"]["logger"]["init_args"]["save_dir"])  # one per recipe
    assert recipe["data"]["distill"]["prompts"]  # self-distilled, by a datasets id
    cli = main(
        [
            "fit",
            "--config",
            str(config),
            "--model.base_model",
            str(ROOT / "configs" / "models" / "tiny-llama" / "config.json"),
            "--data.data",
            str(ROOT / "data" / "tiny_chat.jsonl"),
            "--data.distill",
            "null",
            "--data.val_fraction",
            "0.125",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.strategy",
            "auto",
            "--trainer.fast_dev_run",
            "true",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert cli.trainer.state.finished and cli.trainer.global_step == 1
    assert {p.dtype for p in trained_parameters(cli)} == {torch.float32}  # under the recipe's bf16-mixed
    made, asked = cli.model.drafter.config, recipe["model"]["drafter"]
    assert made.num_heads == asked["num_heads"] and made.lm_head == asked["lm_head"]
    assert made.head_type == asked.get("head_type", "medusa")


@pytest.mark.slow
def test_the_gpu_check_runs_in_its_cpu_mode(tmp_path):
    """scripts/gpu_check.sh with MTP_DEVICE=cpu: the same five steps as on a GPU, smaller, so it cannot rot."""
    env = os.environ | {"MTP_DEVICE": "cpu", "OUT": str(tmp_path), "MTP_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "A step's cost against the fastest plain step" in done.stdout and "| overall | 1 |" in done.stdout
    assert "Memory per device (estimate)" in done.stdout and "measured / estimate" in done.stdout
    assert "| weights | nodes | eager ms | compiled ms |" in done.stdout and "\n| float | 4 | " in done.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["summary"]["overall"]["mismatches"]["mtp"] == 0
    assert (tmp_path / "tiny" / "lightning_logs" / "version_0" / "heads" / "config.json").is_file()
