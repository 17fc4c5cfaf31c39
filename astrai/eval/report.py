"""The quick start's report card: ``report.md`` plus a self-contained ``report.html``.

Both are rendered from one summary dict (what the run measured) and the metrics
JSONL each training stage wrote, so every number in the report is one the run
produced. Curves are PNG files beside the report; the HTML inlines them as
base64 so the single file can be mailed or opened anywhere.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Optional

from astrai.eval.changes import STAGE_TITLES, headline, stage_changes

SAMPLES_NOTE = ("Greedy answers to fixed prompts: after pre-training the prompt is continued as plain text "
                "(the model has not seen the chat template yet); after SFT, DPO and GRPO it goes through the template.")
# Where pre-training's text held worked problems in the chat template, every stage is asked through it.
CHAT_SAMPLES_NOTE = ("Greedy answers to fixed prompts through the chat template after every stage (pre-training's "
                     "text held worked problems as chat conversations).")
_PLAIN_PRETRAIN = ("after pre-training the problem is continued as plain text and the answer is the rest of its line")
_CHAT_PRETRAIN = ("every stage, pre-training too (its text held worked problems as chat conversations), is asked "
                  "through the chat template")


def eval_note_for(chat_pretrain: bool = False) -> str:
    """The report's note on what the evaluation measures and how the pre-trained model is asked."""
    return ("Perplexity is per token of this run's tokenizer; bits per byte is the same likelihood per UTF-8 byte "
            "of the held-out documents, comparable across tokenizers. The task accuracy is on the arithmetic task's "
            "held-out pool (two-digit addition and subtraction asked as `23+45=`, in English and in Chinese; no "
            "stage trains on these problems), greedy answers, with its 95% Wilson interval. An answer counts when the last "
            "integer it states is right, so the column working before it (`3+5=8, 2+4=6, so 68`) is allowed; "
            f"{_CHAT_PRETRAIN if chat_pretrain else _PLAIN_PRETRAIN}. The "
            "preference accuracy is the share of held-out pairs (the right working against a near miss's) whose "
            "right answer the model finds likelier, with its 95% Wilson interval; the margin is how much likelier, "
            "in nats of log-likelihood, averaged over the pairs.")


