"""Export heads for serving elsewhere, or publish them.

    python -m mtp.tools.export --drafter DRAFTER --to vllm --out DIR
    python -m mtp.tools.export --drafter EAGLE_DRAFTER --to eagle3 --out DIR      # or --to speculators
    python -m mtp.tools.export --drafter DRAFTER --to hub --repo OWNER/NAME --data "..." --tau "..."

`vllm`: the layout of vLLM's Medusa draft model (`vllm/model_executor/models/medusa.py` and its `MedusaConfig`):
`config.json` with `model_type: medusa`, and `model.safetensors` holding, per head h and block l,
`blocks.{h}.layers.{l}.weight|bias` (our residual blocks compute x + SiLU(W x + b), as vLLM's do with
`medusa_fc_bias`) and the projections: `lm_heads.{h}.weight` for heads with their own, or one
`lm_heads.0.weight` with `original_lm_head: true` for heads that share the base model's lm_head. A draft
vocabulary becomes vLLM's `truncated_vocab_size` and `token_map` (the draft token ids, the rows of the
projections). vLLM's Medusa model reads the hidden state alone, so Hydra heads, which also read the candidate
path, cannot be exported to it. Serve (vLLM, on a GPU; not run here):

    vllm serve BASE --speculative-config '{"method": "medusa", "model": "DIR", "num_speculative_tokens": 4}'

`eagle3`: a feature-level drafter (`head_type: eagle`) in EAGLE-3's checkpoint layout, which vLLM
(`vllm/model_executor/models/llama_eagle3.py`) and SGLang (`python/sglang/srt/models/llama_eagle3.py`) load:
`config.json` with `architectures: ["LlamaForCausalLMEagle3"]`, the layer's Llama fields, `draft_vocab_size`,
`target_hidden_size` and the feature layers; `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head` (the
draft vocabulary's rows: those of the base model's lm_head for a drafter that shares it) and, when the draft
vocabulary is smaller than the base's, `d2t` and `t2d`. No `embed_tokens`: both engines take the base model's.
The engines count the feature layers differently: vLLM's id k is the input of decoder layer k (transformers'
`hidden_states[k]`, as `feature_layers` counts), SGLang's id v the output of layer v (`hidden_states[v + 1]`);
vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` first and SGLang only `eagle_config`'s, so the first
holds our ids and the second our ids less one. `speculators`: the same drafter in vLLM's `speculators` format
(`speculators_model_type: eagle3`, its `speculators_config` with a greedy proposal of as many tokens as the
deepest path of the drafter's sized tree, the verifier, `transformer_layer_config`; weights named `layers.0.*`).
Serve (vLLM and SGLang, on a GPU; not run here):

    vllm serve BASE --speculative-config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}'
    python -m sglang.launch_server --model-path BASE --speculative-algorithm EAGLE3 \
        --speculative-draft-model-path DIR --speculative-num-steps 3 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 4

`hub`: the heads folder as it is, with a model card (README.md) that states the base model, the heads, the data
they learned (--data), their calibration, the tree and lookup sized for them, and the tau measured with them
(--tau), uploaded to a Hub model repository (created if missing; needs a Hub token). `mtp.load`, `decode.py
--drafter` and `mtp.tools.bench --drafter` take that repository id as they take a folder.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtp.decoding.tree import DynamicTree
from mtp.drafters.contract import Drafter, load_with_base
from mtp.tools.cli import user_errors


def check_layout(drafter: Drafter, layout: str) -> None:
    """Raise unless `drafter`'s kind exports to `layout` (`Drafter.exports`), naming the layouts it does."""
    if layout not in drafter.exports:
        others = " or ".join(f"--to {name}" for name in drafter.exports)
        fix = f"export them with {others}" if others else "decode them with mtp (--to hub uploads their folder)"
        raise ValueError(f"{drafter.config.head_type} drafters do not fit the {layout} layout: {fix}.")


