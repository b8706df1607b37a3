"""Exports: to vLLM's Medusa layout and to EAGLE-3's (vLLM, SGLang, speculators), the names, shapes, config fields and
values their loaders expect, an EAGLE-3 checkpoint read back, and what each cannot take."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

import mtp
import mtp.tools.export
from mtp.base import load_tokenizer
from mtp.decoding.decoder import Decoder
from mtp.drafters.contract import Drafter, DrafterConfig
from mtp.drafters.eagle import Eagle
from tests.conftest import PROMPT, TINY_BASE, TREE, random_heads, reference, save_random_heads, tiny_model


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
    out = mtp.tools.export.to_vllm(heads, model.get_output_embeddings().weight, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 1
    assert config["truncated_vocab_size"] == (149 if draft else config["vocab_size"])  # 3, 5, .., 299
    loaded = {
        "lm_head.weight" if config["original_lm_head"] and n == "lm_heads.0.weight" else n: w.shape
        for n, w in weights.items()
        if n != "token_map"
    }  # vLLM's load_weights renaming
    assert loaded == {name: torch.Size(shape) for name, shape in vllm_parameters(config).items()}
    assert ("token_map" in weights) is draft
    hidden = torch.randn(5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = heads(hidden, model.get_output_embeddings())  # (K, N, V)
        if draft:  # our heads rank the draft tokens only: the same scores there, nothing elsewhere
            ours = torch.full_like(ours, float("-inf")).index_copy(
                -1, torch.tensor(heads.config.draft_vocab), ours[..., heads.config.draft_vocab]
            )
    torch.testing.assert_close(vllm_logits(config, weights, hidden), ours)


def test_hydra_heads_are_refused_with_the_reason(tmp_path, monkeypatch, capsys):
    path, _, _ = save_random_heads(tmp_path, head_type="hydra")
    monkeypatch.setattr(
        sys, "argv", ["mtp.tools.export", "--drafter", path, "--to", "vllm", "--out", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as done:
        mtp.tools.export.main()
    assert done.value.code == 2 and "hydra drafters do not fit the vllm layout" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "to, head_type, says",
    [("vllm", "medusa", "vLLM Medusa heads"), ("eagle3", "eagle", "EAGLE-3"), ("speculators", "eagle", "speculators")],
)
def test_the_command_writes_the_folder(tmp_path, monkeypatch, capsys, to, head_type, says):
    path, model, _ = save_random_heads(tmp_path, head_type=head_type)
    if head_type == "eagle":  # the engines tap the inputs of layers 1 .. L - 1: layer 1 of the 2-layer model
        config = Drafter.from_pretrained(path).config
        config.feature_layers = [1]
        Eagle.new(config, model).save_pretrained(path)
    monkeypatch.setattr(
        sys, "argv", ["mtp.tools.export", "--drafter", path, "--to", to, "--out", str(tmp_path / "out")]
    )
    mtp.tools.export.main()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert f"Wrote {says}" in capsys.readouterr().out.replace("the drafter in ", "")


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
    url = mtp.tools.export.to_hub(path, "someone/tiny-heads", "tiny chats", "tau 1.50 on 3 questions")
    assert url == "local://someone/tiny-heads"
    card = (hub / "someone" / "tiny-heads" / "README.md").read_text()
    assert "base_model: " + heads.config.base_model in card and "Data: tiny chats" in card
    assert "head 0 0.500 / 0.750" in card and "Measured: tau 1.50 on 3 questions" in card
    assert "--drafter someone/tiny-heads" in card

    fetched = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo_id, allow_patterns: fetched.append(repo_id) or str(hub / repo_id),
    )
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


# EAGLE-3's layout, as vLLM 0.33 (vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM.load_weights)
# and SGLang 0.5.23 (python/sglang/srt/models/llama_eagle3.py) load it: unprefixed names, `midlayer.` read as
# `layers.0.` (the speculators format's own names), `t2d` skipped, `d2t` only for a draft vocabulary smaller than
# the target's, no `embed_tokens` needed (both take the target's).
EAGLE3_LAYER = [
    "input_layernorm",
    "hidden_norm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def eagle3_parameters(config: dict, layer: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """The shapes the engines build for an EAGLE-3 drafter of `config` (layer fields in `layer`), by name."""
    hidden, heads, kv = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    d, mlp, draft = layer["head_dim"], layer["intermediate_size"], config["draft_vocab_size"]
    # vLLM sizes fc by num_aux_hidden_states, else by eagle_config's ids, else for 3 layers
    aux = (
        config.get("num_aux_hidden_states")
        or len(config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", []))
        or 3
    )
    shapes = [
        (hidden,),
        (hidden,),
        (hidden,),
        (heads * d, 2 * hidden),
        (kv * d, 2 * hidden),
        (kv * d, 2 * hidden),
        (hidden, heads * d),
        (mlp, hidden),
        (mlp, hidden),
        (hidden, mlp),
    ]
    names = {f"{prefix}{name}.weight": shape for name, shape in zip(EAGLE3_LAYER, shapes, strict=True)}
    names |= {
        "fc.weight": (hidden, aux * config["target_hidden_size"]),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft, hidden),
    }
    if draft < layer["vocab_size"]:
        names |= {"d2t": (draft,), "t2d": (layer["vocab_size"],)}
    return names


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def eagle3_step(w: dict, layer: dict, prefix: str, feature, embedding, positions, past=None):
    """One pass of an EAGLE-3 drafter layer as the engines compute it, from the exported weights alone: entries
    (feature (Q, H), the next token's embedding (Q, H)) at `positions`, causal over `past` (keys, values) and
    themselves -> (draft logits (Q, D), pre-norm outputs (Q, H), keys and values)."""
    eps, heads, kv, d = (
        layer["rms_norm_eps"],
        layer["num_attention_heads"],
        layer["num_key_value_heads"],
        layer["head_dim"],
    )
    p = lambda name: w[f"{prefix}{name}.weight"]  # noqa: E731
    x = torch.cat([rms(embedding, p("input_layernorm"), eps), rms(feature, p("hidden_norm"), eps)], -1)
    q, k, v = (F.linear(x, p(f"self_attn.{n}_proj")).view(len(x), -1, d).transpose(0, 1) for n in "qkv")
    inv = 1.0 / layer["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.cat([positions[:, None] * inv] * 2, -1)  # (Q, d)

    def rotate(t):
        half = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
        return t * angles.cos() + half * angles.sin()

    q, k = rotate(q), rotate(k)
    keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
    seen = torch.ones(len(x), keys.shape[1], dtype=torch.bool).tril(keys.shape[1] - len(x))
    scores = (q @ keys.repeat_interleave(heads // kv, 0).transpose(1, 2)) / d**0.5
    out = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values.repeat_interleave(heads // kv, 0)
    hidden = feature + F.linear(out.transpose(0, 1).reshape(len(x), -1), p("self_attn.o_proj"))
    h = rms(hidden, p("post_attention_layernorm"), eps)
    hidden = hidden + F.linear(
        F.silu(F.linear(h, p("mlp.gate_proj"))) * F.linear(h, p("mlp.up_proj")), p("mlp.down_proj")
    )
    return rms(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T, hidden, (keys, values)


def eagle_drafter(model, lm_head: str, draft: bool, feature_layers=(1, 2, 3)):
    """A random feature-level drafter of a 4-layer tiny model, reading the inputs of its layers 1, 2 and 3."""
    torch.manual_seed(1)
    config = DrafterConfig(
        num_heads=3,
        head_type="eagle",
        lm_head=lm_head,
        hidden_size=64,
        vocab_size=512,
        feature_layers=list(feature_layers),
    )
    drafter = Eagle.new(config, model)
    for parameter in drafter.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    if draft:
        drafter.set_draft_vocab(list(range(3, 500, 3)), model)
    drafter.config.tree = [[0], [0, 0], [1]]
    return drafter.eval()


@pytest.mark.parametrize("speculators", [False, True], ids=["eagle3", "speculators"])
@pytest.mark.parametrize("lm_head, draft", [("shared", True), ("own", False)], ids=["shared-draft", "own-full"])
def test_an_eagle3_export_is_what_the_engines_load_and_drafts_what_ours_does(
    tmp_path, speculators, lm_head, draft, float_drafts
):
    model = tiny_model(num_hidden_layers=4)
    drafter = eagle_drafter(model, lm_head, draft)
    out = mtp.tools.export.to_eagle3(drafter, model, tmp_path / "out", speculators=speculators)
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")
    layer = config["transformer_layer_config"] if speculators else config
    prefix = "layers.0." if speculators else "midlayer."
    assert {n: tuple(w.shape) for n, w in weights.items()} == eagle3_parameters(config, layer, prefix)
    assert config["draft_vocab_size"] == (166 if draft else 512) and layer["vocab_size"] == 512
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is False
    if speculators:
        spec = config["speculators_config"]
        assert config["speculators_model_type"] == spec["algorithm"] == "eagle3"
        assert spec["proposal_methods"] == [
            {"proposal_type": "greedy", "speculative_tokens": 2, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ]
        assert spec["default_proposal_method"] == "greedy" and spec["verifier"]["architectures"] == ["LlamaForCausalLM"]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's EntryClass; vLLM maps it too
        sglang = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # SGLang reads layer v's output
        assert [v + 1 for v in sglang] == config["eagle_aux_hidden_state_layer_ids"]
    if draft:
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
        assert (weights["d2t"] + torch.arange(166)).tolist() == list(range(3, 500, 3))  # target = draft + d2t[draft]

    ids = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # vLLM's id k: hidden_states[k]
        features = torch.cat([states[k][0] for k in config["eagle_aux_hidden_state_layer_ids"]], -1)  # (T, 3H)
        embed = model.get_input_embeddings()
        # the engines' first step: entry j pairs the feature at j - 1 with token j (positions: any common offset)
        fused = F.linear(features[:-1], weights["fc.weight"])
        logits, hidden, past = eagle3_step(weights, layer, prefix, fused, embed(ids[0, 1:]), torch.arange(9.0))
        # their second step at the last entry: its feature is the first step's output at the entry before
        second, _, _ = eagle3_step(
            weights,
            layer,
            prefix,
            hidden[-2:-1],
            embed(ids[0, -1:]),
            torch.tensor([8.0]),
            (past[0][:, :-1], past[1][:, :-1]),
        )
        steps = drafter.unroll(features[None], ids, embed, 2)  # (2, 1, 9, H)
        ours = drafter.logits(steps[:, 0], model.get_output_embeddings())  # (2, 9, D)
    torch.testing.assert_close(logits, ours[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[0], ours[1, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("speculators", [False, True], ids=["eagle3", "speculators"])
def test_an_eagle3_checkpoint_loads_as_a_drafter_and_decodes_losslessly(tmp_path, speculators):
    model = tiny_model(num_hidden_layers=4)
    drafter = eagle_drafter(model, "shared", draft=True)
    out = mtp.tools.export.to_eagle3(drafter, model, tmp_path / "out", speculators=speculators)
    loaded = Drafter.from_pretrained(out)
    assert loaded.config.head_type == "eagle" and loaded.config.feature_layers == [1, 2, 3]
    assert loaded.draft_ids.tolist() == drafter.draft_ids.tolist() and loaded.config.lm_head == "own"
    features = torch.randn(1, 6, 192, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(1))
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.logits(loaded.unroll(features, ids, embed, 3), lm_head),
            drafter.logits(drafter.unroll(features, ids, embed, 3), lm_head),
        )
    tokenizer = load_tokenizer(TINY_BASE)
    result = Decoder(model, tokenizer, loaded, TREE).generate(PROMPT, max_new_tokens=30)
    assert result.token_ids == reference(model, tokenizer(PROMPT, return_tensors="pt").input_ids, 30)


def test_what_eagle3_cannot_hold_is_refused_with_the_alternative(tmp_path):
    model = tiny_model(num_hidden_layers=4)
    with pytest.raises(ValueError, match="--to vllm"):
        mtp.tools.export.to_eagle3(random_heads(model), model, tmp_path / "medusa")
    with pytest.raises(ValueError, match="decode them with mtp"):
        mtp.tools.export.to_eagle3(random_heads(model, head_type="hydra"), model, tmp_path / "hydra")
    with pytest.raises(ValueError, match="--to eagle3"):
        mtp.tools.export.to_vllm(
            random_heads(model, head_type="eagle"), model.get_output_embeddings().weight, tmp_path / "v"
        )
    for layers in [(0, 2), (1, 4), (3, 2)]:  # the embeddings; the last, post-norm state; not increasing
        with pytest.raises(ValueError, match="feature_layers"):
            mtp.tools.export.to_eagle3(eagle_drafter(model, "shared", True, layers), model, tmp_path / "layers")
    assert not any(tmp_path.iterdir())
    config = json.loads(
        (
            mtp.tools.export.to_eagle3(eagle_drafter(model, "shared", True), model, tmp_path / "e") / "config.json"
        ).read_text()
    )
    for change, message in [
        ({"eagle_aux_hidden_state_layer_ids": None}, "names no feature layers"),
        ({"norm_before_residual": True}, "norm_before_residual"),
    ]:
        (tmp_path / "e" / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ValueError, match=message):
            Drafter.from_pretrained(tmp_path / "e")


def test_an_imported_drafter_without_a_base_model_asks_for_one(tmp_path):
    model = tiny_model(num_hidden_layers=4)
    out = mtp.tools.export.to_eagle3(eagle_drafter(model, "shared", True), model, tmp_path / "out")
    with pytest.raises(ValueError, match="No base model named.*--base-model"):
        mtp.load(str(out))


def test_a_scaled_rotary_embedding_goes_through_export_and_import(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # Llama-3.1's kind, scaled down
    model = tiny_model(num_hidden_layers=4, rope_parameters=rope)
    drafter = eagle_drafter(model, "shared", True)
    out = mtp.tools.export.to_eagle3(drafter, model, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["rope_scaling"] == {
        k: v for k, v in rope.items() if k != "rope_theta"
    }
    loaded = Drafter.from_pretrained(out)
    features = torch.randn(1, 80, 192, generator=torch.Generator().manual_seed(0))  # past the original 64
    ids = torch.randint(1, 512, (1, 80), generator=torch.Generator().manual_seed(1))
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.logits(loaded.unroll(features, ids, embed, 2), lm_head),
            drafter.logits(drafter.unroll(features, ids, embed, 2), lm_head),
        )
