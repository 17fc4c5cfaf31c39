"""Preprocessing: raw JSONL files → a tokenised dataset directory (mmap, HDF5 or JSON).

Lines are read in batches; each batch is parsed, validated and tokenised in one
call to the tokenizer, in this process or in a pool of worker processes (order is
kept either way), then laid out (streamed, padded or best-fit packed) and written
in shards. A bad line stops the run with its file and line number, or, with
``skip_bad``, is skipped and counted under its reason in the summary.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from astrai.dataset.packing import KEY_DTYPES, make_layout
from astrai.dataset.records import RecordEncoder, RecordError, parse_line
from astrai.dataset.writer import ShardWriter
from astrai.errors import DataError
from astrai.progress import Phase
from astrai.tokenize import AutoTokenizer

TRAIN_TYPES = ("seq", "sft", "dpo", "grpo")


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output: str
    tokenizer: str
    train_type: str = "seq"
    format: str = "mmap"
    packing: str = "concat"          # concat | none | best_fit (seq/sft)
    seq_len: int | None = None       # row length for none/best_fit, dpo and grpo
    position_ids: str = "auto"       # continuous | reset | auto (reset when rows are packed)
    doc_mask: str = "auto"           # on | off | auto (on for best_fit)
    truncation: str = "right"        # right: keep the start; left: keep the end
    max_prompt_len: int | None = None  # grpo prompt width (default seq_len // 2)
    shard_size: int = 16_000_000     # tokens (elements of the first key) per shard
    num_workers: int = 1
    batch_size: int = 512            # lines per tokenizer call
    pack_buffer: int = 20_000        # documents per best-fit packing round
    skip_bad: bool = False
    show_progress: bool = True
    pad_id: int = field(default=0, repr=False)

    @property
    def grpo_prompt_len(self) -> int:
        """The width of a GRPO row's prompt: ``max_prompt_len``, else half of ``seq_len``."""
        return self.max_prompt_len or self.seq_len // 2

    @property
    def store_doc_ids(self) -> bool:
        return self.resolved_position_ids == "reset" or self.resolved_doc_mask

    @property
    def resolved_position_ids(self) -> str:
        if self.position_ids != "auto":
            return self.position_ids
        return "reset" if self.packing == "best_fit" else "continuous"

    @property
    def resolved_doc_mask(self) -> bool:
        return self.doc_mask == "on" or (self.doc_mask == "auto" and self.packing == "best_fit")

    def validate(self) -> None:
        checks = [
            (self.train_type in TRAIN_TYPES, f"train_type must be one of {TRAIN_TYPES}, got {self.train_type!r}"),
            (self.format in ("mmap", "h5", "json"), f"format must be mmap, h5 or json, got {self.format!r}"),
            (self.packing in ("concat", "none", "best_fit"), f"packing must be concat, none or best_fit, got {self.packing!r}"),
            (self.position_ids in ("auto", "continuous", "reset"), f"position_ids must be continuous or reset, got {self.position_ids!r}"),
            (self.doc_mask in ("auto", "on", "off"), f"doc_mask must be on, off or auto, got {self.doc_mask!r}"),
            (self.truncation in ("left", "right"), f"truncation must be left or right, got {self.truncation!r}"),
            (self.num_workers >= 1 and self.batch_size >= 1, "num_workers and batch_size must be at least 1"),
            (bool(self.inputs), "no input files given"),
        ]
        needs_len = self.train_type in ("dpo", "grpo") or self.packing != "concat"
        checks.append((not needs_len or (self.seq_len or 0) > 1,
                       "--seq_len (> 1) is required for dpo/grpo data and for packing 'none' or 'best_fit'"))
        if self.train_type == "grpo" and self.seq_len and self.max_prompt_len:
            checks.append((0 < self.max_prompt_len < self.seq_len, "max_prompt_len must be between 1 and seq_len - 1"))
        for ok, message in checks:
            if not ok:
                raise DataError(f"preprocess: {message}")
        for path in self.inputs:
            if not Path(path).is_file():
                raise DataError(f"{path}: input file not found")


def read_batches(inputs: list[str], batch_size: int) -> Iterator[list[tuple[str, int, str]]]:
    """Non-blank lines as (file, line number, text), in batches."""
    batch = []
    for path in inputs:
        try:
            with open(path, encoding="utf-8") as handle:
                for lineno, line in enumerate(handle, 1):
                    if line.strip():
                        batch.append((path, lineno, line))
                        if len(batch) >= batch_size:
                            yield batch
                            batch = []
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise DataError(f"{path}: cannot be read ({exc.strerror})") from None
    if batch:
        yield batch


_WORKER: RecordEncoder | None = None


def _init_worker(tokenizer_path: str, train_type: str) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = RecordEncoder(AutoTokenizer.from_pretrained(tokenizer_path), train_type)