def to_vllm(heads: Drafter, base_lm_head: torch.Tensor, out: str | Path) -> Path:
    """Write `heads` in vLLM's Medusa layout into `out`; `base_lm_head` (V, H): the base model's lm_head weight."""
    config = heads.config
    check_layout(heads, "vllm")
    if config.adapter:
        raise ValueError(
            "These heads decode with their base model adapted (a LoRA adapter beside them), and vLLM's Medusa "
            "proposer serves the heads beside an unchanged base: decode these with mtp, or export heads trained on "
            "a frozen base."
        )
    rows = None if config.draft_vocab is None else torch.tensor(config.draft_vocab)
    tensors = {}
    for h, block in enumerate(heads.blocks):
        for i, layer in enumerate(block):
            tensors[f"blocks.{h}.layers.{i}.weight"] = layer.linear.weight
            tensors[f"blocks.{h}.layers.{i}.bias"] = layer.linear.bias
    projections = [base_lm_head] if heads.projections is None else [p.weight for p in heads.projections]
    for h, weight in enumerate(projections):
        tensors[f"lm_heads.{h}.weight"] = weight if rows is None else weight[rows]
    if rows is not None:
        tensors["token_map"] = rows
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in tensors.items()}, out / "model.safetensors")
    vllm_config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": heads.projections is None,
        "truncated_vocab_size": config.vocab_size if rows is None else len(rows),
        "base_model_name_or_path": config.base_model,
    }
    (out / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
    return out


def to_eagle3(drafter: Drafter, base_model, out: str | Path, speculators: bool = False) -> Path:
    """Write a feature-level drafter in EAGLE-3's layout (or, with `speculators`, vLLM's speculators format) into
    `out`; `base_model`: the base it drafts for (its lm_head rows, its architecture)."""
    config = drafter.config
    check_layout(drafter, "speculators" if speculators else "eagle3")
    if config.adapter:
        raise ValueError(
            "This drafter decodes with its base model adapted (a LoRA adapter beside it); the engines "
            "serve a drafter beside an unchanged base: decode it with mtp."
        )
    ids, depth = config.feature_layers, base_model.config.get_text_config(decoder=True).num_hidden_layers
    if not (0 < ids[0] and ids[-1] < depth and ids == sorted(set(ids))):
        raise ValueError(
            f"feature_layers {ids}: the engines read the inputs of decoder layers 1 .. {depth - 1}, in "
            f"increasing order (SGLang counts the output of the layer before; transformers' last hidden "
            f"state, {depth}, is after the final norm, which no engine taps): train the drafter on such "
            f"layers (EAGLE-3's default: 2, L // 2, L - 3)."
        )
    layer = config.draft_layer
    if layer["hidden_act"] != "silu":
        raise ValueError(
            f"The drafter's MLP uses {layer['hidden_act']!r}; the engines' EAGLE-3 layer is a SiLU "
            f"Llama layer: decode it with mtp."
        )
    draft = drafter.draft_ids
    rows = drafter.lm_head.weight if drafter.lm_head is not None else base_model.get_output_embeddings().weight[draft]
    tensors = {name: tensor for name, tensor in drafter.state_dict().items() if name not in ("d2t", "t2d")}
    tensors["lm_head.weight"] = rows
    if len(draft) < config.vocab_size:  # the engines expect no d2t for a draft vocabulary of every token
        tensors |= {"d2t": drafter.d2t, "t2d": drafter.t2d}
    if speculators:
        tensors = {name.replace("midlayer.", "layers.0.", 1): tensor for name, tensor in tensors.items()}
    dtype = next(iter(tensors.values())).dtype
    llama = _llama_layer(layer, config.vocab_size, dtype)
    shared = {
        "draft_vocab_size": len(draft),
        "target_hidden_size": config.hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "num_aux_hidden_states": len(ids),
    }
    if speculators:
        exported = _speculators_config(config, base_model, llama, shared)
    else:
        sglang = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]}  # its count
        exported = {"architectures": ["LlamaForCausalLMEagle3"], **llama, **shared, "eagle_config": sglang}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in tensors.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(exported, indent=2) + "\n")
    return out


