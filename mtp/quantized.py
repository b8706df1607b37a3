"""Base models whose linear layers keep their weights in blocks of 32, as llama.cpp's Q8_0 and Q4_1 keep them: 8-bit
(each block a scale) or 4-bit (each block a scale and a minimum).

`weights=` on `load_base`, `mtp.load`, decode.py, bench and sizing: "float" (as loaded), "int8" or "int4" (the float
weights of every linear layer, the lm_head's included, put in blocks here), or "gguf" (a GGUF base's own blocks as
the file holds them: Q4_0, Q4_1 and Q8_0 map exactly onto these; its other tensors stay float). The quantized model is
the model decoded: greedy output equals mtp's plain greedy decoding of the same weights and sampling keeps that
model's distribution; it answers as a different model from the float one would.

On a CPU with AVX2, in float32, products run through mtp's kernel (`blocks.cpp`: each block unpacked in registers
and multiplied in float32 by up to 8 input rows at a time; built once per machine and torch, and called by the
compiled pass too), so a pass streams 4 or 8 bits a weight instead of 32, and a row's product is computed alike
whatever the row count (a prompt's prefill, a tree, a batch). Another device or dtype multiplies by the weights
unpacked to float for that product.
"""

import argparse
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mtp.internals import cxx11_abi
from mtp.machine import cache_dir

WEIGHTS = ("float", "int8", "int4", "gguf")
BLOCK = 32  # weights a block, each block with its own scale (and, 4-bit, minimum)
_SOURCE = Path(__file__).with_name("blocks.cpp")
_SOURCE_DIGEST = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
_FILE_BLOCKS = {  # GGUF block type: (bytes a block, 4-bit)
    gguf.GGMLQuantizationType.Q4_0: (18, True),
    gguf.GGMLQuantizationType.Q4_1: (20, True),
    gguf.GGMLQuantizationType.Q8_0: (34, False),
}


