"""The drafter contract: `Drafter`, what every kind of drafter declares (the base model's layers it reads, the one
call training makes, its guesses along a true path for sizing, its proposer for decoding, what it exports to) and
what they share: the folder a drafter is saved in and loaded from (`config.json`, a `DrafterConfig`: the kind and
shape, the identity of the base model it was trained for, what `mtp.tools.sizing` chose; safetensors parts; an
optional peft adapter of the base beside them) and the checks that it fits a base. Each kind registers itself by
its `head_type` (`Drafter.kinds`) as it is defined."""

import hashlib
import json
import re
from abc import ABCMeta, abstractmethod
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mtp.base import gguf_file, load_base
from mtp.decoding.proposer import Proposer
from mtp.decoding.target import Target
from mtp.quantized import quantize

# what a heads folder holds (adapter_*: peft's files of a base adapter trained with the heads)
HEADS_FILES = ["config.json", "model*.safetensors", "medusa_lm_head.*", "README.md", "adapter_*"]
SHARD_BYTES = 8_000_000  # weights past this are written in parts (model-00001-of-0000N.safetensors), small files


@dataclass
class DrafterConfig:
    """Shape of the heads and the identity of the base model they were trained on."""

    num_heads: int = 4
    """Number of heads; head k predicts the token k+2 positions ahead (`eagle`: the steps unrolled in training,
    step k predicting what head k does)."""
    head_type: str = "medusa"
    """`medusa`: head k reads the base model's hidden state at t; `hydra`: also the input embeddings of the tokens
    t+1 .. t+k+1 (the candidate path when decoding): sequentially dependent heads; `eagle`: a decoder layer over the
    base model's features at `feature_layers` (see `mtp.drafters.eagle`)."""
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
    """Paths of the decoding tree chosen for these heads (see `mtp.decoding.tree`); None: the default named tree."""
    lookup: list[int] = field(default_factory=list)
    """Prompt-lookup tokens verified beside the tree after a match of 1, 2, ... tokens (`mtp.decoding.lookup.Lookup`'s
    lengths), chosen with the tree by `mtp.tools.sizing`; empty: none."""
    dynamic_tree: str | None = None
    """A `DynamicTree` (`dynamic:NODES:DEPTH:TOP_K`) that decoding always takes, as if given to `mtp.load`."""
    acceptance: list[dict] = field(default_factory=list)
    """What each candidate tree and lookup accepts per step on held-out answers (`mtp.decoding.pacing.Candidate`,
    written by `mtp.tools.sizing`): `mtp.load` chooses among them by the step costs of the machine it runs on. Empty:
    among the trees grown from `calibration`, without lookup."""
    adapter: bool = False
    """The folder also holds a LoRA adapter of the base model trained with the heads (peft's `adapter_config.json`
    and `adapter_model.safetensors`): decoding merges it into the base, and the output is the adapted model's."""
    base_weights: str = ""
    """With an adapter: `weights_fingerprint` of the base it was trained on (an adapter fits those weights only)."""
    draft_vocab: list[int] | None = None
    """Token ids the heads' guesses are drawn from when decoding (the most frequent target tokens of the
    training data): each head's projection then scores these rows only. None: the whole vocabulary."""
    feature_layers: list[int] = field(default_factory=list)
    """For a drafter that reads the base model's features (`eagle`): the indices of the hidden states it reads
    (as transformers' `output_hidden_states` counts them: 0 the input embeddings, i the output of decoder layer
    i - 1, as vLLM counts EAGLE-3's layer ids; SGLang's are one less), fused by its `fc`."""
    draft_layer: dict = field(default_factory=dict)
    """For `eagle`: the shape of its decoder layer (a `LlamaConfig`'s fields, copied from the base model)."""

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads={self.num_heads}: need at least 1 head.")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: need at least 1 residual block per head.")
        Drafter.of_kind(self.head_type)
        if self.lm_head not in ("shared", "own"):
            raise ValueError(f"lm_head={self.lm_head!r}: choose 'shared' (the base's frozen lm_head) or 'own'.")

    def identity(self) -> str:
        return (
            f"{self.base_model!r} (hidden {self.hidden_size}, vocab {self.vocab_size}, "
            f"tokenizer {self.tokenizer_fingerprint})"
        )