def encode_batch(batch: list[tuple[str, int, str]], encoder: RecordEncoder | None = None):
    """Parse and tokenise a batch: (examples with their (file, line), bad lines as (file, line, reason, message))."""
    encoder = encoder or _WORKER
    pieces, builders, bad = [], [], []
    for path, lineno, line in batch:
        try:
            record_pieces, build = encoder.prepare(parse_line(line))
        except RecordError as exc:
            bad.append((path, lineno, exc.reason, str(exc)))
            continue
        builders.append((path, lineno, len(pieces), len(record_pieces), build))
        pieces.extend(record_pieces)
    encoded = encoder.encode_pieces(pieces) if pieces else []
    examples = [((path, lineno), build(encoded[start:start + n])) for path, lineno, start, n, build in builders]
    return examples, bad, len(batch), sum(len(line.encode("utf-8")) for _, _, line in batch)


def prompts_truncated_warning(summary: dict, opts: PreprocessOptions) -> str:
    """What to tell the user when GRPO prompts lost their beginning: a chat template's system
    prompt, or the question itself, which a reward reading the prompt then cannot find."""
    return (f"warning: {summary['prompts_truncated']} of {summary['prompts']} GRPO prompts were longer than "
            f"{opts.grpo_prompt_len} tokens and lost their beginning; raise --max_prompt_len (default seq_len // 2) or --seq_len")


def run_preprocess(opts: PreprocessOptions) -> dict:
    """Run the whole pipeline; returns the summary (also stored in meta.json)."""
    opts.validate()
    tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer)
    opts.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    layout = make_layout(opts)
    writer = ShardWriter(opts.output, opts.format, opts.shard_size, KEY_DTYPES)
    skipped: Counter = Counter()
    records = 0
    start = time.perf_counter()
    total_bytes = sum(Path(p).stat().st_size for p in opts.inputs)
    more = f" and {len(opts.inputs) - 1} more" if len(opts.inputs) > 1 else ""
    progress = Phase(f"tokenize {opts.inputs[0]}{more}", total=total_bytes, unit="B", unit_scale=True,
                     show=opts.show_progress)
    batches = read_batches(opts.inputs, opts.batch_size)
    if opts.num_workers > 1:
        pool = multiprocessing.get_context("fork" if os.name == "posix" else "spawn").Pool(
            opts.num_workers, initializer=_init_worker, initargs=(str(opts.tokenizer), opts.train_type))
        results = pool.imap(encode_batch, batches, chunksize=1)
    else:
        pool = None
        encoder = RecordEncoder(tokenizer, opts.train_type)
        results = (encode_batch(batch, encoder) for batch in batches)
    try:
        with progress:
            for examples, bad, n_lines, n_bytes in results:
                for path, lineno, reason, message in bad:
                    if not opts.skip_bad:
                        raise DataError(f"{path}:{lineno}: {message} (use --skip_bad to skip such lines)")
                    skipped[reason] += 1
                for (path, lineno), example in examples:
                    try:
                        layout.add(example)
                    except RecordError as exc:
                        raise DataError(f"{path}:{lineno}: {exc}") from None
                    for chunk in layout.drain():
                        writer.add(chunk)
                records += n_lines
                progress(n_bytes)
            for chunk in layout.drain(final=True):
                writer.add(chunk)
    finally:
        if pool is not None:
            pool.terminate()
    skipped.update({k.split(": ", 1)[1]: v for k, v in layout.stats.items() if k.startswith("skipped: ")})
    written = records - sum(skipped.values())
    if records == 0:
        raise DataError(f"{', '.join(opts.inputs)}: empty input (no records)")
    if written <= 0:
        raise DataError(f"{', '.join(opts.inputs)}: all {records} records were skipped ({dict(skipped)})")
    writer.flush()
    seconds = time.perf_counter() - start
    options = {k: v for k, v in asdict(opts).items() if k not in ("show_progress",)}
    options.update(position_ids=opts.resolved_position_ids, doc_mask=opts.resolved_doc_mask)
    summary = {
        "records": records, "written": written, "skipped": dict(skipped),
        "tokens": writer.totals.get(layout.keys[0], 0),
        **{k: v for k, v in layout.stats.items() if not k.startswith("skipped: ")},
        "shards": len(writer.shards), "seconds": round(seconds, 3),
    }
    summary["tokens_per_s"] = round(summary["tokens"] / max(seconds, 1e-9))
    meta = {"train_type": opts.train_type, "layout": layout.layout, "row_lengths": layout.row_lengths(),
            "seq_len": opts.seq_len, "position_ids": opts.resolved_position_ids, "doc_mask": opts.resolved_doc_mask,
            "tokenizer": {"path": str(opts.tokenizer), "vocab_size": tokenizer.vocab_size,
                          "eos_id": tokenizer.eos_id, "pad_id": opts.pad_id},
            "options": options, "summary": summary}
    writer.close(meta)
    return summary
