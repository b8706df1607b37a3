"""A feature-level drafter (EAGLE-3's design): one transformer decoder layer of its own that reads the base model's
hidden states at a few layers, fused by a linear layer (`fc`), beside the input embedding of the next token, and
drafts autoregressively: the feature it outputs at one level is its input at the next.

Entry j of the drafter pairs a feature with token j (the token at position j): the base model's fused feature at
j - 1 when that one is known (the prompt and every accepted token), else the drafter's own output at j - 1 (a node
it drafted). Its output after the final norm scores token j + 1. The layer's attention reads the normed embedding
and the normed feature side by side, so its q, k and v projections take twice the hidden size; the parameters are
named as EAGLE-3's checkpoints name them (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so that an export
to the engines that serve them is a renaming.

Training unrolls the drafter on its own outputs ("training-time test", `unroll`): step 0 is teacher forcing on the
base model's features; at step k entry j reads the step k - 1 output at j - 1 and attends to the true entries up
to j - k and to its own chain (the step i entry at j - k + i, i = 1 .. k), which is exactly what a node at depth
k + 1 attends to when decoding (the cache up to its root, its ancestors, itself). Step k at entry j predicts token
j + 1, k + 1 tokens past the last true feature: "head k" of the metrics, as for Medusa heads.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from mtp.decoding.target import Target
from mtp.drafters.contract import Drafter, DrafterConfig
from mtp.drafters.eagle_proposer import EagleProposer
from mtp.internals import version
from mtp.linears import int8_product, uses_int8_rows

# the base's rotary settings the drafter's layer takes: its type, theta and scaling (not a partial rotary factor:
# the drafter rotates whole heads)
ROPE_KEYS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def layer_shape(model: PreTrainedModel) -> dict:
    """The drafter layer's shape, copied from the base model's decoder layers (the attention heads, the MLP, the
    norm's epsilon, the rotary embedding): `DrafterConfig.draft_layer`."""
    config = model.config.get_text_config(decoder=True)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or hidden // heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu"),
        "rms_norm_eps": getattr(config, "rms_norm_eps", None) or 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
        | {
            k: v
            for k, v in (getattr(config, "rope_parameters", None) or {}).items()
            if k in ROPE_KEYS and v is not None
        },
        "max_position_embeddings": getattr(config, "max_position_embeddings", None) or 4096,
    }


class Attention(nn.Module):
    """Grouped-query attention whose queries, keys and values read [normed embedding, normed feature] (2H)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        wide, self.heads, self.kv_heads, self.head_dim = (
            2 * config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(wide, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, rotary, past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor):
        """x (B, Q, 2H), rotary (cos, sin) at the queries' positions, past keys and values (B, G, S, d) already
        rotated, mask (B, 1, Q, S+Q) bool (True: seen) -> (output (B, Q, H), the queries' keys and values)."""
        batch, queries, _ = x.shape
        q = self.q_proj(x).view(batch, queries, self.heads, self.head_dim).transpose(1, 2)  # (B, heads, Q, d)
        k = self.k_proj(x).view(batch, queries, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, G, Q, d)
        v = self.v_proj(x).view(batch, queries, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        group = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), attn_mask=mask
        )  # (B, heads, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(batch, queries, -1)), (k, v)


class Layer(nn.Module):
    """The drafter's decoder layer: pre-norm attention over [embedding, feature], then a pre-norm MLP, each with
    the feature as its residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # the token embedding's
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)  # the feature's
        self.self_attn = Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, feature, embedding, rotary, past, mask):
        """feature, embedding (B, Q, H) -> (the new features (B, Q, H), the queries' keys and values)."""
        x = torch.cat([self.input_layernorm(embedding), self.hidden_norm(feature)], -1)  # (B, Q, 2H)
        attended, cached = self.self_attn(x, rotary, past, mask)
        hidden = feature + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), cached


