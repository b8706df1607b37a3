"""mtp's block kernel (`mtp.quantized`) against float32 products, one core, per weight shape and row count: the
nanoseconds per block of 32 weights (per output row), so the kernel's cost per block can be read beside the
machine's. The weights fit the CPU's caches (one layer repeated): this measures arithmetic, not memory.

    python benchmarks/block_products.py --shape 1536 576 --rows 1 2 4 8
"""

import argparse
import time

import torch
from torch import nn

from mtp.machine import device_name
from mtp.quantized import BlockLinear, kernels


def nanoseconds(call, blocks: int, repeats: int) -> float:
    for _ in range(repeats // 10 + 1):  # warm-up
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e9 / blocks


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("OUT", "IN"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    if not kernels():
        raise SystemExit("no block kernels on this machine (see the line above)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = nn.Linear(args.shape[1], args.shape[0], bias=False)
    blocks = args.shape[0] * args.shape[1] // 32
    made = {"float32": layer, "8-bit": BlockLinear.made_from(layer, 8), "4-bit": BlockLinear.made_from(layer, 4)}
    print(f"{device_name('cpu')}, a {args.shape[0]}x{args.shape[1]} weight: ns per block of 32 weights")
    print("| rows | " + " | ".join(made) + " |\n| ---: |" + " ---: |" * len(made))
    for rows in args.rows:
        x = torch.randn(rows, args.shape[1])
        cells = [f"{nanoseconds(lambda m=m, x=x: m(x), blocks, args.repeats):.2f}" for m in made.values()]
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
