"""The compiled pass's constants supplied from the model's own tensors, so that its weights are not held twice.

AOTInductor would freeze the pass's constants into its package: every weight, and each linear layer's weight again
in the blocks of the C++ GEMM template that multiplies by it. Its loader copies them out of the package's library
into memory of their own, so a process held the model's weights and the package's (SmolLM2's 540 MB: 2.5 GB resident
after loading its package, 1.2 GB decoding eagerly). Here the package is compiled without its constants; while it
compiles, each constant it makes is recorded and described in terms of the model's tensors (`recipes_for`): the tensor
itself, its transpose, or its rows in blocks of `bn` ((N/bn, K, bn): the template's layout). A load gives the package
the model's own tensors, and the blocked linear weights made once (`supply`), as constants that it uses in place.
Where a constant is none of these (a folded table), its values are kept beside the package.
"""

import ctypes
import gc
import json
import mmap
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mtp.quantized import kernels


def blocked(weight: torch.Tensor, bn: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer's weight (N, K) in the GEMM template's blocks: (ceil(N / bn), K, bn), rows past N zero; written
    into `out` if given (no copy on the way where bn divides N)."""
    rows, inner = weight.shape
    blocks = -(-rows // bn)
    if rows % bn:
        weight = F.pad(weight, (0, 0, 0, blocks * bn - rows))  # (blocks * bn, K)
    source = weight.detach().view(blocks, bn, inner).transpose(1, 2)  # (blocks, K, bn)
    return source.contiguous() if out is None else out.copy_(source)


def _form(data: torch.Tensor, tensor: torch.Tensor) -> str | None:
    """What `data` is of `tensor`, if anything: "same" (the tensor itself), "t" (its transpose) or "blocked" (its rows
    in the template's blocks); a look at one row first, then every value."""
    if data.dtype != tensor.dtype:
        return None
    if data.shape == tensor.shape and torch.equal(data, tensor):
        return "same"
    if tensor.dim() != 2:
        return None
    if data.shape == tensor.shape[::-1] and torch.equal(data[:, 0], tensor[0]) and torch.equal(data, tensor.t()):
        return "t"
    if data.dim() == 3 and data.shape[1] == tensor.shape[1] and 0 <= data.shape[0] * data.shape[2] - tensor.shape[0]:
        fits = data.shape[0] * data.shape[2] - tensor.shape[0] < data.shape[2]
        if fits and torch.equal(data[0, :, 0], tensor[0]) and torch.equal(data, blocked(tensor, data.shape[2])):
            return "blocked"
    return None


def recipes_for(made: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(recipes, rest): each constant in `made` as [name of one of `tensors`, what it is of that tensor (`_form`),
    columns a block] where it is one; the others' values, apart."""
    recipes, rest = {}, {}
    with torch.no_grad():
        for constant, data in made.items():
            found = next(((name, form) for name, tensor in tensors.items() if (form := _form(data, tensor))), None)
            if found:
                recipes[constant] = [*found, data.shape[-1] if found[1] == "blocked" else 0]
            else:
                rest[constant] = data.detach().clone(memory_format=torch.contiguous_format)
    return recipes, rest


def save(package: Path, recipes: dict, rest: dict) -> None:
    """Keep `recipes_for`'s result beside the package file (written before the package, which marks it complete)."""
    package.with_suffix(".json").write_text(json.dumps(recipes))
    save_file(rest, str(package.with_suffix(".safetensors")))


def supply(
    package: Path, tensors: dict[str, torch.Tensor], reported: list[str], linears: torch.nn.Module, prefix: str
) -> dict[str, torch.Tensor]:
    """The constants the package reads (`reported`: its `get_constant_fqns`) from `tensors` (the model's, used in
    place) as its saved recipes say, the blocked weights made once, in order, into one stretch of memory (`_pages`),
    the rest read from beside the package. Each float32 `torch.nn.Linear` of `linears` (named `prefix` among
    `tensors`) whose weight the package reads only in blocks then becomes a `PanelLinear` over those blocks and its
    weight is let go, so that the process holds it once (none where mtp's kernels cannot be built,
    `mtp.quantized.kernels`). The caller keeps the constants alive while the package runs."""
    recipes, constants = _read(package, reported)
    forms = {}
    for name, form, _ in recipes.values():
        forms.setdefault(name, set()).add(form)
    let_go = {
        f"{prefix}.{path}.weight": (path, layer)
        for path, layer in linears.named_modules()
        if type(layer) is torch.nn.Linear
        and layer.weight.dtype == torch.float32
        and forms.get(f"{prefix}.{path}.weight") == {"blocked"}
    }
    let_go = let_go if let_go and kernels() else {}
    made = _blocks(recipes, tensors, let_go, lambda name: _weight(tensors, name, linears, prefix))
    for constant, (name, form, bn) in recipes.items():
        if form == "blocked":
            constants[constant] = made[name, bn]
        else:
            weight = _weight(tensors, name, linears, prefix).detach()
            constants[constant] = weight if form == "same" else weight.t()
    _hold_once(linears, let_go, made)
    return constants


def _hold_once(linears: torch.nn.Module, let_go: dict, made: dict[tuple[str, int], torch.Tensor]) -> None:
    """Each layer of `let_go` ({weight name: (path in `linears`, layer)}) replaced by a `PanelLinear` over its
    weight's blocks in `made`, and what the layers held given back to the system."""
    layer = None
    for (name, _), blocks in made.items():
        if name in let_go:
            path, layer = let_go.pop(name)
            parent, _, child = path.rpartition(".")
            linears.get_submodule(parent).register_module(child, PanelLinear(blocks, layer.out_features, layer.bias))
    layer = None
    gc.collect()  # (a layer given a forward of its own by `mtp.linears.fast_linears` refers to itself)
    free_memory()


def _read(package: Path, reported: list[str]) -> tuple[dict, dict]:
    """The recipes and the saved values of the constants that the package reads (`reported`; a name shared by
    several constants is the base of theirs). Raises if it reads one that was not recorded: AOTInductor's loader
    only warns, and the pass would read memory that holds nothing."""
    names = {re.sub(r"[^a-zA-Z0-9_]", "_", name) for name in reported}

    def read(constant: str) -> bool:
        return any(constant == name or constant.startswith(f"{name}_") for name in names)

    saved = load_file(str(package.with_suffix(".safetensors")))
    recipes = json.loads(package.with_suffix(".json").read_text())
    found = [name for name in [*saved, *recipes] if read(name)]
    missing = sorted(name for name in names if not any(own == name or own.startswith(f"{name}_") for own in found))
    if missing:
        raise RuntimeError(f"the package's constants {missing[:5]} were not recorded while it compiled")
    return {name: recipe for name, recipe in recipes.items() if read(name)}, {n: v for n, v in saved.items() if read(n)}


def _blocks(
    recipes: dict, tensors: dict[str, torch.Tensor], let_go: dict, weight_of: Callable[[str], torch.Tensor]
) -> dict[tuple[str, int], torch.Tensor]:
    """Each linear weight that `recipes` read in blocks, by (name, columns a block): a layer's own where it holds its
    weight so already (`PanelLinear`), else made into `_pages` from `weight_of(name)`; a weight in `let_go` handed back
    to the system as soon as its blocks are made, where it lies in memory mapped from a file (a model loaded from
    safetensors)."""
    made = {}
    for name, form, bn in recipes.values():
        held = tensors.get(name.removesuffix("weight") + "blocks") if name not in tensors else None
        if form == "blocked" and held is not None and held.shape[2] == bn:
            made[name, bn] = held
    wanted = list(dict.fromkeys((n, bn) for n, form, bn in recipes.values() if form == "blocked"))
    weights = {name: weight_of(name) for name, bn in wanted if (name, bn) not in made}
    files = _file_mappings()
    for dtype in {weight.dtype for weight in weights.values()}:
        keys = [(name, bn) for name, bn in wanted if name in weights and weights[name].dtype == dtype]
        sizes = [-(-weights[name].shape[0] // bn) * bn * weights[name].shape[1] for name, bn in keys]
        for (name, bn), part in zip(keys, _pages(sum(sizes), dtype).split(sizes), strict=True):
            made[name, bn] = blocked(weights[name], bn, out=part.view(-1, weights[name].shape[1], bn))
            if name in let_go:
                _hand_back(weights[name], files)  # as it goes: the process never holds every weight twice
    return made


def _weight(tensors: dict[str, torch.Tensor], name: str, linears: torch.nn.Module, prefix: str) -> torch.Tensor:
    """The tensor `name` of `tensors`; for the weight of a layer of `linears` (named `prefix`) that holds it in
    blocks (`PanelLinear`), made from them (a copy)."""
    if name in tensors:
        return tensors[name]
    return linears.get_submodule(name.removeprefix(f"{prefix}.").removesuffix(".weight")).weight


def unblocked(blocks: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight (rows, K) that `blocked` put in `blocks` (ceil(rows / bn), K, bn): a copy."""
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[:rows].contiguous()


class PanelLinear(torch.nn.Module):
    """A float32 linear layer whose weight is held only as a compiled pass reads it, in the template's blocks
    (`blocked`), so that the process holds it once; eager products (a prompt's prefill, a tree larger than the
    compiled node counts, a batch, plain `generate`) multiply by the blocks in mtp's kernel (`panel_mm` of
    `mtp/blocks.cpp`, the float sums taken in order along K)."""

    def __init__(self, blocks: torch.Tensor, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.bias = bias
        self.in_features, self.out_features = blocks.shape[1], out_features

    @property
    def weight(self) -> torch.Tensor:
        """The weight (N, K), made from the blocks on each call (products never ask)."""
        return unblocked(self.blocks, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mtp.panel_mm(x.reshape(-1, x.shape[-1]), self.blocks, self.out_features)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks of {self.blocks.shape[2]}"


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files (Linux; none elsewhere)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    ranges = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            low, high = fields[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


def _hand_back(tensor: torch.Tensor, files: list[tuple[int, int]]) -> None:
    """Where `tensor` lies in memory mapped from a file, drop its whole pages from the process
    (`madvise(MADV_DONTNEED)`): for a weight that nothing reads any more (a read would map them from the file again,
    and lose what was changed in place)."""
    start = tensor.data_ptr()
    end, page = start + tensor.nbytes, mmap.PAGESIZE
    if any(low <= start and end <= high for low, high in files):
        low, high = -(-start // page) * page, end // page * page
        if high > low:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), mmap.MADV_DONTNEED)


def free_memory() -> None:
    """Give the memory the process freed back to the system, where the C library is glibc: after compiling a pass and
    blocking its weights, glibc kept what they freed (its threshold for memory of their own grows as large blocks
    are freed), and a 360M-parameter model's process held 1.2 GB more than it used."""
    if sys.platform.startswith("linux") and (trim := getattr(ctypes.CDLL(None), "malloc_trim", None)) is not None:
        trim(0)


def _pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Memory for `numel` elements of `dtype`, in 2 MB pages where Linux gives them: a pass streams every weight, and
    over 4 KB pages the walk through them costs TLB misses (a pass ran up to 7% slower over separate tensors)."""
    size, huge = numel * dtype.itemsize, 2 << 20
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    memory = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # (keeps `memory` alive)
    start = -raw.data_ptr() % huge  # the first byte at a page's start
    return raw[start : start + size].view(dtype)
