"""Export heads for serving elsewhere.

    python -m mtp.export --heads HEADS --to vllm --out DIR

`vllm`: the layout of vLLM's Medusa draft model (`vllm/model_executor/models/medusa.py` and its `MedusaConfig`):
`config.json` with `model_type: medusa`, and `model.safetensors` holding, per head h and block l,
`blocks.{h}.layers.{l}.weight|bias` (our residual blocks compute x + SiLU(W x + b), as vLLM's do with
`medusa_fc_bias`) and the projections: `lm_heads.{h}.weight` for heads with their own, or one
`lm_heads.0.weight` with `original_lm_head: true` for heads that share the base model's lm_head. A draft
vocabulary becomes vLLM's `truncated_vocab_size` and `token_map` (the draft token ids, the rows of the
projections). vLLM's Medusa model reads the hidden state alone, so Hydra heads, which also read the candidate
path, cannot be exported to it. Serve (vLLM, on a GPU; not run here):

    vllm serve BASE --speculative-config '{"method": "medusa", "model": "DIR", "num_speculative_tokens": 4}'
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtp.base import load_base
from mtp.cli import user_errors
from mtp.heads import Heads


def to_vllm(heads: Heads, base_lm_head: torch.Tensor, out: str | Path) -> Path:
    """Write `heads` in vLLM's Medusa layout into `out`; `base_lm_head` (V, H): the base model's lm_head weight."""
    config = heads.config
    if heads.reads_path:
        raise ValueError(
            f"{config.head_type} heads read the candidate path, which vLLM's Medusa model cannot give them: "
            f"export Medusa heads (head_type: medusa), or decode these with mtp."
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


@user_errors
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="heads folder")
    parser.add_argument("--to", required=True, choices=["vllm"], help="the layout to write")
    parser.add_argument("--out", required=True, help="folder to write")
    args = parser.parse_args()
    heads = Heads.from_pretrained(args.heads)
    model, tokenizer = load_base(heads.config.base_model)
    heads.check_base(heads.config.base_model, model, tokenizer)
    out = to_vllm(heads, model.get_output_embeddings().weight, args.out)
    print(f"Wrote vLLM Medusa heads to {out}")


if __name__ == "__main__":
    main()
