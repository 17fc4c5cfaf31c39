"""``astrai quickstart``: the first thing a newcomer runs.

One command walks a model through its whole life on the bundled data: a tokenizer
trained on the bilingual corpus, pre-training of the ``tiny`` preset on the text and
the arithmetic task's worked problems, SFT on the bundled conversations and worked
arithmetic conversations with some pre-training text replayed, DPO on the bundled
preference pairs and worked arithmetic pairs, online GRPO on the arithmetic task, an
evaluation after every stage, and a report. It uses only the
public APIs a user would (AutoTokenizer, run_preprocess, Trainer/TrainConfig with the
registered strategies, the eval package), so it doubles as a worked example.

Time: a short measured training run gives the machine's tokens/s; each stage then
gets a share of the time that is left (recomputed at every stage, so a slow stage
does not sink the rest), turned into a step count, with a deadline callback as a
guard. Pre-training checks the probe against its own first steps and starts over with
the rate it measured when the two disagree (the probe lasts seconds; a busy moment
would otherwise size the longest stage). Resume: every finished stage leaves
``done.json``; an unfinished training stage continues from its last checkpoint, with
the settings it started with.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

import astrai.alignment  # noqa: F401  registers the dpo and grpo train types of the later stages
from astrai.backends import backend_for
from astrai.config import TrainConfig
from astrai.config.train_config import PRECISIONS
from astrai.dataset import PreprocessOptions, run_preprocess
from astrai.dataset.arithmetic import (HELDOUT_SIZE, grpo_record, training_problems, worked_conversation, worked_line,
                                      worked_preference_pair)
from astrai.dataset.corpus import corpus_ready, default_corpus_dir
from astrai.dataset.preprocess import prompts_truncated_warning
from astrai.errors import ConfigError
from astrai.eval.changes import headline, stage_changes
from astrai.eval.recorded import save_eval_config
from astrai.eval.report import STAGE_TITLES, plot_curves, plot_stage_accuracy, read_metrics, write_report
from astrai.eval.generation import engine_generator
from astrai.eval.preference import preference_accuracy
from astrai.eval.suite import DEFAULT_HELDOUT, evaluate
from astrai.eval.task_accuracy import arithmetic_task
from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.parallel import get_current_device
from astrai.serialization import latest_checkpoint
from astrai.tokenize import AutoTokenizer
from astrai.trainer import TrainCallback, Trainer

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
# Share of the training time each stage gets (of what is left when it starts). GRPO's fifth:
# over six runs on machine E its gain over DPO grew with its steps (254-333 steps: +8.4 to +9.6
# points; 361-569: +11.1 to +11.8), and it is the stage that trains on the checked answer.
STAGE_SHARES = {"pretrain": 0.62, "sft": 0.12, "dpo": 0.06, "grpo": 0.2}
# SFT stops after this many passes over its data: more passes memorise the small bundled
# conversation set and wreck held-out perplexity.
SFT_MAX_PASSES = 1.5
# Share of SFT batches drawn from the pre-training text (replay, every token counted). On the
# small bundled conversations SFT alone wears the plain-text skill away (held-out perplexity
# five- to six-fold). At least SFT_REPLAY of the batches replay text; where SFT's time buys more
# than SFT_MAX_PASSES over the conversations, replayed text fills the rest, up to SFT_MAX_REPLAY.
# From one Zen 5 pre-trained model (1.536 / 1.748 bits per byte en / zh), half replayed for 284
# steps left +2.6% / +3.7%; 0.6 for 355 steps +1.9% / +1.7%; 0.8 for 710 steps -1.5% / -1.7%,
# with the same task accuracy (docs/benchmarks.md).
SFT_REPLAY = 0.5
SFT_MAX_REPLAY = 0.8
# Worked arithmetic conversations in SFT: enough to carry the task into the chat format, few
# enough that SFT does not teach the whole task and GRPO's reward teaches the rest. 4000 take
# SFT to 0.92-0.94 and leave GRPO 8-10 points; 2000 stop SFT at 0.81-0.93 and GRPO adds 9-12;
# 1000 lose the phrasing pre-training taught (docs/benchmarks.md).
SFT_ARITHMETIC = 2000
# Worked problems ("23+45= 3+5=8, 2+4=6, so 68", one per line) in pre-training. The 4M-parameter
# model needs about a million tokens of them before it adds held-out pairs: as a few per cent of
# the text it never did (held-out accuracy 0.00-0.02 after every stage), and on worked problems
# alone it answered 53% of the held-out pool after 1.2M tokens. Pre-training sees
# ARITHMETIC_TOKENS of them whatever the machine's speed: their share of the windows is what buys
# that many, within [ARITHMETIC_MIN_SHARE, ARITHMETIC_MAX_SHARE]. A fixed share would hand a fast
# machine's pre-training the whole task (at 40% a Zen 5's 7M tokens answered 0.90 as plain text,
# leaving GRPO eleven points) and a slow one's too little (0.6M on an AVX2 machine: 6%).
ARITHMETIC_TOKENS = 1_500_000
ARITHMETIC_MIN_SHARE = 0.1
ARITHMETIC_MAX_SHARE = 0.8
# Fewer worked-problem tokens than this and the run says the budget is too short for the task:
# on an AVX2 Zen 3, 1.2-1.4M of them answered 0.55-0.77 as plain text and GRPO ended at
# 0.86-0.94; on a Zen 1 (1,732 tokens/s), 0.63M answered 0.20 and no later stage got above 0.01.
TASK_TOKENS_ENOUGH = 1_200_000
# Where `tiny` would read fewer pre-training tokens than SHALLOW_BELOW_TOKENS, it trains with
# SHALLOW_LAYERS layers instead of 4, which run 1.6-2.1 times the tokens/s. At a Zen 1's 15
# minutes (0.8M tokens with 4 layers; replayed in fp32 on a Zen 5 with the plan pinned) 4 layers
# answered 0.007 after GRPO and 2 layers 0.767. Above that 2 layers read the text 10-21% better
# in bits per byte in every pair measured (up to 3.46M tokens), but the task is riskier: at a
# Zen 3's pace (15 minutes on one thread, fp32, 1.8-2.2M tokens with 4 layers) 4 layers ended
# at 0.944 and 0.947 (seeds 0, 1), 2 layers at 0.891 and 0.402, where SFT took the second from
# 0.911 as plain text to 0.129 in the chat format. The threshold keeps such CPUs at 4 layers.
# The shallow model learns the task from fewer worked problems: with 0.75M of them (a CPU a third
# slower than a Zen 1) it answered 0.038, and below SHALLOW_TASK_TOKENS_ENOUGH the run says its
# budget is too short.
SHALLOW_BELOW_TOKENS = 1_500_000
SHALLOW_LAYERS = 2
SHALLOW_TASK_TOKENS_ENOUGH = 1_000_000
STAGE_OVERRUN = 1.15  # a stage may run this much past its plan when a later stage can absorb it
PRETRAIN_STEP_SHARE = 0.90  # of the steps the probed throughput would fit: checkpoints and validation take the rest
# Pre-training's schedule: 5% linear warm-up, then a linear decay to zero over the rest (WSD whose
# decay spans the whole run). At equal steps it ends lower than a cosine decay to a tenth of the peak.
PRETRAIN_SCHEDULE = dict(schedule="wsd", warmup_ratio=0.05, decay_ratio=0.95, min_rate=0.0)
# The token embedding (tied to the head) learns at 12× the peak rate: a row moves only when its
# token occurs, and at the shared rate the table trails the dense weights. With the dense rate
# lowered to 7e-4, equal steps end 10% lower in held-out bits per byte (docs/benchmarks.md).
PRETRAIN_EMBEDDING_LR_SCALE = 12.0
# Weight decay on the hidden matrices and on that table. A row stepped at 12× memorises the few
# contexts its rare token appears in: on the bundled sample read eight times (8 minutes a side
# in bench/quickstart_baseline.py, Zen 5) held-out bits per byte rose from 1.58 at 4 minutes to
# 1.71-1.74 undecayed, and ended at 1.60 with both decays at 0.1; at 4 minutes 1.566 against
# 1.577 (docs/benchmarks.md).
PRETRAIN_WEIGHT_DECAY = 0.1
# Pre-training times its own steps PACE_CHECK_STEPS[0]..[1]; when that rate is off the probe's
# by more than PACE_TOLERANCE, the stage starts over, planned with the rate it measured: a probe
# taken while another program holds a core can read half the real rate and halve pre-training.
# Within the tolerance the stage keeps going and plans its length again in place: the steps that
# fit in PACE_STEP_SHARE of its time left at the measured rate. The probe's short run reads a few
# per cent off the stage's own pace, and the first plan keeps PRETRAIN_STEP_SHARE in reserve, so
# without this a stage ended 3-16% early (an AVX2 machine, docs/benchmarks.md).
PACE_CHECK_STEPS = (5, 25)
PACE_TOLERANCE = 0.2
PACE_STEP_SHARE = 0.95
# GRPO times this many of its steps, then plans the steps that fit in its share: its rollouts
# run the inference engine, whose pace under contention the training throughput does not tell.
GRPO_TIMED_STEPS = 3
# GRPO's learning rate rises over its first tenth: Adam's first steps move every weight by the full
# rate, and at 1e-4 its first two steps alone took held-out accuracy from 0.84 to 0.06.
GRPO_WARMUP = 0.1
# Pre-training and SFT train in bf16 autocast (fp32 master weights) when the throughput probe
# finds it this much faster than fp32: on a CPU with AVX-512-BF16 about 1.7x for `tiny`; where
# bf16 matmuls are emulated it is slower, and the device's backend says so before any probe.
BF16_MIN_GAIN = 1.1
TRAIN_STAGES = tuple(STAGE_SHARES)
PLAN_FILE = "plan.json"  # the optimizer steps each stage planned; `--plan` pins a run to it
OLD_MATMULS_KEY = "cpu_products"  # cpu_matmuls in plans, settings.json and stage records written before the name
# With the large corpus (astrai.dataset.corpus), a run takes this much of its text per minute of
# budget: more than the tiny preset reads on two cores (about 1 MB a minute), so nothing repeats, yet a short run
# does not tokenise all of it. The tokenizer learns from the first TOKENIZER_SAMPLE_BYTES of it.
CORPUS_BYTES_PER_MINUTE = 1_500_000
TOKENIZER_SAMPLE_BYTES = 4_000_000
# The evaluation's engine holds a task prompt or a sample prompt with its answer.
EVAL_MAX_SEQ_LEN = 256


@dataclass
class Settings:
    """Everything that shapes a run; saved to ``settings.json`` so a resumed run keeps them."""

    out: str = "runs/quickstart"
    minutes: float = 15.0
    seed: int = 0
    preset: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    n_layers: Optional[int] = None        # the run's own choice of depth (SHALLOW_LAYERS where 4 would read too few tokens); None: the preset's
    vocab_size: int = 4096
    corpus: str = "auto"                  # "auto" (the cached large corpus when built, else bundled), "bundled", or a corpus dir
    window_size: int = 256
    batch_size: int = 8
    dpo_seq_len: int = 128
    grpo_prompts_per_step: int = 8
    grpo_group_size: int = 4
    grpo_max_new_tokens: int = 32          # the longest working ("12-5=7, 7-4-1=2, so 27") and the stop token
    grpo_temperature: float = 0.7
    dpo_rpo_alpha: float = 1.0            # weight of the chosen answers' NLL beside DPO's loss (RPO)
    sft_arithmetic: int = SFT_ARITHMETIC  # task conversations for SFT, from the training pool
    dpo_arithmetic: int = 1000            # task preference pairs for DPO, from the training pool
    grpo_problems: int = 2000             # GRPO prompts, from the training pool
    pretrain_arithmetic: int = 100_000    # worked problems from the training pool, a dataset of their own for pre-training
    arithmetic_share: Optional[float] = None  # share of pre-training windows drawn from them; None: arithmetic_share_for
    arithmetic_chat_share: float = 0.0    # of those, the share written as chat conversations (docs/quickstart.md)
    sft_replay: Optional[float] = None    # share of SFT batches that are pre-training text; None: sft_replay_for
    eval_problems: Optional[int] = None   # first N of the task's held-out pool; None = all of it
    eval_max_new_tokens: int = 32         # the task's answers: the working, the number and the stop token
    steps: Optional[dict] = None          # the stage plan pinned (optimizer steps per stage) instead of sized by time
    stop_at: Optional[dict] = None        # pinned stages the planning run's deadline guard ended early: the step it stopped at
    replanned: Optional[dict] = None      # pinned stages the planning run re-planned in place: {"at_step", "first_steps"}
    cpu_matmuls: Optional[dict] = None    # pinned: the planning run's fp32 CPU matmuls decision (else measured)
    precision: str = "auto"               # pre-training's and SFT's: fp32, bf16 (autocast), or auto (the probe's faster)
    # SFT's rate carries the sums into the chat format in the 200-odd steps a CPU without fast bf16
    # gives it: from one pre-trained model on such a CPU, 1e-4 / 3e-4 / 6e-4 left 0.07 / 0.20 / 0.80
    # held-out accuracy, and 6e-4 the lowest bits per byte.
    lr: dict = field(default_factory=lambda: {"pretrain": 7e-4, "sft": 6e-4, "dpo": 1e-5, "grpo": 1e-5})
    ppl_max_tokens: Optional[int] = 8000  # per held-out file (whole documents); None = all of it
    sample_max_new_tokens: int = 48
    progress: bool = True


# --- small helpers ----------------------------------------------------------------------
def arithmetic_share_for(tokens: int) -> float:
    """Pre-training's share of worked problems for a stage of ``tokens``: enough for
    ARITHMETIC_TOKENS of them, within [ARITHMETIC_MIN_SHARE, ARITHMETIC_MAX_SHARE]."""
    return min(ARITHMETIC_MAX_SHARE, max(ARITHMETIC_MIN_SHARE, ARITHMETIC_TOKENS / max(tokens, 1)))


def planned_tokens(config: TrainConfig) -> int:
    """Training tokens a stage's ``config`` plans to read (one device's batch)."""
    return config.max_steps * config.batch_per_device * config.window_size


def minutes_for_the_task(minutes: float, task_tokens: float, enough: float = TASK_TOKENS_ENOUGH) -> Optional[int]:
    """The budget, in whole five minutes, at which pre-training would read ARITHMETIC_TOKENS of
    worked problems, where this run's ``task_tokens`` of them fall short of ``enough``; else
    None. Pre-training takes a fixed share of the budget, so its tokens grow with it."""
    if task_tokens >= enough:
        return None
    return 5 * math.ceil(minutes * ARITHMETIC_TOKENS / max(task_tokens, 1.0) / 5)


def sft_replay_for(conversation_tokens: int, tokens: int) -> float:
    """SFT's share of replayed pre-training text for a stage of ``tokens``: what SFT_MAX_PASSES
    over ``conversation_tokens`` leave, within [SFT_REPLAY, SFT_MAX_REPLAY]."""
    return min(SFT_MAX_REPLAY, max(SFT_REPLAY, 1 - SFT_MAX_PASSES * conversation_tokens / max(tokens, 1)))


def log(message: str) -> None:
    print(f"[quickstart] {message}", file=sys.stderr, flush=True)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


class Deadline:
    """Wall-clock budget of the whole run."""

    def __init__(self, minutes: float, already_spent: float = 0.0):
        self.total = minutes * 60.0
        self.start = time.perf_counter() - already_spent

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return max(0.0, self.total - self.elapsed)


def make_stage_deadline_callback(seconds: float, clock=time.perf_counter):
    """A TrainCallback ending the stage as if its step budget were reached when the next step
    would end past ``seconds`` (a guard for when the throughput estimate was too kind). The
    next step is taken to last as long as the mean of those since the first (which also
    loads, compiles or starts an engine): with steps of seconds, as a 100M-parameter model
    takes, stopping only once the budget had passed would overrun it by up to a step."""
    class StageDeadline(TrainCallback):
        def on_train_begin(self, context) -> None:
            self.until = clock() + seconds
            self.first_end: Optional[float] = None

        def on_step_end(self, context) -> None:
            if context.done:
                return
            now = clock()
            if self.first_end is None:
                self.first_end, self.first_step = now, context.step
                next_step = 0.0
            else:
                next_step = (now - self.first_end) / max(1, context.step - self.first_step)
            if now + next_step > self.until:
                log(f"stage time budget ({seconds:.0f}s) used up at step {context.step}/{context.total_steps}")
                context.total_steps = context.step

    return StageDeadline()


def make_stop_at_step_callback(step: int):
    """A TrainCallback ending the stage at ``step`` exactly as the deadline guard did when it
    ended the planning run's stage there: the schedule still spans the planned steps."""
    class StopAtStep(TrainCallback):
        def on_step_end(self, context) -> None:
            if context.step >= step and not context.done:
                context.total_steps = context.step

    return StopAtStep()


