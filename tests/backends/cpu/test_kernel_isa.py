"""The kernel library's instruction-set levels (kernels.LEVELS): which level a CPU's flags
select, ASTRAI_KERNEL_ISA forcing one (a level the CPU lacks refused by name), and every level
this machine runs, each loaded as its own library, giving the portable level's numbers at
every kernel entry point; for int8 and int4 the vector levels' integer sums (maddubs or VNNI's
vpdpbusd) give the avx2 level's outputs bit for bit."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import pytest
import torch

from astrai.backends.cpu import dense_matmul as dense
from astrai.backends.cpu import kernels, serving
from astrai.backends.cpu.kernels import (BF16, F32, FEATURE_AVX2, FEATURE_AVX512, FEATURE_BF16, FEATURE_VNNI, Q4,
                                        Q4X8, Q8, Q8X8, Q41, kernels_available)
from astrai.errors import ConfigError
from astrai.inference import InferenceEngine, SamplingParams
from astrai.model.quantized import quantize_model
from inference_helpers import make_model
from test_dequant_matmul_kernel import typed

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

FEATURES = {"portable": 0, "avx2": FEATURE_AVX2, "avx512": FEATURE_AVX2 | FEATURE_AVX512,
            "avx512_vnni": FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_VNNI,
            "avx512_bf16": FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_VNNI | FEATURE_BF16, "native": None}
V3 = "flags : fpu sse2 ssse3 pni cx16 lahf_lm popcnt sse4_1 sse4_2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
EVERYTHING = V4 + " avx512_vnni avx512_bf16 amx_tile amx_int8"
RESULTS_FILE = Path(__file__).resolve().parents[3] / "bench" / "results_file.py"


@pytest.fixture(scope="module")
def libraries():
    """Every level this CPU runs, built and loaded beside the library the process serves with."""
    return {level.name: kernels.level_library(level.name) for level in kernels.runnable_levels()}


@pytest.fixture
def on_level(libraries, monkeypatch):
    """Route the kernels' wrappers to one level's library (the served one stays loaded)."""
    def use(name):
        monkeypatch.setattr(kernels, "_library", lambda: libraries[name])
        monkeypatch.setattr(dense, "_library", lambda: libraries[name])
    return use


def _on_cpu(monkeypatch, flags, machine="x86_64"):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels.platform, "machine", lambda: machine)
    monkeypatch.delenv("ASTRAI_KERNEL_ISA", raising=False)
    monkeypatch.delenv("ASTRAI_PORTABLE_KERNELS", raising=False)


@pytest.mark.parametrize("flags,machine,level", [(V3, "x86_64", "avx2"), ("flags : fpu sse2", "x86_64", "portable"),
                                                 ("", "x86_64", "portable"), (V4, "x86_64", "avx512"),
                                                 (EVERYTHING, "x86_64", "avx512_bf16"),
                                                 (V4 + " avx512_vnni", "x86_64", "avx512_vnni"),
                                                 (V3 + " avx512_vnni", "x86_64", "avx2"),  # VNNI without AVX-512
                                                 ("Features : fp asimd", "aarch64", "native")])
def test_the_highest_level_the_cpu_reports_is_selected(monkeypatch, flags, machine, level):
    _on_cpu(monkeypatch, flags, machine)
    assert kernels.selected_level().name == level
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")
    assert kernels.selected_level().name == "portable"


def test_a_forced_level_the_cpu_lacks_is_refused_naming_what_it_lacks(monkeypatch):
    _on_cpu(monkeypatch, V3)
    monkeypatch.setenv("ASTRAI_KERNEL_ISA", "avx512_vnni")
    with pytest.raises(ConfigError, match="avx512_vnni, avx512bw.*it runs portable, avx2"):
        kernels.selected_level()
    with pytest.raises(ConfigError, match="avx512f"):
        kernels._library.__wrapped__()  # what the first kernel call meets: the error, not a silent fallback
    monkeypatch.setenv("ASTRAI_KERNEL_ISA", "sse9")
    with pytest.raises(ConfigError, match="not a kernel level.*portable, avx2, avx512, avx512_vnni"):
        kernels.selected_level()
    monkeypatch.setenv("ASTRAI_KERNEL_ISA", "avx2")
    monkeypatch.setenv("ASTRAI_PORTABLE_KERNELS", "1")  # the named level wins
    assert kernels.selected_level().name == "avx2"


@pytest.mark.parametrize("forced", ["portable", None])
def test_the_forced_level_is_the_one_loaded(monkeypatch, libraries, forced):
    """ASTRAI_KERNEL_ISA picks the build the process serves with, and kernel_isa() names it; unset,
    the highest level this CPU runs. Each build's loops use that level's intrinsics."""
    if forced is None:
        monkeypatch.delenv("ASTRAI_KERNEL_ISA", raising=False)
    else:
        monkeypatch.setenv("ASTRAI_KERNEL_ISA", forced)
    kernels._library.cache_clear()
    try:
        assert kernels.kernel_isa() == (forced or kernels.runnable_levels()[-1].name)
        assert kernels.kernel_features() == FEATURES[kernels.kernel_isa()] or kernels.kernel_isa() == "native"
    finally:
        monkeypatch.delenv("ASTRAI_KERNEL_ISA", raising=False)
        kernels._library.cache_clear()
    for name, library in libraries.items():
        assert library.level == name
        assert FEATURES[name] is None or kernels.kernel_features(library) == FEATURES[name]


def test_a_chosen_level_that_does_not_build_gives_way_to_the_next_lower(monkeypatch, caplog):
    """A compiler without an option of the highest level (as an old one lacks -mavx512vnni):
    the next lower level serves, with a warning; a forced level never gives way."""
    _on_cpu(monkeypatch, EVERYTHING)
    build = kernels._build

    def without_vnni(compiler, level):
        if "-mavx512vnni" in level.target:
            raise RuntimeError("cc: error: unrecognized command-line option '-mavx512vnni'")
        return build(compiler, level)

    monkeypatch.setattr(kernels, "_build", without_vnni)
    with caplog.at_level("WARNING", logger="astrai.backends.cpu.kernels"):
        assert kernels._library.__wrapped__().level == "avx512"
    assert "-mavx512vnni" in caplog.text and "serving with the avx512 level" in caplog.text
    monkeypatch.setenv("ASTRAI_KERNEL_ISA", "avx512_vnni")
    assert kernels._library.__wrapped__() is None


def _integer_outputs(on_level, name):
    """Every entry point's outputs that sums int8 or int4 products in integers, on odd shapes
    under level ``name``."""
    on_level(name)
    torch.manual_seed(3)
    out = []
    for kind in (Q8, Q4, Q41, Q4X8, Q8X8):
        n_out = 40 if kind in (Q4X8, Q8X8) else 37
        weight = typed(torch.randn(n_out, 200), kind)[0]
        out += [kernels.dequant_matmul(torch.randn(rows, 200), weight, torch.randn(n_out)) for rows in range(1, 9)]
        if kind not in (Q8, Q8X8):  # int8 prompts take integer_matmul with VNNI only
            out += [dense.integer_matmul(torch.randn(rows, 200), weight) for rows in (1, 5, 9, 30, 31, 40)]
    x = torch.randn(5, 200)
    x[1, 3] = float("nan")
    return out + [kernels.rounded_activations(x)]


def _float_outputs(on_level, name):
    """The other entry points' outputs on odd shapes under level ``name``."""
    on_level(name)
    torch.manual_seed(4)
    out = []
    for kind in (Q8, BF16, F32):
        weight = typed(torch.randn(37, 200), kind)[0]
        if kind != Q8:  # int8's few-row sums are integers (_integer_outputs)
            out += [kernels.dequant_matmul(torch.randn(rows, 200), weight, torch.randn(37)) for rows in range(1, 9)]
        if kind != F32:
            out.append(dense.dense_matmul(torch.randn(9, 200), weight, torch.randn(37)))
        if kind == BF16:  # a prompt's rows: vdpbf16ps where the level has it, else the weight widened
            with torch.no_grad():
                out += [serving.dequant_serving_linear(torch.randn(rows, 200), weight, torch.randn(37), None)
                        for rows in (9, 40)]
    bf16_odd = typed(torch.randn(21, 88), BF16)[0]  # five sixteens and a tail: the AVX2 loop's lone last sixteen
    out += [kernels.dequant_matmul(torch.randn(rows, 88), bf16_odd) for rows in (1, 3)]
    w = torch.randn(45, 131)
    out += [kernels.row_matmul(torch.randn(131), w, torch.randn(45)), kernels.row_matmul_argmax(torch.randn(131), w)[0]]
    out += [kernels.rows_matmul(torch.randn(rows, 131), w) for rows in (2, 5, 9, 16)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if kernels.kv_kind(dtype) is None:
            continue
        q, k, v = torch.randn(3, 1, 6, 40), torch.randn(3, 70, 2, 40).to(dtype), torch.randn(3, 70, 2, 24).to(dtype)
        out.append(kernels.decode_attention(q, k, v, torch.tensor([1, 33, 70]), 0.15))
    return out


def test_int8_and_int4_sums_are_the_same_integers_on_every_vector_level(libraries, on_level):
    """Integer sums are exact: maddubs (avx2, avx512) and vpdpbusd (avx512_vnni) give the same
    outputs bit for bit, and the plain-C loops the same up to the order of the float additions."""
    portable = _integer_outputs(on_level, "portable")
    vector = [name for name in libraries if name != "portable"]
    first = _integer_outputs(on_level, vector[0]) if vector else portable
    for name in vector[1:]:
        for a, b in zip(first, _integer_outputs(on_level, name)):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan()), name
    for a, b in zip(first, portable):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4, equal_nan=True)


