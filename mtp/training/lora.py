"""Medusa-2's joint training: LoRA adapters on the base model, trained with the heads, and the divergence that keeps
the adapted model's next-token distribution the original's."""

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class Lora:
    """Medusa-2: train the base model too, through peft's low-rank adapters (LoRA), jointly with the heads, while
    a self-distillation term keeps its next-token distribution the original model's (the same network with its
    adapters off). The heads then decode with the adapted model, whose output is the one they keep."""

    r: int = 32
    """Rank of each adapter."""
    alpha: int = 16
    """An adapter adds alpha / r x B A to its layer's weight."""
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names (the last part) of the base's linear layers that get an adapter."""
    last_layers: int | None = None
    """Adapters on the last this many decoder layers only (None: every layer). A step then back-propagates through
    those layers only, and the adapter is smaller."""
    heads_lr_scale: float = 4.0
    """The heads learn at the model's lr times this; the adapters at lr."""
    heads_warmup_steps: int = 0
    """The heads' loss weight rises linearly from 0 to 1 over the first steps."""
    distill_weight: float = 1.0
    """Weight of KL(original || adapted), the next-token distributions at every position that predicts an answer
    token."""


def with_adapters(model: nn.Module, lora: Lora) -> nn.Module:
    """`model` wrapped by peft with LoRA adapters on `lora.target_modules` (its own weights frozen)."""
    from peft import LoraConfig, get_peft_model

    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    )
    missing = sorted(set(lora.target_modules) - set(linear))
    if missing or not lora.target_modules:
        raise ValueError(
            f"lora.target_modules {missing or '[]'}: not linear layers of this base model; choose among {linear}."
        )
    depth = model.config.num_hidden_layers
    if lora.last_layers is not None and not 1 <= lora.last_layers <= depth:
        raise ValueError(
            f"lora.last_layers {lora.last_layers}: this base model has {depth} decoder layers; choose 1 to {depth}, "
            "or null for every layer."
        )
    layers = None if lora.last_layers is None else list(range(depth - lora.last_layers, depth))
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        layers_to_transform=layers,
    )
    return get_peft_model(model, config)


def divergence(adapted: torch.Tensor, original: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(original || adapted) and the number of rows whose top-1 agree, from log-probabilities (N, V)."""
    agree = (adapted.argmax(-1) == original.argmax(-1)).sum()
    return F.kl_div(adapted, original, log_target=True, reduction="sum"), agree
