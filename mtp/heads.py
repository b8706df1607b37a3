"""Medusa-style heads: head k reads the base model's last hidden state at position t and predicts token t+k+2."""

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mtp.lookup import MAX_NGRAM

# what a heads folder holds (adapter_*: peft's files of a base adapter trained with the heads)
HEADS_FILES = ["config.json", "model*.safetensors", "medusa_lm_head.*", "README.md", "adapter_*"]
SHARD_BYTES = 8_000_000  # weights past this are written in parts (model-00001-of-0000N.safetensors), small files


@dataclass
class HeadsConfig:
    """Shape of the heads and the identity of the base model they were trained on."""

    num_heads: int = 4
    """Number of heads; head k predicts the token k+2 positions ahead."""
    head_type: str = "medusa"
    """`medusa`: head k reads the base model's hidden state at t; `hydra`: also the input embeddings of the tokens
    t+1 .. t+k+1 (the candidate path when decoding): sequentially dependent heads."""
    num_layers: int = 1
    """Residual blocks per head."""
    lm_head: str = "shared"
    """`shared`: project with the base model's frozen lm_head (no extra parameters); `own`: a trainable copy."""
    base_model: str = ""
    """Name the base model was loaded by (see `mtp.base.load_base`)."""
    hidden_size: int = 0
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    """sha256 (first 16 hex digits) of the base tokenizer's sorted vocabulary ("": unknown, for heads imported
    from a FasterDecoding Medusa checkpoint; then only the sizes are checked)."""
    calibration: list[list[float]] | None = None
    """calibration[k][r]: fraction of held-out positions where head k's rank-r guess (r from 0) was the token
    (measured by the last validation run of training); the tree search starts from it."""
    tree: list[list[int]] | None = None
    """Paths of the decoding tree chosen for these heads (see `mtp.tree`); None: the default named tree."""
    lookup: list[int] = field(default_factory=list)
    """Prompt-lookup tokens verified beside the tree after a match of 1, 2, ... tokens (`mtp.lookup.Lookup`'s
    lengths), chosen with the tree by `mtp.sizing`; empty: none."""
    batch_trees: list[dict] = field(default_factory=list)
    """Trees and lookups for steps over several prompts at once, chosen by `mtp.sizing`: each {"rows": B, "tree":
    paths, "lookup": lengths} holds for steps over B or more rows (up to the next entry's B); empty: `tree` and
    `lookup` for every step."""
    adapter: bool = False
    """The folder also holds a LoRA adapter of the base model trained with the heads (peft's `adapter_config.json`
    and `adapter_model.safetensors`): decoding merges it into the base, and the output is the adapted model's."""
    base_weights: str = ""
    """With an adapter: `weights_fingerprint` of the base it was trained on (an adapter fits those weights only)."""
    draft_vocab: list[int] | None = None
    """Token ids the heads' guesses are drawn from when decoding (the most frequent target tokens of the
    training data): each head's projection then scores these rows only. None: the whole vocabulary."""

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads={self.num_heads}: need at least 1 head.")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: need at least 1 residual block per head.")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type={self.head_type!r}: choose one of {sorted(HEAD_TYPES)}.")
        if self.lm_head not in ("shared", "own"):
            raise ValueError(f"lm_head={self.lm_head!r}: choose 'shared' (the base's frozen lm_head) or 'own'.")
        if isinstance(self.lookup, int):  # heads sized before lookup lengths depended on the match
            self.lookup = [self.lookup] * MAX_NGRAM if self.lookup else []

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


