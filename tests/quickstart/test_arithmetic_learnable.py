"""The recipe's task is learnable: a small model pre-trained on the quick start's worked
problems alone, through the same pieces (tokenizer training, run_preprocess, Trainer),
answers held-out problems it never saw, asked the way the report asks a pre-trained model.
One phrasing (``What is 23+45?``, the one small models learn first) keeps it to a minute or two.

At this budget the outcome follows every rounding of the run (the matmul library, the thread
count), so it runs in a fresh process of its own, one thread, oneDNN's fp32 matmuls: the
same process on every test machine, whatever tests ran before it in the worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.config import TrainConfig
from astrai.dataset import PreprocessOptions, run_preprocess
from astrai.dataset.arithmetic import training_problems, worked_line
from astrai.eval.suite import evaluate
from astrai.eval.task_accuracy import arithmetic_task
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer
from astrai.trainer import Trainer

MODEL = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, dim_ffn=384, max_len=128)
STEPS = 400             # of 16 windows of 128 tokens: about 60,000 worked problems read
HELD_OUT = 90           # the held-out pool's first 90 problems
MIN_ACCURACY = 0.15     # measured 0.29 (machine E) and 0.38 (machine D); an answer counts only when its integer is right


def held_out_accuracy(tmp_path: Path) -> dict:
    """Train on worked problems alone and answer the held-out ones (run in its own process)."""
    lines = [worked_line(p) for p in training_problems(120_000, seed=0) if p["style"] == "en"]
    source = tmp_path / "worked.jsonl"
    source.write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 50])}) + "\n" for i in range(0, len(lines), 50)),
                      encoding="utf-8")
    tokenizer = AutoTokenizer.train([str(source)], 320, show_progress=False)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    run_preprocess(PreprocessOptions(inputs=[str(source)], output=str(tmp_path / "data"),
                                     tokenizer=str(tmp_path / "tokenizer"), train_type="seq", show_progress=False))
    config = TrainConfig(train_type="seq", data_root_path=str(tmp_path / "data"), model_preset="tiny",
                         model_overrides={**MODEL, "vocab_size": tokenizer.vocab_size},
                         tokenizer_path=str(tmp_path / "tokenizer"), batch_per_device=16, window_size=128,
                         max_steps=STEPS, max_lr=3e-3, schedule="wsd", warmup_ratio=0.05, decay_ratio=0.95, min_rate=0.0,
                         ckpt_dir=str(tmp_path / "ckpt"), ckpt_interval=STEPS, progress_bar=False, random_seed=0)
    Trainer(config).train()
    model = AutoModel.from_pretrained(tmp_path / "ckpt" / "final").eval()
    problems, prompt_of, check = arithmetic_task(HELD_OUT, plain_text=True)
    problems = [{**p, "prompt": f"What is {p['a']}{p['op']}{p['b']}?"} for p in problems]
    result = evaluate(model, tokenizer, task=(problems, prompt_of, check), chat=False, task_max_new_tokens=24)["task"]
    return {"accuracy": result["accuracy"], "by_style": result["by_style"], "examples": result["examples"][:2]}


@pytest.mark.slow
@pytest.mark.timeout(600)  # 1.5 minutes on a Zen 5, 4 on a Zen 1
def test_worked_problems_teach_held_out_arithmetic(tmp_path):
    # oneDNN's or MKL's fp32 matmuls: at this budget their summation orders alone move the
    # held-out accuracy (0.29-0.33 with oneDNN's, 0.13 with MKL's, machine E), so the run does
    # not time them (agree_on_matmuls) but takes oneDNN's
    env = dict(os.environ, ASTRAI_ONEDNN_LINEAR="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("held-out accuracy", result)
    assert result["accuracy"] >= MIN_ACCURACY


if __name__ == "__main__":
    print(json.dumps(held_out_accuracy(Path(sys.argv[1])), ensure_ascii=False))