EVAL_NOTE = eval_note_for()
# The commands the report ends with: use the model, score it again, train for longer.
NEXT_COMMANDS = ("serve", "chat", "eval", "longer")
CHANGES_NOTE = ("Each stage against the stage before it, not against the first: bits per byte as a relative change "
                "(lower is better), task and preference accuracy as differences in points with a 95% interval "
                "(Newcombe's, from the two Wilson intervals); an interval that holds 0 is a change within noise.")


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics JSONL file (missing file: no rows)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (noisy per-step metrics like GRPO rewards)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(rows: list[dict], keys: list[str], title: str, path: Path) -> Optional[Path]:
    """One PNG with a panel per metric in ``keys`` against the optimizer step (raw and, for
    long runs, a moving average); None if there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None and "step" in r] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 1, figsize=(6, 2.4 * len(series) + 0.6), dpi=100, sharex=True,
                             squeeze=False)
    for ax, (key, points) in zip(axes[:, 0], series.items()):
        steps, values = [p[0] for p in points], [p[1] for p in points]
        smooth = len(values) > 30
        ax.plot(steps, values, alpha=0.35 if smooth else 1.0, marker="." if len(values) < 30 else None, label=key)
        if smooth:
            window = max(2, len(values) // 20)
            ax.plot(steps, moving_average(values, window), label=f"{key} (mean of {window} steps)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def plot_stage_accuracy(summary: dict, path: Path) -> Optional[Path]:
    """One PNG: held-out task accuracy (and preference accuracy where measured) after each
    stage, with 95% intervals as error bars: the run's story at a glance. None if no stage
    measured an accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in summary["stages"] if s.get("eval", {}).get("task")]
    if not stages:
        return None
    names = [STAGE_TITLES.get(s["name"], s["name"]) for s in stages]
    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    for key, label, shift in (("task", "held-out task accuracy", -0.1), ("preference", "held-out preference accuracy", 0.1)):
        results = [s["eval"].get(key) for s in stages]
        if not all(results):
            continue
        values = [r["accuracy"] for r in results]
        errors = [[v - r["interval"][0] for v, r in zip(values, results)],
                  [r["interval"][1] - v for v, r in zip(values, results)]]
        ax.errorbar([i + shift for i in range(len(stages))], values, yerr=errors, fmt="o", capsize=4, label=label)
    ax.set_xticks(range(len(stages)), names)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (95% interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("What each stage left behind")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _with_interval(result: dict) -> str:
    """An accuracy with its interval: "0.512 [0.466, 0.558]"."""
    text = _fmt(result.get("accuracy"), 3)
    if result.get("interval"):
        text += " [{:.3f}, {:.3f}]".format(*result["interval"])
    return text


def eval_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per evaluated stage, plus the unigram baseline."""
    names = sorted({n for s in summary["stages"] for n in s.get("eval", {}).get("perplexity", {})},
                   key=lambda n: (n.startswith("corpus-"), n))  # the bundled held-out files first
    header = (["stage"] + [f"perplexity {n}" for n in names] + [f"bits/byte {n}" for n in names]
              + ["held-out task accuracy [95% interval]", "task mean reward"])
    preference = any("preference" in s.get("eval", {}) for s in summary["stages"])
    if preference:
        header += ["held-out preference accuracy [95% interval]", "preference margin, nats"]
    rows = []
    for stage in summary["stages"]:
        ev = stage.get("eval", {})
        ppl = ev.get("perplexity", {})
        task = ev.get("task", {})
        rows.append([STAGE_TITLES.get(stage["name"], stage["name"])]
                    + [_fmt(ppl.get(n, {}).get("perplexity")) for n in names]
                    + [_fmt(ppl.get(n, {}).get("bits_per_byte"), 3) for n in names]
                    + [_with_interval(task), _fmt(task.get("mean_reward"), 3)]
                    + ([_with_interval(ev.get("preference", {})), _fmt(ev.get("preference", {}).get("mean_margin"))]
                       if preference else []))
    baseline = summary.get("unigram_perplexity", {})
    if baseline:
        rows.append(["unigram baseline (fitted on the held-out text)"] + [_fmt(baseline.get(n)) for n in names]
                    + ["–" for _ in names] + ["–", "–"] + (["–", "–"] if preference else []))
    return header, rows


def training_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["stage", "steps", "planned steps", "tokens", "seconds", "tokens/s", "final loss"]
    rows = [[STAGE_TITLES.get(s["name"], s["name"]), _fmt(s.get("steps")), _fmt(s.get("planned_steps")),
             _fmt(s.get("tokens")),
             _fmt(s.get("seconds"), 1), _fmt(s.get("tokens_per_s"), 0), _fmt(s.get("final_loss"), 3)]
            for s in summary["stages"] if s.get("steps") is not None]
    return header, rows


def changes_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: what each stage changed against the stage before it (``summary["changes"]``)."""
    changes = summary.get("changes") or stage_changes(summary["stages"])
    names = sorted({n for c in changes for n in c["bits_per_byte"]}, key=lambda n: (n.startswith("corpus-"), n))
    header = (["stage", "against"] + [f"bits/byte {n}" for n in names]
              + ["task accuracy change, points [95% interval]", "task mean reward"])
    preference = any("preference" in c for c in changes)
    if preference:
        header += ["preference accuracy change, points [95% interval]", "preference margin change, nats [95% interval]"]
    rows = []
    for c in changes:
        bpb = [c["bits_per_byte"].get(n) for n in names]
        reward = c.get("mean_reward")
        rows.append([STAGE_TITLES.get(c["stage"], c["stage"]), STAGE_TITLES.get(c["against"], c["against"])]
                    + [f"{b['before']:.3f} → {b['after']:.3f} ({b['relative']:+.1%})" if b else "–" for b in bpb]
                    + [_points(c.get("accuracy")), f"{reward['before']:.3f} → {reward['after']:.3f}" if reward else "–"]
                    + ([_points(c.get("preference")), _nats(c.get("preference"))] if preference else []))
    return header, rows


def _nats(preference: Optional[dict]) -> str:
    margin = (preference or {}).get("margin")
    if not margin:
        return "–"
    text = f"{margin['before']:.2f} → {margin['after']:.2f}"
    return text + (" ({:+.2f} [{:+.2f}, {:+.2f}])".format(margin["nats"], *margin["interval"]) if "interval" in margin else "")


def _points(change: Optional[dict]) -> str:
    return "{:+.1f} [{:+.1f}, {:+.1f}]".format(change["points"], *change["interval"]) if change else "–"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _samples(summary: dict) -> list[tuple[str, str, str]]:
    """(stage, prompt, answer) for every stage's sample generations."""
    return [(STAGE_TITLES.get(s["name"], s["name"]), item["prompt"], item["answer"])
            for s in summary["stages"] for item in s.get("eval", {}).get("samples", [])]


def _corpus_words(corpus: Optional[dict]) -> str:
    if corpus and corpus.get("kind") == "large":
        return f"{corpus['bytes'] / 1e6:.0f} MB of the large bilingual corpus ({corpus['dir']}) and the bundled sample"
    return "the bundled sample (data/pretrain)"


def write_report(out_dir: str | Path, summary: dict, plots: list[Path]) -> tuple[Path, Path]:
    """Write report.md and report.html into ``out_dir``; return their paths. A summary may
    carry its own ``intro``, ``eval_note`` and ``samples_note`` (a run from a pretrained
    model describes itself differently)."""
    out_dir = Path(out_dir)
    train_h, train_rows = training_table(summary)
    eval_h, eval_rows = eval_table(summary)
    change_h, change_rows = changes_table(summary)
    story = summary.get("headline") or headline(summary)
    samples = _samples(summary)
    commands = summary["commands"]
    intro = summary.get("intro") or (f"Model: `{summary['model']['preset']}` preset, {summary['model']['parameters']:,} parameters, "
             f"vocabulary {summary['model']['vocab_size']}. Budget {summary['budget_minutes']:g} min, "
             f"took {summary['total_seconds'] / 60:.1f} min on {summary['device']} "
             f"(measured training throughput before sizing the stages: "
             f"{summary['measured_tokens_per_s']:.0f} tokens/s). Seed {summary['seed']}; stage plan "
             f"{summary['plan']['source']}. Pre-training text: {_corpus_words(summary.get('corpus'))}.")
    first = summary["stages"][0] if summary.get("stages") else {}
    chat_pretrain = first.get("name") == "pretrain" and bool(first.get("eval", {}).get("samples_chat"))
    eval_note = summary.get("eval_note", eval_note_for(chat_pretrain))
    samples_note = summary.get("samples_note", CHAT_SAMPLES_NOTE if chat_pretrain else SAMPLES_NOTE)
    rerun = (f"The stage plan is in `plan.json`; the same seed and plan give the same numbers: "
             f"`{commands['rerun']}`")

    md = ["# astrai quick start report", "", story, "", intro, "", "## Training", "", _md_table(train_h, train_rows), "",
          rerun, "", "## Evaluation", "", _md_table(eval_h, eval_rows), "", eval_note, "",
          "## What each stage changed", "", CHANGES_NOTE, "", _md_table(change_h, change_rows), "", "## Curves", ""]
    md += [f"![{p.stem}]({p.relative_to(out_dir).as_posix() if p.is_relative_to(out_dir) else p})" for p in plots]
    md += ["", "## Sample generations", "", samples_note, "", _md_table(["stage", "prompt", "answer"],
                                                       [[s, p, a.replace("\n", " ")] for s, p, a in samples]), "",
           "## Next", "", "```bash"] + [commands[k] for k in NEXT_COMMANDS if k in commands] + ["```", ""]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(md), encoding="utf-8")

    images = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"/></figure>' for p in plots)
    sample_rows = [[s, p, a] for s, p, a in samples]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>astrai quick start report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }}
