"""The target model: the base model's parts that verification, drafters and sizing read, in one object."""

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from mtp.base import eos_ids
from mtp.decoding.cache import attention_windows


@dataclass
class States:
    """What a pass of the base model gives the drafters, per row and query (node or prompt token)."""

    last: torch.Tensor
    """(B, Q, H) the last hidden states (after the final norm)."""
    layers: tuple[torch.Tensor, ...] | None
    """transformers' `hidden_states` ((B, Q, H) each: 0 the input embeddings, i decoder layer i - 1's output), when
    a drafter reads features; None otherwise."""

    def prefix(self, length: int) -> "States":
        """The states of the first `length` queries."""
        return States(self.last[:, :length], self.layers and tuple(layer[:, :length] for layer in self.layers))

    def features(self, layers: list[int], row: int, nodes: torch.Tensor | slice) -> torch.Tensor:
        """(n, F) the concatenated hidden states at `layers` (the last ones for no layers) of `nodes` of `row`."""
        if not layers:
            return self.last[row, nodes]
        return torch.cat([self.layers[i][row, nodes] for i in layers], -1)


class Target:
    """`base_model` as the verifier, the drafters and `mtp.tools.sizing` see it: its backbone and logits (with Gemma-2's
    soft cap), embeddings, attention windows, context window, EOS ids and whether its RoPE depends on a pass's
    length."""

    def __init__(self, base_model: PreTrainedModel):
        if base_model.config._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"Attention implementation {base_model.config._attn_implementation!r} of "
                f"{base_model.config.model_type} takes no custom 4D tree mask: load it with attn_implementation='sdpa'."
            )
        self.backbone = base_model.get_decoder()
        self.lm_head, self.embed = base_model.get_output_embeddings(), base_model.get_input_embeddings()
        self.device, self.dtype = base_model.device, base_model.dtype
        text = base_model.config.get_text_config(decoder=True)
        self.windows = attention_windows(base_model.config)
        self.context = getattr(text, "max_position_embeddings", None)
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.eos_ids = eos_ids(base_model)
        # RoPE that picks its frequencies from the highest position of a pass: one row would change another's
        rope = getattr(text, "rope_parameters", None) or {}
        kinds = {p.get("rope_type") for p in ([rope] if "rope_type" in rope else rope.values()) if isinstance(p, dict)}
        self.length_dependent_rope = sorted(k for k in kinds if k and ("dynamic" in k or k == "longrope"))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's next-token logits (..., V) from its last hidden states (..., H)."""
        logits = self.lm_head(hidden)
        if self.softcap:  # Gemma-2's final soft cap, as the model's own forward applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def run(self, layers: bool, **inputs) -> States:
        """One pass of the backbone over `inputs` (input_ids, cache, ...); with every layer's hidden states if
        `layers`."""
        out = self.backbone(**inputs, use_cache=True, output_hidden_states=layers)
        return States(out.last_hidden_state, out.hidden_states if layers else None)