class BlockLinear(nn.Module):
    """A linear layer whose weight (N, K) is kept in blocks of BLOCK along K: `q` (N, K/2) uint8, weight i of a block
    in the low half of its byte i and weight 16 + i in the high half (4-bit, as GGUF's Q4 blocks), or (N, K) int8
    held as uint8 (8-bit); `scale` and, 4-bit, `minimum` (N, K/BLOCK) float32: a weight is q * scale + minimum."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        tied: torch.Tensor | None = None,
    ):
        super().__init__()
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("minimum", None if minimum is None else minimum.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.bits = 8 if minimum is None else 4
        self.out_features, self.in_features = scale.shape[0], scale.shape[1] * BLOCK
        self._float = tied  # the float weight: the embedding's where the lm_head shares it (drafters read its rows)

    @classmethod
    def made_from(cls, layer: nn.Linear, bits: int, tied: torch.Tensor | None = None) -> "BlockLinear":
        """`layer`'s weight put in blocks: 8-bit, each block's scale its largest magnitude over 127; 4-bit, its
        minimum and its range over 15 (rounded to the nearest step)."""
        weight = layer.weight.detach().float()
        blocks = weight.reshape(weight.shape[0], -1, BLOCK)  # (N, K/BLOCK, BLOCK)
        tiny = torch.finfo(torch.float32).tiny
        if bits == 8:
            scale = blocks.abs().amax(-1).clamp_min(tiny) / 127  # (N, K/BLOCK)
            q = torch.round(blocks / scale[..., None]).to(torch.int8).view(torch.uint8)
            return cls(q.reshape(weight.shape), scale, None, layer.bias, tied)
        minimum = blocks.amin(-1)
        scale = (blocks.amax(-1) - minimum).clamp_min(tiny) / 15
        q = torch.round((blocks - minimum[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return cls((q[..., :16] | q[..., 16:] << 4).reshape(weight.shape[0], -1), scale, minimum, layer.bias, tied)

    @property
    def weight(self) -> torch.Tensor:
        """The float weight: the tied embedding's, else the blocks unpacked on first use and kept (a drafter that
        reads the lm_head's rows asks every step; products never do)."""
        if self._float is None:
            self._float = self.unpacked()
        return self._float

    def unpacked(self) -> torch.Tensor:
        """The weights the blocks hold, (N, K) float32: q * scale + minimum, rounded as GGUF's own unpacking."""
        return unpacked(self.q, self.scale, self.minimum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or not kernels():
            return F.linear(x, self.unpacked().to(x.dtype), self.bias)
        flat = x.reshape(-1, x.shape[-1])
        if self.minimum is None:
            out = torch.ops.mtp.q8_mm(flat, self.q, self.scale)
        else:
            out = torch.ops.mtp.q4_mm(flat, self.q, self.scale, self.minimum)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def unpacked(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
    """Blocks (`BlockLinear`'s layout) as float32 weights (N, K)."""
    rows = q.shape[0]
    if minimum is None:
        return (q.view(torch.int8).reshape(rows, -1, BLOCK).float() * scale[..., None]).reshape(rows, -1)
    halves = q.reshape(rows, -1, BLOCK // 2)  # (N, K/BLOCK, 16)
    values = torch.cat([halves & 15, halves >> 4], -1).float()  # (N, K/BLOCK, BLOCK)
    return (values * scale[..., None] + minimum[..., None]).reshape(rows, -1)


def require_weights(weights: str) -> None:
    """Raise unless `weights` is one of WEIGHTS."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}.")


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """The --weights option of decode.py, mtp.tools.bench and mtp.tools.sizing."""
    parser.add_argument(
        "--weights",
        default="float",
        choices=WEIGHTS,
        help="the base's weights: as loaded, in "
        "blocks of 8 or 4 bits, or a GGUF base's own blocks (the packaged default's: 4-bit); see "
        "mtp.quantized",
    )


def quantize(model: nn.Module, weights: str, gguf_file: str | Path | None = None) -> nn.Module:
    """`model` with its linear layers (those whose input width is a multiple of BLOCK) in blocks as `weights` says
    (`WEIGHTS`); "gguf" takes each layer's blocks from `gguf_file`, found by value (the converted model's float
    weights are the file's blocks unpacked), so any architecture's names and row orders map; a layer the file
    keeps otherwise stays float. Replaced in place; returns `model`."""
    require_weights(weights)
    if weights == "float":
        return model
    if weights == "gguf" and gguf_file is None:
        raise ValueError(
            "weights='gguf' keeps a GGUF file's own blocks: load a .gguf base (or the packaged default), "
            "or choose weights='int8' or 'int4'."
        )
    embed = model.get_input_embeddings().weight
    layers = {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.in_features % BLOCK == 0
    }
    found = _blocks_in_file(Path(gguf_file), layers) if weights == "gguf" else {}
    with torch.no_grad():
        while layers:  # each float weight let go once its blocks are made: memory for one layer's more at a time
            name, layer = layers.popitem()
            tied = embed if layer.weight is embed else None
            if weights == "gguf":
                made = BlockLinear(*found[name], layer.bias, tied) if name in found else None
            else:
                made = BlockLinear.made_from(layer, 8 if weights == "int8" else 4, tied)
            if made is not None:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, made)
            del layer, made
    if model.device.type == "cpu":
        kernels()  # built (or found) now, before a compiled pass that calls them is loaded
    return model


def blocks_of(model: nn.Module) -> str:
    """What `model`'s weights are, for keys of measured costs: "float", or its block layers' count by bits and the
    kernel that multiplies them (its source's digest)."""
    bits = [module.bits for module in model.modules() if isinstance(module, BlockLinear)]
    return f"blocks: {bits.count(4)} 4-bit, {bits.count(8)} 8-bit, kernel {_SOURCE_DIGEST}" if bits else "float"


def file_blocks(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> tuple:
    """A GGUF tensor's rows of Q4_0, Q4_1 or Q8_0 blocks ((N, bytes) uint8, as `gguf.GGUFReader` gives them) as
    `BlockLinear`'s (q, scale, minimum): Q4_0's weight d (q - 8) is q * d + (-8 d), exactly; Q4_1's d q + m and
    Q8_0's d q as they are."""
    size, four = _FILE_BLOCKS[kind]
    raw = torch.from_numpy(np.array(data)).reshape(data.shape[0], -1, size)  # (N, K/BLOCK, bytes)
    scale = raw[..., :2].contiguous().view(torch.float16)[..., 0].float()  # (N, K/BLOCK)
    if kind == gguf.GGMLQuantizationType.Q4_0:
        return raw[..., 2:].reshape(data.shape[0], -1), scale, -8 * scale
    if kind == gguf.GGMLQuantizationType.Q4_1:
        minimum = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        return raw[..., 4:].reshape(data.shape[0], -1), scale, minimum
    return raw[..., 2:].reshape(data.shape[0], -1), scale, None


def _blocks_in_file(path: Path, layers: dict[str, nn.Linear]) -> dict[str, tuple]:
    """Per layer of `layers` whose every weight row is a row of one of the file's Q4_0, Q4_1 or Q8_0 tensors (equal
    values: rows found by digest, in the layer's order), that tensor's blocks in that order."""
    if not path.is_file() or path.suffix != ".gguf":
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist: weights='gguf' needs the base's .gguf file.")
    tensors, where = [], {}  # each tensor's blocks; a row's digest -> (tensor, row)
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.tensor_type in _FILE_BLOCKS and len(tensor.shape) == 2:
            blocks = file_blocks(tensor.data, tensor.tensor_type)
            for row, values in enumerate(unpacked(*blocks).numpy()):
                where.setdefault(_digest(values), (len(tensors), row))
            tensors.append(blocks)
    found = {}
    for name, layer in layers.items():
        hits = [where.get(_digest(values)) for values in layer.weight.detach().float().numpy()]
        if None in hits or len({tensor for tensor, _ in hits}) != 1:
            continue
        q, scale, minimum = tensors[hits[0][0]]
        order = torch.tensor([row for _, row in hits])
        found[name] = q[order], scale[order], None if minimum is None else minimum[order]
    return found


def _digest(values: np.ndarray) -> bytes:
    return hashlib.blake2b(values.tobytes(), digest_size=16).digest()


@functools.cache
def kernels() -> bool:
    """Whether mtp's block kernels (`blocks.cpp`) are loaded: built the first time on this machine and torch (about
    30 s), then kept under mtp's cache folder; False, said in one line, where they cannot be (a CPU without AVX2, no
    C++ compiler): products then unpack the weights to float, slower."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        print(
            f"mtp: no block kernels for this CPU ({capability}, not AVX2): quantized products unpack their weights "
            "to float, slower than float weights",
            file=sys.stderr,
        )
        return False
    library = cache_dir() / "kernels" / f"blocks-{_SOURCE_DIGEST}-torch-{torch.__version__}.so"
    try:
        if not library.is_file():
            _build(_SOURCE, library)
        torch.ops.load_library(str(library))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", b"") or str(error).encode()).decode(errors="replace").strip().splitlines()
        print(
            f"mtp: could not build the block kernels ({detail[-1][:200] if detail else error}): quantized products "
            "unpack their weights to float, slower",
            file=sys.stderr,
        )
        return False
    for name in ("q4_mm", "q8_mm"):  # their output's shape, for export and the compiled pass
        torch.library.register_fake(f"mtp::{name}")(lambda x, q, *rest: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("mtp::panel_mm")(lambda x, blocks, n: x.new_empty(x.shape[0], n))
    return True


def _build(source: Path, library: Path) -> None:
    """Compile `source` into the shared library `library` against this torch (written aside, then renamed)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    library.parent.mkdir(parents=True, exist_ok=True)
    abi = cxx11_abi()
    with tempfile.TemporaryDirectory(dir=library.parent) as staging:
        built = Path(staging) / library.name
        subprocess.run(
            [
                os.environ.get("CXX", "c++"),
                "-O3",
                "-mavx2",
                "-mfma",
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-std=c++20",
                f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                str(source),
                "-o",
                str(built),
                *(f"-I{path}" for path in include_paths()),
                *(f"-L{path}" for path in library_paths()),
                "-lc10",
                "-ltorch_cpu",
            ],
            check=True,
            capture_output=True,
        )
        os.replace(built, library)
