"""Export heads for serving elsewhere, or publish them.

    python -m mtp.export --heads HEADS --to vllm --out DIR
    python -m mtp.export --heads HEADS --to hub --repo OWNER/NAME --data "..." --tau "..."

`vllm`: the layout of vLLM's Medusa draft model (`vllm/model_executor/models/medusa.py` and its `MedusaConfig`):
`config.json` with `model_type: medusa`, and `model.safetensors` holding, per head h and block l,
`blocks.{h}.layers.{l}.weight|bias` (our residual blocks compute x + SiLU(W x + b), as vLLM's do with
`medusa_fc_bias`) and the projections: `lm_heads.{h}.weight` for heads with their own, or one
`lm_heads.0.weight` with `original_lm_head: true` for heads that share the base model's lm_head. A draft
vocabulary becomes vLLM's `truncated_vocab_size` and `token_map` (the draft token ids, the rows of the
projections). vLLM's Medusa model reads the hidden state alone, so Hydra heads, which also read the candidate
path, cannot be exported to it. Serve (vLLM, on a GPU; not run here):

    vllm serve BASE --speculative-config '{"method": "medusa", "model": "DIR", "num_speculative_tokens": 4}'

`hub`: the heads folder as it is, with a model card (README.md) that states the base model, the heads, the data
they learned (--data), their calibration, the tree and lookup sized for them, and the tau measured with them
(--tau), uploaded to a Hub model repository (created if missing; needs a Hub token). `mtp.load`, `decode.py
--heads` and `mtp.bench --heads` take that repository id as they take a folder.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtp.base import load_base
from mtp.cli import user_errors
from mtp.folder import Drafter


def to_vllm(heads: Drafter, base_lm_head: torch.Tensor, out: str | Path) -> Path:
    """Write `heads` in vLLM's Medusa layout into `out`; `base_lm_head` (V, H): the base model's lm_head weight."""
    config = heads.config
    if heads.reads_path:
        raise ValueError(
            f"{config.head_type} heads read the candidate path, which vLLM's Medusa model cannot give them: "
            f"export Medusa heads (head_type: medusa), or decode these with mtp."
        )
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
python decode.py --heads {repo_id} --prompt "Why is the sky blue?"
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
    parser.add_argument("--heads", required=True, help="heads folder")
    parser.add_argument("--to", required=True, choices=["vllm", "hub"], help="vLLM's layout, or the Hub")
    parser.add_argument("--out", help="--to vllm: the folder to write")
    parser.add_argument("--repo", help="--to hub: the repository id, OWNER/NAME")
    parser.add_argument("--data", help="--to hub: what the heads learned, for the model card")
    parser.add_argument("--tau", help="--to hub: the tau measured with them and how, for the model card")
    parser.add_argument("--private", action="store_true", help="--to hub: a private repository")
    args = parser.parse_args()
    needed = ["out"] if args.to == "vllm" else ["repo", "data", "tau"]
    missing = [f"--{name}" for name in needed if not getattr(args, name)]
    if missing:
        parser.error(f"--to {args.to} needs {', '.join(missing)}")
    if args.to == "hub":
        print(f"Uploaded {args.heads} to {to_hub(args.heads, args.repo, args.data, args.tau, args.private)}")
        return
    heads = Drafter.from_pretrained(args.heads)
    model, tokenizer = load_base(heads.config.base_model)
    heads.check_base(heads.config.base_model, model, tokenizer)
    out = to_vllm(heads, model.get_output_embeddings().weight, args.out)
    print(f"Wrote vLLM Medusa heads to {out}")


if __name__ == "__main__":
    main()
