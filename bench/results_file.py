"""Where every benchmark writes its figures: one dated JSON file per run in bench/results/.

Each file records when it was measured, on what machine (CPU model, cores, the vector
features that decide which kernels run and the kernel level that ran, memory) and with which command, so a figure in
docs/benchmarks.md can always be traced to the run that produced it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from astrai.backends.cpu.kernels import kernel_isa

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
# settings that hold a run below what the CPU offers (astrai's kernels, oneDNN, PyTorch's own
# vector code, MKL, the llama.cpp build): recorded when set, so such a run is never read as the CPU's best
ISA_LIMITS = ("ASTRAI_KERNEL_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
              "LLAMACPP_ISA")


def describe_machine() -> dict:
    """The CPU model with its family and model numbers (a virtual machine's name is often just
    "AMD EPYC"; the numbers tell Zen 3, 4 and 5 apart), logical cores, memory, the vector
    features found at run time, the instruction-set level of the C kernels the process served
    with (None without them) and PyTorch's, the ``ISA_LIMITS`` settings in force, and the GPU
    when one is visible."""
    cpu, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and cpu in ("", platform.machine(), platform.processor()):
                cpu = value
            elif key in ("cpu family", "model"):
                numbers.setdefault(key, value)
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    memory_gib = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory_gib = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    import torch

    return {"cpu": cpu, "cpu_family": numbers.get("cpu family"), "cpu_model": numbers.get("model"),
            "logical_cores": os.cpu_count(), "memory_gib": memory_gib,
            "features": [f for f in FEATURES if f in flags], "kernel_isa": kernel_isa(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_limits": {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)},
            **({"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
               if torch.cuda.is_available() else {})}


def write_result(name: str, results: dict, out: str | os.PathLike | None = None) -> Path:
    """Write ``results`` with the date, the machine and the command to
    ``bench/results/<name>-<UTC timestamp>.json`` (or ``out``); returns the path."""
    now = _dt.datetime.now(_dt.timezone.utc)
    path = Path(out) if out else RESULTS_DIR / f"{name}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": now.isoformat(timespec="seconds"), "machine": describe_machine(),
              "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
              "results": results}
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path
