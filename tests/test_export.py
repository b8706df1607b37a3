"""Export to vLLM's Medusa layout: the names, shapes and values its loader expects, and what it cannot take."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

import mtp.export
from mtp.folder import Drafter
from tests.test_stopping import save_random_heads


def vllm_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's Medusa model declares for `config` (vllm/model_executor/models/medusa.py), by name:
    `num_hidden_layers` linear layers per head (with a bias when `medusa_fc_bias`), and one lm_head shared by all
    heads when `original_lm_head`, else one per head, of `truncated_vocab_size` rows."""
    hidden, rows = config["hidden_size"], config["truncated_vocab_size"]
    names = {}
    for h in range(config["num_heads"]):
        for i in range(config["num_hidden_layers"]):
            names[f"blocks.{h}.layers.{i}.weight"] = (hidden, hidden)
            if config["medusa_fc_bias"]:
                names[f"blocks.{h}.layers.{i}.bias"] = (hidden,)
    heads = ["lm_head"] if config["original_lm_head"] else [f"lm_heads.{h}" for h in range(config["num_heads"])]
    return names | {f"{name}.weight": (rows, hidden) for name in heads}


def vllm_logits(config: dict, weights: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """What vLLM's Medusa model computes from a hidden state (N, H): (K, N, V), -inf outside the token map."""
    logits = []
    for h in range(config["num_heads"]):
        x = hidden
        for i in range(config["num_hidden_layers"]):
            x = x + F.silu(
                F.linear(x, weights[f"blocks.{h}.layers.{i}.weight"], weights[f"blocks.{h}.layers.{i}.bias"])
            )
        head = weights["lm_heads.0.weight" if config["original_lm_head"] else f"lm_heads.{h}.weight"]
        full = torch.full((len(hidden), config["vocab_size"]), float("-inf"))
        columns = weights.get("token_map", torch.arange(config["vocab_size"]))
        full[:, columns] = x @ head.T
        logits.append(full)
    return torch.stack(logits)


@pytest.mark.parametrize("lm_head, draft", [("shared", True), ("own", False)], ids=["shared-draft", "own-full"])
def test_an_exported_folder_is_what_vllm_loads_and_computes_what_the_heads_do(tmp_path, lm_head, draft):
    path, model, _ = save_random_heads(tmp_path, lm_head)
    heads = Drafter.from_pretrained(path)
    if draft:
        heads.config.draft_vocab = list(range(3, 300, 2))
    out = mtp.export.to_vllm(heads, model.get_output_embeddings().weight, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 1
    assert config["truncated_vocab_size"] == (149 if draft else config["vocab_size"])  # 3, 5, .., 299
    loaded = {"lm_head.weight" if config["original_lm_head"] and n == "lm_heads.0.weight" else n: w.shape
              for n, w in weights.items() if n != "token_map"}  # fmt: skip  # vLLM's load_weights renaming
    assert loaded == {name: torch.Size(shape) for name, shape in vllm_parameters(config).items()}
    assert ("token_map" in weights) is draft
    hidden = torch.randn(5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = heads(hidden, model.get_output_embeddings())  # (K, N, V)
        if draft:  # our heads rank the draft tokens only: the same scores there, nothing elsewhere
            ours = torch.full_like(ours, float("-inf")).index_copy(-1, torch.tensor(heads.config.draft_vocab),
                                                                    ours[..., heads.config.draft_vocab])  # fmt: skip
    torch.testing.assert_close(vllm_logits(config, weights, hidden), ours)


def test_hydra_heads_are_refused_with_the_reason(tmp_path, monkeypatch, capsys):
    path, _, _ = save_random_heads(tmp_path, head_type="hydra")
    monkeypatch.setattr(sys, "argv", ["mtp.export", "--heads", path, "--to", "vllm", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as done:
        mtp.export.main()
    assert done.value.code == 2 and "read the candidate path" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_command_writes_the_folder(tmp_path, monkeypatch, capsys):
    path, _, _ = save_random_heads(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mtp.export", "--heads", path, "--to", "vllm", "--out", str(tmp_path / "out")])
    mtp.export.main()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert "Wrote vLLM Medusa heads" in capsys.readouterr().out


def test_heads_are_published_with_a_model_card_and_load_back_by_repository_id(tmp_path, monkeypatch):
    """Offline: the Hub client is replaced by one that keeps what is uploaded in a local folder."""
    import huggingface_hub

    path, _, _ = save_random_heads(tmp_path)
    heads = Drafter.from_pretrained(path)
    heads.config.calibration = [[0.5, 0.1, 0.05, 0.05, 0.05], [0.3, 0.1, 0.1, 0.0, 0.0], [0.2] + [0.0] * 4]
    heads.save_config(path)
    hub = tmp_path / "hub"

    class LocalHub:
        def create_repo(self, repo_id, private=False, exist_ok=False):
            (hub / repo_id).mkdir(parents=True, exist_ok=exist_ok)
            return f"local://{repo_id}"

        def upload_folder(self, folder_path, repo_id, commit_message):
            shutil.copytree(folder_path, hub / repo_id, dirs_exist_ok=True)

    monkeypatch.setattr(huggingface_hub, "HfApi", LocalHub)
    url = mtp.export.to_hub(path, "someone/tiny-heads", "tiny chats", "tau 1.50 on 3 questions")
    assert url == "local://someone/tiny-heads"
    card = (hub / "someone" / "tiny-heads" / "README.md").read_text()
    assert "base_model: " + heads.config.base_model in card and "Data: tiny chats" in card
    assert "head 0 0.500 / 0.750" in card and "Measured: tau 1.50 on 3 questions" in card
    assert "--heads someone/tiny-heads" in card

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, allow_patterns: fetched.append(repo_id) or str(hub / repo_id))  # fmt: skip
    loaded = Drafter.from_pretrained("someone/tiny-heads")
    assert fetched == ["someone/tiny-heads"] and loaded.config == heads.config
    for a, b in zip(heads.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_repository_that_cannot_be_fetched_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, allow_patterns):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="'someone/missing' is not a local folder.*ConnectionError: no network"):
        Drafter.from_pretrained("someone/missing")
