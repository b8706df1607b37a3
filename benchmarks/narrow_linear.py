"""Why `mtp.linears` measures its choice: on a CPU, the two ways of multiplying a few input rows by a linear
layer's weight differ in speed, and which is faster differs from one machine to another. Over 30 layers of
SmolLM2-135M's seven weight shapes (distinct random weights, so the weights stream from memory as in a real
pass), the median of 7 runs per row count, in one run:

    python benchmarks/narrow_linear.py [--dtype bfloat16]

x W^T is what `torch.nn.functional.linear` computes; W x^T is the narrow path, the same product (one row repeated
into two, as `mtp.linears.narrow_product` takes it); blocks is the product by the weight held in a compiled pass's
blocks of 8 columns (`mtp.decoding.constants.PanelLinear`, mtp's kernel), which a decoder layer's eager products
take once its pass is compiled (float32; a prompt's prefill is the row counts past 16).
"""

import argparse
import time

import torch
from torch.nn import functional as F

from mtp.decoding.constants import blocked
from mtp.linears import narrow_product
from mtp.quantized import kernels

HIDDEN, INTERMEDIATE = 576, 1536
SHAPES = [
    (HIDDEN, HIDDEN),
    (192, HIDDEN),
    (192, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]  # q, k, v, o, gate, up, down


def seconds(weights: list[torch.Tensor], rows: int, way: str) -> float:
    inputs = {width: torch.randn(rows, width, dtype=weights[0].dtype) for width in (HIDDEN, INTERMEDIATE)}
    start = time.perf_counter()
    for weight in weights:
        x = inputs[weight.shape[1]]
        if way == "blocks":
            torch.ops.mtp.panel_mm(x, weight, weight.shape[0] * weight.shape[2])
        else:
            narrow_product(x, weight) if way == "narrow" else F.linear(x, weight)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    dtype = getattr(torch, parser.parse_args().dtype)
    torch.manual_seed(0)
    weights = [torch.randn(out, width, dtype=dtype) for _ in range(30) for out, width in SHAPES]
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{megabytes:.0f} MB of weights in {dtype}, {torch.get_num_threads()} threads")
    blocks = [blocked(weight, 8) for weight in weights] if dtype == torch.float32 and kernels() else None
    print(
        "| rows | x W^T ms | W x^T ms | blocks ms | x W^T against 1 row | W x^T against 1 row | blocks against x W^T |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    one = None
    for rows in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 256):
        plain, narrow = (sorted(seconds(weights, rows, way) for _ in range(7))[3] for way in ("plain", "narrow"))
        held = sorted(seconds(blocks, rows, "blocks") for _ in range(7))[3] if blocks else float("nan")
        one = one or plain
        print(
            f"| {rows} | {plain * 1e3:.1f} | {narrow * 1e3:.1f} | {held * 1e3:.1f} | {plain / one:.2f} | "
            f"{narrow / one:.2f} | {held / plain:.2f} |"
        )


if __name__ == "__main__":
    main()
