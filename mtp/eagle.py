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

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from mtp.folder import Drafter, HeadsConfig


def layer_shape(model: PreTrainedModel) -> dict:
    """The drafter layer's shape, copied from the base model's decoder layers (the attention heads, the MLP, the
    norm's epsilon, the rotary embedding): `HeadsConfig.draft_layer`."""
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
        | {k: v for k, v in (getattr(config, "rope_parameters", None) or {}).items() if k in ("rope_type", "rope_theta")
           and v is not None},
        "max_position_embeddings": getattr(config, "max_position_embeddings", None) or 4096,
    }  # fmt: skip


class Attention(nn.Module):
    """Grouped-query attention whose queries, keys and values read [normed embedding, normed feature] (2H)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        wide, self.heads, self.kv_heads, self.head_dim = (
            2 * config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )  # fmt: skip
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


class Eagle(Drafter):
    """The feature-level drafter's weights; `num_heads` is the number of unrolled training steps (decoding drafts
    as deep as its tree asks)."""

    reads_path = True

    def __init__(self, config: HeadsConfig):
        super().__init__()
        if not config.draft_layer:
            raise ValueError("An eagle drafter needs its layer's shape (HeadsConfig.draft_layer): build it with "
                             "Eagle.new(config, base_model), which copies the base model's.")  # fmt: skip
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
    def new(cls, config: HeadsConfig, base_model: PreTrainedModel) -> "Eagle":
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

    def set_draft_vocab(self, ids: list[int], base_model: PreTrainedModel) -> None:
        """Draft among `ids` (kept in id order, as EAGLE-3's d2t has them); an own lm_head restarts as the base's
        rows of them."""
        self.config.draft_vocab = sorted(ids)
        draft = torch.tensor(self.config.draft_vocab, device=self.d2t.device)
        self.d2t = draft - torch.arange(len(draft), device=draft.device)
        self.t2d = torch.zeros_like(self.t2d).index_fill_(0, draft, True)
        if self.lm_head is not None:
            weight = base_model.get_output_embeddings().weight[draft].detach().clone()
            self.lm_head = nn.Linear(*weight.shape[::-1], bias=False, device=weight.device, dtype=weight.dtype)
            self.lm_head.weight.data.copy_(weight)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(D,) the target id of each draft column."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def logits(self, features: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """Draft-vocabulary logits (..., D) of the drafter's output features (..., H)."""
        normed = self.norm(features)
        if self.lm_head is not None:
            return self.lm_head(normed)
        return normed @ self._rows(base_lm_head).T

    def _rows(self, base_lm_head: nn.Module) -> torch.Tensor:
        """The base lm_head's rows of the draft vocabulary (D, H), gathered once per weight."""
        weight = base_lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype, self.d2t.data_ptr())
        if getattr(self, "_rows_key", None) != key:
            self._rows_key, self._rows_cache = key, weight[self.draft_ids].detach()
        return self._rows_cache

    def teacher_forced(self, hidden, features, input_ids, keep, base_lm_head, embed) -> torch.Tensor:
        """Training: the draft logits (K, N, D) of the K unrolled steps, step k where head k of Medusa heads would
        be (at position t, the last true feature of its chain, for token t + k + 2), at the N positions `keep`
        (B, T) marks; features (B, T, F) the base model's features, input_ids (B, T). `hidden` is unused."""
        steps = self.unroll(features, input_ids, embed, self.config.num_heads)  # (K, B, T-1, H)
        # step k's entry j = t + k + 1 (index t + k) scores token t + k + 2: shift it back to t
        aligned = torch.stack([F.pad(step, (0, 0, 0, k + 1))[:, k:] for k, step in enumerate(steps)])  # (K, B, T, H)
        return self.logits(aligned[:, keep], base_lm_head)  # (K, N, D)

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