def make_pace_check_callback(expected_tokens_per_s: float, tokens_per_step: int, seconds: Optional[float] = None,
                             on_replan=None, clock=time.perf_counter):
    """A TrainCallback timing steps PACE_CHECK_STEPS of a stage given ``seconds`` from its
    creation. When their rate is off ``expected`` by more than PACE_TOLERANCE it records the
    rate in ``measured`` and ends the stage there (the caller starts it over). Otherwise, with
    ``seconds`` given, it sets the stage's length to the steps that fit in PACE_STEP_SHARE of
    the time left at that rate and calls ``on_replan(step, first_steps, total_steps)``."""
    first, last = PACE_CHECK_STEPS
    created = clock()

    class PaceCheck(TrainCallback):
        measured: Optional[float] = None
        started: Optional[float] = None

        def on_step_end(self, context) -> None:
            if context.step == first:
                self.started = clock()
            elif context.step == last and self.started is not None:
                now = clock()
                rate = (last - first) * tokens_per_step / max(now - self.started, 1e-9)
                if abs(rate / expected_tokens_per_s - 1) > PACE_TOLERANCE:
                    self.measured = rate
                    context.total_steps = context.step
                elif seconds is not None:
                    left = seconds - (now - created)
                    total = max(last + 1, last + int(PACE_STEP_SHARE * left * rate / tokens_per_step))
                    if total != context.total_steps:
                        planned = context.total_steps
                        context.resize(total)
                        if on_replan is not None:
                            on_replan(context.step, planned, total)

    return PaceCheck()


