"""The fastest way, on this machine, to multiply a few input rows by a model's linear layers.

A linear layer computes x W^T (`torch.nn.functional.linear`). For a handful of rows (a decoding step: one row, or
the few nodes of a tree) the same product can also be taken as W x^T, and which of the two runs faster depends on
the machine: on one CPU W x^T can be the faster for a few rows, and one row fastest as a two-row W x^T (the
row repeated); on another, x W^T is the faster or equal at every row count
(`benchmarks/narrow_linear.py` prints both). So the choice is measured, not assumed: `fast_linears` times both
ways over the model's own weights for 1 to ROWS rows, and gives a layer the W x^T path for exactly the row counts
where it was faster by more than NOISE; every other input (and every row count on a machine where x W^T wins)
keeps the usual path. The choice is cached per machine and set of weight shapes in `$MTP_CACHE/linears.json`.
"""

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.nn import functional as F

from mtp.internals import int8_rows_product, version
from mtp.machine import device_name, measured

ROWS = 16  # the most input rows for which the W x^T path is considered
NOISE = 0.05  # W x^T is taken only where it was faster than x W^T by more than this fraction


def narrow_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T computed as W x^T: x (R, in) -> (R, out); one row is repeated into two (contiguous) and the first
    result kept, since a one-row W x^T is a matrix-vector product, the slow case where two rows are not."""
    if x.shape[0] == 1:
        return (weight @ x.expand(2, -1).contiguous().T)[:, :1].T  # (out, 2) -> (1, out)
    return (weight @ x.T).T  # (out, R) -> (R, out)


_PROPOSING = ContextVar("proposing", default=False)


@contextmanager
def proposing() -> Iterator[None]:
    """Inside this block drafters propose candidates for decoding (`uses_int8_rows`); outside it, as in training and
    validation, they project from their float rows."""
    token = _PROPOSING.set(True)
    try:
        yield
    finally:
        _PROPOSING.reset(token)


def uses_int8_rows(device: torch.device) -> bool:
    """Whether a drafter multiplies by its vocabulary projection's rows as int8 (`quantized_rows`): when it drafts for
    decoding (`proposing`) on a CPU, where a level of a tree streams them from memory for one row or a few. The
    accuracies that validation measures, and saves with the heads, are those of the float rows."""
    return device.type == "cpu" and _PROPOSING.get()


def quantized_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) as int8 rows, each with its own scale (its largest magnitude over 127), for `quantized_product`."""
    weight = weight.detach().float()
    scales = weight.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (out,)
    return torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16)


def quantized_product(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x W^T from W's `quantized_rows`, x taken in bfloat16, in x's dtype: x (..., in) -> (..., out). A quarter of
    float32 W's bytes, for a product that streams W from memory to multiply one row or a few: a drafter's
    vocabulary projection, whose guesses need not be exact (the base model verifies them)."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return int8_rows_product(flat, *rows).to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_product(owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x W^T (+ bias) from W's `quantized_rows`, quantized on first use and kept on `owner` (a module: one weight
    each) until the weight changes: another tensor (even one at the same address), or this one changed in place."""
    key = (weight.data_ptr(), version(weight), weight.dtype)
    kept = getattr(owner, "_int8_key", None)
    if kept is None or kept[0]() is not weight or kept[1:] != key:
        owner._int8_key, owner._int8 = (weakref.ref(weight), *key), quantized_rows(weight)
    out = quantized_product(x, owner._int8)
    return out if bias is None else out + bias


def draft_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`; drafting for decoding on a CPU (`uses_int8_rows`) without gradients, from its weight's int8 rows
    (`int8_product`): a drafter's small layers run once or twice per level of a tree, their weights streamed from
    memory after each verification pass: int8 rows stream a quarter of float32's bytes."""
    if not uses_int8_rows(x.device) or torch.is_grad_enabled():
        return layer(x)
    return int8_product(layer, x, layer.weight, layer.bias)


