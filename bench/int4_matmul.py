"""An int4 weight's matmul by a few to many rows: each kernel astrai has, and torch's.

The serving linear picks a kernel by the number of rows (astrai/backends/cpu/serving.py):
the dequantizing matmul (native/dequant_matmul.c: reads the weight once, eight rows a pass)
below ``INTEGER_MIN_ROWS``, the integer matmul (W4A8, native/integer_matmul.c: eight weight
rows unpacked, every row of rounded activations over them) from there on; a Q4_0 weight is
served eight rows interleaved (interleaved.py), which takes the dequantizing matmul up to
``MAX_DEQUANT_ROWS`` rows. This measures both kernels over both layouts
at every row count, beside what a user would run otherwise: torch's fp32 matmul over the
dequantized weight (oneDNN's, or the BLAS's), which is the compute bound an int4 kernel has to
beat on a prompt. Real shapes: SmolLM2-135M's MLP (576 -> 1536, 1536 -> 576) and a Llama
1B's (2048 -> 8192); random Q4_0 weights. Best of ``--repeats`` timings each, the kernels
alternating; figures in GFLOP/s (2 x rows x in x out per matmul).

    OMP_NUM_THREADS=2 .venv/bin/python bench/int4_matmul.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.backends.cpu.dense_matmul import dense_matmul_available, integer_matmul  # noqa: E402
from astrai.backends.cpu.interleaved import interleaved_scales, interleaved_values  # noqa: E402
from astrai.backends.cpu.kernels import MAX_DEQUANT_ROWS, Q4, Q4X8, TypedWeight, dequant_matmul  # noqa: E402
from astrai.backends.cpu.serving import INTEGER_MIN_ROWS  # noqa: E402
from astrai.model.quantized import QuantizedLinear  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

SHAPES = {"smollm2 up (576 -> 1536)": (576, 1536), "smollm2 down (1536 -> 576)": (1536, 576),
          "llama1b up (2048 -> 8192)": (2048, 8192)}
ROWS = (1, 2, 3, 4, 8, 16, 64, 512)


def dequant_rows(x: torch.Tensor, weight: TypedWeight) -> torch.Tensor:
    """The dequantizing matmul over any number of rows, ``MAX_DEQUANT_ROWS`` a pass."""
    return torch.cat([dequant_matmul(x[i:i + MAX_DEQUANT_ROWS], weight) for i in range(0, x.shape[0], MAX_DEQUANT_ROWS)])


def seconds_of(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not dense_matmul_available():
        sys.exit("int4_matmul: astrai's C kernels are not built here (no C compiler?)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    table = []
    print(f"{'shape':28} {'rows':>5} {'dequant':>8} {'integer':>8} {'dequant x8':>10} {'integer x8':>10} "
          f"{'torch fp32':>10}  GFLOP/s; served / torch")
    for name, (n_in, n_out) in SHAPES.items():
        module = QuantizedLinear.from_linear(torch.nn.Linear(n_in, n_out, bias=False), 4)
        weight = TypedWeight(module.qweight, module.scales, Q4, n_in)
        x8 = TypedWeight(interleaved_values(module.qweight), interleaved_scales(module.scales), Q4X8, n_in)
        dense = module.dequantize()
        for rows in ROWS:
            x = torch.randn(rows, n_in)
            kernels = {"dequant": lambda: dequant_rows(x, weight), "integer": lambda: integer_matmul(x, weight),
                       "dequant_x8": lambda: dequant_rows(x, x8), "integer_x8": lambda: integer_matmul(x, x8),
                       "torch_fp32": lambda: F.linear(x, dense)}
            for run in kernels.values():
                run()  # the first call on a shape is slower
            seconds = {kernel: float("inf") for kernel in kernels}
            for _ in range(args.repeats):  # alternate the kernels, one timing each per round
                for kernel, run in kernels.items():
                    seconds[kernel] = min(seconds[kernel], seconds_of(run))
            flops = 2 * rows * n_in * n_out
            rate = {kernel: flops / s / 1e9 for kernel, s in seconds.items()}
            served = "integer_x8" if rows > MAX_DEQUANT_ROWS else "dequant_x8"
            ratio = rate[served] / rate["torch_fp32"]
            table.append({"shape": name, "rows": rows, "gflop_s": rate, "seconds": seconds,
                          "served_over_torch": ratio, "kernel_served": served})
            print(f"{name:28} {rows:5d} {rate['dequant']:8.1f} {rate['integer']:8.1f} {rate['dequant_x8']:10.1f} "
                  f"{rate['integer_x8']:10.1f} {rate['torch_fp32']:10.1f}  {ratio:.2f}x")
    write_result("int4_matmul", {"threads": args.threads, "repeats": args.repeats,
                                 "integer_min_rows": INTEGER_MIN_ROWS, "table": table}, args.out)


if __name__ == "__main__":
    main()
