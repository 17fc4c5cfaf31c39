"""Accuracy intervals (Wilson) and bits per byte, each against a computation by hand."""

import json
import math

import pytest
import torch
from torch import nn

from astrai.config import preset
from astrai.errors import DataError
from astrai.eval.intervals import Z_95, wilson_interval
from astrai.eval.perplexity import bits_per_byte, heldout_perplexity
from astrai.eval.task_accuracy import task_accuracy


def interval_by_bisection(successes: int, n: int) -> tuple[float, float]:
    """The Wilson interval from its definition: the p whose score test does not reject,
    (p_hat - p)^2 <= z^2 p (1 - p) / n, found by bisection on each side of p_hat."""
    p_hat = successes / n

    def inside(p):
        return (p_hat - p) ** 2 <= Z_95 ** 2 * p * (1 - p) / n

    def edge(lo, hi):  # inside(lo) != inside(hi)
        for _ in range(100):
            mid = (lo + hi) / 2
            if inside(mid) == inside(lo):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if inside(0.0) else edge(0.0, p_hat)
    high = 1.0 if inside(1.0) else edge(p_hat, 1.0)
    return low, high


@pytest.mark.parametrize("successes,n", [(0, 10), (8, 10), (10, 10), (37, 450), (225, 450), (1, 300)])
def test_wilson_interval_matches_its_definition(successes, n):
    low, high = wilson_interval(successes, n)
    assert (low, high) == pytest.approx(interval_by_bisection(successes, n), abs=1e-9)
    assert 0.0 <= low <= successes / n <= high <= 1.0


def test_wilson_interval_known_values_and_bad_input():
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook example
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    for successes, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(DataError, match="successes"):
            wilson_interval(successes, n)


def test_task_accuracy_reports_the_interval_and_each_phrasing():
    problems = [{"prompt": f"{i}+0=", "answer": str(i), "style": "en" if i % 2 else "zh"} for i in range(10)]
    answers = {f"{i}+0=": str(i) if i < 6 else "x" for i in range(10)}  # 6 of 10 right: 0..5
    result = task_accuracy(lambda prompts: [answers[p] for p in prompts], None, problems, lambda p: p["prompt"],
                           lambda p, a: float(a == p["answer"]), chat=False)
    assert result["accuracy"] == 0.6 and result["interval"] == pytest.approx(list(wilson_interval(6, 10)))
    assert result["by_style"] == {"zh": {"accuracy": 0.6, "n": 5}, "en": {"accuracy": 0.6, "n": 5}}


class UniformModel(nn.Module):
    """Every token equally likely: the negative log-likelihood of each is ln(vocabulary)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.config = preset("tiny", vocab_size=vocab_size, max_len=64)
        self.weight = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids, input_mask=None, **_):
        return {"logits": self.weight.expand(*input_ids.shape, -1)}


def test_bits_per_byte_by_hand(tokenizer, tmp_path):
    docs = ["The sea is calm tonight.", "春眠不觉晓，处处闻啼鸟。", "a longer English line " * 12]
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    result = heldout_perplexity(UniformModel(tokenizer.vocab_size), tokenizer, path, window_size=32, stride=24)
    # with a bos before each document every token of the text is scored, and every byte counts
    tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert result["tokens"] == tokens and result["bytes"] == n_bytes
    expected = tokens * math.log(tokenizer.vocab_size) / math.log(2) / n_bytes
    assert result["bits_per_byte"] == pytest.approx(expected, rel=1e-6)
    assert bits_per_byte(8 * math.log(2), 4) == pytest.approx(2.0)  # 8 bits over 4 bytes
    with pytest.raises(DataError, match="bytes"):
        bits_per_byte(1.0, 0)