def product(
    x: torch.Tensor, weight: torch.Tensor, narrow: frozenset[int] | set[int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ bias) for x (..., in), taken as W x^T (`narrow_product`) when x's row count is in `narrow` and no
    gradient is needed (training keeps the usual path)."""
    rows = x.numel() // x.shape[-1]
    if rows not in narrow or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    out = narrow_product(x.reshape(rows, -1), weight).reshape(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def fast_linears(model: torch.nn.Module) -> dict[str, list[int]]:
    """Give every `torch.nn.Linear` of `model` the faster product for each input row count, as measured here for
    its weight's shape (`narrow_rows`); returns, per shape, the row counts that take the W x^T path (often none).
    Outputs equal the usual ones up to float rounding order; with gradients on (training), the usual path. Works
    on any Hugging Face model (plain `generate` included) and on mtp's heads; layers offloaded by accelerate keep
    their own forward."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and not hasattr(m, "_hf_hook")]  # offloaded
    groups = {}  # the layers of each device and dtype, measured apart
    for layer in layers:
        groups.setdefault((layer.weight.device, layer.weight.dtype), []).append(layer.weight)
    chosen = {shape: rows for weights in groups.values() for shape, rows in narrow_rows(weights).items()}

    def forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return product(x, layer.weight, layer.narrow_rows, layer.bias)

    for layer in layers:
        layer.narrow_rows = frozenset(chosen[_shape(layer.weight)])
        vars(layer).pop("forward", None)  # a layer with nothing chosen keeps its own forward: no call added per step
        if layer.narrow_rows:
            layer.forward = forward.__get__(layer)
    return chosen


def narrow_counts(model: torch.nn.Module) -> set[int]:
    """The row counts for which some linear layer of `model` takes the W x^T path (`fast_linears`)."""
    return {rows for module in model.modules() for rows in getattr(module, "narrow_rows", ())}


@contextmanager
def usual_linears(model: torch.nn.Module) -> Iterator[None]:
    """Inside this block, `model`'s linear layers take the usual product (x W^T) whatever `fast_linears` chose:
    plain decoding as users run it, for comparison."""
    chosen = {m: vars(m).pop("forward") for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)}
    try:
        yield
    finally:
        for module, forward in chosen.items():
            module.forward = forward


@torch.no_grad()
def narrow_rows(weights: list[torch.Tensor], rounds: int = 3) -> dict[str, list[int]]:
    """Per weight shape, the row counts 1..ROWS for which W x^T ran faster than x W^T by more than NOISE, over the
    weights of that shape. Both ways are timed over all of `weights` in order, as a pass streams them from memory
    (each product's time counted to its shape), for each row count in turn, `rounds` times over; the median of
    each is kept. Measured once per machine, dtype and set of shapes; on devices other than a CPU or CUDA (no
    timing here), none."""
    first = weights[0] if weights else None
    if first is None or first.device.type not in ("cpu", "cuda"):
        return {_shape(w): [] for w in weights}
    shapes = sorted({_shape(w) for w in weights})
    key = (
        f"{device_name(first.device)} | torch {torch.__version__} | {first.dtype} | rows {ROWS}, noise {NOISE}, "
        f"{rounds} rounds | {len(weights)} weights {shapes}"
    )

    def measure() -> dict[str, list[int]]:
        inputs = {
            rows: {
                width: torch.randn(rows, width, dtype=first.dtype, device=first.device)
                for width in {w.shape[1] for w in weights}
            }
            for rows in range(1, ROWS + 1)
        }
        times = {(shape, rows, narrow): [] for shape in shapes for rows in inputs for narrow in (False, True)}
        for _ in range(rounds):
            for rows in inputs:
                for narrow in (False, True):
                    spent = dict.fromkeys(shapes, 0.0)
                    for weight in weights:
                        x, start = inputs[rows][weight.shape[1]], time.perf_counter()
                        narrow_product(x, weight) if narrow else F.linear(x, weight)
                        if first.device.type == "cuda":
                            torch.cuda.synchronize(first.device)
                        spent[_shape(weight)] += time.perf_counter() - start
                    for shape, seconds in spent.items():
                        times[shape, rows, narrow].append(seconds)
        median = {way: sorted(spent)[len(spent) // 2] for way, spent in times.items()}
        return {
            shape: [rows for rows in inputs if median[shape, rows, True] < (1 - NOISE) * median[shape, rows, False]]
            for shape in shapes
        }

    return measured("linears.json", key, measure)


def _shape(weight: torch.Tensor) -> str:
    return "x".join(map(str, weight.shape))
