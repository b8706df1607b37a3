"""The memory per GPU that training prints before its first step (`mtp.training.memory.estimate`), for each GPU
recipe, on a machine without its base model's weights or a GPU: the base is built from its architecture
(`benchmarks/recipe_bases/*.json`, the Hub configs' shape fields) with its decoder layers on PyTorch's meta device
(counted, never allocated) and its embeddings, final norm and lm_head random, in bfloat16; the drafter as the
recipe builds it, in float32, its draft vocabulary sized as the recipe asks. The drafter's pass is measured on the
CPU under the recipe's bf16-mixed autocast (what autograd keeps is the same on a GPU up to the kernels chosen).

    python benchmarks/recipe_memory.py configs/gpu-qwen2.5-7b-instruct.yaml

One recipe a process: an eagle recipe's measured pass holds about 10 GB, which one process does not give back.
"""

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from lightning.pytorch.plugins.precision import MixedPrecision
from transformers import AutoConfig, AutoModelForCausalLM

from mtp.training.memory import estimate, memory_line
from mtp.training.module import build_drafter
from mtp.training.settings import DrafterSettings, Loss

BASES = {
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b-instruct.json",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3.1-8b-instruct.json",
}


def base_of(name: str) -> torch.nn.Module:
    """The base `name` in bfloat16: its decoder layers on the meta device, the rest random on the CPU."""
    config = AutoConfig.from_pretrained(Path(__file__).parent / "recipe_bases" / BASES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    kept = [model.get_input_embeddings(), model.get_output_embeddings(), model.get_decoder().norm]
    for module in kept:
        module.to_empty(device="cpu")
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
    return model.eval().requires_grad_(False)


def recipe_estimate(path: Path) -> str:
    recipe = yaml.safe_load(path.read_text())
    model, data = recipe["model"], recipe["data"]
    drafting, loss = DrafterSettings(**model["drafter"]), Loss(**model.get("loss", {}))
    base = base_of(model["base_model"])
    vocab_size, hidden_size = base.get_output_embeddings().weight.shape
    identity = dict(
        base_model=model["base_model"], hidden_size=hidden_size, vocab_size=vocab_size, tokenizer_fingerprint=""
    )
    drafter = build_drafter(base, None, identity, drafting)
    if drafting.draft_vocab:  # the most frequent tokens in training; their number is what costs memory
        drafter.set_draft_vocab(list(range(drafting.draft_vocab)), base)
    module = SimpleNamespace(
        base_model=base,
        drafter=drafter,
        features=None,
        loss=loss,
        weights=loss.head_weights(drafting.num_heads),
        parameters=drafter.parameters,
        trainer=SimpleNamespace(precision_plugin=MixedPrecision("bf16-mixed", "cpu")),
    )
    found = estimate(module, data["batch_size"], data["max_length"])
    return f"{path.name}: {memory_line(found, data['batch_size'], data['max_length'])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    print(recipe_estimate(parser.parse_args().recipe))


if __name__ == "__main__":
    main()