class Eagle(Drafter, kind="eagle"):
    """The feature-level drafter's weights; `num_heads` is the number of unrolled training steps (decoding drafts
    as deep as its tree asks)."""

    exports = ("eagle3", "speculators")  # EAGLE-3's layout (vLLM, SGLang) and vLLM's speculators format

    def __init__(self, config: DrafterConfig):
        super().__init__()
        if not config.draft_layer:
            raise ValueError(
                "An eagle drafter needs its layer's shape (DrafterConfig.draft_layer): build it with "
                "Eagle.new(config, base_model), which copies the base model's."
            )
        if not config.feature_layers:
            raise ValueError("feature_layers is empty: name the base model's hidden states the drafter reads.")
        self.config = config
        layer = LlamaConfig(**config.draft_layer)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.midlayer = Layer(layer)
        self.norm = LlamaRMSNorm(hidden, layer.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(layer)
        draft = torch.arange(vocab) if config.draft_vocab is None else torch.tensor(sorted(config.draft_vocab))
        self.lm_head = nn.Linear(hidden, len(draft), bias=False) if config.lm_head == "own" else None
        # EAGLE-3's draft vocabulary: draft id i is target id i + d2t[i]; t2d marks the target ids drafted
        self.register_buffer("d2t", draft - torch.arange(len(draft)))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft, True))

    @classmethod
    def default_layers(cls, depth: int) -> list[int]:
        """EAGLE-3's: a low, a middle and a high layer (the last one alone for a base of fewer than 6)."""
        return [2, depth // 2, depth - 3] if depth >= 6 else [depth]

    @classmethod
    def new(cls, config: DrafterConfig, base_model: PreTrainedModel) -> "Eagle":
        """A fresh drafter for `base_model`: its layer shaped as the base's; fc starts as the mean of the features,
        an own lm_head as the base's rows of the draft vocabulary."""
        config.draft_layer = config.draft_layer or layer_shape(base_model)
        drafter = cls(config)
        layers = len(config.feature_layers)
        with torch.no_grad():
            drafter.fc.weight.copy_(torch.eye(config.hidden_size).repeat(1, layers) / layers)
            if drafter.lm_head is not None:
                drafter.lm_head.weight.copy_(base_model.get_output_embeddings().weight[drafter.draft_ids])
        return drafter.to(base_model.dtype)

    @classmethod
    def from_foreign(cls, folder: Path, raw: dict) -> "Eagle | None":
        """An EAGLE-3 checkpoint, or vLLM's speculators format (`draft_vocab_size` in its config): `from_eagle3`."""
        return cls.from_eagle3(folder, raw) if "draft_vocab_size" in raw else None

    @classmethod
    def from_eagle3(cls, folder: Path, raw: dict) -> "Eagle":
        """An EAGLE-3 drafter as SafeAILab/EAGLE, vLLM and SGLang lay it out (`config.json` with `draft_vocab_size`;
        `fc`, `midlayer.*` or `layers.0.*`, `norm`, `lm_head`, `d2t` in `model*.safetensors`), or in vLLM's
        speculators format (`speculators_config`, the layer's fields in `transformer_layer_config`). Feature layers
        are read as vLLM reads them (`eagle_aux_hidden_state_layer_ids`: transformers' `hidden_states` indices)."""
        speculators = "speculators_config" in raw
        layer = raw["transformer_layer_config"] if speculators else raw
        variants = [
            key
            for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
            if raw.get(key, speculators and key == "norm_before_residual")
        ]  # vLLM's defaults
        if variants or layer.get("num_hidden_layers", 1) != 1:
            what = ", ".join(variants) or "more than one layer"
            raise ValueError(
                f"{folder / 'config.json'} describes an EAGLE-3 variant mtp does not build ({what}): "
                f"serve it with vLLM or SGLang."
            )
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ValueError(
                f"{folder / 'config.json'} names no feature layers: add `eagle_aux_hidden_state_layer_ids`"
                f" (EAGLE-3's default for a base of L layers: [2, L // 2, L - 3])."
            )
        weights = _eagle3_weights(folder)
        vocab = layer["vocab_size"]
        d2t = weights.pop("d2t", None)
        for unused in ("t2d", "embed_tokens.weight"):  # the draft vocabulary is d2t's; embeddings are the base's
            weights.pop(unused, None)
        draft = None if d2t is None else (d2t + torch.arange(len(d2t))).tolist()
        if draft is not None and any(a >= b for a, b in zip(draft, draft[1:], strict=False)):
            raise ValueError(
                f"{folder}: its d2t does not map draft ids to increasing target ids, as EAGLE-3's does: "
                f"not an EAGLE-3 draft vocabulary."
            )
        shape = _eagle3_layer(layer)
        tokens = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] if speculators else 3
        base = raw["speculators_config"]["verifier"].get("name_or_path", "") if speculators else ""
        config = DrafterConfig(
            num_heads=tokens,
            head_type="eagle",
            lm_head="own",
            base_model=base or "",
            hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
            vocab_size=vocab,
            draft_vocab=draft,
            feature_layers=list(ids),
            draft_layer=shape,
        )
        drafter = cls(config)
        drafter.folder = folder
        try:
            missing, unexpected = drafter.load_state_dict(
                weights | {"d2t": drafter.d2t, "t2d": drafter.t2d}, strict=False
            )
        except RuntimeError as error:  # a shape that its config does not describe
            raise ValueError(
                f"{folder}'s weights do not fit its config.json: {str(error).splitlines()[-1].strip()}"
            ) from None
        if missing or unexpected:
            raise ValueError(
                f"{folder} is not an EAGLE-3 drafter of this shape: missing {missing[:3]}, unexpected {unexpected[:3]}."
            )
        return drafter

    def set_draft_vocab(self, ids: list[int], base_model: PreTrainedModel) -> None:
        """Draft among `ids` (kept in id order, as EAGLE-3's d2t has them); an own lm_head restarts as the base's
        rows of them, in the drafter's dtype (float32 in training, whatever the base computes in)."""
        self.config.draft_vocab = sorted(ids)
        draft = torch.tensor(self.config.draft_vocab, device=self.d2t.device)
        self.d2t = draft - torch.arange(len(draft), device=draft.device)
        self.t2d = torch.zeros_like(self.t2d).index_fill_(0, draft, True)
        if self.lm_head is not None:
            weight = base_model.get_output_embeddings().weight[draft].detach().to(self.lm_head.weight.dtype)
            self.lm_head = nn.Linear(*weight.shape[::-1], bias=False, device=weight.device, dtype=weight.dtype)
            self.lm_head.weight.data.copy_(weight)

    def proposer(self, target: Target, cut: dict) -> EagleProposer:
        """This drafter over the rows of a batch (see `mtp.decoding.proposer`), on the trees of each step's plan."""
        return EagleProposer(self, target, cut)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(D,) the target id of each draft column."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def logits(self, features: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """Draft-vocabulary logits (..., D) of the drafter's output features (..., H)."""
        return self.project(self.norm(features), base_lm_head)

    def project(self, normed: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """Draft-vocabulary logits (..., D) of normed output features (..., H); drafting for decoding on a CPU
        (`mtp.linears.uses_int8_rows`), from the rows as int8 (`mtp.linears.quantized_rows`, kept per weight), as the
        heads draft."""
        weight = self.lm_head.weight if self.lm_head is not None else self._rows(base_lm_head)
        if uses_int8_rows(weight.device) and not torch.is_grad_enabled():
            return int8_product(self, normed, weight)
        if self.lm_head is not None:
            return self.lm_head(normed)
        return normed @ weight.T

    def _rows(self, base_lm_head: nn.Module) -> torch.Tensor:
        """The base lm_head's rows of the draft vocabulary (D, H), gathered once per weight."""
        weight = base_lm_head.weight
        key = (weight.data_ptr(), version(weight), weight.device, weight.dtype, self.d2t.data_ptr())
        if getattr(self, "_rows_key", None) != key:
            self._rows_key, self._rows_cache = key, weight[self.draft_ids].detach()
        return self._rows_cache

    def teacher_forced(self, hidden, features, input_ids, keep, embed) -> torch.Tensor:
        """The normed output features (K, N, H) of the K unrolled steps, step k where head k of Medusa heads would
        be (at position t, the last true feature of its chain, for token t + k + 2); `hidden` is unused."""
        return self.norm(self._aligned(features, input_ids, embed)[:, keep])  # (K, N, H)

    def path_guesses(self, hidden, features, input_ids, base_lm_head, embed, k: int) -> torch.Tensor:
        """Target ids of every step's top-k guesses at every position of one sequence, unrolled along the true
        tokens: features (T, F), input_ids (T,) -> (K, T, k); `hidden` is unused."""
        logits = self.logits(self._aligned(features[None], input_ids[None], embed)[:, 0], base_lm_head)  # (K, T, D)
        return self.draft_ids[logits.topk(k, dim=-1).indices]

    def _aligned(self, features: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """`unroll`'s outputs (K, B, T, H), step k at position t: the last true feature of its chain, for token
        t + k + 2 (step k's entry j = t + k + 1, index t + k, shifted back to t; zeros past the end)."""
        steps = self.unroll(features, input_ids, embed, self.config.num_heads)  # (K, B, T-1, H)
        return torch.stack([F.pad(step, (0, 0, 0, k + 1))[:, k:] for k, step in enumerate(steps)])

    def unroll(self, features: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module, steps: int) -> torch.Tensor:
        """Training-time test: the drafter's output features of `steps` unrolled steps at every entry.

        Args:
            features: (B, T, F) the base model's fused-layer features at positions 0 .. T-1 (the concatenated hidden
                states of `feature_layers`).
            input_ids: (B, T) the tokens.
            embed: the base model's input embedding.
            steps: K.

        Returns:
            (K, B, T-1, H): [k, b, i] is step k's output at entry j = i + 1, which scores token j + 1; entries with
            i < k have no true feature at the start of their chain, and their outputs are meaningless.
        """
        feature = self.fc(features[:, :-1])  # (B, L, H), L = T-1: entry j = i+1 reads the feature at j-1
        embedding = embed(input_ids[:, 1:])  # (B, L, H)
        length = feature.shape[1]
        positions = torch.arange(1, length + 1, device=feature.device)[None]  # (1, L) entry j at position j
        rotary = self.rotary(feature, positions)
        query, key = torch.arange(length, device=feature.device)[:, None], torch.arange(length, device=feature.device)
        outputs, past = [], None
        for k in range(steps):
            # step k at i sees step 0 up to i - k, then step m at i - k + m (m = 1 .. k): its chain, itself last
            blocks = [key <= query - k] + [key == query - k + m for m in range(1, k + 1)]  # each (L, L)
            mask = torch.cat(blocks, 1)[None, None]  # (1, 1, L, (k+1) L)
            hidden, (keys, values) = self.midlayer(feature, embedding, rotary, past, mask)
            outputs.append(hidden)
            past = (keys, values) if past is None else (torch.cat([past[0], keys], 2), torch.cat([past[1], values], 2))
            feature = F.pad(hidden, (0, 0, 1, 0))[:, :-1]  # (B, L, H): entry i reads step k's output at i - 1
        return torch.stack(outputs)


def _eagle3_weights(folder: Path) -> dict[str, torch.Tensor]:
    """An EAGLE-3 folder's weights, named as `Eagle` names them (its layer `midlayer`, no `model.` prefix)."""
    files = sorted(folder.glob("model*.safetensors"))
    if files:
        stored = {name: tensor for file in files for name, tensor in load_file(file).items()}
    elif (folder / "pytorch_model.bin").is_file():  # as SafeAILab/EAGLE's published drafters are stored
        stored = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(
            f"{folder / 'model.safetensors'} (or pytorch_model.bin) does not exist: an "
            f"EAGLE-3 drafter keeps its weights there."
        )
    return {name.removeprefix("model.").replace("layers.0.", "midlayer.", 1): tensor for name, tensor in stored.items()}


def _eagle3_layer(layer: dict) -> dict:
    """The draft layer's shape and rotary settings (`DrafterConfig.draft_layer`) from an EAGLE-3 config's fields."""
    heads = layer["num_attention_heads"]
    scaling = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    rope = {"rope_type": scaling.get("type", "default"), "rope_theta": float(layer.get("rope_theta") or 10000.0)}
    rope |= {k: v for k, v in scaling.items() if k in ROPE_KEYS and v is not None}
    shape = {name: layer[name] for name in ("hidden_size", "num_attention_heads", "intermediate_size")}
    return shape | {
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_parameters": rope,
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
    }