def test_every_level_gives_the_portable_levels_numbers(libraries, on_level):
    portable = _float_outputs(on_level, "portable")
    for name in libraries:
        for i, (a, b) in enumerate(zip(_float_outputs(on_level, name), portable)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4), (name, i)


def test_a_rows_products_do_not_depend_on_the_rows_beside_it(libraries, on_level):
    """A speculative step verifies drafts as extra rows of the same matmuls: each row of a
    few-row call must be the one-row call's numbers bit for bit (else greedy decoding with
    drafts could leave greedy decoding without them), on every level, the portable one's
    plain-C loops included (which the compiler may reorder per row count unless each row has
    its own function), with a pair tail and an odd last block of int4. An fp32 weight's one row
    goes to another kernel (row_matmul.c's GEMV), which must add in the same order."""
    for name in libraries:
        on_level(name)
        torch.manual_seed(5)
        for kind in (Q8, Q4, Q41, Q4X8, Q8X8, BF16, F32):
            for n_in in (64, 80, 200, 576):  # 200: a tail past the sixteens (the AVX2 bf16 loop adds it apart)
                weight = typed(torch.randn(16 if kind in (Q4X8, Q8X8) else 9, n_in), kind)[0]
                x = torch.randn(8, n_in)
                alone = torch.cat([kernels.dequant_matmul(x[r:r + 1].contiguous(), weight) for r in range(8)])
                for rows in range(2, 9):
                    assert torch.equal(kernels.dequant_matmul(x[:rows].contiguous(), weight), alone[:rows]), \
                        (name, kind, n_in, rows)


def test_every_level_decodes_an_int4_model_to_the_same_tokens(libraries, on_level):
    """The fused C step and the few-row and prompt matmuls under each level: the same greedy tokens."""
    model = quantize_model(make_model("tiny", seed=2), "int4")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 3] * 5, [17, 4]]
    tokens = {}
    for name in libraries:
        on_level(name)
        with InferenceEngine(model, None, max_batch_size=2, page_size=4, num_pages=64) as engine:
            tokens[name] = [engine.submit(p, params).result(timeout=60).token_ids for p in prompts]
    assert len(set(map(str, tokens.values()))) == 1, tokens


def test_a_benchmarks_json_records_the_level_it_ran(monkeypatch):
    """The kernel level, PyTorch's, and any setting that held the run below the CPU's best."""
    spec = importlib.util.spec_from_file_location("results_file", RESULTS_FILE)
    results_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results_file)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    machine = results_file.describe_machine()
    assert machine["kernel_isa"] == kernels.kernel_isa() is not None
    assert machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["isa_limits"].get("ONEDNN_MAX_CPU_ISA") == "AVX2" and "ATEN_CPU_CAPABILITY" not in machine["isa_limits"]
    if platform.machine() == "x86_64":  # the numbers that name the core (family 25: Zen 3/4, 26: Zen 5)
        assert machine["cpu_family"].isdigit() and machine["cpu_model"].isdigit()
