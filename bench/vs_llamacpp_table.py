"""Markdown tables of `bench/vs_llamacpp.py` results, one figure a cell, for docs/benchmarks.md.

A machine kind's grid is gathered from several runs (a whole grid does not fit one sitting of
a shared machine); given in order, a later file's cell replaces an earlier one's, so the
table holds each cell's latest measurement and names the file it came from.

Usage: .venv/bin/python bench/vs_llamacpp_table.py bench/results/vs_llamacpp-A.json [B.json ...]
       ... --grid ratio      (one row a measure, one column a precision; also astrai, llamacpp,
                              astrai_share and llamacpp_share: the fraction of the read bound)
       ... --measure decode  (only the decode cells; or prefill)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL_NAMES = {"smollm2": "SmolLM2-135M", "llama1b": "Llama 1B shape"}
PRECISIONS = ("fp32", "bf16", "int8", "int4", "int4-asym")


def _median(cell: dict | None) -> float | None:
    return None if not cell else cell.get("median")


def collect(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The one-stream cells keyed (model, precision, measure, tokens) and the chat rows, a
    later file's cell replacing an earlier one's."""
    cells: dict[tuple, dict] = {}
    chats: dict[str, dict] = {}

    def put(key: tuple, ours: dict | None, theirs: dict | None, bound: float | None, name: str) -> None:
        if _median(ours) and _median(theirs):  # a side that failed or did not run leaves no cell
            cells[key] = dict(astrai=_median(ours), llamacpp=_median(theirs), bound=bound, file=name)

    for path in paths:
        results, name = json.loads(path.read_text(encoding="utf-8"))["results"], path.name
        for pair in results.get("pairs", []):
            model, precision = pair["model"], pair["precision"]
            put((model, precision, "decode", results["prompt_tokens"]), pair.get("astrai_decode"),
                pair.get("llamacpp_decode_default"), pair.get("bound_tok_s"), name)
            put((model, precision, "prefill", results["prefill_tokens"]), pair.get("astrai_prefill"),
                pair.get("llamacpp_prefill_default"), None, name)
        for row in results.get("depths", []):
            put((row["model"], row["precision"], "decode", row["depth"]), row.get("astrai_decode"),
                row.get("llamacpp_decode"), row.get("bound_tok_s"), name)
        for row in results.get("chat", []):
            chats[row["precision"]] = dict(row, file=name)
    return cells, list(chats.values())


def _figure(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def one_stream_table(cells: dict) -> str:
    """Decode after N tokens of context (N = the prompt for the plain decode part) and prefill of N tokens."""
    lines = ["| model | weights | measure | tokens | astrai tok/s | llama.cpp tok/s | ratio | bound tok/s | run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {p: i for i, p in enumerate(PRECISIONS)}
    for model, precision, measure, tokens in sorted(
            cells, key=lambda k: (list(MODEL_NAMES).index(k[0]), k[2], k[3], order.get(k[1], 9))):
        cell = cells[(model, precision, measure, tokens)]
        lines.append(f"| {MODEL_NAMES.get(model, model)} | {precision} | {measure} | {tokens:,} | "
                     f"{_figure(cell['astrai'])} | {_figure(cell['llamacpp'])} | "
                     f"{cell['astrai'] / cell['llamacpp']:.2f}× | {_figure(cell['bound'])} | `{cell['file']}` |")
    return "\n".join(lines)


GRID_VALUES = {
    "ratio": lambda c: f"{c['astrai'] / c['llamacpp']:.2f}×",
    "astrai": lambda c: _figure(c["astrai"]),
    "llamacpp": lambda c: _figure(c["llamacpp"]),
    "astrai_share": lambda c: "–" if not c["bound"] else f"{c['astrai'] / c['bound']:.2f}",
    "llamacpp_share": lambda c: "–" if not c["bound"] else f"{c['llamacpp'] / c['bound']:.2f}",
}


def grid(cells: dict, value: str) -> str:
    """One row a (model, measure, tokens), one column a precision, each cell one figure."""
    rows = sorted({(m, measure, tokens) for m, _, measure, tokens in cells},
                  key=lambda k: (list(MODEL_NAMES).index(k[0]), k[1], k[2]))
    precisions = [p for p in PRECISIONS if any(k[1] == p for k in cells)]
    lines = ["| model | measure | tokens | " + " | ".join(precisions) + " |",
             "| --- | --- | --- |" + " --- |" * len(precisions)]
    for model, measure, tokens in rows:
        figures = [GRID_VALUES[value](cells[(model, p, measure, tokens)]) if (model, p, measure, tokens) in cells
                   else "–" for p in precisions]
        lines.append(f"| {MODEL_NAMES.get(model, model)} | {measure} | {tokens:,} | " + " | ".join(figures) + " |")
    return "\n".join(lines)


def chat_table(chats: list[dict]) -> str:
    """The chat workload: output tokens/s, time to first token and resident memory, each side."""
    lines = ["| weights | astrai out tok/s | llama-server out tok/s | ratio | TTFT p50 astrai s | "
             "TTFT p50 llama-server s | TTFT p95 astrai s | TTFT p95 llama-server s | RSS astrai GB | "
             "RSS llama-server GB | run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in chats:
        ours, theirs = row["astrai"], row["llamacpp"]
        lines.append(f"| {row['precision']} | {_figure(ours['output_tok_s'])} | {_figure(theirs['output_tok_s'])} | "
                     f"{row['ratio']:.2f}× | {_figure(ours['ttft_p50_s'])} | {_figure(theirs['ttft_p50_s'])} | "
                     f"{_figure(ours['ttft_p95_s'])} | {_figure(theirs['ttft_p95_s'])} | "
                     f"{ours['vm_rss_bytes'] / 1e9:.2f} | {theirs['vm_rss_bytes'] / 1e9:.2f} | `{row['file']}` |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="vs_llamacpp JSON files, oldest first")
    parser.add_argument("--grid", choices=sorted(GRID_VALUES), default=None,
                        help="print one figure of every cell as a grid instead of the long table")
    parser.add_argument("--measure", choices=("decode", "prefill"), default=None, help="only this measure's cells")
    args = parser.parse_args()
    cells, chats = collect(args.files)
    cells = {key: cell for key, cell in cells.items() if args.measure in (None, key[2])}
    print(grid(cells, args.grid) if args.grid else one_stream_table(cells))
    if chats:
        print()
        print(chat_table(chats))


if __name__ == "__main__":
    main()
