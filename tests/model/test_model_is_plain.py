"""The model package is plain PyTorch: nothing in it names the CPU backend's fast paths, and
importing it imports no backend."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import astrai.model

MODEL_DIR = Path(astrai.model.__file__).parent
FAST_PATH_NAMES = ["backends", "native", "row_matmul", "decode_attention", "decode_step", "kernels_available",
                   "packed_weight", "pack_linears", "joint_weight", "joint_linears", "linear_group", "onednn",
                   "mkldnn", "huge_page", "hugepage", "decode_buffer", "DecodeBuffers", "FusedDecode",
                   "fused_decode", "ctypes", "openmp", "mallopt", "greedy_run", "ServingLinear", "C kernel",
                   "amx", "perf_counter", "matmul_pays"]


def test_no_fast_path_name_appears_under_astrai_model():
    pattern = re.compile("|".join(map(re.escape, FAST_PATH_NAMES)), re.IGNORECASE)
    hits = [f"{path.relative_to(MODEL_DIR)}:{number}: {line.strip()}"
            for path in sorted(MODEL_DIR.rglob("*")) if path.is_file() and path.suffix in (".py", ".c", ".h")
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
    assert not [p for p in MODEL_DIR.rglob("*") if p.suffix in (".c", ".h", ".so")]


def test_importing_the_model_imports_no_backend():
    code = ("import sys, astrai.model, astrai.model.hf, astrai.model.lora; "
            "print([m for m in sys.modules if m.startswith('astrai.backends') or m.startswith('astrai.inference')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
