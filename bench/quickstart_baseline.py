"""The quick start's pre-training against what a user would otherwise write, in the same minutes.

The baseline is a plain, carefully set up PyTorch loop over a ``transformers``
``LlamaForCausalLM`` of the same shape as astrai's model (the quick start's preset, same
vocabulary): the same tokenizer and text (with the worked problems at the same share:
``--arithmetic-share``, 0.4 by default; the quick start's own rule buys 1.5M tokens of them,
which would make a short run mostly worked problems),
windows of the same length, AdamW (betas 0.9/0.95, weight decay 0.1), linear warm-up then cosine decay sized from a timed
probe and fitted again to the time left from its own steps 5-25 (a probe of a few steps reads
the loop's pace 15-20% off either way), gradient clipping at 1.0, and bf16 autocast when a probe shows it is faster than
fp32. astrai's side is the quick start's own pre-training stage (``Quickstart.train_config``:
its preset, learning rate, schedule, window and batch; the 4-layer `tiny` even where the quick
start would train 2 layers at this length, so both sides keep one shape), sized from its throughput probe
and planned again from its own steps 5-25 as in a real run: started over when they run more
than 20% off the probe's pace, else fitted in place to the time left. Each side gets ``--minutes`` of training wall-clock; then both are scored on the
same held-out documents in bits per byte (the same likelihood code for
both, so the numbers compare exactly). The target is astrai ≤ 0.85 × the baseline.

    OMP_NUM_THREADS=2 .venv/bin/python bench/quickstart_baseline.py --minutes 5

Both sides run one after the other on the same threads; a busy machine slows whichever
side it meets, so compare runs made on a quiet one.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from results_file import write_result  # bench/ is on sys.path when a script runs

TARGET_RATIO = 0.85
ARITHMETIC_SHARE = 0.4  # of the windows, on both sides, unless --arithmetic-share says otherwise
PACE_STEPS = (5, 25)  # the baseline times these of its steps and fits its schedule to the time left


# --- the data, as a user would prepare it ------------------------------------------------
def token_windows(tokenizer, files: list[str], window: int) -> torch.Tensor:
    """Every document encoded, bos + text + eos, concatenated and cut into rows of window + 1."""
    from astrai.eval.perplexity import read_documents

    stream: list[int] = []
    for path in files:
        for text in read_documents(path):
            stream += [tokenizer.bos_id, *tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_id]
    rows = len(stream) // (window + 1)
    return torch.tensor(stream[:rows * (window + 1)], dtype=torch.long).view(rows, window + 1)


class HFForEval(torch.nn.Module):
    """A transformers causal LM seen through the interface astrai's perplexity code calls."""

    def __init__(self, model, max_len: int):
        super().__init__()
        self.model = model
        self.config = type("Config", (), {"max_len": max_len})()

    def forward(self, input_ids, input_mask=None, **_):
        return {"logits": self.model(input_ids=input_ids, attention_mask=input_mask).logits}