def make_resize_at_step_callback(step: int, total_steps: int, on_replan=None):
    """A TrainCallback re-planning the stage to ``total_steps`` at ``step``, as the planning
    run's pace check did there (a pinned run repeats it); ``on_replan`` as the pace check's."""
    class ResizeAtStep(TrainCallback):
        def on_step_end(self, context) -> None:
            if context.step == step and context.total_steps != total_steps:
                planned = context.total_steps
                context.resize(total_steps)
                if on_replan is not None:
                    on_replan(context.step, planned, total_steps)

    return ResizeAtStep()


def make_replan_callback(seconds: float, timed_steps: int = GRPO_TIMED_STEPS, clock=time.perf_counter):
    """A TrainCallback for a stage at a constant learning rate (GRPO): it times steps 2 to
    ``timed_steps + 1`` (the first one also starts the inference engine) and, when fewer
    steps than planned fit in ``seconds``, plans that many instead (kept in ``planned``), so
    that the stage completes the steps it reports as planned. Its pace is checked again every
    tenth of the stage (steps slow down as answers grow, and on a shared machine, and speed up
    when the machine's load goes), from the mean of every step since the first, so a plan cut
    by slow early steps grows back. Never past the first plan: the estimate it replaces may
    be pessimistic, and the stage's data and checkpoints are sized by that plan."""
    class Replan(TrainCallback):
        planned: Optional[int] = None

        def on_train_begin(self, context) -> None:
            self.began = clock()
            self.first_plan = context.total_steps

        def on_step_end(self, context) -> None:
            if context.step == 1:
                self.first = clock()
                return
            after_timed = context.step - (timed_steps + 1)
            if context.done or after_timed < 0 or after_timed % max(timed_steps, context.total_steps // 10):
                return
            now = clock()
            fit = context.step + int((seconds - (now - self.began)) / ((now - self.first) / (context.step - 1)))
            fit = max(context.step, min(fit, self.first_plan))
            if fit != context.total_steps:
                context.total_steps = self.planned = fit

    return Replan()


# --- the run ------------------------------------------------------------------------
class Quickstart:
    # The training stages in order, each one's share of the time left when it starts, and the
    # number the first one has in the progress log; a run that starts from a pretrained model
    # (astrai/quickstart/from_pretrained.py) changes them.
    stages: tuple[str, ...] = TRAIN_STAGES
    shares: dict = STAGE_SHARES
    first_stage_number = 4

    def __init__(self, settings: Settings):
        self.s = settings
        self.out = Path(settings.out)
        self.stages_dir = self.out / "stages"
        self.summary_path = self.out / "summary.json"
        self.tps = 0.0                         # measured training tokens/s of pre-training at its precision
        self.precision = "auto"                # pre-training's and SFT's TrainConfig.precision, from the probe
        self.speedup = 1.0                     # that precision's tokens/s over the fp32 stages' (DPO, GRPO)
        self.eval_seconds: Optional[float] = None  # how long the last evaluation took
        self.corpus: dict = {"kind": "bundled", "heldout": {}}  # the pre-training text, chosen by stage_corpus

    # paths
    def stage_dir(self, name: str) -> Path:
        return self.stages_dir / name

    def done_path(self, name: str) -> Path:
        return self.stage_dir(name) / "done.json"

    def model_dir(self, name: str) -> Path:
        return self.stage_dir(name) / "ckpt" / "final"

    @property
    def tokenizer_dir(self) -> Path:
        return self.out / "tokenizer"

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        spent = read_json(self.out / "time.json")["seconds"] if (self.out / "time.json").is_file() else 0.0
        self.deadline = Deadline(self.s.minutes, spent)
        self.prepare()
        records = []
        for index, name in enumerate(self.stages):
            records.append(self.train_stage(index, name))
            self.save_time()
        final = self.finish(records)
        self.save_time()
        return final

    def prepare(self) -> None:
        """Everything before the first training stage: the text, the tokenizer, the datasets, the throughput."""
        self.stage_corpus()
        self.stage_tokenizer()
        self.stage_data()
        self.tps = self.measure_throughput()

    def save_time(self) -> None:
        write_json(self.out / "time.json", {"seconds": self.deadline.elapsed})

    # --- the pre-training text --------------------------------------------------------------
    def stage_corpus(self) -> None:
        """Choose the pre-training text: the bundled sample, or (when built, see
        astrai.dataset.corpus) the large corpus's first ``minutes × CORPUS_BYTES_PER_MINUTE``
        bytes beside it, with the corpus's own held-out files added to the evaluation."""
        marker = self.done_path("corpus")
        if marker.is_file():
            self.corpus = read_json(marker)
            return
        choice = self.s.corpus
        directory = default_corpus_dir() if choice == "auto" else None if choice == "bundled" else Path(choice)
        bundled = DATA_DIR / "pretrain" / "train.jsonl"
        record = {"kind": "bundled", "train": [str(bundled)], "tokenizer": [str(bundled)], "heldout": {}}
        if directory is not None and corpus_ready(directory):
            subset = self.out / "data" / "corpus_train.jsonl"
            sample = self.out / "data" / "tokenizer_sample.jsonl"
            limit = self.s.minutes * CORPUS_BYTES_PER_MINUTE
            taken = _copy_prefix(directory / "train.jsonl", subset, limit)
            _copy_prefix(subset, sample, TOKENIZER_SAMPLE_BYTES)
            record = {"kind": "large", "dir": str(directory), "bytes": taken, "train": [str(subset), str(bundled)],
                      "tokenizer": [str(sample), str(bundled)],
                      "heldout": {f"corpus-{lang}": str(directory / f"valid_{lang}.jsonl") for lang in ("en", "zh")}}
            log(f"pre-training text: {taken / 1e6:.0f} MB of the large corpus in {directory} beside the bundled sample")
        elif choice not in ("auto", "bundled"):
            raise ConfigError(f"--corpus {choice}: not a built corpus (no manifest.json); build one with "
                              f"`bash scripts/build_large_corpus.sh` or use --corpus bundled")
        else:
            log("pre-training text: the bundled sample (build the large corpus with `bash scripts/build_large_corpus.sh`)")
        write_json(marker, record)
        self.corpus = record

    def arithmetic_text(self, chat: bool = False) -> Path:
        """Worked problems from the task's training pool as documents of fifty, pre-training's
        second dataset: the sums are learnt where the model sees the most tokens, and SFT has
        the chat format left to teach. Plain lines (``worked_line``: the question and its column
        working), or with ``chat`` conversations in the chat template, token for token what SFT
        trains on and the evaluation asks (a dataset of its own draw, mixed in by
        ``arithmetic_chat_share``)."""
        if chat:
            problems = training_problems(self.s.pretrain_arithmetic, seed=6000 + self.s.seed)
            texts = [self.tokenizer.apply_chat_template(worked_conversation(p)["messages"]) for p in problems]
            separator = ""
        else:
            texts = [worked_line(p) for p in training_problems(self.s.pretrain_arithmetic, seed=5000 + self.s.seed)]
            separator = "\n"
        path = self.out / "data" / ("arithmetic_chat_pretrain.jsonl" if chat else "arithmetic_pretrain.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": separator.join(texts[i:i + 50])}, ensure_ascii=False) + "\n"
                                for i in range(0, len(texts), 50)), encoding="utf-8")
        return path

    def heldout(self) -> dict:
        return {**DEFAULT_HELDOUT, **self.corpus["heldout"]}

    # --- stage 0: tokenizer -------------------------------------------------------------
    def stage_tokenizer(self) -> None:
        marker = self.done_path("tokenizer")
        if marker.is_file():
            log(f"tokenizer: done already ({self.tokenizer_dir})")
        else:
            log(f"[1/7] training a byte-level BPE tokenizer (vocabulary {self.s.vocab_size}) on the pre-training text")
            start = time.perf_counter()
            sources = [*self.corpus["tokenizer"], DATA_DIR / "sft" / "train.jsonl"]
            tokenizer = AutoTokenizer.train([str(p) for p in sources], self.s.vocab_size, show_progress=self.s.progress)
            tokenizer.save_pretrained(self.tokenizer_dir)
            write_json(marker, {"seconds": time.perf_counter() - start, "vocab_size": tokenizer.vocab_size})
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    # --- stage 1: tokenised datasets ------------------------------------------------------
    def data_dir(self, kind: str) -> Path:
        return self.out / "data" / kind

    def stage_data(self) -> None:
        marker = self.done_path("data")
        if marker.is_file():
            log("datasets: done already")
            return
        jobs = self.data_jobs(self.arithmetic_data())
        log(f"[2/7] tokenising the training data ({', '.join(jobs)}: bundled and generated arithmetic)")
        summaries = {}
        for kind, job in jobs.items():
            target = self.data_dir(kind)
            if target.exists():
                shutil.rmtree(target)  # a half-written directory from an interrupted run
            opts = PreprocessOptions(inputs=[str(p) for p in job.pop("inputs")], output=str(target),
                                     tokenizer=str(self.tokenizer_dir), show_progress=self.s.progress, **job)
            summaries[kind] = run_preprocess(opts)
            if summaries[kind].get("prompts_truncated"):
                log(prompts_truncated_warning(summaries[kind], opts))
        write_json(marker, summaries)

    def data_jobs(self, task_files: dict[str, Path]) -> dict[str, dict]:
        """What ``run_preprocess`` makes of the data, per dataset: inputs and options."""
        jobs = {"pretrain": dict(inputs=self.corpus["train"], train_type="seq")}
        if self.s.pretrain_arithmetic and self.s.arithmetic_share != 0:
            jobs["arithmetic"] = dict(inputs=[self.arithmetic_text()], train_type="seq")
            if self.reads_chat_problems:
                jobs["arithmetic_chat"] = dict(inputs=[self.arithmetic_text(chat=True)], train_type="seq")
        return {
            **jobs,
            "sft": dict(inputs=[DATA_DIR / "sft" / "train.jsonl", task_files["sft"]], train_type="sft"),
            "dpo": dict(inputs=[DATA_DIR / "dpo" / "train.jsonl", task_files["dpo"]], train_type="dpo",
                        seq_len=self.s.dpo_seq_len, packing="none"),
            "grpo": dict(inputs=[task_files["grpo"]], train_type="grpo", seq_len=64, packing="none"),
        }

    def arithmetic_data(self) -> dict[str, Path]:
        """The arithmetic task's SFT conversations, DPO pairs and GRPO prompts, all drawn from
        its training pool (never from the held-out problems the evaluation asks), each set
        from its own seed derived from the run's: the bundled conversations alone teach the
        format but are too few for a tiny model to learn the sums in a few minutes."""
        paths = {}
        pair = lambda problem, rng: worked_preference_pair(problem)  # noqa: E731  the slip is the problem's own
        for kind, records in self.arithmetic_sets(worked_conversation, pair, grpo_record).items():
            paths[kind] = self.out / "data" / f"arithmetic_{kind}.jsonl"
            paths[kind].parent.mkdir(parents=True, exist_ok=True)
            paths[kind].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        return paths

    def arithmetic_sets(self, conversation, pair, grpo) -> dict[str, list[dict]]:
        """The SFT, DPO and GRPO records made by ``conversation(problem)``, ``pair(problem, rng)``
        and ``grpo(problem)`` from training-pool problems drawn with seeds derived from the run's."""
        s = self.s
        rng = random.Random(3000 + s.seed)
        return {
            "sft": [conversation(p) for p in training_problems(s.sft_arithmetic, seed=1000 + s.seed)],
            "dpo": [pair(p, rng) for p in training_problems(s.dpo_arithmetic, seed=2000 + s.seed)],
            "grpo": [grpo(p) for p in training_problems(s.grpo_problems, seed=4000 + s.seed)],
        }

    def records(self, kind: str) -> int:
        """How many examples the preprocessed ``kind`` dataset holds."""
        return read_json(self.done_path("data"))[kind]["written"]

    # --- throughput ---------------------------------------------------------------------
    def model_overrides(self) -> dict:
        depth = {"n_layers": self.s.n_layers} if self.s.n_layers else {}
        return {**self.s.model_overrides, **depth, "vocab_size": self.tokenizer.vocab_size}

    def measure_throughput(self) -> float:
        """Training tokens/s of the pre-training set-up, from a few real Trainer steps at each
        precision worth trying: the trainer's default (fp32 on a CPU) and, where the device's
        bf16 matmuls are fast (``Backend.bf16_training_pays``) or ``precision`` asks for it,
        bf16 autocast. Pre-training and SFT take the faster, by BF16_MIN_GAIN; DPO and GRPO
        compare log-probabilities of two models and stay at the default, sized by its rate."""
        path = self.out / "throughput.json"
        if path.is_file():
            saved = read_json(path)
            self.precision, self.speedup = saved.get("precision", "auto"), saved.get("speedup", 1.0)
            return saved["tokens_per_s"]
        log(f"pretrain: measuring the {self.s.n_layers}-layer model's training throughput" if self.s.n_layers
            else "[3/7] measuring training throughput to size the stages")
        asked = self.s.precision
        base = "fp32" if asked == "fp32" else "auto"
        tried = [base]
        # a pinned plan names its precision: "auto" there is the trainer's default, not a probe
        probe_bf16 = asked == "auto" and not self.s.steps and backend_for(get_current_device()).bf16_training_pays()
        if asked == "bf16" or probe_bf16:
            tried.append("bf16")
        rates = {precision: self.probe_throughput(precision) for precision in tried}
        bf16_pays = "bf16" in rates and (asked == "bf16" or rates["bf16"] >= BF16_MIN_GAIN * rates[base])
        self.precision = "bf16" if bf16_pays else base
        self.speedup = rates[self.precision] / rates[base]
        write_json(path, {"tokens_per_s": rates[self.precision], "precision": self.precision,
                          "speedup": self.speedup, "probed": rates})
        shown = ", ".join(f"{p} {r:.0f}" for p, r in rates.items())
        log(f"throughput: {rates[self.precision]:.0f} training tokens/s at precision {self.precision} ({shown})")
        return rates[self.precision]

    def probe_throughput(self, precision: str) -> float:
        """Median tokens/s of pre-training's steps 3-6 at ``precision``; the model is thrown away."""
        probe_dir = self.stage_dir("throughput")
        config = TrainConfig(train_type="seq", data_root_path=str(self.data_dir("pretrain")), model_preset=self.s.preset,
                             model_overrides=self.model_overrides(), tokenizer_path=str(self.tokenizer_dir),
                             batch_per_device=self.s.batch_size, window_size=self.s.window_size, max_steps=6,
                             ckpt_dir=str(probe_dir), ckpt_interval=1000, progress_bar=False,
                             save_final_model=False, random_seed=self.s.seed, precision=precision)
        start = time.perf_counter()
        Trainer(config).train()
        rates = [r["tokens_per_s"] for r in _metrics(probe_dir)[2:]]
        tokens_per_s = sorted(rates)[len(rates) // 2] if rates else 6 * config.batch_per_device * config.window_size / (
            time.perf_counter() - start)
        shutil.rmtree(probe_dir, ignore_errors=True)
        return tokens_per_s

    @property
    def fp32_tps(self) -> float:
        """Training tokens/s at the default precision, which DPO, GRPO and evaluation run at."""
        return self.tps / self.speedup

    # --- training stages ------------------------------------------------------------------
    def training_seconds_left(self, name: str) -> float:
        """Time left for this and the later training stages, after reserving their evaluations."""
        remaining = self.stages[self.stages.index(name):]
        if self.eval_seconds is not None:  # timed: every evaluation left is reserved, so the run ends on time
            eval_reserve = len(remaining) * self.eval_seconds
        else:  # estimated: at most 30% of the time left, so a bad estimate cannot starve the training
            eval_reserve = min(len(remaining) * self.estimate_eval_seconds(), 0.3 * self.deadline.left)
        return self.deadline.left - eval_reserve - 5.0

    def stage_seconds(self, name: str) -> float:
        """This stage's share of the time left, after reserving the remaining evaluations."""
        remaining = self.stages[self.stages.index(name):]
        share = self.shares[name] / sum(self.shares[n] for n in remaining)
        return max(5.0, self.training_seconds_left(name) * share)

    def stage_time_limit(self, name: str, seconds: float) -> float:
        """When the deadline guard ends a stage: 15% past its plan, but never past the run's
        end (the last stage has no later one to take the overrun from)."""
        return max(seconds, min(STAGE_OVERRUN * seconds, self.training_seconds_left(name)))

    def estimate_eval_seconds(self) -> float:
        """Before the first evaluation has been timed: forward passes cost about a third of
        a training step per token; generations are short."""
        ppl_tokens = len(self.heldout()) * (self.s.ppl_max_tokens or 20_000) * 4 / 3  # windows overlap by 1/4
        problems = self.s.eval_problems if self.s.eval_problems is not None else HELDOUT_SIZE
        generated = (problems * 4 + 6 * self.s.sample_max_new_tokens) * 64
        return (ppl_tokens + generated) / (3 * self.fp32_tps) + 2.0

    def train_config(self, index: int, name: str, seconds: float):
        s, tps = self.s, self.tps
        ckpt = self.stage_dir(name) / "ckpt"
        common = dict(tokenizer_path=str(self.tokenizer_dir), ckpt_dir=str(ckpt), random_seed=s.seed + index,
                      progress_bar=s.progress, ckpt_keep=2)
        if name == "pretrain":
            # The probe times a few steady steps only; the stage also saves 9 checkpoints and
            # validates, which the probe does not see. Planning 10% fewer steps keeps that time
            # from being taken out of the later stages.
            steps = PRETRAIN_STEP_SHARE * seconds * tps / (s.batch_size * s.window_size)
            kw = dict(train_type="seq", model_preset=s.preset,
                      model_overrides=self.model_overrides(), batch_per_device=s.batch_size,
                      window_size=s.window_size, max_lr=s.lr["pretrain"], embedding_lr_scale=PRETRAIN_EMBEDDING_LR_SCALE,
                      adamw_weight_decay=PRETRAIN_WEIGHT_DECAY, embedding_weight_decay=PRETRAIN_WEIGHT_DECAY,
                      precision=self.precision, **PRETRAIN_SCHEDULE)
        elif name == "sft":
            # at most SFT_MAX_PASSES over the conversations, the replayed text coming on top
            most_replay = s.sft_replay if s.sft_replay is not None else SFT_MAX_REPLAY
            conversations = SFT_MAX_PASSES * self.sft_tokens() / (1 - most_replay)
            steps = min(seconds * tps, conversations) / (s.batch_size * s.window_size)
            kw = dict(train_type="sft", param_path=str(self.model_dir("pretrain")), batch_per_device=s.batch_size,
                      window_size=s.window_size, max_lr=s.lr["sft"], warmup_ratio=0.05, precision=self.precision)
        elif name == "dpo":
            steps, kw = self.dpo_plan(seconds)
        else:
            steps = seconds / self.grpo_step_seconds()
            kw = dict(train_type="grpo", data_root_path=str(self.data_dir("grpo")), param_path=str(self.model_dir("dpo")),
                      batch_per_device=s.grpo_prompts_per_step, window_size=64, max_lr=s.lr["grpo"], warmup_ratio=GRPO_WARMUP,
                      schedule="constant", max_grad_norm=1.0,
                      strategy_kwargs={"group_size": s.grpo_group_size, "reward": "arithmetic", "kl_coef": 0.01,
                                       "max_new_tokens": s.grpo_max_new_tokens, "temperature": s.grpo_temperature,
                                       "sync_interval": 0, "seed": s.seed})
        if self.s.steps:  # pinned: the length the stage started with (a recorded re-plan changes it later)
            steps = (self.s.replanned or {}).get(name, {}).get("first_steps", self.s.steps[name])
        steps = max(2, int(steps))
        if name == "pretrain":  # the mixture follows the steps planned (or pinned)
            kw.update(self.pretrain_data(steps * s.batch_size * s.window_size))
        elif name == "sft":
            kw.update(self.sft_data(steps * s.batch_size * s.window_size))
        return TrainConfig(max_steps=steps, ckpt_interval=max(1, steps // 8), **common, **kw)

    def pretrain_data(self, tokens: int) -> dict:
        """Pre-training's data fields for a stage of ``tokens``: the text, or the text and the
        worked problems mixed by share."""
        if not (self.s.pretrain_arithmetic and self.s.arithmetic_share != 0):
            return dict(data_root_path=str(self.data_dir("pretrain")))
        share = self.s.arithmetic_share if self.s.arithmetic_share is not None else arithmetic_share_for(tokens)
        chat = self.s.arithmetic_chat_share
        rates = {"pretrain": 1 - share, "arithmetic": share * (1 - chat), "arithmetic_chat": share * chat}
        return dict(datasets=[{"path": str(self.data_dir(kind)), "rate": rate, "type": "seq"}
                              for kind, rate in rates.items() if rate > 0])

    @property
    def reads_chat_problems(self) -> bool:
        """Whether pre-training reads worked problems as chat conversations."""
        return bool(self.s.pretrain_arithmetic and self.s.arithmetic_share != 0 and self.s.arithmetic_chat_share)

    def planned_task_tokens(self, config: TrainConfig) -> float:
        """Tokens of worked problems pre-training's ``config`` plans to read."""
        return planned_tokens(config) * self.task_share(config)

    def task_share(self, config: TrainConfig) -> float:
        """The share of ``config``'s windows that are worked problems (0 without them)."""
        arithmetic = {str(self.data_dir("arithmetic")), str(self.data_dir("arithmetic_chat"))}
        return sum(d["rate"] for d in config.datasets or [] if d["path"] in arithmetic)

    def goes_shallow(self, config: TrainConfig) -> bool:
        """Where `tiny` would read fewer than SHALLOW_BELOW_TOKENS tokens in pre-training's
        ``config`` (a slow CPU or a short budget), train it with SHALLOW_LAYERS layers, the
        throughput measured again (``settings.json`` keeps the choice for a resumed run,
        ``plan.json`` for a rerun). Not where the depth was given: a preset other than `tiny`, an
        override, a pinned plan."""
        s = self.s
        if s.preset != "tiny" or s.steps or s.n_layers or "n_layers" in s.model_overrides:
            return False
        tokens = planned_tokens(config)
        if tokens >= SHALLOW_BELOW_TOKENS:
            return False
        log(f"pretrain: at {self.tps:.0f} training tokens/s the 4-layer model would read {tokens / 1e6:.2f}M tokens, "
            f"fewer than the {SHALLOW_BELOW_TOKENS / 1e6:.1f}M where its depth pays; training it with "
            f"{SHALLOW_LAYERS} layers, which read more in the same minutes")
        s.n_layers = SHALLOW_LAYERS
        write_json(self.out / "settings.json", s.__dict__)
        (self.out / "throughput.json").unlink(missing_ok=True)
        self.tps = self.measure_throughput()
        return True

    def warn_if_too_short(self, task_tokens: float) -> None:
        """Say before pre-training when its worked problems are too few for the task to be learnt."""
        shortfall = self.task_shortfall({"task_tokens": task_tokens, "tokens_per_s": self.tps})
        if shortfall is not None:
            log(f"pretrain: at {self.tps:.0f} training tokens/s this budget buys {task_tokens / 1e6:.2f}M tokens of "
                f"worked problems, short of the {ARITHMETIC_TOKENS / 1e6:.1f}M the task needs: expect low task accuracy; "
                f"--minutes {shortfall['minutes']} gives them")

    def report_shortfall(self, records: list[dict]) -> Optional[dict]:
        """What the report says when the budget was too short for the recipe to work: here,
        pre-training's worked problems (a run from a pretrained model counts its steps)."""
        return self.task_shortfall(records[0])

    def task_shortfall(self, pretrain: dict) -> Optional[dict]:
        """What the report says when pre-training read too few worked problems for the task."""
        task_tokens = pretrain.get("task_tokens")
        enough = SHALLOW_TASK_TOKENS_ENOUGH if self.s.n_layers == SHALLOW_LAYERS else TASK_TOKENS_ENOUGH
        minutes = minutes_for_the_task(self.s.minutes, task_tokens, enough) if task_tokens else None
        if minutes is None:
            return None
        return {"task_tokens": task_tokens, "needed_tokens": ARITHMETIC_TOKENS, "minutes": minutes,
                "tokens_per_s": pretrain.get("tokens_per_s") or self.tps}

    def sft_tokens(self) -> int:
        """Tokens in SFT's conversations (the bundled ones and the task's)."""
        return read_json(self.done_path("data"))["sft"]["tokens"]

    def sft_data(self, tokens: int) -> dict:
        """SFT's data fields for a stage of ``tokens``: the conversations, with pre-training
        text replayed by share."""
        s = self.s
        replay = s.sft_replay if s.sft_replay is not None else sft_replay_for(self.sft_tokens(), tokens)
        if replay == 0:
            return dict(data_root_path=str(self.data_dir("sft")))
        return dict(datasets=[{"path": str(self.data_dir("sft")), "rate": 1 - replay},
                              {"path": str(self.data_dir("pretrain")), "rate": replay, "type": "seq"}])

    def grpo_step_seconds(self) -> float:
        """One GRPO step's estimated time: an update (policy, behaviour and reference passes) over
        each prompt of ~16 tokens once with its group's answers of ~16 behind it (GRPOStrategy packs
        them) plus one decoding step of all sequences per answer token (a forward costs ~1/3 of
        training). Where fewer steps fit, the stage's timed steps 2-4 plan fewer
        (``make_replan_callback``), so it completes the steps it reports."""
        s = self.s
        sequences = s.grpo_prompts_per_step * s.grpo_group_size
        packed_tokens = s.grpo_prompts_per_step * (16 + s.grpo_group_size * 16)
        tps = self.fp32_tps
        return 1.5 * packed_tokens / tps + s.grpo_max_new_tokens * (sequences / (3 * tps) + 0.004)

    def dpo_plan(self, seconds: float) -> tuple[float, dict]:
        """DPO's step count for ``seconds`` and its TrainConfig fields. Chosen + rejected go
        through the policy (forward + backward) and the reference (forward); at most half a pass
        over the pairs: longer DPO on this small constructed set pulls the chosen answers down with
        the rejected ones (seen: arithmetic accuracy 0.24 → 0.04 after 1.3 passes at lr 5e-5)."""
        s = self.s
        steps = min(seconds * self.fp32_tps / (s.batch_size * 2 * s.dpo_seq_len * 4 / 3),
                    self.records("dpo") // (2 * s.batch_size))
        return steps, dict(train_type="dpo", data_root_path=str(self.data_dir("dpo")),
                           param_path=str(self.model_dir("sft")), batch_per_device=s.batch_size,
                           window_size=s.dpo_seq_len, max_lr=s.lr["dpo"], warmup_ratio=0.1,
                           strategy_kwargs={"beta": 0.1, "rpo_alpha": s.dpo_rpo_alpha})

    def resumed_config(self, index: int, name: str) -> tuple[TrainConfig, float]:
        """An interrupted stage's config and time budget. The step budget (and with it the
        schedule) and the data mixture are the ones the stage started with, whatever the pace
        reads now; paths are rebuilt so a run directory that was moved resumes into itself."""
        started = TrainConfig.load(self.stage_dir(name) / "train_config.json")
        seconds = read_json(self.stage_dir(name) / "budget.json")["seconds"]
        config = self.train_config(index, name, seconds)
        config.max_steps, config.ckpt_interval = started.max_steps, started.ckpt_interval
        for dataset, begun in zip(config.datasets or [], started.datasets or []):
            dataset["rate"] = begun["rate"]
        return config, seconds

    def train_stage(self, index: int, name: str, check_pace: bool = True) -> dict:
        marker = self.done_path(name)
        if marker.is_file():
            record = read_json(marker)
            log(f"{name}: done already (eval: {_headline(record.get('eval', {}))})")
            self.eval_seconds = record.get("seconds_eval", self.eval_seconds)
            self.follow_throughput(record)
            return record
        config_path = self.stage_dir(name) / "train_config.json"
        budget_path = self.stage_dir(name) / "budget.json"
        checkpoint = latest_checkpoint(self.stage_dir(name) / "ckpt") if config_path.is_file() else None
        if checkpoint is not None:
            config, seconds = self.resumed_config(index, name)
            log(f"[{index + self.first_stage_number}/7] {name}: resuming from {checkpoint}")
        else:
            seconds = self.stage_seconds(name)
            config = self.train_config(index, name, seconds)
            if name == "pretrain" and self.goes_shallow(config):  # sized again at the shallow model's pace
                seconds = self.stage_seconds(name)
                config = self.train_config(index, name, seconds)
            config_path.parent.mkdir(parents=True, exist_ok=True)
            config.save(config_path)
            write_json(budget_path, {"seconds": seconds})
            log(f"[{index + self.first_stage_number}/7] {name}: {config.max_steps} steps in about {seconds:.0f}s "
                f"({self.deadline.left / 60:.1f} min left in the run)")
            if name == "pretrain":
                self.warn_if_too_short(self.planned_task_tokens(config))
        start = time.perf_counter()
        extra = {"tokenizer": self.tokenizer} if name == "grpo" else None

        def record_replan(at_step: int, first_steps: int, total_steps: int) -> None:
            # the plan keeps both lengths (a pinned run repeats the change); a resumed stage continues the second
            log(f"{name}: planned again at step {at_step} from its own pace: {total_steps} steps, not {first_steps}")
            write_json(budget_path, {**read_json(budget_path), "replanned": {
                "at_step": at_step, "first_steps": first_steps, "steps": total_steps}})
            config.max_steps = total_steps
            config.save(config_path)

        if self.s.steps:
            stop = (self.s.stop_at or {}).get(name)
            callbacks = [make_stop_at_step_callback(stop)] if stop else []
            replanned = (self.s.replanned or {}).get(name)
            if replanned:
                callbacks.insert(0, make_resize_at_step_callback(replanned["at_step"], self.s.steps[name],
                                                                 on_replan=record_replan))
        else:
            callbacks = [make_stage_deadline_callback(self.stage_time_limit(name, seconds))]
        replan = None
        if name == "grpo" and not self.s.steps:
            replan = make_replan_callback(seconds)
            callbacks.append(replan)
        pace = None
        # only a fresh, time-sized pre-training whose checkpoints all come after the timed steps
        if (check_pace and name == "pretrain" and not self.s.steps and checkpoint is None
                and config.ckpt_interval > PACE_CHECK_STEPS[1]):
            pace = make_pace_check_callback(self.tps, config.batch_per_device * config.window_size, seconds,
                                            on_replan=record_replan)
            callbacks.append(pace)
        context = self.trainer(config, callbacks, extra).train(checkpoint=checkpoint)
        if context is None or context.stop_requested:
            log(f"{name} interrupted after step {context.step if context else '?'}; its checkpoint is saved: "
                f"run the same command again to resume")
            raise KeyboardInterrupt
        if pace is not None and pace.measured is not None:
            first, last = PACE_CHECK_STEPS
            log(f"{name}: steps {first}-{last} ran at {pace.measured:.0f} tokens/s, not the probed {self.tps:.0f} "
                f"(the machine's load changed): planning the stage again")
            shutil.rmtree(self.stage_dir(name))
            write_json(self.out / "throughput.json", {**read_json(self.out / "throughput.json"),
                                                      "tokens_per_s": pace.measured, "probed_tokens_per_s": self.tps})
            self.tps = pace.measured
            return self.train_stage(index, name, check_pace=False)
        train_seconds = time.perf_counter() - start
        metrics = _metrics(self.stage_dir(name) / "ckpt")
        replanned = read_json(budget_path).get("replanned")
        record = {
            "name": name, "steps": context.step, "tokens": context.tokens_seen,
            "planned_steps": replan.planned if replan is not None and replan.planned else config.max_steps,
            "cpu_matmuls": context.backend_state, "precision": config.precision,
            **({"replanned": {"at_step": replanned["at_step"], "first_steps": replanned["first_steps"]}} if replanned else {}),
            **({"task_tokens": int(context.tokens_seen * self.task_share(config))} if name == "pretrain" else {}),
            "seconds": train_seconds, "tokens_per_s": _median([m.get("tokens_per_s") for m in metrics[1:]]),
            "final_loss": metrics[-1]["loss"] if metrics else None, "model_dir": str(self.model_dir(name)),
        }
        del context  # the trained model, its optimizer state and gradients: the evaluation reloads the model
        start = time.perf_counter()
        record["eval"] = self.evaluate(name)
        record["seconds_eval"] = self.eval_seconds = time.perf_counter() - start
        log(f"{name}: {_headline(record['eval'])}")
        write_json(marker, record)
        self.follow_throughput(record)
        return record

    def trainer(self, config, callbacks: list, extra: Optional[dict]):
        """The Trainer of one stage (a subclass may prepare the model itself, e.g. with LoRA adapters)."""
        return Trainer(config, callbacks=callbacks, strategy_extra=extra, backend_state=self.s.cpu_matmuls)

    def follow_throughput(self, record: dict) -> None:
        """Size later stages with the throughput just measured (the machine's load may have
        changed since the probe); only seq/sft stages measure plain training tokens/s."""
        if record["name"] in ("pretrain", "sft") and record.get("tokens_per_s"):
            self.tps = record["tokens_per_s"]

    # --- evaluation ------------------------------------------------------------------------
    def ppl_window(self) -> int:
        """The window held-out text is scored in: the one the model was trained with."""
        return self.s.window_size

    def eval_settings(self) -> dict:
        """How this run scores a model, as ``eval_config.json`` records it beside the weights:
        ``astrai eval --model DIR`` takes these as its defaults and repeats the report's
        perplexity, bits per byte and task accuracy (astrai/eval/recorded.py)."""
        return {"ppl_window": self.ppl_window(), "ppl_max_tokens": self.s.ppl_max_tokens,
                "task_problems": self.s.eval_problems, "task_max_new_tokens": self.s.eval_max_new_tokens,
                "max_new_tokens": self.s.sample_max_new_tokens}

    def evaluate(self, name: str) -> dict:
        """Held-out perplexity, arithmetic accuracy and sample answers after every stage: the
        perplexity shows what each fine-tuning stage costs the plain-text skill (a few
        seconds per stage for the quick start's model). The settings go into the model's
        directory first, so that they travel with it."""
        log(f"evaluating {name}: perplexity, arithmetic accuracy, sample answers")
        settings = self.eval_settings()
        save_eval_config(self.model_dir(name), settings)
        model = AutoModel.from_pretrained(self.model_dir(name)).eval()
        chat = name != "pretrain" or self.reads_chat_problems
        problems, prompt_of, check = arithmetic_task(settings["task_problems"], plain_text=not chat)
        results = evaluate(model, self.tokenizer, heldout=self.heldout(), ppl_window=settings["ppl_window"],
                           ppl_max_tokens=settings["ppl_max_tokens"])
        # the answers decode through the engine's KV cache, around the model itself (not used again)
        with InferenceEngine(model, self.tokenizer, max_batch_size=32, max_seq_len=EVAL_MAX_SEQ_LEN,
                             in_place=True) as engine:
            results.update(evaluate(model, self.tokenizer, task=(problems, prompt_of, check), chat=chat,
                                    generator=engine_generator(engine, settings["task_max_new_tokens"])))
            results.update(evaluate(model, self.tokenizer, samples=True, chat=chat,
                                    generator=engine_generator(engine, settings["max_new_tokens"])))
        pairs = [worked_preference_pair(p) for p in problems]
        results["preference"] = preference_accuracy(model, self.tokenizer, pairs, chat=chat)
        results["samples_chat"] = chat
        return results

    # --- the end ---------------------------------------------------------------------------
    def rerun_arguments(self) -> str:
        """The flags that repeat this run: its seed, its plan, and whatever shaped its data
        (the budget sizes the share of the large corpus; the corpus as it was resolved)."""
        s = self.s
        corpus = self.corpus.get("dir", "bundled")
        flags = ["--seed", str(s.seed), "--plan", str((self.out / PLAN_FILE).resolve()), "--minutes", f"{s.minutes:g}",
                 "--corpus", corpus, "--preset", s.preset, "--vocab-size", str(s.vocab_size)]
        return " ".join(shlex.quote(flag) for flag in flags)

    def finish(self, records: list[dict]) -> dict:
        final_dir = self.out / "model"
        if final_dir.exists():
            shutil.rmtree(final_dir)
        shutil.copytree(self.model_dir(self.stages[-1]), final_dir)
        self.tokenizer.save_pretrained(final_dir)
        write_json(final_dir / "generation_config.json",
                   {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 128})
        plots_dir = self.out / "plots"
        plots_dir.mkdir(exist_ok=True)
        plots = []
        for record in records:
            rows = _metrics(self.stage_dir(record["name"]) / "ckpt")
            keys = {"grpo": ["loss", "reward_mean"], "dpo": ["loss", "reward_accuracy", "reward_margin"]}.get(record["name"], ["loss"])
            plot = plot_curves(rows, keys, STAGE_TITLES.get(record["name"], record["name"]),
                               plots_dir / f"{record['name']}.png")
            if plot is not None:
                plots.append(plot)
        summary = self.summary(records, final_dir)
        accuracy_plot = plot_stage_accuracy(summary, plots_dir / "accuracy.png")
        if accuracy_plot is not None:
            plots.insert(0, accuracy_plot)
        summary["changes"] = stage_changes(summary["stages"])
        shortfall = self.report_shortfall(records)
        if shortfall is not None:
            summary["task_shortfall"] = shortfall
        summary["headline"] = headline(summary)
        write_json(self.out / PLAN_FILE, summary["plan"])
        write_json(self.summary_path, summary)
        md, html = write_report(self.out, summary, plots)
        log(f"done in {summary['total_seconds'] / 60:.1f} min: model in {final_dir}, report in {md} and {html}")
        return summary

    def summary(self, records: list[dict], final_dir: Path) -> dict:
        """What the run measured, as the report and ``summary.json`` show it."""
        pretrain_ppl = records[0]["eval"].get("perplexity", {})
        model_path = shlex.quote(str(final_dir.resolve()))
        astrai = _astrai_command()
        return {
            "model": {"preset": self.s.preset, "vocab_size": self.tokenizer.vocab_size,
                      "parameters": _parameters(final_dir), "overrides": self.s.model_overrides,
                      **({"n_layers": self.s.n_layers} if self.s.n_layers else {})},
            "budget_minutes": self.s.minutes, "total_seconds": self.deadline.elapsed, "device": _device_name(),
            "seed": self.s.seed,
            "plan": plan_of(records, pinned=bool(self.s.steps), n_layers=self.s.n_layers),
            "measured_tokens_per_s": read_json(self.out / "throughput.json")["tokens_per_s"], "stages": records,
            "unigram_perplexity": {k: v["unigram_perplexity"] for k, v in pretrain_ppl.items()},
            "model_dir": str(final_dir), "corpus": self.corpus,
            "commands": {
                "serve": f"{astrai} serve --model {model_path} --port 8000",
                "chat": f"{astrai} chat --model {model_path}",
                "eval": f"{astrai} eval --model {model_path}",
                "rerun": f"{astrai} quickstart {self.rerun_arguments()} --out NEW_DIR",
                "longer": f"{astrai} quickstart --minutes {4 * self.s.minutes:g} --out {shlex.quote(str(self.out))}-longer",
            },
        }


# --- module helpers -------------------------------------------------------------------
def _metrics(log_dir: Path) -> list[dict]:
    return read_metrics(Path(log_dir) / "metrics.jsonl")


def _copy_prefix(source: Path, target: Path, limit: float) -> int:
    """Copy whole lines of ``source`` into ``target`` until ``limit`` bytes; return the bytes copied."""
    target.parent.mkdir(parents=True, exist_ok=True)
    copied = 0
    with open(source, "rb") as reader, open(target, "wb") as writer:
        for line in reader:
            if copied and copied + len(line) > limit:
                break
            writer.write(line)
            copied += len(line)
    return copied


def _median(values: list) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _parameters(model_dir: Path) -> int:
    """The logical parameter count, as ``astrai model info`` gives it."""
    return AutoModel.from_pretrained(model_dir).num_parameters()


def _astrai_command() -> str:
    """How this run was started (e.g. ``.venv/bin/astrai``), so the report's commands paste as they are."""
    launcher = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if launcher is not None and launcher.name == "astrai" and launcher.parent != Path("."):
        return shlex.quote(str(launcher))
    return "astrai"


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({torch.get_num_threads()} threads, {os.cpu_count()} cores)"


def _headline(ev: dict) -> str:
    parts = [f"{k} ppl {v['perplexity']:.1f} ({v['bits_per_byte']:.3f} bits/byte)" for k, v in ev.get("perplexity", {}).items()]
    if "task" in ev:
        low, high = ev["task"]["interval"]
        parts.append(f"held-out arithmetic accuracy {ev['task']['accuracy']:.3f} [{low:.3f}, {high:.3f}]")
    return ", ".join(parts) or "no evaluation"


def run_quickstart(**settings: Any) -> dict:
    """Python entry point: ``run_quickstart(out="runs/qs", minutes=15)``; returns the summary."""
    s = Settings(**settings)
    if s.sft_replay is not None and not 0 <= s.sft_replay < 1:
        raise ConfigError(f"sft_replay must be in [0, 1), got {s.sft_replay}")
    if s.arithmetic_share is not None and not 0 <= s.arithmetic_share < 1:
        raise ConfigError(f"arithmetic_share must be in [0, 1), got {s.arithmetic_share}")
    if not 0 <= s.arithmetic_chat_share <= 1:
        raise ConfigError(f"arithmetic_chat_share must be in [0, 1], got {s.arithmetic_chat_share}")
    return Quickstart(resumed_settings(s)).run()


def resumed_settings(s: Settings) -> Settings:
    """The settings a run directory was started with when it has them (a resumed run keeps
    them), else ``s``, saved there."""
    path = Path(s.out) / "settings.json"
    if path.is_file():
        try:
            fields = read_json(path)
            fields.setdefault("cpu_matmuls", fields.pop(OLD_MATMULS_KEY, None))
            saved = type(s)(**fields)
        except (TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not the settings of a quick start run ({exc}); use a new --out") from None
        if (saved.minutes, saved.preset, saved.vocab_size) != (s.minutes, s.preset, s.vocab_size):
            log(f"{path}: resuming a run started with other settings; keeping those ({saved.minutes:g} min, "
                f"preset {saved.preset}, vocabulary {saved.vocab_size}). Use a new --out to start afresh.")
        saved.out, saved.progress = s.out, s.progress  # where it lives now; display only
        return saved
    write_json(path, s.__dict__)
    return s


def plan_of(records: list[dict], pinned: bool, n_layers: Optional[int] = None) -> dict:
    """The stage plan a run followed, as ``plan.json`` keeps it: each stage's planned steps
    (the length of its learning-rate schedule), for stages the deadline guard ended early
    the step where they stopped, for stages re-planned in place the step and the length they
    started with (which sized pre-training's mixture), the fp32 CPU matmuls the run measured to be faster
    (oneDNN's or the BLAS's, which round differently), the precision pre-training took and the
    depth the run chose (2 layers in a short budget), so that ``--plan`` repeats the run exactly."""
    plan = {"steps": {r["name"]: r["planned_steps"] for r in records}}
    stopped = {r["name"]: r["steps"] for r in records if r["steps"] < r["planned_steps"]}
    if stopped:
        plan["stop_at"] = stopped
    replanned = {r["name"]: r["replanned"] for r in records if r.get("replanned")}
    if replanned:
        plan["replanned"] = replanned
    matmuls = next(filter(None, (r.get("cpu_matmuls") or r.get(OLD_MATMULS_KEY) for r in records)), None)
    if matmuls:
        plan["cpu_matmuls"] = matmuls
    precision = next((r["precision"] for r in records if r.get("precision")), None)
    if precision:
        plan["precision"] = precision
    if n_layers:
        plan["n_layers"] = n_layers
    plan["source"] = "pinned (--plan)" if pinned else "measured from throughput"
    return plan


def load_plan(path: str | Path, stages: tuple[str, ...] = TRAIN_STAGES) -> dict:
    """A plan file (``plan.json`` of an earlier run, or ``{"steps": {"pretrain": 300, "sft":
    100, "dpo": 10, "grpo": 20}}``) as Settings fields: ``steps`` (optimizer steps per stage),
    ``stop_at`` (where stages ended early, optional), ``replanned`` (stages re-planned in
    place: ``{"at_step": 25, "first_steps": 300}``, optional), ``cpu_matmuls`` (the fp32 matmuls
    decision, optional; read under its older name ``cpu_products`` too), ``precision``
    (pre-training's and SFT's, optional) and ``n_layers`` (the depth a run chose,
    optional); ``stages`` are the run's training stages."""
    try:
        plan = read_json(Path(path))
        steps, stop_at, replanned = plan["steps"], plan.get("stop_at", {}), plan.get("replanned", {})
        matmuls = plan.get("cpu_matmuls", plan.get(OLD_MATMULS_KEY))
        precision = plan.get("precision", "auto")
        n_layers = plan.get("n_layers")
    except FileNotFoundError:
        raise ConfigError(f"--plan {path}: file not found") from None
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ConfigError(f"--plan {path}: expected JSON with a 'steps' object ({exc})") from None
    if not isinstance(steps, dict) or set(steps) != set(stages) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in steps.values()):
        raise ConfigError(f"--plan {path}: 'steps' must give a positive integer for each of {', '.join(stages)}, "
                          f"got {steps!r}")
    if not isinstance(stop_at, dict) or not all(
            name in steps and isinstance(n, int) and not isinstance(n, bool) and 0 < n <= steps[name]
            for name, n in stop_at.items()):
        raise ConfigError(f"--plan {path}: 'stop_at' must give, for stages of the plan, a positive step no later "
                          f"than the stage's planned steps, got {stop_at!r}")
    if not isinstance(replanned, dict) or not all(
            name in steps and isinstance(r, dict) and set(r) == {"at_step", "first_steps"}
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in r.values())
            and r["at_step"] < min(r["first_steps"], steps[name]) for name, r in replanned.items()):
        raise ConfigError(f"--plan {path}: 'replanned' must give, for stages of the plan, "
                          f"{{\"at_step\": N, \"first_steps\": M}} with N before both M and the stage's planned steps, "
                          f"got {replanned!r}")
    if matmuls is not None and not (isinstance(matmuls, dict) and set(matmuls) == {"forward", "weight_grad"}
                                    and all(isinstance(v, bool) for v in matmuls.values())):
        raise ConfigError(f"--plan {path}: 'cpu_matmuls' must be {{\"forward\": true|false, \"weight_grad\": "
                          f"true|false}}, got {matmuls!r}")
    if precision not in PRECISIONS:
        raise ConfigError(f"--plan {path}: 'precision' must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if n_layers is not None and not (isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers > 0):
        raise ConfigError(f"--plan {path}: 'n_layers' must be a positive integer, got {n_layers!r}")
    return {"steps": dict(steps), "stop_at": dict(stop_at), "replanned": dict(replanned), "cpu_matmuls": matmuls,
            "precision": precision, **({"n_layers": n_layers} if n_layers else {})}


def print_outcome(summary: dict, out: str) -> None:
    """The run's last words on stdout: where the model and the report are, and each stage's headline."""
    print(json.dumps({"model_dir": summary["model_dir"], "report": str(Path(out) / "report.html"),
                      **{f"{s['name']}": _headline(s.get("eval", {})) for s in summary["stages"]}},
                     indent=2, ensure_ascii=False))
