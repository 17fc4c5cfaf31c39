"""A draft head's drafts in one C call (astrai/backends/cpu/fused_head.py): the head's own greedy
drafts, for fp32 and int8 heads on one and several threads, taken by the engine's head drafter,
and refused for a head the kernels cannot read."""

from __future__ import annotations

import pytest
import torch

from astrai.backends.cpu.fused_head import FusedHead
from astrai.backends.cpu.kernels import kernels_available
from astrai.backends.cpu.serving import prepare_for_serving
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.head_drafter import HeadDrafter
from astrai.model.draft_head import DraftHead
from astrai.model.quantized import QuantizedLinear
from inference_helpers import greedy_reference, make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")


def random_head(target, seed: int = 0) -> DraftHead:
    """A head over every third of the target's first 200 tokens, its weights drawn large enough
    that its guesses differ from step to step."""
    torch.manual_seed(seed)
    head = DraftHead.for_target(target, torch.arange(0, 200, 3))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    return head


def torch_drafts(head: DraftHead, hidden: torch.Tensor, token: int, k: int) -> tuple[list[int], list[float]]:
    """The head's own greedy drafts through its modules, and each step's margin between its best
    and second-best scores (a near tie may go either way in another summation order)."""
    tokens, margins, h, t = [], [], hidden.reshape(1, -1), torch.tensor([token])
    with torch.no_grad():
        for _ in range(k):
            h, scores = head(h, t)
            top = scores[0].topk(2).values
            margins.append(float(top[0] - top[1]))
            t = head.draft_ids[scores.argmax(dim=-1)]
            tokens.append(int(t))
    return tokens, margins


def agree_until_a_near_tie(got: list[int], want: list[int], margins: list[float]) -> bool:
    for g, w, m in zip(got, want, margins):
        if m < 1e-3:
            return True  # past a near tie the two may part, both right
        if g != w:
            return False
    return len(got) == len(want)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_fused_drafts_are_the_heads_own(weights, threads):
    target = make_model("tiny")
    head = random_head(target)
    if weights == "int8":
        head = head.quantize()
    prepare_for_serving(head)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = FusedHead.for_head(head)
        assert fused is not None
        for i in range(12):
            hidden = torch.randn(target.config.dim, generator=torch.Generator().manual_seed(i))
            token = (7 * i) % 200
            want, margins = torch_drafts(head, hidden, token, 5)
            assert agree_until_a_near_tie(fused(hidden, token, 5), want, margins), i
    finally:
        torch.set_num_threads(before)


def test_a_head_with_a_bias_or_a_weight_the_kernels_cannot_read_is_not_fused():
    target = make_model("tiny")
    head = random_head(target)
    head.down_proj.bias = torch.nn.Parameter(torch.zeros(head.config.dim))
    assert FusedHead.for_head(head) is None
    head = random_head(target)
    head.gate_proj.weight.data = head.gate_proj.weight.data.double()
    assert FusedHead.for_head(head) is None


@pytest.mark.timeout(120)
def test_the_engine_drafts_a_lone_row_through_the_fused_head_and_keeps_plain_tokens(monkeypatch):
    """A verify step at a time (``greedy_run_steps=1``; a lone greedy row otherwise takes runs of
    verify steps in C, test_speculative_runs.py), the head's drafts come from its fused call."""
    calls = []
    real = FusedHead.__call__
    monkeypatch.setattr(FusedHead, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    target = make_model("tiny", seed=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = greedy_reference(target, prompt, 40)
    drafter = HeadDrafter(random_head(target, seed=1))
    with InferenceEngine(target, None, max_batch_size=1, page_size=4, num_pages=64, speculative="draft",
                         drafter=drafter, in_place=False, greedy_run_steps=1) as engine:
        got = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)).result(60)
        stats = engine.get_stats()["speculative"]
    assert got.token_ids == expected
    assert calls and stats["drafted_tokens"] > 0


@pytest.mark.timeout(120)
def test_a_quantized_engine_serves_a_saved_head_in_int8_and_keeps_plain_tokens(tokenizer, tmp_path):
    """``from_pretrained(quantize=...)`` with a head directory: the head's linears are served as
    int8 blocks (a quarter of the bytes a draft token reads) and the tokens are the plain engine's."""
    target = make_model("tiny", seed=2, vocab_size=tokenizer.vocab_size)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    random_head(target, seed=3).save_pretrained(tmp_path / "head")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with InferenceEngine.from_pretrained(tmp_path / "target", quantize="int8") as plain:
        want = [plain.submit(p, params).result(60).token_ids for p in prompts]
    with InferenceEngine.from_pretrained(tmp_path / "target", quantize="int8", draft_model=str(tmp_path / "head"),
                                         max_batch_size=1) as engine:
        head = engine.scheduler._drafter.head
        assert all(isinstance(getattr(head, n), QuantizedLinear)
                   for n in ("fuse", "gate_proj", "up_proj", "down_proj", "out_proj"))
        assert [engine.submit(p, params).result(60).token_ids for p in prompts] == want
        assert engine.get_stats()["speculative"]["drafted_tokens"] > 0
