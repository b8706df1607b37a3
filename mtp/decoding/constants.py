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
import json
import mmap
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


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


def supply(package: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The package's constants from `tensors` (the model's, used in place) as its saved recipes say, the blocked
    weights made once, in order, into one stretch of memory (`_pages`), the rest read from beside it. The caller
    keeps them alive while the package runs."""
    constants = load_file(str(package.with_suffix(".safetensors")))
    recipes = json.loads(package.with_suffix(".json").read_text())
    wanted = list(dict.fromkeys((name, bn) for name, form, bn in recipes.values() if form == "blocked"))
    made = {}
    for dtype in {tensors[name].dtype for name, _ in wanted}:
        keys = [(name, bn) for name, bn in wanted if tensors[name].dtype == dtype]
        sizes = [-(-tensors[name].shape[0] // bn) * bn * tensors[name].shape[1] for name, bn in keys]
        for (name, bn), part in zip(keys, _pages(sum(sizes), dtype).split(sizes), strict=True):
            made[name, bn] = blocked(tensors[name], bn, out=part.view(-1, tensors[name].shape[1], bn))
    for constant, (name, form, bn) in recipes.items():
        tensor = tensors[name].detach()
        constants[constant] = {"same": tensor, "t": tensor.t(), "blocked": made.get((name, bn))}[form]
    return constants


def check(reported: list[str], constants: dict[str, torch.Tensor]) -> None:
    """Raise unless every constant a package reports (`get_constant_fqns`: a name shared by several constants is
    the base of theirs) is among `constants`: AOTInductor's loader only warns of one left out, and a pass would
    read memory that holds nothing."""
    names = {re.sub(r"[^a-zA-Z0-9_]", "_", name) for name in reported}
    missing = sorted(name for name in names if not any(own == name or own.startswith(f"{name}_") for own in constants))
    if missing:
        raise RuntimeError(f"the package's constants {missing[:5]} were not recorded while it compiled")


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
