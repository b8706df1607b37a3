"""The target model: the base model's parts that verification, drafters and sizing read, in one object."""

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from mtp.base import eos_ids
from mtp.decoding.cache import attention_windows
from mtp.internals import attention_implementation


@dataclass
class PassStates:
    """What a pass of the base model gives the drafters, per row and query (node or prompt token)."""

    last: torch.Tensor
    """(B, Q, H) the last hidden states (after the final norm)."""
    layers: tuple[torch.Tensor, ...] | None
    """transformers' `hidden_states` ((B, Q, H) each: 0 the input embeddings, i decoder layer i - 1's output), when
    a drafter reads features; None otherwise."""
    logits: torch.Tensor | None = None
    """(B, Q, V) the base model's next-token logits after each query, where the pass computed them (verification)."""

    def prefix(self, length: int) -> "PassStates":
        """The states of the first `length` queries."""
        return PassStates(self.last[:, :length], self.layers and tuple(layer[:, :length] for layer in self.layers))

    def features(self, layers: list[int], row: int, nodes: torch.Tensor | slice) -> torch.Tensor:
        """(n, F) the concatenated hidden states at `layers` (the last ones for no layers) of `nodes` of `row`."""
        if not layers:
            return self.last[row, nodes]
        return torch.cat([self.layers[i][row, nodes] for i in layers], -1)


# Config attributes by which transformers' causal LMs scale lm_head's logits, multiplied or divided by family
# (Granite and MiniCPM3 divide by logits_scaling, HyperCLOVA X multiplies by it, Cohere by logit_scale): which one
# applies is read off the model's own forward
SCALES = ("logits_scaling", "logit_scale")


class Target:
    """`base_model` as the verifier, the drafters and `mtp.tools.sizing` see it: its backbone and logits (as its own
    forward makes them: a scale and a final soft cap), embeddings, attention windows, context window, EOS ids and
    the length past which its RoPE changes every position's frequencies."""

    def __init__(self, base_model: PreTrainedModel):
        attention = attention_implementation(base_model.config)
        if attention not in ("eager", "sdpa"):
            raise ValueError(
                f"Attention implementation {attention!r} of "
                f"{base_model.config.model_type} takes no custom 4D tree mask: load it with attn_implementation='sdpa'."
            )
        self.backbone = base_model.get_decoder()
        self.lm_head, self.embed = base_model.get_output_embeddings(), base_model.get_input_embeddings()
        self.device, self.dtype = base_model.device, base_model.dtype
        text = base_model.config.get_text_config(decoder=True)
        self.windows = attention_windows(base_model.config)
        self.context = getattr(text, "max_position_embeddings", None)
        self.num_layers = text.num_hidden_layers
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.scale, self.divide = self._scaling(base_model, text)
        self.eos_ids = eos_ids(base_model)
        # RoPE whose frequencies follow the longest sequence of a pass. `dynamic` changes them only past
        # max_position_embeddings, the context window that every request is held within. `longrope` switches from
        # its short to its long factors once a sequence passes original_max_position_embeddings, and plain
        # `generate` then recomputes the whole sequence: a pass that crosses it cannot match plain decoding.
        rope = getattr(text, "rope_parameters", None) or {}
        kinds = [rope] if "rope_type" in rope else [p for p in rope.values() if isinstance(p, dict)]  # per layer type
        longrope = [p for p in kinds if p.get("rope_type") == "longrope"]
        self.rope_limit = min(
            (p.get("original_max_position_embeddings") or text.original_max_position_embeddings for p in longrope),
            default=None,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's next-token logits (..., V) from its last hidden states (..., H)."""
        return self.finished(self.lm_head(hidden), self.scale, self.divide)

    def finished(self, logits: torch.Tensor, scale: float, divide: bool) -> torch.Tensor:
        """lm_head's output `logits` scaled (divided by `scale` if `divide`), then soft-capped as the model does."""
        if scale != 1.0:
            logits = logits / scale if divide else logits * scale
        if self.softcap:  # Gemma-2's final soft cap, as the model's own forward applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _scaling(self, base_model: PreTrainedModel, text) -> tuple[float, bool]:
        """(scale, divide): how the model's own forward turns lm_head's output into logits, found by one probe pass
        among the scales its config names; a forward that none of them reproduces is refused."""
        values = [float(v) for name in SCALES if isinstance(v := getattr(text, name, None), int | float) and v != 1]
        probe = torch.arange(min(8, text.vocab_size), device=self.device)[None]
        with torch.no_grad():
            theirs = base_model(input_ids=probe, use_cache=False).logits.float()
            raw = self.lm_head(self.backbone(input_ids=probe, use_cache=False).last_hidden_state)
        for scale, divide in [(1.0, False)] + [(v, divide) for v in values for divide in (False, True)]:
            if (self.finished(raw, scale, divide).float() - theirs).norm() <= 1e-3 * theirs.norm():
                return scale, divide
        found = ", ".join(f"{name}={getattr(text, name)}" for name in SCALES if hasattr(text, name)) or "no scale"
        raise ValueError(
            f"{text.model_type}'s own forward makes logits that are not its lm_head's output with the scales and soft "
            f"cap its config names ({found}, final_logit_softcapping={self.softcap}): mtp would verify against other "
            "logits than plain decoding samples from: decode this model with its own `generate`."
        )

    def run(self, every_layer: bool, **inputs) -> PassStates:
        """One pass of the backbone over `inputs` (input_ids, cache, ...); with every layer's hidden states if
        `every_layer`."""
        out = self.backbone(**inputs, use_cache=True, output_hidden_states=every_layer)
        return PassStates(out.last_hidden_state, out.hidden_states if every_layer else None)