def model_card(heads: Drafter, repo_id: str, data: str, tau: str) -> str:
    """A Hub model card for `heads`: the base, the heads, the data, the calibration, the tree, the measured tau."""
    config = heads.config
    calibration = "not measured (no validation split)"
    if config.calibration:
        calibration = ", ".join(
            f"head {k} {row[0]:.3f} / {sum(row[:5]):.3f}" for k, row in enumerate(config.calibration)
        )
    vocabulary = "the whole vocabulary" if config.draft_vocab is None else f"{len(config.draft_vocab)} draft tokens"
    tree = "the default tree" if config.tree is None else f"{len(config.tree) + 1} nodes"
    return f"""---
base_model: {config.base_model}
tags: [mtp, {config.head_type}, speculative-decoding]
---
# {config.head_type.capitalize()} heads for {config.base_model}

{config.num_heads} {config.head_type} heads of {config.num_layers} residual block(s), trained with mtp on the frozen
base model `{config.base_model}` (hidden size {config.hidden_size}, vocabulary {config.vocab_size}); projection:
{"the base model's lm_head" if config.lm_head == "shared" else "one of their own each"}, over {vocabulary}.

- Data: {data}
- Calibration (held-out top-1 / top-5 per head): {calibration}
- Decoding tree: {tree}; prompt-lookup tokens per step: {config.lookup}
- Measured: {tau}

Decoding is lossless: greedy output equals the base model's own greedy output, token for token.

```bash
python decode.py --drafter {repo_id} --prompt "Why is the sky blue?"
```
"""


def to_hub(heads_path: str, repo_id: str, data: str, tau: str, private: bool = False) -> str:
    """Upload the heads folder with its model card to Hub repository `repo_id`; returns the repository's URL."""
    from huggingface_hub import HfApi

    heads = Drafter.from_pretrained(heads_path)
    with tempfile.TemporaryDirectory() as folder:
        shutil.copytree(heads_path, folder, dirs_exist_ok=True)  # the folder as it is, and its card
        (Path(folder) / "README.md").write_text(model_card(heads, repo_id, data, tau))
        api = HfApi()
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message="Heads trained with mtp")
    return str(url)


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", "--heads", required=True, help="drafter folder")
    parser.add_argument(
        "--to",
        required=True,
        choices=["vllm", "eagle3", "speculators", "hub"],
        help="vLLM's Medusa layout, EAGLE-3's (vLLM, SGLang), vLLM's speculators format, or the Hub",
    )
    parser.add_argument("--out", help="--to vllm, eagle3, speculators: the folder to write")
    parser.add_argument("--repo", help="--to hub: the repository id, OWNER/NAME")
    parser.add_argument("--data", help="--to hub: what the heads learned, for the model card")
    parser.add_argument("--tau", help="--to hub: the tau measured with them and how, for the model card")
    parser.add_argument("--private", action="store_true", help="--to hub: a private repository")
    args = parser.parse_args()
    needed = ["repo", "data", "tau"] if args.to == "hub" else ["out"]
    missing = [f"--{name}" for name in needed if not getattr(args, name)]
    if missing:
        parser.error(f"--to {args.to} needs {', '.join(missing)}")
    if args.to == "hub":
        print(f"Uploaded {args.drafter} to {to_hub(args.drafter, args.repo, args.data, args.tau, args.private)}")
        return
    heads, model, _ = load_with_base(args.drafter, fast=False, adapt=False)
    if args.to == "vllm":
        print(f"Wrote vLLM Medusa heads to {to_vllm(heads, model.get_output_embeddings().weight, args.out)}")
    else:
        out = to_eagle3(heads, model, args.out, speculators=args.to == "speculators")
        print(f"Wrote the drafter in {'speculators' if args.to == 'speculators' else 'EAGLE-3'} format to {out}")


if __name__ == "__main__":
    main()


def _llama_layer(layer: dict, vocab_size: int, dtype: torch.dtype) -> dict:
    """The drafter's layer (`DrafterConfig.draft_layer`) as the fields of a one-layer Llama config, as the engines
    read an EAGLE-3 drafter's."""
    rope = dict(layer["rope_parameters"])
    theta = rope.pop("rope_theta")
    fields = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    return {
        "model_type": "llama",
        **{name: layer[name] for name in fields},
        "rope_theta": theta,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "num_hidden_layers": 1,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _speculators_config(config, base_model, llama: dict, shared: dict) -> dict:
    """The config.json of vLLM's speculators format for the drafter of `config`: its verifier, its greedy proposal
    as deep as the drafter's tree, the Llama layer and the fields it shares with EAGLE-3's."""
    depth = max((len(path) for path in config.tree or []), default=0) or config.num_heads  # the sized tree's
    depth = DynamicTree.parse(config.dynamic_tree).deepest if config.dynamic_tree else depth
    architectures = base_model.config.architectures or [type(base_model).__name__]
    verifier = {"name_or_path": config.base_model, "architectures": architectures}
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "verifier": verifier,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": depth,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
        },
        "transformer_layer_config": llama,
        **shared,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }
