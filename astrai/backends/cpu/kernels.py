"""Small C kernels for the CPU decode step and prefill, compiled on first use with the system's C compiler.

Eight kernels live in ``native/``, built into one library: the four below,
``native/dense_rows.c``, which widens rows of a bf16 or int8 weight to fp32 for the
prefill's matmuls, ``native/integer_matmul.c``, which multiplies many rows by an int4
(with VNNI, also an int8) weight in integers (both bound in dense_matmul.py),
``native/bf16_matmul.c``, a prompt's rows by a bf16 weight with AVX512-BF16, and
``native/cross_entropy.c``, the fused training loss's softmax and logit gradient of a chunk
(cross_entropy.py).

Decode attention. PyTorch has no CPU kernel for attention of one query over rows of
different lengths: batched matmuls over every row padded to the longest context read the
padding too. ``native/decode_attention.c`` reads each row's own context only, once, with
vectorised loops.

One-row matmuls (GEMV). A single request's decode step is bound by streaming the weights.
``native/row_matmul.c`` reads a row-major weight (nn.Linear's layout) one output row
at a time, each thread a contiguous stretch of rows: one stream per thread, which the
hardware prefetcher follows on its own. ``rows_matmul`` is the same walk for a few rows
(a decode step of continuous batching): each weight row, read once, serves every row of x
in groups of four while it sits in L1. Up to ``MAX_F32_ROWS`` rows it reads a model's
weights faster than oneDNN's matmul over its packed copy.

Weight-only dequantizing matmuls. ``native/dequant_matmul.c`` is the same matmul for one to
``MAX_DEQUANT_ROWS`` rows over a bf16 weight or one quantized in blocks of 32 (int8 as GGUF's
Q8_0, int4 as its Q4_0: astrai/model/quantized.py's layout, or Q4_0 with eight rows
interleaved as serving lays it out, and so int8 where the CPU has VNNI: interleaved.py),
reading the weight once for all rows and dequantizing each block in registers. bf16 sums in fp32 over float activations;
int8 and int4 (W8A8 and W4A8, as llama.cpp's ``vec_dot`` with Q8_0 activations) round the
activations to Q8_0 blocks as ``quantize_activations`` does and sum each block's int8 x int8
or int4 x int8 products in integers (the plain-C build the same integer sums).
``TypedWeight`` describes such a weight (``dequant_matmul`` takes it).
``rounded_activations`` is that rounding on its own, in one pass, for the paths that
multiply a quantized weight in floats.

A whole single-request decode step. ``native/decode_step.c`` runs every layer of a GQA +
SwiGLU model for one row - norms (QK-norm too), biases, rotary embedding, K/V writes,
attention, SiLU, residuals and the head - in one call, between the same matmuls (over
fp32, bf16, int8 or int4 weights, each weight's type in its table) and decode attention as
above; fused_decode.py decides when a model and a step qualify and builds its
table of pointers. ``decode_steps`` runs several such steps of a greedy request in one
call, each taking the last one's argmax as its token. ``draft_head_steps`` runs a draft
head's drafts of one row the same way (fused_head.py builds its ``HeadPlan``).

The library is built with ``cc`` (``$CC``) into a per-user cache directory, keyed by
the source, the flags and this CPU's feature flags (it is tuned for this CPU; a new
build deletes all but the ``KEEP_BUILDS`` most recent older ones), and loaded with ctypes; its OpenMP
calls resolve to the libgomp that torch already loaded, so its threads are torch's. Without
a compiler, or with ``ASTRAI_NATIVE_KERNELS=0``, nothing is built: attention keeps the
batched matmuls, one-row matmuls the split and typed weights are dequantized for torch's
matmul (a warning says so once; the engine's ``decode_paths`` statistic shows it).

Instruction-set levels. On x86-64 the library is built for one of ``LEVELS``: ``portable``
(the generic target, plain C loops), ``avx2`` (x86-64-v3's features: AVX2, FMA, F16C; the
dequantizing and integer matmuls widen blocks with intrinsics and sum int4 x int8 products
with maddubs), ``avx512`` (x86-64-v4's: sixteen-lane loops for several rows of int8 and fp32
weights) and ``avx512_vnni`` (x86-64-v4's with AVX512-VNNI: each group of four int4 x int8
products summed by one ``vpdpbusd``, the same integer sums, so the same outputs as ``avx2``)
and ``avx512_bf16`` (as ``avx512_vnni``, and bf16 weights multiplied with ``vdpbf16ps``: a few
rows in native/dequant_matmul.c, a prompt's in native/bf16_matmul.c).
Each is built into its own library, tuned for this CPU (``-mtune=native``), and the process
loads the highest level whose flags /proc/cpuinfo reports (``kernel_isa()`` names it), or,
where the compiler cannot build that one, the next lower that it can.
``ASTRAI_KERNEL_ISA=<level>`` forces a level, and one the CPU cannot run is refused naming
the flags it lacks; ``ASTRAI_PORTABLE_KERNELS=1`` is ``portable``, forced. Other CPUs have
two levels: ``portable`` and ``native`` (``-march=native``, the default).
``level_library`` loads another level beside the served one, as its own handle: the tests
compare every level's kernels with the portable level's that way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from astrai.errors import ConfigError
from astrai.model.quantized import quantize_activations

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "native").glob("*.c")))
HEADERS = tuple(sorted((Path(__file__).parent / "native").glob("*.h")))  # included by the sources, hashed with them
# -ffast-math's parts but -ffinite-math-only, named one by one: the reductions need reassociation,
# but -ffast-math (and -funsafe-math-optimizations) on the link line also links crtfastmath.o,
# which turns on flush-to-zero for the whole process when the library loads.
FAST_MATH = ["-fno-math-errno", "-fassociative-math", "-freciprocal-math", "-fno-signed-zeros", "-fno-trapping-math",
             "-fno-rounding-math", "-fno-signaling-nans", "-fcx-limited-range", "-fexcess-precision=fast",
             "-ffp-contract=fast"]
FLAGS = ["-O3", *FAST_MATH, "-fopenmp", "-fPIC", "-shared"]  # a level's target flags come before these
MAX_F32_ROWS = 16  # rows serving gives rows_matmul (beyond, oneDNN's packed matmul is as fast or faster)
MAX_DEQUANT_ROWS = 8  # rows a dequantizing matmul takes at most (ASTRAI_MAX_DEQUANT_ROWS in native/dequant_matmul.c)


@dataclass(frozen=True)
class KernelLevel:
    """An instruction-set level the library is built for: the compiler's ``target`` flags and
    the /proc/cpuinfo flags a CPU must report (``needs``) to run what they build."""

    name: str
    target: tuple[str, ...]
    needs: frozenset[str] = frozenset()


# the x86-64 micro-architecture levels as /proc/cpuinfo names their features (lzcnt is "abm", sse3 "pni")
X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
X86_64_V3 = X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# the compiler's option for each of them: -march=x86-64-v3/-v4 spelled out, for compilers
# older than those names (GCC 11, Clang 12)
OPTIONS = {"cx16": "-mcx16", "lahf_lm": "-msahf", "popcnt": "-mpopcnt", "pni": "-msse3", "ssse3": "-mssse3",
           "sse4_1": "-msse4.1", "sse4_2": "-msse4.2", "avx": "-mavx", "avx2": "-mavx2", "bmi1": "-mbmi",
           "bmi2": "-mbmi2", "f16c": "-mf16c", "fma": "-mfma", "abm": "-mlzcnt", "movbe": "-mmovbe",
           "xsave": "-mxsave", "avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512cd": "-mavx512cd",
           "avx512dq": "-mavx512dq", "avx512vl": "-mavx512vl", "avx512_vnni": "-mavx512vnni",
           "avx512_bf16": "-mavx512bf16"}


def _x86_level(name: str, needs: frozenset[str]) -> KernelLevel:
    """A level built for exactly the features it needs, tuned for the CPU at hand."""
    return KernelLevel(name, (*sorted(OPTIONS[flag] for flag in needs), "-mtune=native"), needs)


PORTABLE = KernelLevel("portable", ("-DASTRAI_PORTABLE",))
LEVELS = (PORTABLE, _x86_level("avx2", X86_64_V3), _x86_level("avx512", X86_64_V4),
          _x86_level("avx512_vnni", X86_64_V4 | {"avx512_vnni"}),
          _x86_level("avx512_bf16", X86_64_V4 | {"avx512_vnni", "avx512_bf16"}))  # lowest first
OTHER_LEVELS = (PORTABLE, KernelLevel("native", ("-march=native",)))  # CPUs other than x86-64


def portable_forced() -> bool:
    """Whether ``ASTRAI_PORTABLE_KERNELS=1`` asks for the plain-C build for the generic target."""
    return os.environ.get("ASTRAI_PORTABLE_KERNELS", "0") not in ("", "0")


def _levels() -> tuple[KernelLevel, ...]:
    return LEVELS if platform.machine().lower() in ("x86_64", "amd64") else OTHER_LEVELS


def _forced() -> str:
    """The level's name the environment forces, or ''."""
    return os.environ.get("ASTRAI_KERNEL_ISA", "") or ("portable" if portable_forced() else "")


def runnable_levels() -> tuple[KernelLevel, ...]:
    """The levels this CPU reports every flag of, lowest first."""
    flags = set(cpu_flags().split())
    return tuple(level for level in _levels() if level.needs <= flags)


def selected_level() -> KernelLevel:
    """The level the process loads: the one ``ASTRAI_KERNEL_ISA`` (or ``ASTRAI_PORTABLE_KERNELS=1``)
    forces, else the highest this CPU runs. A forced level unknown here, or needing a flag this
    CPU does not report, is a ConfigError naming what is missing and the levels it can run."""
    runnable = runnable_levels()
    forced = _forced()
    if not forced:
        return runnable[-1]
    names = ", ".join(level.name for level in runnable)
    level = next((level for level in _levels() if level.name == forced), None)
    if level is None:
        known = ", ".join(level.name for level in _levels())
        raise ConfigError(f"ASTRAI_KERNEL_ISA={forced!r} is not a kernel level here ({known}); this CPU runs {names}")
    missing = sorted(level.needs - set(cpu_flags().split()))
    if missing:
        raise ConfigError(f"ASTRAI_KERNEL_ISA={forced}: this CPU does not report {', '.join(missing)}; "
                          f"it runs {names} (unset ASTRAI_KERNEL_ISA for the highest)")
    return level


def _cache_dir() -> Path:
    base = os.environ.get("ASTRAI_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "astrai" / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (the processor's name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, level: KernelLevel) -> Path:
    source = b"".join(path.name.encode() + path.read_bytes() for path in SOURCES + HEADERS)
    flags = [*level.target, *FLAGS]
    key = hashlib.sha256(source + " ".join([compiler, *flags, cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"astrai-kernels-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build under the temporary directory instead
        target = Path(tempfile.gettempdir()) / f"astrai-kernels-{os.getuid()}" / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then rename: parallel builds never clash
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            names = ", ".join(path.name for path in SOURCES)
            raise RuntimeError(f"{compiler} failed to build {names}:\n{result.stderr.strip()}")
        os.replace(built, target)
    _prune(target)
    return target


KEEP_BUILDS = 8  # other builds kept beside a new one (other levels, checkouts, CPUs or compilers sharing the cache)


def _prune(newest: Path) -> None:
    """Delete all but the ``KEEP_BUILDS`` most recently built other libraries: each change to a
    kernel's source builds a new one under a new name, and nothing else would ever remove the
    old. A process that still has one loaded keeps its mapping."""
    others = [path for path in newest.parent.glob("astrai-kernels-*.so") if path != newest]
    others.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    for path in others[KEEP_BUILDS:]:
        try:
            path.unlink()
        except OSError:  # already gone (another process pruned it), or not ours to delete
            pass


@functools.lru_cache(maxsize=1)
def _library() -> Optional[ctypes.CDLL]:
    """The library the process serves with: ``selected_level()``'s build or, where that level was
    chosen (not forced) and does not build (a compiler lacking one of its options), the highest
    lower level that does."""
    if os.environ.get("ASTRAI_NATIVE_KERNELS", "1") == "0":
        return None
    level = selected_level()
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: decode attention and one-row matmuls keep PyTorch's ops (slower)")
        return None
    failures = []
    for candidate in [level] if _forced() else reversed(runnable_levels()):
        try:
            library = _load(compiler, candidate)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            failures.append(f"{candidate.name}: {exc}")
            continue
        if failures:
            logger.warning("could not build astrai's kernels for %s; serving with the %s level",
                           "; ".join(failures), candidate.name)
        return library
    logger.warning("could not build astrai's decode kernels (%s); keeping PyTorch's ops", "; ".join(failures))
    return None


def _compiler() -> Optional[str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return compiler if platform.system() == "Linux" else None


@functools.lru_cache(maxsize=None)
def level_library(name: str) -> ctypes.CDLL:
    """The build of the level ``name`` (one of ``runnable_levels()``), loaded as a handle of its
    own beside the one the process serves with (which it leaves in place): for comparing one
    level's kernels with another's. RuntimeError without a compiler or a level this CPU runs."""
    level = next((level for level in runnable_levels() if level.name == name), None)
    compiler = _compiler()
    if level is None or compiler is None:
        raise RuntimeError(f"cannot build kernel level {name!r} here (no compiler, or not one of this CPU's levels)")
    return _load(compiler, level)


def _load(compiler: str, level: KernelLevel) -> ctypes.CDLL:
    """``level``'s library, built if need be, loaded with its functions' argument types set."""
    library = ctypes.CDLL(str(_build(compiler, level)))
    library.level = level.name
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.astrai_decode_attention_f32.argtypes = ([ptr] * 6 + [i64] * 11 + [ptr, i64, i64] + [ctypes.c_float, i64, i64]
                                                    + [ctypes.c_int] * 2)
    library.astrai_decode_attention_workspace_floats.argtypes = [i64] * 6
    library.astrai_decode_attention_workspace_floats.restype = i64
    library.astrai_kv_kinds.argtypes = []
    library.astrai_kv_kinds.restype = ctypes.c_int
    library.astrai_row_matmul_f32.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    library.astrai_row_matmul_argmax_f32.argtypes = [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    library.astrai_rows_matmul_f32.argtypes = [ptr, i64] + [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    library.astrai_row_matmul_argmax_f32.restype = i64
    library.astrai_decode_step_f32.argtypes = [ctypes.POINTER(DecodePlan)] + [i64] * 4 + [ptr]
    library.astrai_decode_step_f32.restype = i64
    library.astrai_decode_steps_f32.argtypes = ([ctypes.POINTER(DecodePlan)] + [i64] * 2 + [ptr] * 2 + [i64] + [ptr]
                                                 + [i64] * 2 + [ctypes.c_double] + [ptr] * 2)
    library.astrai_decode_steps_f32.restype = i64
    library.astrai_verify_step_f32.argtypes = [ctypes.POINTER(DecodePlan), ptr, i64, i64] + [ptr] * 4
    library.astrai_verify_step_f32.restype = i64
    library.astrai_step_work_floats.argtypes = [ctypes.POINTER(DecodePlan), i64]
    library.astrai_step_work_floats.restype = i64
    library.astrai_head_work_floats.argtypes = [ctypes.POINTER(HeadPlan)]
    library.astrai_head_work_floats.restype = i64
    library.astrai_draft_head_steps.argtypes = [ctypes.POINTER(HeadPlan), ptr, i64, i64, ptr]
    library.astrai_draft_head_steps.restype = i64
    library.astrai_head_speculative_steps.argtypes = [ctypes.POINTER(DecodePlan), ctypes.POINTER(HeadPlan),
                                                      ctypes.POINTER(SpeculativeRun)]
    library.astrai_head_speculative_steps.restype = i64
    library.astrai_lookup_speculative_steps.argtypes = [ctypes.POINTER(DecodePlan), ctypes.POINTER(PromptLookupRun),
                                                        ctypes.POINTER(SpeculativeRun)]
    library.astrai_lookup_speculative_steps.restype = i64
    library.astrai_ngram_drafts.argtypes = [ptr] + [i64] * 4 + [ptr]
    library.astrai_ngram_drafts.restype = i64
    library.astrai_dequant_matmul.argtypes = ([ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr] + [i64] * 5
                                              + [ctypes.c_int] * 2)
    library.astrai_dequant_matmul.restype = i64
    library.astrai_round_activations.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    library.astrai_round_activations.restype = None
    library.astrai_integer_matmul.argtypes = ([ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ptr, ptr]
                                              + [i64] * 3 + [ctypes.c_int])
    library.astrai_integer_matmul.restype = i64
    library.astrai_bf16_matmul.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr] + [i64] * 3 + [ctypes.c_int]
    library.astrai_bf16_matmul.restype = i64
    library.astrai_softmax_gradient.argtypes = ([ptr, ctypes.c_int] + [i64] * 3 + [ptr, ptr, ctypes.c_float, ptr, ptr,
                                                 ctypes.c_int, i64, ctypes.c_int])
    library.astrai_softmax_gradient.restype = None
    library.astrai_kernel_features.argtypes = []
    library.astrai_kernel_features.restype = ctypes.c_int
    for function in (library.astrai_decode_attention_f32, library.astrai_row_matmul_f32,
                     library.astrai_rows_matmul_f32):
        function.restype = None
    return library


def kernels_available() -> bool:
    """Whether the kernels are built and loaded (building them on first call)."""
    return _library() is not None


# the K/V dtypes native/decode_attention.c reads (and decode_step.c writes), by their kind there
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kv_kind(dtype: torch.dtype) -> Optional[int]:
    """The kernels' kind of a K/V cache of ``dtype``, or None when the loaded build has none
    (a compiler without ``_Float16`` offers no fp16). Call only when ``kernels_available()``."""
    kind = KV_KINDS.get(dtype)
    return kind if kind is not None and _library().astrai_kv_kinds() >> kind & 1 else None


def attention_workspace(rows: int, heads: int, group: int, v_width: int, max_len: int, threads: int) -> torch.Tensor:
    """The scratch memory native/decode_attention.c takes for up to ``rows`` rows of up to
    ``max_len`` positions on up to ``threads`` threads, its per-row counts zeroed (the kernel
    leaves them zero, so one workspace serves any number of calls)."""
    floats = _library().astrai_decode_attention_workspace_floats(rows, heads, group, v_width, max_len, threads)
    workspace = torch.empty(floats, dtype=torch.float32)
    workspace[:rows].zero_()
    return workspace


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                     scale: float, lengths_checked: bool = False) -> torch.Tensor:
    """Attention of one query per row over that row's first ``lens[row]`` keys.

    q [B, 1, H, D] contiguous fp32; k [B, S, Hkv, D] and v [B, S, Hkv, Dv], CPU views of one
    dtype the kernels read (``kv_kind``: fp32, bf16, fp16) whose last dimension is contiguous
    (the decode buffers); ``lens`` [B] int64 with
    1 <= lens <= S. Returns [B, 1, H, Dv]. Call only when ``kernels_available()``.
    ``lengths_checked`` skips the check of ``lens`` (two reductions per layer) for a
    caller that built them itself within those limits: the engine's decode view.
    """
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[1] == 1):
        raise ValueError("decode_attention: unsupported layout or dtype (q [B, 1, H, D], k and v 4-d)")
    B, _, H, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if not (q.is_contiguous() and k.stride(3) == 1 and v.stride(3) == 1 and lens.dtype == torch.int64
            and q.dtype == torch.float32 and k.dtype == v.dtype and kv_kind(k.dtype) is not None and Hkv > 0 and H % Hkv == 0 and lens.shape == (B,)
            and k.shape[0] == v.shape[0] == B and k.shape[3] == D and v.shape[1:3] == (S, Hkv)):
        raise ValueError("decode_attention: unsupported layout or dtype")
    longest = S
    if not lengths_checked:
        longest = int(lens.max())
        if longest > S or int(lens.min()) < 1:
            raise ValueError(f"decode_attention: lengths must be in 1..{S}, got {lens.tolist()}")
    out = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    lens = lens.contiguous()
    threads = torch.get_num_threads()
    workspace = attention_workspace(B, Hkv, H // Hkv, Dv, longest, threads)
    _library().astrai_decode_attention_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lens.data_ptr(), workspace.data_ptr(),
        B, Hkv, H // Hkv, D, Dv, k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2), v.stride(1),
        None, 0, 0, scale, longest, B, kv_kind(k.dtype), threads)
    return out


def paged_decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, lens: torch.Tensor,
                           pages: torch.Tensor, page_size: int, scale: float,
                           workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query per row over that row's first ``lens[row]`` positions, read where
    they lie in a page store: position p of row b is slot ``pages[b, p // page_size] *
    page_size + p % page_size`` of ``k_store`` [slots, Hkv, D] / ``v_store`` [slots, Hkv, Dv]
    (one layer of ``Storage``: contiguous, a dtype ``kv_kind`` reads). Nothing is copied or
    gathered: a long context costs its bytes' reading only.

    q [B, 1, H, D] contiguous fp32; ``lens`` [B] int64, 1 <= lens, and ``pages`` [B, P] int64
    (rows may share pages) must cover them: the caller (the engine's decode view) builds both
    from the cache's own page lists, so they are not checked here. Returns [B, 1, H, Dv].
    ``workspace``: one ``attention_workspace`` for these rows and ``pages``' length, to reuse
    across a step's layers (made here when None). Call only when ``kernels_available()``."""
    B, _, H, D = q.shape
    Hkv, Dv = k_store.shape[1], v_store.shape[2]
    if not (q.dim() == 4 and q.shape[1] == 1 and q.is_contiguous() and q.dtype == torch.float32
            and k_store.dim() == v_store.dim() == 3 and k_store.is_contiguous() and v_store.is_contiguous()
            and k_store.dtype == v_store.dtype and kv_kind(k_store.dtype) is not None and k_store.shape[2] == D
            and v_store.shape[:2] == k_store.shape[:2] and Hkv > 0 and H % Hkv == 0
            and lens.shape == (B,) and lens.dtype == torch.int64 and lens.is_contiguous()
            and pages.dim() == 2 and pages.shape[0] == B and pages.dtype == torch.int64 and pages.stride(1) == 1
            and page_size > 0):
        raise ValueError("paged_decode_attention: unsupported layout or dtype")
    longest = pages.shape[1] * page_size
    out = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    threads = torch.get_num_threads()
    if workspace is None:
        workspace = attention_workspace(B, Hkv, H // Hkv, Dv, longest, threads)
    elif workspace.numel() < _library().astrai_decode_attention_workspace_floats(B, Hkv, H // Hkv, Dv, longest, threads):
        raise ValueError("paged_decode_attention: the workspace is too small for these rows")
    _library().astrai_decode_attention_f32(
        q.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), out.data_ptr(), lens.data_ptr(), workspace.data_ptr(),
        B, Hkv, H // Hkv, D, Dv, 0, D, Hkv * D, 0, Dv, Hkv * Dv,
        pages.data_ptr(), pages.stride(0), page_size, scale, longest, B, kv_kind(k_store.dtype), threads)
    return out


def row_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` [..., in] (fp32, contiguous) and a
    row-major fp32 ``weight`` [out, in] (contiguous rows; rows may lie further apart).
    Call only when ``kernels_available()``."""
    _check_row_matmul(x, weight, bias)
    n_out, n_in = weight.shape
    out = torch.empty(n_out, dtype=x.dtype)
    _library().astrai_row_matmul_f32(
        x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
        n_in, n_out, weight.stride(0), max(torch.get_num_threads(), 1))
    return out.view(*x.shape[:-1], n_out)


def rows_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows ``x`` [..., in] (fp32, contiguous; up to
    ``MAX_F32_ROWS`` is where it beats oneDNN's packed matmul) and a row-major fp32 ``weight``,
    reading the weight once for all rows. Call only when ``kernels_available()``."""
    n_out, n_in = weight.shape if weight.dim() == 2 else (0, -1)
    if not (x.shape[-1] == n_in and x.is_contiguous() and row_major(weight) and x.dtype == weight.dtype == torch.float32
            and fits_bias(bias, n_out)):
        raise ValueError("rows_matmul: unsupported layout or dtype")
    rows = x.numel() // max(n_in, 1)
    out = torch.empty(rows, n_out, dtype=x.dtype)
    if rows:
        _library().astrai_rows_matmul_f32(
            x.data_ptr(), rows, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
            n_in, n_out, weight.stride(0), max(torch.get_num_threads(), 1))
    return out.view(*x.shape[:-1], n_out)


def row_matmul_argmax(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``row_matmul(x, weight)`` [out] and the index of its maximum as ``torch.argmax`` gives
    it (the first maximum; the first NaN if any): the GEMV the C decode step ends with,
    for its head. Call only when ``kernels_available()``."""
    _check_row_matmul(x, weight, None)
    n_out, n_in = weight.shape
    out = torch.empty(n_out, dtype=x.dtype)
    best = _library().astrai_row_matmul_argmax_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), n_in, n_out,
                                                   weight.stride(0), max(torch.get_num_threads(), 1))
    return out, best


def _check_row_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    n_in = weight.shape[1] if weight.dim() == 2 else -1
    if not (x.numel() == n_in and x.is_contiguous() and row_major(weight)
            and x.dtype == weight.dtype == torch.float32 and fits_bias(bias, weight.shape[0])):
        raise ValueError("row_matmul: unsupported layout or dtype")


def fits_bias(bias: Optional[torch.Tensor], n_out: int) -> bool:
    """Whether ``bias`` is absent or one contiguous fp32 value per output: the kernels read
    ``n_out`` floats from its address, whatever its length."""
    return bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.dim() == 1
                            and bias.numel() == n_out)


def row_major(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [out, in] has contiguous rows, as ``row_matmul`` reads it."""
    return weight.dim() == 2 and (weight.stride(1) == 1 or weight.shape[1] == 1) and weight.stride(0) >= weight.shape[1]


# weight types of native/dequant_matmul.c
F32, BF16, Q8, Q4, Q41, Q4X8, Q8X8 = 0, 1, 2, 3, 4, 5, 6  # Q41: int4 with a minimum per block (GGUF's Q4_1)
# Q4X8, Q8X8: Q4_0 and Q8_0 with eight rows interleaved (interleaved.py)
INT4_KINDS = (Q4, Q41, Q4X8)
INT8_KINDS = (Q8, Q8X8)
INTERLEAVED_KINDS = (Q4X8, Q8X8)
QUANTIZED_KINDS = (*INT8_KINDS, *INT4_KINDS)
BLOCK = 32  # inputs per quantized block (one fp16 scale each)


@dataclass(frozen=True)
class TypedWeight:
    """A row-major weight [out, in] as the dequantizing matmuls read it: ``data`` fp32 or bf16
    [out, >= in], or the quantized values (int8 [out, padded in], or uint8 [out, padded in / 2]
    for int4) with their fp16 ``scales`` [out, padded in / 32]; rows may lie further apart
    than their length (a block of a stacked weight), each tensor's last dimension contiguous.
    An interleaved weight's (``Q4X8``, ``Q8X8``) groups of eight rows each lie whole: both
    tensors have rows exactly as long as their blocks need, and a multiple of eight of them."""

    data: torch.Tensor
    scales: Optional[torch.Tensor]
    kind: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def check(self) -> "TypedWeight":
        """This weight, after checking that the kernels can read it (ValueError otherwise)."""
        data, scales, n_in = self.data, self.scales, self.in_features
        blocks = -(-n_in // BLOCK)
        expected = {F32: (torch.float32, n_in), BF16: (torch.bfloat16, n_in), Q8: (torch.int8, blocks * BLOCK),
                    Q4: (torch.uint8, blocks * BLOCK // 2), Q41: (torch.uint8, blocks * BLOCK // 2),
                    Q4X8: (torch.uint8, blocks * BLOCK // 2), Q8X8: (torch.int8, blocks * BLOCK)}.get(self.kind)
        ok = expected is not None and data.dim() == 2 and data.dtype == expected[0] and data.shape[1] >= expected[1]
        ok = ok and (data.stride(1) == 1 or data.shape[1] == 1) and data.stride(0) >= data.shape[1]
        if self.kind in INTERLEAVED_KINDS:
            ok = (ok and data.shape[0] % 8 == 0 and data.stride(0) == data.shape[1] == expected[1]
                  and scales is not None and scales.dim() == 2 and scales.shape[1] == blocks
                  and scales.stride(0) == blocks)
        if self.kind in QUANTIZED_KINDS:
            # Q4_1: the row's d's, then its minimums, which the kernels find right after the d's
            width_ok = scales is not None and scales.dim() == 2 and (scales.shape[1] == 2 * blocks if self.kind == Q41
                                                                     else scales.shape[1] >= blocks)
            ok = ok and (width_ok and scales.dtype == torch.float16
                         and scales.shape[0] == data.shape[0]
                         and (scales.stride(1) == 1 or scales.shape[1] == 1))
        if not ok:
            raise ValueError("typed weight: unsupported layout or dtype")
        return self

    def pointers(self) -> tuple[int, int, int, int, int]:
        """(data, its row stride in elements, scales or 0, their row stride, type): a weight's
        columns in decode_step.c's table."""
        scales = self.scales
        return (self.data.data_ptr(), self.data.stride(0), 0 if scales is None else scales.data_ptr(),
                0 if scales is None else scales.stride(0), self.kind)


def dequant_matmul(x: torch.Tensor, weight: TypedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` over the weight ``weight`` describes, dequantized, for 1 to
    ``MAX_DEQUANT_ROWS`` rows ``x`` [..., in] (fp32, contiguous); one row of an fp32 weight takes
    ``row_matmul``'s kernel. Call only when ``kernels_available()``."""
    n_in = weight.in_features
    rows = x.numel() // n_in if n_in else 0
    if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == n_in and 1 <= rows <= MAX_DEQUANT_ROWS
            and fits_bias(bias, weight.out_features)):
        raise ValueError("dequant_matmul: unsupported rows, layout or dtype")
    weight.check()
    n_out = weight.out_features
    out = torch.empty(rows, n_out, dtype=torch.float32)
    data, stride, scales, scale_ld, kind = weight.pointers()
    _library().astrai_dequant_matmul(x.data_ptr(), rows, n_in, data, scales, kind,
                                     0 if bias is None else bias.data_ptr(), out.data_ptr(), n_out, n_in, n_out,
                                     stride, scale_ld, max(torch.get_num_threads(), 1), 0)
    return out.view(*x.shape[:-1], n_out)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """``quantize_activations(x)`` (Q8_0 blocks along the last dimension) in one native pass for
    a contiguous fp32 CPU tensor without autograd, else through torch."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and x.numel()
            and not (torch.is_grad_enabled() and x.requires_grad) and kernels_available()):
        return quantize_activations(x)
    out = torch.empty_like(x)
    _library().astrai_round_activations(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], out.data_ptr(),
                                        max(torch.get_num_threads(), 1))
    return out


# what astrai_kernel_features() reports a build's loops use (native/dequant_matmul.c)
FEATURE_AVX2, FEATURE_AVX512, FEATURE_VNNI, FEATURE_BF16 = 1, 2, 4, 8


def kernel_features(library: Optional[ctypes.CDLL] = None) -> int:
    """The ``FEATURE_*`` bits of the intrinsics ``library`` (the one loaded) was built with: 0 for
    plain C loops, or without a library."""
    library = library if library is not None else _library()
    return library.astrai_kernel_features() if library is not None else 0


def dequant_matmul_vectorised() -> bool:
    """Whether the loaded build reads typed weights with AVX2 intrinsics (else plain C)."""
    return bool(kernel_features() & FEATURE_AVX2)


def kernel_isa() -> Optional[str]:
    """The name of the level the process serves with (building it on first call), or None
    when no library is loaded."""
    library = _library()
    return None if library is None else library.level


COLUMNS = 29  # int64 values per layer in decode_step.c's table
WEIGHT_VALUES = 5  # of them per weight: TypedWeight.pointers()


class DecodePlan(ctypes.Structure):
    """``struct astrai_decode_plan`` (native/decode_step.c): what a model's one-row decode step
    reads that stays fixed from step to step. Make it with ``decode_plan``, which also keeps
    the tensors its pointers point into alive for as long as the plan is."""

    _fields_ = [("embedding", ctypes.c_void_p), ("embedding_row_stride", ctypes.c_int64),
                ("embedding_col_stride", ctypes.c_int64), ("layers", ctypes.c_void_p),
                ("n_layers", ctypes.c_int64), ("dim", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("ffn", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p),
                ("head", ctypes.c_int64 * WEIGHT_VALUES), ("vocab", ctypes.c_int64),
                ("work", ctypes.c_void_p), ("attention_workspace", ctypes.c_void_p), ("threads", ctypes.c_int64),
                ("kv_kind", ctypes.c_int64)]


def decode_plan(embedding: torch.Tensor, layers: torch.Tensor, dims: tuple[int, int, int, int, int],
                cos: torch.Tensor, sin: torch.Tensor, capacity: int, eps: float, scale: float,
                final_norm: torch.Tensor, head: TypedWeight, threads: int,
                kv_dtype: torch.dtype = torch.float32) -> DecodePlan:
    """The plan of ``native/decode_step.c`` for one model and one set of decode buffers.

    ``layers`` [n_layers, COLUMNS] int64 is the per-layer table that file describes, ``dims`` is
    (dim, heads, kv_heads, head_dim, ffn), ``cos``/``sin`` [capacity, head_dim] contiguous
    are ``rotary_tables``' rows for positions 0..capacity-1, ``capacity`` the decode buffers'
    length and ``head`` the output weight [vocab, dim] (checked); ``kv_dtype`` is the K/V stores'
    and buffers' dtype (one ``kv_kind`` has). Every pointer in ``layers``
    must be valid memory of the sizes and types the table names (``fused_decode``
    checks them); the plan keeps the tensors given here, and its scratch memory, alive.
    """
    dim, heads, kv_heads, head_dim, ffn = dims
    if not (cos.shape == sin.shape == (capacity, head_dim) and cos.is_contiguous() and sin.is_contiguous()
            and layers.dtype == torch.int64 and layers.is_contiguous() and layers.shape[1] == COLUMNS
            and head.in_features == dim and embedding.dtype == torch.float32 and kv_kind(kv_dtype) is not None):
        raise ValueError("decode_plan: rotary tables, layer table, head, embedding or K/V dtype of the wrong shape")
    head.check()
    workspace = attention_workspace(MAX_VERIFY_TOKENS, kv_heads, heads // kv_heads, head_dim, capacity, threads)
    plan = DecodePlan(embedding.data_ptr(), embedding.stride(0), embedding.stride(1), layers.data_ptr(),
                      layers.shape[0], dim, heads, kv_heads, head_dim, ffn, cos.data_ptr(), sin.data_ptr(),
                      capacity, eps, scale, final_norm.data_ptr(), (ctypes.c_int64 * WEIGHT_VALUES)(*head.pointers()),
                      head.out_features, None, workspace.data_ptr(), threads)
    work = torch.empty(_library().astrai_step_work_floats(plan, 1), dtype=torch.float32)
    plan.work = work.data_ptr()
    plan.kv_kind = kv_kind(kv_dtype)
    plan.keep = (embedding, layers, cos, sin, final_norm, head, work, workspace)
    plan.embedding_rows = embedding.shape[0]
    return plan


class HeadPlan(ctypes.Structure):
    """``struct astrai_head_plan`` (native/decode_step.c): a draft head's weights as its C drafting
    reads them. Make it with ``head_plan``, which keeps the tensors its pointers point into alive."""

    _fields_ = [("embedding", ctypes.c_void_p), ("embedding_row_stride", ctypes.c_int64),
                ("embedding_col_stride", ctypes.c_int64), ("embedding_rows", ctypes.c_int64),
                ("dim", ctypes.c_int64), ("hidden_dim", ctypes.c_int64), ("draft_vocab", ctypes.c_int64),
                ("eps", ctypes.c_float), ("hidden_norm", ctypes.c_void_p), ("embed_norm", ctypes.c_void_p),
                ("mlp_norm", ctypes.c_void_p), ("out_norm", ctypes.c_void_p),
                ("fuse", ctypes.c_int64 * WEIGHT_VALUES), ("gate", ctypes.c_int64 * WEIGHT_VALUES),
                ("up", ctypes.c_int64 * WEIGHT_VALUES), ("down", ctypes.c_int64 * WEIGHT_VALUES),
                ("out", ctypes.c_int64 * WEIGHT_VALUES), ("draft_ids", ctypes.c_void_p), ("work", ctypes.c_void_p),
                ("threads", ctypes.c_int64)]


def head_plan(embedding: torch.Tensor, norms: Sequence[torch.Tensor], linears: Sequence[TypedWeight],
              draft_ids: torch.Tensor, eps: float, threads: int) -> HeadPlan:
    """The plan of ``astrai_draft_head_steps`` for a draft head: ``norms`` its hidden, embedding,
    MLP and output norms' scales (fp32 [dim], contiguous), ``linears`` its fuse [dim, 2 dim],
    gate and up [hidden, dim], down [dim, hidden] and out [draft vocab, dim] weights (checked),
    ``embedding`` the target's [vocab, dim] fp32 and ``draft_ids`` the target id of each out row
    (int64, each a row of the embedding). ValueError for anything of another shape or type."""
    fuse, gate, up, down, out = (w.check() for w in linears)
    dim, hidden = fuse.out_features, gate.out_features
    if not (embedding.dim() == 2 and embedding.dtype == torch.float32 and embedding.shape[1] == dim
            and all(n.shape == (dim,) and n.dtype == torch.float32 and n.is_contiguous() for n in norms)
            and len(norms) == 4 and fuse.in_features == 2 * dim and gate.in_features == up.in_features == dim
            and up.out_features == hidden and down.in_features == hidden and down.out_features == dim
            and out.in_features == dim and draft_ids.shape == (out.out_features,) and draft_ids.dtype == torch.int64
            and draft_ids.is_contiguous() and 0 <= int(draft_ids.min()) and int(draft_ids.max()) < embedding.shape[0]):
        raise ValueError("head_plan: norms, linears, embedding or draft ids of the wrong shape or type")
    plan = HeadPlan(embedding.data_ptr(), embedding.stride(0), embedding.stride(1), embedding.shape[0], dim, hidden,
                    out.out_features, eps, *(n.data_ptr() for n in norms),
                    *((ctypes.c_int64 * WEIGHT_VALUES)(*w.pointers()) for w in (fuse, gate, up, down, out)),
                    draft_ids.data_ptr(), None, threads)
    work = torch.empty(_library().astrai_head_work_floats(plan), dtype=torch.float32)
    plan.work = work.data_ptr()
    plan.keep = (embedding, *norms, fuse, gate, up, down, out, draft_ids, work)
    return plan


def draft_head_steps(plan: HeadPlan, hidden: torch.Tensor, token: int, k: int) -> list[int]:
    """``k`` greedy drafts of a draft head in one call (``astrai_draft_head_steps``) from the
    target's final hidden state ``hidden`` (fp32 [dim], contiguous) and the token it chose;
    fewer when a draft has no embedding row. Call only when ``kernels_available()``."""
    if not (hidden.shape == (plan.dim,) and hidden.dtype == torch.float32 and hidden.is_contiguous()):
        raise ValueError(f"draft_head_steps: hidden must be contiguous fp32 [{plan.dim}]")
    tokens = (ctypes.c_int64 * max(k, 1))()
    done = _library().astrai_draft_head_steps(plan, hidden.data_ptr(), token, k, tokens)
    return tokens[:done]


class SpeculativeRun(ctypes.Structure):
    """``struct astrai_speculative_run`` (native/decode_step.c): one call's verify steps of a
    greedy row. ``speculative_steps`` fills it."""

    _fields_ = [("token", ctypes.c_int64), ("pos", ctypes.c_int64), ("steps", ctypes.c_int64),
                ("k_offsets", ctypes.c_void_p), ("v_offsets", ctypes.c_void_p), ("hidden", ctypes.c_void_p),
                ("stop_ids", ctypes.c_void_p), ("n_stop", ctypes.c_int64), ("embedding_rows", ctypes.c_int64),
                ("max_seconds", ctypes.c_double), ("max_draft", ctypes.c_int64), ("decay", ctypes.c_double),
                ("min_kept", ctypes.c_double), ("length", ctypes.c_int64), ("kept", ctypes.c_double),
                ("tokens", ctypes.c_void_p), ("drafted", ctypes.c_void_p), ("kept_drafts", ctypes.c_void_p),
                ("verify_steps", ctypes.c_int64), ("hidden_out", ctypes.c_void_p), ("work", ctypes.c_void_p),
                ("logits", ctypes.c_void_p)]


@dataclass
class SpeculativeSteps:
    """What ``speculative_steps`` gave: the tokens, each verify step's drafts made and kept, and
    (drafting with a head) the final hidden state [dim] whose logits chose the last token."""

    tokens: list[int]
    drafted: list[int]
    kept_drafts: list[int]
    hidden: Optional[torch.Tensor]


class PromptLookupRun(ctypes.Structure):
    """``struct astrai_prompt_lookup`` (native/decode_step.c): a row's tokens for prompt lookup in
    a run of verify steps, with room for the tokens the run gives."""

    _fields_ = [("context", ctypes.c_void_p), ("length", ctypes.c_int64), ("synced", ctypes.c_int64),
                ("min_n", ctypes.c_int64), ("max_n", ctypes.c_int64)]


def ngram_drafts(context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup's ``k`` drafts after ``context`` as a run of verify steps makes them in C
    (``astrai_ngram_drafts``, speculative.py's ``NgramIndex.lookup``), or [] when none. Call only
    when ``kernels_available()``."""
    tokens = (ctypes.c_int64 * max(len(context), 1))(*context)
    out = (ctypes.c_int64 * max(k, 1))()
    return out[:_library().astrai_ngram_drafts(tokens, len(context), min_n, max_n, k, out)]


def speculative_steps(plan: DecodePlan, drafter, token: int, pos: int, kv_offsets: Sequence[tuple[int, int]],
                      hidden: Optional[torch.Tensor], stop_ids: Sequence[int], embedding_rows: int,
                      max_seconds: float, length: int, kept: float, max_draft: int, decay: float,
                      min_kept: float) -> SpeculativeSteps:
    """Verify steps of one greedy row in one call, each keeping what greedy acceptance keeps: at
    most ``len(kv_offsets)`` tokens, the positions from ``pos`` on writing their K/V at those
    offsets (as ``decode_steps``). ``drafter`` is a draft head's ``HeadPlan``
    (``astrai_head_speculative_steps``: each step drafts from the last one's hidden state, the
    first from ``hidden``; None: it drafts nothing), or a ``(context, min_n, max_n)`` tuple for
    prompt lookup over the row's tokens (``astrai_lookup_speculative_steps``; the context ends
    with ``token``). ``length`` and ``kept`` are the row's draft length and kept fraction, which
    the steps follow as speculative.py's SpeculationControl (``max_draft`` its k, ``decay`` and
    ``min_kept`` its settings); the run also ends after a step that takes the kept fraction
    below ``min_kept``. Call only when ``kernels_available()``."""
    n = len(kv_offsets)
    _check_step(plan, token, pos, n, embedding_rows)
    if not 1 <= max_draft < MAX_VERIFY_TOKENS or length < 1:
        raise ValueError(f"speculative steps: {max_draft} drafts a step (1 to {MAX_VERIFY_TOKENS - 1}), "
                         f"length {length}")
    library = _library()
    k_offsets = (ctypes.c_int64 * n)(*(k for k, _ in kv_offsets))
    v_offsets = (ctypes.c_int64 * n)(*(v for _, v in kv_offsets))
    stops = (ctypes.c_int64 * max(len(stop_ids), 1))(*stop_ids)
    tokens, drafted, kept_drafts = ((ctypes.c_int64 * n)() for _ in range(3))
    work = torch.empty(library.astrai_step_work_floats(plan, MAX_VERIFY_TOKENS), dtype=torch.float32)
    logits = torch.empty(MAX_VERIFY_TOKENS, plan.vocab, dtype=torch.float32)
    run = SpeculativeRun(token, pos, n, ctypes.addressof(k_offsets), ctypes.addressof(v_offsets), None,
                         ctypes.addressof(stops), len(stop_ids), embedding_rows, max_seconds, max_draft, decay,
                         min_kept, length, kept, ctypes.addressof(tokens), ctypes.addressof(drafted),
                         ctypes.addressof(kept_drafts), 0, None, work.data_ptr(), logits.data_ptr())
    hidden_out = None
    if isinstance(drafter, HeadPlan):
        if drafter.dim != plan.dim:
            raise ValueError(f"speculative steps: a head of width {drafter.dim} for a model of {plan.dim}")
        if hidden is not None:
            if not (hidden.shape == (plan.dim,) and hidden.dtype == torch.float32 and hidden.is_contiguous()):
                raise ValueError(f"speculative steps: hidden must be contiguous fp32 [{plan.dim}]")
            run.hidden = hidden.data_ptr()
        hidden_out = torch.empty(plan.dim, dtype=torch.float32)
        run.hidden_out = hidden_out.data_ptr()
        given = library.astrai_head_speculative_steps(plan, drafter, run)
    else:
        context, min_n, max_n = drafter
        if not (context and context[-1] == token and 1 <= min_n <= max_n):
            raise ValueError("speculative steps: prompt lookup needs the row's context ending with its token "
                             f"and 1 <= min_n <= max_n, got {min_n}, {max_n}")
        buffer = (ctypes.c_int64 * (len(context) + n))(*context)
        given = library.astrai_lookup_speculative_steps(
            plan, PromptLookupRun(ctypes.addressof(buffer), len(context), 0, min_n, max_n), run)
    return SpeculativeSteps(tokens[:given], drafted[:run.verify_steps], kept_drafts[:run.verify_steps], hidden_out)


def _check_step(plan: DecodePlan, token: int, pos: int, steps: int, embedding_rows: int) -> None:
    """The C step reads the embedding's row ``token`` and the rotary and decode-buffer rows up
    to ``pos + steps - 1``: refuse what lies outside the plan's tensors."""
    if not (0 <= token < plan.embedding_rows and 0 <= pos and pos + steps <= plan.capacity
            and 0 <= embedding_rows <= plan.embedding_rows):
        raise ValueError(f"decode step: token {token} or positions {pos}..{pos + steps - 1} outside the plan "
                         f"({plan.embedding_rows} embedding rows, capacity {plan.capacity})")


def decode_step(plan: DecodePlan, token: int, pos: int, kv_offsets: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """Logits [vocab] of one decode step of one row through ``native/decode_step.c``, and the
    index of their maximum (``torch.argmax``'s, NaN counted as the largest).

    ``pos`` < the plan's capacity is the token's position and ``kv_offsets`` where its K and
    V go in each layer's page store (in elements from the layer's start); ``token`` must be a
    row of the embedding. Call only when ``kernels_available()``.
    """
    _check_step(plan, token, pos, 1, 0)
    logits = torch.empty(plan.vocab, dtype=torch.float32)
    best = _library().astrai_decode_step_f32(plan, token, pos, kv_offsets[0], kv_offsets[1], logits.data_ptr())
    return logits, best


def decode_steps(plan: DecodePlan, token: int, pos: int, kv_offsets: Sequence[tuple[int, int]],
                 stop_ids: Sequence[int], embedding_rows: int, max_seconds: float = float("inf")) -> list[int]:
    """Greedy decode steps of one row in one call through ``native/decode_step.c``: step i
    takes position ``pos + i``, writes its K/V at ``kv_offsets[i]`` (as ``decode_step``) and
    gives the argmax that step i + 1 takes as its token. Returns the tokens, one per step run:
    all ``len(kv_offsets)`` of them, or fewer when one is in ``stop_ids`` (it is the last), is
    not below ``embedding_rows``, or when the steps so far have taken ``max_seconds``.
    Positions up to ``pos + len(kv_offsets) - 1`` must be below the plan's capacity. Call
    only when ``kernels_available()``.
    """
    n = len(kv_offsets)
    _check_step(plan, token, pos, n, embedding_rows)
    k_offsets = (ctypes.c_int64 * n)(*(k for k, _ in kv_offsets))
    v_offsets = (ctypes.c_int64 * n)(*(v for _, v in kv_offsets))
    stops = (ctypes.c_int64 * max(len(stop_ids), 1))(*stop_ids)
    tokens = (ctypes.c_int64 * n)()
    logits = torch.empty(plan.vocab, dtype=torch.float32)
    done = _library().astrai_decode_steps_f32(plan, token, pos, k_offsets, v_offsets, n, stops, len(stop_ids),
                                              embedding_rows, max_seconds, tokens, logits.data_ptr())
    return tokens[:done]


MAX_VERIFY_TOKENS = 8  # decode_step.c's ASTRAI_MAX_VERIFY_ROWS


def verify_step(plan: DecodePlan, tokens: Sequence[int], pos: int,
                kv_offsets: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, vocab] and final hidden states [n, dim] (what the head multiplies) of ``n``
    consecutive tokens of one row at positions ``pos`` ..
    ``pos + n - 1`` in one step through ``native/decode_step.c`` (every weight read once for all
    of them; token i attends to positions up to ``pos + i``): a speculative decoder's check of
    its drafted tokens. Token i's K/V go to ``kv_offsets[i]`` (as ``decode_step``). 1 <= n <=
    ``MAX_VERIFY_TOKENS``; positions must lie below the plan's capacity and every token must
    be a row of the embedding. Call only when ``kernels_available()``.
    """
    n = len(tokens)
    if not 1 <= n <= MAX_VERIFY_TOKENS or len(kv_offsets) != n:
        raise ValueError(f"verify step: 1 to {MAX_VERIFY_TOKENS} tokens, one K/V offset pair each; "
                         f"got {n} tokens and {len(kv_offsets)} offsets")
    for token in tokens:
        _check_step(plan, token, pos, n, 0)
    library = _library()
    ids = (ctypes.c_int64 * n)(*tokens)
    k_offsets = (ctypes.c_int64 * n)(*(k for k, _ in kv_offsets))
    v_offsets = (ctypes.c_int64 * n)(*(v for _, v in kv_offsets))
    work = torch.empty(library.astrai_step_work_floats(plan, n), dtype=torch.float32)
    logits = torch.empty(n, plan.vocab, dtype=torch.float32)
    library.astrai_verify_step_f32(plan, ids, n, pos, k_offsets, v_offsets, work.data_ptr(), logits.data_ptr())
    return logits, work[n * plan.dim:2 * n * plan.dim].view(n, plan.dim)  # team_step's h: after x