table {{ border-collapse: collapse; margin: 1rem 0; }} td, th {{ border: 1px solid #ccc; padding: .3rem .6rem; }}
th {{ background: #f3f3f3; }} pre {{ background: #f6f6f6; padding: .8rem; overflow-x: auto; }}
figure {{ display: inline-block; margin: .5rem; }} td {{ white-space: pre-wrap; }}
</style></head><body>
<h1>astrai quick start report</h1>
<p><strong>{html.escape(story.replace('`', ''))}</strong></p>
<p>{html.escape(intro.replace('`', ''))}</p>
<h2>Training</h2>{_html_table(train_h, train_rows)}
<p>{html.escape(rerun.replace('`', ''))}</p>
<h2>Evaluation</h2>{_html_table(eval_h, eval_rows)}
<p>{html.escape(eval_note.replace('`', ''))}</p>
<h2>What each stage changed</h2><p>{html.escape(CHANGES_NOTE)}</p>{_html_table(change_h, change_rows)}
<h2>Curves</h2>{images}
<h2>Sample generations</h2><p>{html.escape(samples_note)}</p>{_html_table(["stage", "prompt", "answer"], sample_rows)}
<h2>Next</h2><pre>{html.escape(chr(10).join(commands[k] for k in NEXT_COMMANDS if k in commands))}</pre>
</body></html>
"""
    html_path = out_dir / "report.html"
    html_path.write_text(page, encoding="utf-8")
    return md_path, html_path
