"""Metric logger (JSONL + PNG plot) and progress (a tqdm bar, or plain lines off a terminal), both on rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from tqdm import tqdm

from astrai.progress import on_terminal
from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a crash ends the usable log
    return records


def plot_metrics(records: list[dict], out_path: Path) -> None:
    """Training loss, validation loss and learning rate against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    lrs = [(r["tokens"], r["lr"]) for r in records if r.get("lr") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax_lr = ax.twinx()
    if lrs:
        ax_lr.plot(*zip(*lrs), color="tab:green", alpha=0.6, label="lr")
    ax_lr.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + ax_lr.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax_lr.get_legend_handles_labels()[1]
    ax.legend(handles, labels, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


@CallbackFactory.register("metric_logger")
class MetricLoggerCallback(TrainCallback):
    """One JSON line per ``save_interval`` steps: step, tokens, loss, lr, grad norm of this step,
    tokens/s, validation loss (when measured), MoE router load and the strategy's metrics.

    On resume, lines beyond the resumed step are dropped so the log reads as one run.
    """

    def __init__(self, log_dir: str, save_interval: int = 1, plot: bool = True):
        self.log_dir, self.save_interval, self.plot = Path(log_dir), save_interval, plot
        self.path = self.log_dir / METRICS_NAME
        self._handle = None
        self._last_time = 0.0
        self._last_tokens = 0

    def on_train_begin(self, context) -> None:
        self._last_time, self._last_tokens = time.perf_counter(), context.tokens_seen
        if not context.is_main:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in _read_records(self.path) if r.get("step", 0) <= context.step] if context.step else []
        with open(self.path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)
        self._handle = open(self.path, "a", encoding="utf-8")

    def on_step_end(self, context) -> None:
        now = time.perf_counter()
        rate = (context.tokens_seen - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens = now, context.tokens_seen
        context.metrics["tokens_per_s"] = rate
        if not context.is_main or self._handle is None:
            return
        if context.step % self.save_interval and context.val_loss is None and not context.done:
            return
        record = {"step": context.step, "epoch": context.epoch, "tokens": context.tokens_seen, "loss": context.loss,
                  "lr": context.lr, "grad_norm": context.grad_norm, "tokens_per_s": round(rate, 2)}
        if context.val_loss is not None:
            record["val_loss"] = context.val_loss
        if context.router_stats:
            record["router"] = context.router_stats
        record.update({k: v for k, v in context.metrics.items() if k not in record})
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def on_train_end(self, context) -> None:
        if self._handle is None:
            return
        self._handle.close()
        self._handle = None
        if self.plot:
            plot_metrics(_read_records(self.path), self.log_dir / PLOT_NAME)

    def on_error(self, context) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


@CallbackFactory.register("progress_bar")
class ProgressBarCallback(TrainCallback):
    """tqdm over optimizer steps with loss, lr and tokens/s (tqdm supplies the ETA) on a terminal;
    elsewhere (a pipe, a log file) one plain line every ``line_seconds`` and at the last step,
    since a bar's carriage returns would pile up in a log as one endless line."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, line_seconds: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self.stream = stream
        self.line_seconds = line_seconds
        self.clock = clock
        self.bar = None
        self.lines = False
        self.last_line = 0.0

    def on_train_begin(self, context) -> None:
        if not (self.enabled and context.is_main):
            return
        stream = self.stream or sys.stderr
        if on_terminal(stream):
            self.bar = tqdm(total=context.total_steps, initial=context.step, desc="train", unit="step",
                            dynamic_ncols=True, file=stream)
        else:
            self.lines, self.last_line = True, self.clock()

    def on_step_end(self, context) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{context.loss:.4f}", lr=f"{context.lr:.2e}",
                                 tok_s=f"{context.metrics.get('tokens_per_s', 0):.0f}", refresh=False)
        elif self.lines:
            now = self.clock()
            if now - self.last_line >= self.line_seconds or context.step >= context.total_steps:
                self.last_line = now
                print(f"train: step {context.step}/{context.total_steps}  loss {context.loss:.4f}  "
                      f"lr {context.lr:.2e}  {context.metrics.get('tokens_per_s', 0):.0f} tokens/s",
                      file=self.stream or sys.stderr, flush=True)

    def on_train_end(self, context) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.lines = False

    on_error = on_train_end
