"""bench/vs_llamacpp_table.py: a machine kind's grid gathered from several runs, the latest cell winning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks import each other by name

from vs_llamacpp_table import collect, grid, one_stream_table  # noqa: E402


def _run(path: Path, depths=(), pairs=(), prompt_tokens=32, prefill_tokens=512) -> Path:
    results = {"prompt_tokens": prompt_tokens, "prefill_tokens": prefill_tokens, "read_bandwidth_gb_s": [30.0, 31.0],
               "pairs": list(pairs), "depths": list(depths), "chat": []}
    path.write_text(json.dumps({"results": results}), encoding="utf-8")
    return path


def _depth(precision, depth, ours, theirs, bound):
    return {"model": "smollm2", "precision": precision, "depth": depth, "bound_tok_s": bound,
            "astrai_decode": {"median": ours}, "llamacpp_decode": {"median": theirs}}


def test_a_later_run_replaces_a_cell_and_every_cell_names_its_run(tmp_path):
    first = _run(tmp_path / "vs_llamacpp-A.json", depths=[_depth("int8", 512, 50.0, 100.0, 200.0),
                                                         _depth("fp32", 512, 30.0, 20.0, 60.0)])
    second = _run(tmp_path / "vs_llamacpp-B.json", depths=[_depth("int8", 512, 120.0, 60.0, 200.0)],
                  pairs=[{"model": "llama1b", "precision": "int4", "astrai_prefill": {"median": 90.0},
                          "llamacpp_prefill_default": {"median": 45.0}}])
    cells, chats = collect([first, second])
    assert chats == [] and len(cells) == 3
    table = one_stream_table(cells)
    assert "| SmolLM2-135M | int8 | decode | 512 | 120.0 | 60.0 | 2.00× | 200.0 | `vs_llamacpp-B.json` |" in table
    assert "| SmolLM2-135M | fp32 | decode | 512 | 30.0 | 20.0 | 1.50× | 60.0 | `vs_llamacpp-A.json` |" in table
    assert "| Llama 1B shape | int4 | prefill | 512 | 90.0 | 45.0 | 2.00× | – | `vs_llamacpp-B.json` |" in table
    ratios = grid(cells, "ratio").splitlines()
    assert ratios[0] == "| model | measure | tokens | fp32 | int8 | int4 |"
    assert "| SmolLM2-135M | decode | 512 | 1.50× | 2.00× | – |" in ratios
    assert "| Llama 1B shape | prefill | 512 | – | – | 2.00× |" in ratios
    assert "| SmolLM2-135M | decode | 512 | 0.50 | 0.60 | – |" in grid(cells, "astrai_share").splitlines()
