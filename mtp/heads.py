"""Medusa-style heads: head k reads the base model's last hidden state at position t and predicts token t+k+2."""

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class HeadsConfig:
    """Shape of the heads and the identity of the base model they were trained on."""

    num_heads: int = 4
    """Number of heads; head k predicts the token k+2 positions ahead."""
    num_layers: int = 1
    """Residual blocks per head."""
    lm_head: str = "shared"
    """`shared`: project with the base model's frozen lm_head (no extra parameters); `own`: a trainable copy."""
    base_model: str = ""
    """Name the base model was loaded by (see `mtp.base.load_base`)."""
    hidden_size: int = 0
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    """sha256 (first 16 hex digits) of the base tokenizer's sorted vocabulary."""
    calibration: list[list[float]] | None = None
    """calibration[k][r]: fraction of held-out positions where head k's rank-r guess (r from 0) was the token
    (measured by the last validation run of training); the tree search starts from it."""
    tree: list[list[int]] | None = None
    """Paths of the decoding tree chosen for these heads (see `mtp.tree`); None: the default named tree."""
    draft_vocab: list[int] | None = None
    """Token ids the heads' guesses are drawn from when decoding (the most frequent target tokens of the
    training data): each head's projection then scores these rows only. None: the whole vocabulary."""

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads={self.num_heads}: need at least 1 head.")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: need at least 1 residual block per head.")
        if self.lm_head not in ("shared", "own"):
            raise ValueError(f"lm_head={self.lm_head!r}: choose 'shared' (the base's frozen lm_head) or 'own'.")

    def identity(self) -> str:
        return (
            f"{self.base_model!r} (hidden {self.hidden_size}, vocab {self.vocab_size}, "
            f"tokenizer {self.tokenizer_fingerprint})"
        )


def base_identity(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The fields of `HeadsConfig` that pin the base model."""
    vocab_size, hidden_size = model.get_output_embeddings().weight.shape
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    fingerprint = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return dict(base_model=name, hidden_size=hidden_size, vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so that a new block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` stacks of residual blocks, each followed by a vocabulary projection.

    A new head predicts exactly what the base lm_head predicts (the blocks start as the identity and an
    `own` projection starts as a copy of the base lm_head); training moves head k to token t+k+2.
    """

    def __init__(self, config: HeadsConfig, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        # A fresh module per layer and per head: `[ResidualBlock(h)] * n` would share one.
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        self.projections = None
        if config.lm_head == "own":
            self.projections = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(config.num_heads))
            if lm_head_weight is not None:
                for projection in self.projections:
                    projection.weight.data.copy_(lm_head_weight)

    def forward(self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first `num_heads` heads (default: all): hidden (..., H) -> (K, ..., V).

        Args:
            hidden: the base model's last hidden states (after its final norm).
            base_lm_head: the base model's output projection, used when `lm_head == "shared"`.
            num_heads: compute only heads 0..num_heads-1 (a tree of depth d needs the first d).
        """
        states = self._states(hidden, num_heads)  # (K, ..., H)
        if self.projections is None:  # one pass over the shared weight for all heads, not one per head
            return base_lm_head(states)  # (K, ..., V)
        return torch.stack([projection(state) for projection, state in zip(self.projections, states, strict=False)])

    def guesses(self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int, k: int) -> torch.Tensor:
        """Token ids of the top-k guesses of the first `num_heads` heads, from the draft vocabulary if there is one:
        hidden (H,) -> (D, k)."""
        if self.config.draft_vocab is None:
            return self(hidden, base_lm_head, num_heads).topk(k, dim=-1).indices  # (D, k)
        ids, _ = self._draft_rows(base_lm_head)  # (N,)
        return ids[self.draft_logits(hidden, base_lm_head, num_heads).topk(k, dim=-1).indices]  # (D, k)

    def draft_logits(self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary only (column n: token `draft_vocab[n]`): hidden (..., H) -> (K, ..., N)."""
        states = self._states(hidden, num_heads)  # (K, ..., H)
        _, weights = self._draft_rows(base_lm_head)  # (K or 1, N, H)
        flat = states.flatten(1, -2) if states.dim() > 2 else states[:, None]  # (K, M, H)
        logits = flat @ weights[: len(states)].mT  # (K, M, N): the shared rows broadcast over the heads
        return logits.view(*states.shape[:-1], -1)  # (K, ..., N)

    def _states(self, hidden: torch.Tensor, num_heads: int | None) -> torch.Tensor:
        """The first `num_heads` heads' residual blocks over hidden (..., H) -> (K, ..., H)."""
        return torch.stack([blocks(hidden) for blocks in self.blocks[:num_heads]])

    def _draft_rows(self, base_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft vocabulary's ids (N,) and its rows of the projections (K or 1, N, H), gathered once per
        draft vocabulary and projection weights (the gather copies N x H floats: too much to repeat every step)."""
        sources = [base_lm_head.weight] if self.projections is None else [p.weight for p in self.projections]
        # the draft list itself is in the key (compared by identity first, then by value): a new list is new rows
        key = [self.config.draft_vocab, *((w.data_ptr(), w._version, w.device, w.dtype) for w in sources)]
        # training own projections: a fresh gather every time, inside the autograd graph
        trainable = torch.is_grad_enabled() and any(w.requires_grad for w in sources)
        if trainable or getattr(self, "_draft_key", None) != key:
            ids = torch.tensor(self.config.draft_vocab, device=sources[0].device)  # (N,)
            self._draft_key, self._draft = None if trainable else key, (ids, torch.stack([w[ids] for w in sources]))
        return self._draft

    def check_base(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise if these heads were trained for a base other than (model, tokenizer)."""
        other = HeadsConfig(**{**asdict(self.config), **base_identity(name, model, tokenizer)})
        pinned = ("hidden_size", "vocab_size", "tokenizer_fingerprint")
        if any(getattr(self.config, field) != getattr(other, field) for field in pinned):
            raise ValueError(
                f"These heads were trained for base model {self.config.identity()}, not for {other.identity()}: "
                f"load them with the base they were trained for, or train heads for this base."
            )

    def save_config(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    def save_pretrained(self, folder: str | Path) -> None:
        """Write `config.json` and `model.safetensors` (heads only, never base weights)."""
        self.save_config(folder)
        save_file(
            {name: tensor.contiguous() for name, tensor in self.state_dict().items()},
            Path(folder) / "model.safetensors",
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "MedusaHeads":
        folder = Path(folder)
        for file in ("config.json", "model.safetensors"):
            if not (folder / file).is_file():
                raise FileNotFoundError(
                    f"{folder / file} does not exist: point at a folder written by save_pretrained."
                )
        raw = json.loads((folder / "config.json").read_text())
        unknown = set(raw) - {field.name for field in fields(HeadsConfig)}
        if unknown:
            raise ValueError(f"{folder / 'config.json'} has unknown keys {sorted(unknown)}: not a heads folder?")
        heads = cls(HeadsConfig(**raw))
        heads.load_state_dict(load_file(folder / "model.safetensors"))
        return heads