def weights_fingerprint(model: PreTrainedModel) -> str:
    """sha256 (first 16 hex digits) of a strided sample of every weight of `model` (4,096 values per tensor at
    most), rounded to bfloat16: the same whether the weights were loaded in float32 or bfloat16 (float16 rounds
    them otherwise)."""
    digest = hashlib.sha256()
    for name, weight in sorted(model.named_parameters()):
        flat = weight.detach().flatten()
        sample = flat[:: max(len(flat) // 4096, 1)].to("cpu", torch.bfloat16)
        digest.update(name.encode() + sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def is_repo_id(name: str) -> bool:
    """`owner/name`: a Hub repository id rather than a path (a missing local folder is never fetched)."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith((".", "/"))


def from_hub(repo_id: str) -> Path:
    """The local copy of the heads in Hub repository `repo_id` (downloaded once into the Hub cache)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HEADS_FILES))
    except Exception as error:  # offline, a missing repository, no access: one message says which and what to do
        raise FileNotFoundError(
            f"{repo_id!r} is not a local folder, and the Hub repository of that name could not be fetched "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): give a folder of heads, "
            f"or check the id and the network."
        ) from error


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so that a new block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class Heads(nn.Module):
    """What every kind of head shares: `num_heads` stacks of residual blocks, each followed by a vocabulary
    projection (the base lm_head, or an own copy per head), a draft vocabulary, and the folder format. A kind
    says what head k reads (`state`; `reads_path`: the embeddings of the tokens after t too) and how a step's
    guesses fill the tree (`tree_tokens`).

    New heads predict exactly what the base lm_head predicts (the blocks start as the identity and an `own`
    projection as a copy of the base lm_head); training moves head k to token t+k+2.
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

    def state(self, k: int, hidden: torch.Tensor, following: torch.Tensor | None) -> torch.Tensor:
        """Head k's last hidden state (..., H), before its projection.

        Args:
            hidden: the base model's last hidden states at t (after its final norm), (..., H).
            following: the base model's input embeddings of the tokens t+1, t+2, ... (..., >= k+1, H), read by
                the kinds of head that see the candidate path (None for the others).
        """
        raise NotImplementedError

    def forward(
        self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int | None = None, following=None
    ) -> torch.Tensor:
        """Logits over the whole vocabulary of the first `num_heads` heads (default: all): hidden (..., H) ->
        (K, ..., V); `following` as in `state`."""
        return self._project(self._states(hidden, following, 0, num_heads or self.config.num_heads), base_lm_head)

    def draft_logits(
        self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int | None = None, following=None, first=0
    ) -> torch.Tensor:
        """Logits over the draft vocabulary only (column n: token `draft_vocab[n]`) of heads first ..
        first+num_heads-1 (default: all from first): hidden (..., H) -> (K, ..., N)."""
        last = self.config.num_heads if num_heads is None else first + num_heads
        states = self._states(hidden, following, first, last)  # (K, ..., H)
        _, weights = self._draft_rows(base_lm_head)  # (K or 1, N, H)
        flat = states.flatten(1, -2) if states.dim() > 2 else states[:, None]  # (K, M, H)
        rows = weights if self.projections is None else weights[first:last]  # shared rows broadcast over heads
        return (flat @ rows.mT).view(*states.shape[:-1], -1)  # (K, ..., N)

    def _states(self, hidden: torch.Tensor, following, first: int, last: int) -> torch.Tensor:
        """States of heads first .. last-1: (K, ..., H)."""
        return torch.stack([self.state(k, hidden, following) for k in range(first, last)])

    def _project(self, states: torch.Tensor, base_lm_head: nn.Module, first: int = 0) -> torch.Tensor:
        """Whole-vocabulary logits of heads first .. first+K-1 from their states: (K, ..., H) -> (K, ..., V)."""
        if self.projections is None:  # one pass over the shared weight for all heads, not one per head
            return base_lm_head(states)
        return torch.stack([self.projections[first + i](state) for i, state in enumerate(states)])

    def _best(self, hidden, base_lm_head, num_heads: int, k: int, following=None, first: int = 0) -> torch.Tensor:
        """Token ids of the top-k guesses of heads first .. first+num_heads-1, from the draft vocabulary if
        there is one: hidden (..., H) -> (K, ..., k)."""
        if self.config.draft_vocab is None:
            states = self._states(hidden, following, first, first + num_heads)  # (K, ..., H)
            return self._project(states, base_lm_head, first).topk(k, dim=-1).indices
        ids, _ = self._draft_rows(base_lm_head)  # (N,)
        return ids[self.draft_logits(hidden, base_lm_head, num_heads, following, first).topk(k, dim=-1).indices]

    def tree_tokens(self, hidden, root: torch.Tensor, tree, base_lm_head, embed: nn.Module, k: int) -> torch.Tensor:
        """The token of every node of `tree` (an `mtp.tree.Tree`) in each of B rows: the root's, then each node's
        guess, node (r1, .., rd) being rank rd of head d-1's guesses: hidden (B, H) at the root's parent, root
        (B, 1) -> (B, N+1). `embed` is the base model's input embedding; `k` the highest rank in the tree + 1."""
        raise NotImplementedError

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
        pinned = ("hidden_size", "vocab_size") + (
            ("tokenizer_fingerprint",) if self.config.tokenizer_fingerprint else ()
        )
        if any(getattr(self.config, field) != getattr(other, field) for field in pinned):
            raise ValueError(
                f"These heads were trained for base model {self.config.identity()}, not for {other.identity()}: "
                f"load them with the base they were trained for, or train heads for this base."
            )
        if self.config.adapter and (found := weights_fingerprint(model)) != self.config.base_weights:
            hint = " (in float16 the weights round otherwise: load it in float32 or bfloat16)"
            raise ValueError(
                f"These heads' adapter was trained on the weights of {self.config.base_model!r} (fingerprint "
                f"{self.config.base_weights}), not on those of {name!r} (fingerprint {found})"
                f"{hint if model.dtype == torch.float16 else ''}: load them with the base they were trained on."
            )

    def adapt(self, model: PreTrainedModel) -> PreTrainedModel:
        """`model` (the base, checked by `check_base`) with the adapter trained beside these heads merged into its
        weights, the verifier these heads decode with; `model` itself if they have none."""
        if not self.config.adapter:
            return model
        from peft import PeftModel

        return PeftModel.from_pretrained(model, self.folder).merge_and_unload()

    def save_config(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write `config.json` and the weights (heads only, never base weights), in `dtype` if given (bfloat16 halves
        them; loading casts them back to the heads' own dtype): `model.safetensors`, or parts of at most
        SHARD_BYTES each when they are larger (`model-00001-of-00002.safetensors`, ...)."""
        self.save_config(folder)
        parts, size = [{}], 0
        for name, tensor in self.state_dict().items():
            tensor = tensor.to(dtype or tensor.dtype).contiguous()
            if parts[-1] and size + tensor.nbytes > SHARD_BYTES:
                parts, size = [*parts, {}], 0
            parts[-1][name], size = tensor, size + tensor.nbytes
        for old in Path(folder).glob("model*.safetensors"):  # a rewrite leaves no stale part behind
            old.unlink()
        for i, part in enumerate(parts, 1):
            name = "model.safetensors" if len(parts) == 1 else f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, Path(folder) / name)

    @staticmethod
    def from_pretrained(folder: str | Path) -> "Heads":
        """Heads saved by `save_pretrained`, of the kind their config names (`head_type`), or a FasterDecoding
        Medusa checkpoint (see `_from_faster_decoding`); `folder` may also be a Hub repository id that holds one."""
        folder = Path(folder) if Path(folder).is_dir() or not is_repo_id(str(folder)) else from_hub(str(folder))
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder / 'config.json'} does not exist: point at a folder of heads.")
        raw = json.loads((folder / "config.json").read_text())
        if "medusa_num_heads" in raw:
            return Heads._from_faster_decoding(folder, raw)
        files = sorted(folder.glob("model*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{folder / 'model.safetensors'} does not exist: point at a folder written by save_pretrained."
            )
        unknown = set(raw) - {field.name for field in fields(HeadsConfig)}
        if unknown:
            raise ValueError(f"{folder / 'config.json'} has unknown keys {sorted(unknown)}: not a heads folder?")
        config = HeadsConfig(**raw)
        heads = HEAD_TYPES[config.head_type](config)
        heads.folder = folder
        heads.load_state_dict({name: tensor for file in files for name, tensor in load_file(file).items()})
        return heads

    @staticmethod
    def _from_faster_decoding(folder: Path, raw: dict) -> "MedusaHeads":
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
        config = HeadsConfig(num_heads=num_heads, num_layers=num_layers, lm_head="own", hidden_size=hidden_size,
                             vocab_size=vocab_size, base_model=raw.get("base_model_name_or_path") or "")  # fmt: skip
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


class MedusaHeads(Heads):
    """Medusa heads: head k reads the base model's hidden state at t alone, blind to the tokens before its
    target, so one pass of all heads fills the whole tree."""

    reads_path = False

    def state(self, k: int, hidden: torch.Tensor, following: torch.Tensor | None = None) -> torch.Tensor:
        return self.blocks[k](hidden)

    def guesses(self, hidden: torch.Tensor, base_lm_head: nn.Module, num_heads: int, k: int) -> torch.Tensor:
        """Token ids of the top-k guesses of the first `num_heads` heads: hidden (..., H) -> (D, ..., k)."""
        return self._best(hidden, base_lm_head, num_heads, k)

    def tree_tokens(self, hidden, root: torch.Tensor, tree, base_lm_head, embed: nn.Module, k: int) -> torch.Tensor:
        guesses = self.guesses(hidden, base_lm_head, len(tree.levels), k)  # (D, B, k): only the heads the tree reaches
        return torch.cat([root, guesses[tree.depths[1:] - 1, :, tree.ranks[1:]].T], 1)  # (N, B) -> (B, N+1)


class HydraHeads(Heads):
    """Sequentially dependent heads (Hydra, Ankner et al. 2024): head k reads the hidden state at t and the base
    model's input embeddings of the tokens t+1 .. t+k+1 (the true ones in training, the candidate path when
    decoding), mixed by a linear layer that starts as "hidden state only", then residual blocks. A step fills
    the tree level by level: head d-1 runs once over every node of depth d-1 that has children."""

    reads_path = True

    def __init__(self, config: HeadsConfig, lm_head_weight: torch.Tensor | None = None):
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
        return self.blocks[k](self.inputs[k](torch.cat([hidden.expand(*path.shape[:-1], -1), path], -1)))

    def tree_tokens(self, hidden, root: torch.Tensor, tree, base_lm_head, embed: nn.Module, k: int) -> torch.Tensor:
        tokens = torch.cat([root, root.new_zeros(len(root), tree.size - 1)], 1)  # (B, N+1) filled level by level
        for depth, (nodes, rows, paths) in enumerate(tree.levels, 1):
            following = embed(tokens[:, paths])  # (B, P, depth, H): each parent's path, root first
            best = self._best(hidden[:, None], base_lm_head, 1, k, following, first=depth - 1)[0]  # (B, P, k)
            tokens[:, nodes] = best[:, rows, tree.ranks[nodes]]  # (B, M)
        return tokens


HEAD_TYPES = {"medusa": MedusaHeads, "hydra": HydraHeads}