# --- the baseline loop ------------------------------------------------------------------
class Baseline:
    """``sources``: (rows, rate) pairs; each batch row comes from a source picked by its rate
    (the quick start's pre-training mixes its text and the worked problems so)."""

    def __init__(self, model_config, sources: list[tuple[torch.Tensor, float]], batch: int, lr: float, seed: int):
        import transformers

        llama = transformers.LlamaConfig(
            vocab_size=model_config.vocab_size, hidden_size=model_config.dim, intermediate_size=model_config.dim_ffn,
            num_hidden_layers=model_config.n_layers, num_attention_heads=model_config.n_heads,
            num_key_value_heads=model_config.n_kv_heads, max_position_embeddings=model_config.max_len,
            rope_theta=model_config.rope_theta, rms_norm_eps=model_config.norm_eps,
            tie_word_embeddings=model_config.tie_weight, attn_implementation="sdpa")
        torch.manual_seed(seed)
        self.model = transformers.LlamaForCausalLM(llama).train()
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
        self.sources, self.batch, self.lr = [rows for rows, _ in sources], batch, lr
        self.rates = torch.tensor([rate for _, rate in sources], dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)
        self.bf16 = False

    def next_batch(self) -> torch.Tensor:
        picks = torch.multinomial(self.rates, self.batch, replacement=True, generator=self.generator)
        rows = [self.sources[i][torch.randint(len(self.sources[i]), (1,), generator=self.generator)] for i in picks]
        return torch.cat(rows)

    def step(self) -> float:
        rows = self.next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def probe(self, steps: int = 4) -> dict:
        """Seconds per step in fp32 and in bf16 autocast (the last ``steps`` of ``steps + 1``);
        keeps the faster precision. The probe's updates are undone by re-initialising."""
        timings = {}
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        for bf16 in (False, True):
            self.bf16 = bf16
            self.step()
            start = time.perf_counter()
            for _ in range(steps):
                self.step()
            timings["bf16" if bf16 else "fp32"] = (time.perf_counter() - start) / steps
        self.model.load_state_dict(state)
        self.optimizer.state.clear()
        self.bf16 = timings["bf16"] < timings["fp32"]
        return timings

    def train(self, seconds: float) -> dict:
        timings = self.probe()
        step_seconds = min(timings.values())
        first_plan = total = max(10, int(0.97 * seconds / step_seconds))
        warmup = max(1, total // 20)

        def factor(step: int) -> float:  # linear warm-up, cosine down to a tenth (of the current plan)
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        start = time.perf_counter()
        steps, loss, paced_from = 0, float("nan"), start
        while steps < total and time.perf_counter() - start < seconds:
            if steps == PACE_STEPS[0]:
                paced_from = time.perf_counter()
            loss = self.step()
            steps += 1
            if steps == PACE_STEPS[1]:  # the steps that fit in the time left at the loop's own pace
                per_step = (time.perf_counter() - paced_from) / (PACE_STEPS[1] - PACE_STEPS[0])
                total = steps + max(1, int(0.97 * (seconds - (time.perf_counter() - start)) / per_step))
            schedule.step()
        elapsed = time.perf_counter() - start
        tokens = steps * self.batch * (self.sources[0].shape[1] - 1)
        return {"steps": steps, "planned_steps": total, "first_plan_steps": first_plan, "tokens": tokens, "seconds": elapsed,
                "tokens_per_s": tokens / elapsed, "final_loss": loss, "precision": "bf16" if self.bf16 else "fp32",
                "probe_seconds_per_step": timings, "lr": self.lr}


# --- astrai's side ------------------------------------------------------------------------
def astrai_pretrain(qs, seconds: float) -> dict:
    """The quick start's pre-training stage, sized for ``seconds`` from its throughput probe and,
    as in a real run, planned again from its own steps 5-25: started over when they run off the
    probe's pace by more than the quick start's tolerance, else fitted in place to the time left."""
    from astrai.quickstart.from_scratch import make_pace_check_callback, make_stage_deadline_callback
    from astrai.trainer import Trainer

    config = qs.train_config(0, "pretrain", seconds)
    start = time.perf_counter()
    replanned = {}
    pace = make_pace_check_callback(qs.tps, config.batch_per_device * config.window_size, seconds,
                                    on_replan=lambda step, first, total: replanned.update(
                                        in_place_at_step=step, first_plan_steps=first, steps=total))
    context = Trainer(config, callbacks=[make_stage_deadline_callback(seconds), pace]).train()
    if pace.measured is not None:
        replanned = {"probed_tokens_per_s": qs.tps, "measured_tokens_per_s": pace.measured,
                     "first_plan_steps": config.max_steps}
        shutil.rmtree(qs.stage_dir("pretrain"))
        qs.tps = pace.measured
        left = seconds - (time.perf_counter() - start)
        config = qs.train_config(0, "pretrain", left)
        context = Trainer(config, callbacks=[make_stage_deadline_callback(left)]).train()
    elapsed = time.perf_counter() - start
    return {"steps": context.step, "planned_steps": replanned.get("steps", config.max_steps), "tokens": context.tokens_seen,
            "seconds": elapsed, "tokens_per_s": context.tokens_seen / elapsed, "lr": config.max_lr,
            "schedule": config.schedule, "warmup_ratio": config.warmup_ratio, "replanned": replanned,
            "mixture": config.datasets}


def heldout_bits(model, tokenizer, window: int) -> dict:
    """Bits per byte on each bundled held-out file and on both together."""
    from astrai.eval.perplexity import bits_per_byte, heldout_perplexity
    from astrai.eval.suite import DEFAULT_HELDOUT

    model.eval()
    results = {name: heldout_perplexity(model, tokenizer, path, window, window - window // 4)
               for name, path in DEFAULT_HELDOUT.items()}
    nll = sum(r["mean_nll"] * r["tokens"] for r in results.values())
    out = {name: r["bits_per_byte"] for name, r in results.items()}
    out["all"] = bits_per_byte(nll, sum(r["bytes"] for r in results.values()))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="training wall-clock per side (default 5)")
    parser.add_argument("--corpus", default="bundled", help="pre-training text, as `astrai quickstart --corpus` "
                        "(default bundled: the same text on every machine)")
    parser.add_argument("--baseline-lr", type=float, default=1e-3, help="the baseline's peak learning rate")
    parser.add_argument("--arithmetic-share", type=float, default=ARITHMETIC_SHARE,
                        help="share of the windows that are worked problems, on both sides (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--out", default=None, help="result JSON (default bench/results/quickstart_baseline-DATE.json)")
    args = parser.parse_args()

    from astrai.model import AutoModel
    from astrai.quickstart.from_scratch import Deadline, Quickstart, Settings

    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        qs = Quickstart(Settings(out=str(work / "astrai"), minutes=args.minutes, seed=args.seed, corpus=args.corpus,
                                 arithmetic_share=args.arithmetic_share, progress=False))
        qs.deadline = Deadline(10 * args.minutes + 60)
        qs.stage_corpus()
        qs.stage_tokenizer()
        qs.stage_data()
        qs.tps = qs.measure_throughput()
        settings = qs.s
        print(f"astrai: pre-training for {args.minutes:g} min", flush=True)
        astrai = astrai_pretrain(qs, seconds)
        model = AutoModel.from_pretrained(qs.model_dir("pretrain"))
        model_config = model.config
        astrai["parameters"] = model.num_parameters()
        astrai["bits_per_byte"] = heldout_bits(model, qs.tokenizer, settings.window_size)
        del model

        print(f"baseline: transformers LlamaForCausalLM for {args.minutes:g} min", flush=True)
        sources = [(token_windows(qs.tokenizer, qs.corpus["train"], settings.window_size), 1.0)]
        mixture = astrai["mixture"]
        if mixture:  # the worked problems beside the text, at the share astrai's stage took
            problems = token_windows(qs.tokenizer, [str(qs.arithmetic_text())], settings.window_size)
            sources = [(sources[0][0], mixture[0]["rate"]), (problems, mixture[1]["rate"])]
        baseline_side = Baseline(model_config, sources, settings.batch_size, args.baseline_lr, args.seed)
        baseline = baseline_side.train(seconds)
        baseline["parameters"] = sum(p.numel() for p in baseline_side.model.parameters())
        baseline["bits_per_byte"] = heldout_bits(HFForEval(baseline_side.model, model_config.max_len), qs.tokenizer,
                                                 settings.window_size)

    ratio = astrai["bits_per_byte"]["all"] / baseline["bits_per_byte"]["all"]
    results = {"minutes_per_side": args.minutes, "corpus": qs.corpus["kind"], "preset": settings.preset,
               "vocab_size": qs.tokenizer.vocab_size, "window": settings.window_size, "batch": settings.batch_size,
               "threads": torch.get_num_threads(), "astrai": astrai, "baseline": baseline,
               "bpb_ratio_astrai_to_baseline": ratio, "target_ratio": TARGET_RATIO, "target_met": ratio <= TARGET_RATIO}
    print(f"{'':10} {'steps':>7} {'tokens':>10} {'tokens/s':>9} {'bpb en':>7} {'bpb zh':>7} {'bpb all':>8}")
    for name, side in (("astrai", astrai), ("baseline", baseline)):
        bits = side["bits_per_byte"]
        print(f"{name:10} {side['steps']:>7} {side['tokens']:>10} {side['tokens_per_s']:>9.0f} {bits['en']:>7.3f} "
              f"{bits['zh']:>7.3f} {bits['all']:>8.3f}")
    print(f"astrai / baseline bits per byte: {ratio:.3f} (target <= {TARGET_RATIO})")
    write_result("quickstart_baseline", results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
