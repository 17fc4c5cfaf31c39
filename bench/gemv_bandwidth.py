"""A decode step's matmuls against the memory they must read: one row through every weight.

One greedy decode step multiplies one row of activations by every weight of the model once,
so it can go no faster than a read of those bytes. This runs the one-row matmuls of the
1B Llama shape (16 layers of q, k, v, o, gate, up, down and the 128,256-word head, each its
own tensor) through the kernels the engine serves with, weight kind by weight kind, and
alternates each pass with a bare read of as many bytes (torch's sum on the same threads).
It reports each kind's read rate and its share of the bare read: what a kernel leaves on the
table before anything else in the step counts. Weights are random; every matrix of a pass
is in the kind named (the served int4 model keeps its head in int8), laid out as the engine
lays it (int4 eight rows interleaved, int8 too where the kernels have VNNI).
``ASTRAI_KERNEL_ISA`` picks the kernel level, as for the engine.

    OMP_NUM_THREADS=2 .venv/bin/python bench/gemv_bandwidth.py
    ASTRAI_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 .venv/bin/python bench/gemv_bandwidth.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from astrai.backends.cpu import kernels  # noqa: E402
from astrai.backends.cpu.interleaved import interleaved_scales, interleaved_values  # noqa: E402
from astrai.backends.cpu.kernels import (BF16, F32, FEATURE_VNNI, Q4X8, Q8, Q8X8, Q41, TypedWeight,  # noqa: E402
                                        dequant_matmul, kernel_features, kernel_isa, kernels_available)
from astrai.model.quantized import quantize_weight  # noqa: E402
from results_file import write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

DIM, FFN, KV, VOCAB, LAYERS = 2048, 8192, 512, 128256, 16
LAYER_SHAPES = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (FFN, DIM), (DIM, FFN)]  # [out, in]


def typed(n_out: int, n_in: int, precision: str) -> TypedWeight:
    weight = torch.randn(n_out, n_in)
    if precision in ("fp32", "bf16"):
        return TypedWeight(weight.to(torch.float32 if precision == "fp32" else torch.bfloat16), None,
                           F32 if precision == "fp32" else BF16, n_in)
    values, scales = quantize_weight(weight, 8 if precision == "int8" else 4, asymmetric=precision == "int4-asym")
    if precision == "int4-asym":
        return TypedWeight(values, scales, Q41, n_in)
    interleave = precision == "int4" or kernel_features() & FEATURE_VNNI
    if not interleave:
        return TypedWeight(values, scales, Q8, n_in)
    return TypedWeight(interleaved_values(values), interleaved_scales(scales),
                       Q4X8 if precision == "int4" else Q8X8, n_in)


def model_weights(precision: str, layers: int) -> list[TypedWeight]:
    """Each layer's matrices as distinct tensors (copies of one layer's, which are as far apart
    in memory as fresh ones), then the head."""
    layer = [typed(n_out, n_in, precision) for n_out, n_in in LAYER_SHAPES]
    copies = [TypedWeight(w.data.clone(), None if w.scales is None else w.scales.clone(), w.kind, w.in_features)
              for _ in range(layers - 1) for w in layer]
    return layer + copies + [typed(VOCAB, DIM, precision)]


def nbytes(weights: list[TypedWeight]) -> int:
    return sum(w.data.numel() * w.data.element_size() + (0 if w.scales is None else w.scales.numel() * 2)
               for w in weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="fp32,bf16,int8,int4,int4-asym")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not kernels_available():
        sys.exit("gemv_bandwidth: astrai's C kernels are not built here (no C compiler?)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"kernel level {kernel_isa()}, {args.threads} threads")
    for precision in args.precisions.split(","):
        weights = model_weights(precision, args.layers)
        size = nbytes(weights)
        inputs = {n_in: torch.randn(1, n_in) for n_in in (DIM, FFN)}
        buffer = torch.ones(size // 4)

        def step() -> float:
            start = time.perf_counter()
            for w in weights:
                dequant_matmul(inputs[w.in_features], w)
            return time.perf_counter() - start

        def bare() -> float:
            start = time.perf_counter()
            buffer.sum()
            return time.perf_counter() - start

        step(), bare()  # the first pass on a shape is slower
        matmul, read = [], []
        for _ in range(args.rounds):
            matmul.append(step())
            read.append(bare())
        matmul_rate, read_rate = size / statistics.median(matmul), size / statistics.median(read)
        share = statistics.median(r / m for m, r in zip(matmul, read))  # per round: both at one bandwidth level
        rows.append({"precision": precision, "bytes": size, "matmul_s": matmul, "bare_read_s": read,
                     "matmul_gb_s": matmul_rate / 1e9, "bare_read_gb_s": read_rate / 1e9, "share_of_bare_read": share})
        print(f"{precision:10} {size / 1e6:8.0f} MB  matmuls {matmul_rate / 1e9:6.1f} GB/s  bare read "
              f"{read_rate / 1e9:6.1f} GB/s  share {share:.2f}")
        del weights, buffer
    write_result("gemv_bandwidth", {"threads": args.threads, "layers": args.layers, "rounds": args.rounds,
                                    "kernel_level": kernel_isa(), "table": rows}, args.out)


if __name__ == "__main__":
    main()
