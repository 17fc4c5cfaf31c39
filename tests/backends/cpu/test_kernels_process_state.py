"""Loading the native kernels (astrai/backends/cpu/kernels.py) leaves the process's floating
point state alone: subnormals survive in torch and in Python after an engine has built the
kernels and run its decode steps through them (a library linked with -ffast-math would
switch on flush-to-zero for the whole process when it loads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from astrai.backends.cpu.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

DECODE_THEN_CHECK = """
import torch
from astrai.backends.cpu import fused_decode
from astrai.config import preset
from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel

steps = []
real = fused_decode.decode_steps
fused_decode.decode_steps = lambda *a, **k: steps.append(1) or real(*a, **k)
torch.manual_seed(0)
model = AutoModel.from_config(preset("tiny", vocab_size=256, n_layers=2, dim=64, dim_ffn=128, max_len=256)).eval()
with InferenceEngine(model, None, max_batch_size=1, page_size=4, num_pages=32) as engine:
    engine.submit([5, 9, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result(timeout=60)
assert steps, "the decode steps did not run through the native kernels"
tiny = 1e-310  # a name, not a constant expression Python would fold when compiling
print(float((torch.tensor([1e-39]) * 1.0)[0]), tiny * 1.0)
"""


def test_a_decoding_engine_leaves_subnormals_alone():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", DECODE_THEN_CHECK], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    tensor, python = result.stdout.split()
    assert float(tensor) != 0.0 and float(python) == 1e-310, result.stdout
