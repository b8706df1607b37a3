"""Medusa-style heads: head k reads the base model's last hidden state at position t and predicts token t+k+2."""

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from mtp.decoding.proposer import TreeProposer
from mtp.decoding.target import Target
from mtp.drafters.contract import Drafter, DrafterConfig
from mtp.internals import version
from mtp.linears import draft_linear, narrow_rows, product, quantized_product, quantized_rows, uses_int8_rows


def following_tokens(input_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T) -> (B, T, K): [b, t, j] is token t+1+j (0 past the end), what head j-1 and later ones read at t."""
    length = input_ids.shape[1]
    padded = F.pad(input_ids, (0, num_heads))  # (B, T+K)
    return torch.stack([padded[:, 1 + j : 1 + j + length] for j in range(num_heads)], -1)  # (B, T, K)


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so that a new block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(draft_linear(self.linear, x))


class Heads(Drafter):
    """What every kind of head shares: `num_heads` stacks of residual blocks, each followed by a vocabulary
    projection (the base lm_head, or an own copy per head), a draft vocabulary, and the folder format. A kind
    says what head k reads (`state`; `reads_path`: the embeddings of the tokens after t too); a step drafts the
    tree level by level, head d - 1 guessing the children of the nodes of depth d - 1 (`guess`).

    New heads predict exactly what the base lm_head predicts (the blocks start as the identity and an `own`
    projection as a copy of the base lm_head); training moves head k to token t+k+2.
    """

    def __init__(self, config: DrafterConfig, lm_head_weight: torch.Tensor | None = None):
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

    @classmethod
    def new(cls, config: DrafterConfig, base_model: PreTrainedModel) -> "Heads":
        """New heads for `base_model` (an `own` projection starts as a copy of its lm_head)."""
        return cls(config, base_model.get_output_embeddings().weight.detach())

    @property
    def max_depth(self) -> int:
        """The deepest node a tree of these heads may hold: head d - 1 guesses depth d."""
        return self.config.num_heads

    def proposer(self, target: Target, cut: dict) -> "HeadsProposer":
        """These heads drafting over the rows of a batch (`mtp.decoding.proposer`), on the trees of each step's plan."""
        return HeadsProposer(self, target, cut)

    def teacher_forced(self, hidden, features, input_ids, keep, embed) -> torch.Tensor:
        """Every head's states (see `Drafter.teacher_forced`), heads that read the path reading the true tokens;
        `features` is unused (no layers but the last)."""
        following = None  # (N, K, H) the input embeddings of the true tokens t+1 .. t+K, for heads that read them
        if self.reads_path:
            following = embed(following_tokens(input_ids, self.config.num_heads)[keep])
        return self._states(hidden[keep], following, 0, self.config.num_heads)  # (K, N, H)

    def path_guesses(self, hidden, features, input_ids, base_lm_head, embed, k: int) -> torch.Tensor:
        """Token ids of every head's top-k guesses at every position of one sequence, heads that read the path
        reading the true one: hidden (T, H), input_ids (T,) -> (K, T, k); `features` is unused."""
        following = embed(following_tokens(input_ids[None], self.config.num_heads))[0] if self.reads_path else None
        heads = range(self.config.num_heads)
        return torch.stack([self.guess(hidden, following, head, k, base_lm_head)[0] for head in heads])  # (K, T, k)

    def state(self, k: int, hidden: torch.Tensor, following: torch.Tensor | None) -> torch.Tensor:
        """Head k's last hidden state (..., H), before its projection.

        Args:
            hidden: the base model's last hidden states at t (after its final norm), (..., H).
            following: the base model's input embeddings of the tokens t+1, t+2, ... (..., >= k+1, H), read by
                the kinds of head that see the candidate path (None for the others).
        """
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, base_lm_head: nn.Module, following=None) -> torch.Tensor:
        """Every head's logits over the whole vocabulary: hidden (..., H) -> (K, ..., V); `following` as in
        `state`."""
        return self._project_whole(self._states(hidden, following, 0, self.config.num_heads), base_lm_head)

    def project(self, states: torch.Tensor, base_lm_head: nn.Module, first: int = 0) -> torch.Tensor:
        """Logits of heads first .. first+K-1 from their states (K, ..., H): over the draft vocabulary if there is
        one (K, ..., N), else the whole (K, ..., V)."""
        if self.config.draft_vocab is None:
            return self._project_whole(states, base_lm_head, first)
        return self._project_draft(states, base_lm_head, first)

    def _project_draft(self, states: torch.Tensor, base_lm_head: nn.Module, first: int = 0) -> torch.Tensor:
        """Draft-vocabulary logits of heads first .. first+K-1 from their states: (K, ..., H) -> (K, ..., N)."""
        _, weights = self._draft_rows(base_lm_head)  # (K or 1, N, H)
        flat = states.flatten(1, -2) if states.dim() > 2 else states[:, None]  # (K, M, H)
        rows = weights if self.projections is None else weights[first : first + len(states)]  # shared: broadcast
        if len(rows) == 1 and uses_int8_rows(flat.device) and not torch.is_grad_enabled():
            if self._quantized is None:  # the rows as int8, once per gather
                self._quantized = [quantized_rows(each) for each in weights]
            logits = quantized_product(flat, self._quantized[0 if self.projections is None else first])
        elif len(rows) == 1:  # one weight: the product measured faster here, as a linear layer's (bfloat16 `bmm`
            logits = product(flat, rows[0], self._narrow)  # ran 4x slower a row)
        else:
            logits = flat @ rows.mT
        return logits.reshape(*states.shape[:-1], -1)  # (K, ..., N)

    def _states(self, hidden: torch.Tensor, following, first: int, last: int) -> torch.Tensor:
        """PassStates of heads first .. last-1: (K, ..., H)."""
        return torch.stack([self.state(k, hidden, following) for k in range(first, last)])

    def _project_whole(self, states: torch.Tensor, base_lm_head: nn.Module, first: int = 0) -> torch.Tensor:
        """Whole-vocabulary logits of heads first .. first+K-1 from their states: (K, ..., H) -> (K, ..., V)."""
        if self.projections is None:  # one pass over the shared weight for all heads, not one per head
            return base_lm_head(states)
        return torch.stack([self.projections[first + i](state) for i, state in enumerate(states)])

    def guess(self, hidden, following, head: int, k: int, base_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Head `head`'s top-k guesses, from the draft vocabulary if there is one: their token ids (..., k) and log
        probabilities (..., k), most probable first; hidden (..., H) and `following` as in `state`."""
        logits = self.project(self._states(hidden, following, head, head + 1), base_lm_head, head)[0]  # (..., V or N)
        logp, best = logits.float().log_softmax(-1).topk(k, dim=-1)
        return (best if self.config.draft_vocab is None else self._draft_rows(base_lm_head)[0][best]), logp

    def _draft_rows(self, base_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft vocabulary's ids (N,) and its rows of the projections (K or 1, N, H), gathered once per
        draft vocabulary and projection weights (the gather copies N x H floats: too much to repeat every step); with
        them, the row counts for which the product with these rows runs faster as W x^T here (`self._narrow`,
        `mtp.linears.narrow_rows`).
        Drafting for decoding on a CPU quantizes them to int8 on first use (`self._quantized`,
        `mtp.linears.uses_int8_rows`: a quarter of the bytes that a level of the tree streams)."""
        sources = [base_lm_head.weight] if self.projections is None else [p.weight for p in self.projections]
        # the draft list itself is in the key (compared by identity first, then by value): a new list is new rows
        key = [self.config.draft_vocab, *((w.data_ptr(), version(w), w.device, w.dtype) for w in sources)]
        # training own projections: a fresh gather every time, inside the autograd graph
        trainable = torch.is_grad_enabled() and any(w.requires_grad for w in sources)
        if trainable or getattr(self, "_draft_key", None) != key:
            ids = torch.tensor(self.config.draft_vocab, device=sources[0].device)  # (N,)
            self._draft_key, self._draft = None if trainable else key, (ids, torch.stack([w[ids] for w in sources]))
            self._quantized = None
            self._narrow = set(next(iter(narrow_rows(list(self._draft[1])).values()))) if not trainable else set()
        return self._draft

    @staticmethod
    def from_faster_decoding(folder: Path, raw: dict) -> "MedusaHeads":
        """Medusa heads trained by FasterDecoding/Medusa: `config.json` with `medusa_num_heads`,
        `medusa_num_layers` and `base_model_name_or_path`, weights in `medusa_lm_head.safetensors` (or `.pt`),
        head h being blocks `{h}.{l}.linear.weight|bias` then its own projection `{h}.{medusa_num_layers}.weight`."""
        files = [folder / f"medusa_lm_head.{ext}" for ext in ("safetensors", "pt")]
        found = next((file for file in files if file.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{files[0]} (or .pt) does not exist: a Medusa checkpoint keeps its heads there.")
        weights = load_file(found) if found.suffix == ".safetensors" else torch.load(found, weights_only=True)
        num_heads, num_layers = raw["medusa_num_heads"], raw.get("medusa_num_layers", 1)
        vocab_size, hidden_size = weights.get(f"0.{num_layers}.weight", torch.empty(0, 0)).shape
        config = DrafterConfig(
            num_heads=num_heads,
            num_layers=num_layers,
            lm_head="own",
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            base_model=raw.get("base_model_name_or_path") or "",
        )
        names = {f"projections.{h}.weight": f"{h}.{num_layers}.weight" for h in range(num_heads)}
        for h in range(num_heads):
            for i in range(num_layers):
                names |= {f"blocks.{h}.{i}.linear.{p}": f"{h}.{i}.linear.{p}" for p in ("weight", "bias")}
        missing = sorted(set(names.values()) - set(weights))
        if missing:
            raise ValueError(f"{found} lacks {missing[:3]}: not the heads of a {num_heads}-head Medusa checkpoint.")
        ours = {name: weights[theirs] for name, theirs in names.items()}
        heads = MedusaHeads(config)
        heads.load_state_dict(ours)
        return heads


class MedusaHeads(Heads, kind="medusa"):
    """Medusa heads: head k reads the base model's hidden state at t alone, blind to the tokens before its
    target, so one pass of all heads fills the whole tree."""

    reads_path = False
    exports = ("vllm",)  # vLLM's Medusa model: heads that read the hidden state alone

    @classmethod
    def from_foreign(cls, folder: Path, raw: dict) -> "MedusaHeads | None":
        return cls.from_faster_decoding(folder, raw) if "medusa_num_heads" in raw else None

    def state(self, k: int, hidden: torch.Tensor, following: torch.Tensor | None = None) -> torch.Tensor:
        return self.blocks[k](hidden)


class HydraHeads(Heads, kind="hydra"):
    """Sequentially dependent heads (Hydra, Ankner et al. 2024): head k reads the hidden state at t and the base
    model's input embeddings of the tokens t+1 .. t+k+1 (the true ones in training, the candidate path when
    decoding), mixed by a linear layer that starts as "hidden state only", then residual blocks. A step fills
    the tree level by level: head d-1 runs once over every node of depth d-1 that has children."""

    reads_path = True

    def __init__(self, config: DrafterConfig, lm_head_weight: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight)
        hidden = config.hidden_size
        self.inputs = nn.ModuleList(nn.Linear((k + 2) * hidden, hidden) for k in range(config.num_heads))
        for layer in self.inputs:  # [I 0 .. 0]: a new head reads the hidden state alone, as a Medusa head does
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
            layer.weight.data[:, :hidden] = torch.eye(hidden)

    def state(self, k: int, hidden: torch.Tensor, following: torch.Tensor | None) -> torch.Tensor:
        if following is None or following.shape[-2] < k + 1:
            raise ValueError(f"Hydra head {k} reads the embeddings of the {k + 1} tokens after t: pass `following`.")
        path = following[..., : k + 1, :].flatten(-2)  # (..., (k+1) H)
        return self.blocks[k](draft_linear(self.inputs[k], torch.cat([hidden.expand(*path.shape[:-1], -1), path], -1)))


class HeadsProposer(TreeProposer):
    """Heads over the rows of a batch: each row's last hidden state is all they read."""

    name = "heads"

    def __init__(self, heads: Heads, target: Target, cut: dict):
        super().__init__(target, cut)
        self.heads, self.hidden = heads, []  # per row, (H,) the hidden state at its last cached position

    def add(self, input_ids, states, root):
        self.hidden.append(states.last[0, -1])

    def expand(self, draft, nodes, depth, k):
        hidden = torch.stack(self.hidden)[:, None]  # (B, 1, H)
        following = self.target.embed(draft.paths(nodes)) if self.heads.reads_path else None  # (B, P, depth, H)
        best, logp = self.heads.guess(hidden, following, depth - 1, k, self.target.lm_head)  # (B, P or 1, k)
        return best.expand(-1, nodes.shape[1], -1), logp.expand(-1, nodes.shape[1], -1)

    def accept(self, states, nodes, settled):
        self.hidden = [states.last[b, row_nodes[-1]] for b, row_nodes in enumerate(nodes)]

    def keep(self, rows):
        self.hidden = [hidden for hidden, kept in zip(self.hidden, rows, strict=True) if kept]