def base_identity(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The fields of `DrafterConfig` that pin the base model."""
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


class Drafter(nn.Module, metaclass=ABCMeta):
    """A drafter: its weights, its `config` and the folder it was loaded from (`folder`; None for a new one), and
    all that training (`mtp.training`), sizing and export (`mtp.tools`) and decoding (`mtp.decoding`) know of it:
    none of them names a kind. A kind subclasses this with `kind=NAME`, the `head_type` that names it in configs,
    and joins `kinds`; it defines `new`, `teacher_forced`, `project`, `path_guesses` and `proposer`, and where it
    differs, `default_layers`, `max_depth`, `exports`, `from_foreign` and `set_draft_vocab`."""

    config: DrafterConfig
    folder: Path | None = None
    kinds: ClassVar[dict[str, type["Drafter"]]] = {}
    """Every kind of drafter by the `head_type` that names it."""
    max_depth: int | None = None
    """The deepest node of a tree it can fill (None: as deep as a tree asks)."""
    exports: ClassVar[tuple[str, ...]] = ()
    """The layouts other engines serve it in (`mtp.tools.export --to`; every kind goes to the Hub as it is)."""

    def __init_subclass__(cls, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            Drafter.kinds[kind] = cls

    @staticmethod
    def of_kind(head_type: str) -> type["Drafter"]:
        """The kind of drafter `head_type` names."""
        if head_type not in Drafter.kinds:
            raise ValueError(f"head_type={head_type!r}: choose one of {sorted(Drafter.kinds)}.")
        return Drafter.kinds[head_type]

    @classmethod
    def default_layers(cls, depth: int) -> list[int]:
        """The base model's hidden states it reads beside the last (`DrafterConfig.feature_layers`) unless told,
        for a base of `depth` decoder layers."""
        return []

    @classmethod
    @abstractmethod
    def new(cls, config: DrafterConfig, base_model: PreTrainedModel) -> "Drafter":
        """A new drafter of this shape for `base_model`, before training."""

    @abstractmethod
    def teacher_forced(self, hidden, features, input_ids, keep, embed) -> torch.Tensor:
        """Training, at the N positions `keep` (B, T) marks: the states (K, N, H) of its K steps that `project`
        scores, step k guessing token t + k + 2. hidden (B, T, H): the base model's last hidden states; features
        (B, T, L H): its hidden states at `config.feature_layers`; input_ids (B, T): the true tokens, which a
        drafter that reads the path reads; embed: the base model's input embedding."""

    @abstractmethod
    def project(self, states: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """The logits of every step's states (K, ..., H), over the whole vocabulary (K, ..., V), or over the draft
        vocabulary (K, ..., D) when it has one; base_lm_head: the base model's lm_head. Training calls it on a
        chunk of positions at a time (`model.loss.chunk` of a recipe)."""

    @abstractmethod
    def path_guesses(self, hidden, features, input_ids, base_lm_head, embed, k: int) -> torch.Tensor:
        """Sizing: the target ids of every step's top-k guesses at every position of one sequence, along its true
        tokens: hidden (T, H), features (T, L H), input_ids (T,) -> (K, T, k)."""

    @abstractmethod
    def proposer(self, target: Target, cut: dict) -> Proposer:
        """Decoding: this drafter over the rows of a batch (`mtp.decoding.proposer`), on the trees of each step's plan
        (`cut`: the static trees cut so far, kept by the caller across batches)."""

    @classmethod
    def from_foreign(cls, folder: Path, raw: dict) -> "Drafter | None":
        """This kind loaded from a checkpoint another project wrote in `folder` (`raw`: its config.json), or None
        when it is not in a format this kind reads."""
        return None

    def set_draft_vocab(self, ids: list[int], base_model: PreTrainedModel) -> None:
        """Guess among the token ids `ids` only, from now on (in training and decoding)."""
        self.config.draft_vocab = ids

    def check_base(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raise if these heads were trained for a base other than (model, tokenizer)."""
        other = DrafterConfig(**{**asdict(self.config), **base_identity(name, model, tokenizer)})
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
        """Write `config.json` and the weights (heads only, never base weights), the floating-point ones in `dtype`
        if given (bfloat16 halves them; loading casts them back to the heads' own dtype; ids stay exact):
        `model.safetensors`, or parts of at most SHARD_BYTES each when they are larger (`model-00001-of-00002...`)."""
        self.save_config(folder)
        parts, size = [{}], 0
        for name, tensor in self.state_dict().items():
            if dtype is not None and tensor.is_floating_point():  # never the ids of a draft vocabulary
                tensor = tensor.to(dtype)
            tensor = tensor.contiguous()
            if parts[-1] and size + tensor.nbytes > SHARD_BYTES:
                parts, size = [*parts, {}], 0
            parts[-1][name], size = tensor, size + tensor.nbytes
        for old in Path(folder).glob("model*.safetensors"):  # a rewrite leaves no stale part behind
            old.unlink()
        for i, part in enumerate(parts, 1):
            name = "model.safetensors" if len(parts) == 1 else f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, Path(folder) / name)

    @staticmethod
    def from_pretrained(folder: str | Path) -> "Drafter":
        """Heads saved by `save_pretrained`, of the kind their config names (`head_type`), a FasterDecoding
        Medusa checkpoint (see `mtp.drafters.heads.MedusaHeads.from_faster_decoding`) or an EAGLE-3 drafter (see
        `mtp.drafters.eagle.Eagle.from_eagle3`); `folder` may also be a Hub repository id that holds one."""
        folder = Path(folder) if Path(folder).is_dir() or not is_repo_id(str(folder)) else from_hub(str(folder))
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder / 'config.json'} does not exist: point at a folder of heads.")
        raw = json.loads((folder / "config.json").read_text())
        for kind in Drafter.kinds.values():
            if (foreign := kind.from_foreign(folder, raw)) is not None:
                return foreign
        files = sorted(folder.glob("model*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{folder / 'model.safetensors'} does not exist: point at a folder written by save_pretrained."
            )
        raw.pop("batch_trees", None)  # what sizing chose per batch size on its own machine: now chosen at load
        unknown = set(raw) - {field.name for field in fields(DrafterConfig)}
        if unknown:
            raise ValueError(f"{folder / 'config.json'} has unknown keys {sorted(unknown)}: not a heads folder?")
        config = DrafterConfig(**raw)
        heads = Drafter.kinds[config.head_type](config)
        heads.folder = folder
        heads.load_state_dict({name: tensor for file in files for name, tensor in load_file(file).items()})
        return heads


def load_with_base(
    folder: str | Path,
    base_model: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    fast: bool = True,
    adapt: bool = True,
    weights: str = "float",
) -> tuple[Drafter, PreTrainedModel, PreTrainedTokenizerBase]:
    """The drafter in `folder` and the base it was trained for, checked to fit it, both on `device` in `dtype`:
    (drafter, base model, tokenizer). `base_model`: load that base instead of the one the drafter names (a local
    copy of it); `fast`: the base's linear products as `mtp.base.load_base` takes them; `adapt`: with the adapter
    trained beside the drafter merged into the base (`Drafter.adapt`), the verifier it decodes with; `weights`: the
    base's weights as `mtp.base.load_base` takes them, put in blocks after an adapter is merged."""
    drafter = Drafter.from_pretrained(folder)
    name = base_model or drafter.config.base_model
    merged = adapt and drafter.config.adapter
    model, tokenizer = load_base(name, device=device, dtype=dtype, fast=fast, weights="float" if merged else weights)
    drafter.check_base(name, model, tokenizer)
    if merged:  # (with "gguf", a layer the adapter changed is no longer the file's and stays float)
        model = quantize(drafter.adapt(model), weights, gguf_file(name))
    return drafter.to(device=device, dtype=dtype).eval(), model, tokenizer
