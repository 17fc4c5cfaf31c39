"""Perplexity: sliding windows score every token once, causally, and match a direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from astrai.config import preset
from astrai.errors import ConfigError
from astrai.eval.perplexity import perplexity, sliding_windows, token_nlls, unigram_perplexity
from astrai.model import AutoModel


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModel.from_config(preset("tiny", vocab_size=97, n_layers=2, dim=32, n_heads=2, n_kv_heads=1,
                                        dim_ffn=64, max_len=64)).eval()


def direct_nll(model, ids):
    """Sum of -log p(ids[t] | ids[:t]) from one forward pass over the whole sequence."""
    logits = model(torch.tensor([ids]))["logits"][0, :-1]
    return -F.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()


def test_windows_score_every_token_exactly_once():
    for n, window, stride in [(10, 4, 1), (10, 4, 3), (37, 8, 5), (5, 16, 8), (2, 2, 1)]:
        scored = []
        for begin, end, n_scored in sliding_windows(n, window, stride):
            assert end - begin <= window and 1 <= n_scored <= end - begin - 1
            scored += list(range(end - n_scored, end))
        assert scored == list(range(1, n)), (n, window, stride)


def test_window_equal_to_sequence_matches_direct_computation(model):
    ids = torch.randint(0, 97, (40,)).tolist()
    result = perplexity(model, ids, window_size=64)
    assert result.tokens == 39
    assert result.nll == pytest.approx(direct_nll(model, ids), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll / 39), rel=1e-9)


def test_stride_one_gives_each_token_its_last_window_of_context(model):
    ids = torch.randint(0, 97, (30,)).tolist()
    window = 8
    expected = 0.0
    for t in range(1, 30):  # token t is predicted from at most window-1 tokens before it
        context = ids[max(0, t - window + 1):t + 1]
        logits = model(torch.tensor([context]))["logits"][0, -2]
        expected -= F.log_softmax(logits, -1)[ids[t]].item()
    result = perplexity(model, ids, window_size=window, stride=1, batch_size=5)
    assert result.tokens == 29
    assert result.nll == pytest.approx(expected, rel=1e-5)


def test_perplexity_never_sees_future_tokens(model):
    """Each token's score is the same whatever follows it in the stream."""
    torch.manual_seed(1)
    prefix = torch.randint(0, 97, (50,)).tolist()
    tail_a = torch.randint(0, 97, (30,)).tolist()
    tail_b = [(t + 1) % 97 for t in tail_a]
    a = token_nlls(model, prefix + tail_a, window_size=16, stride=5, batch_size=3)
    b = token_nlls(model, prefix + tail_b, window_size=16, stride=5, batch_size=3)
    assert torch.equal(a[:49], b[:49])  # tokens 1..49 are scored identically
    assert not torch.allclose(a[49:], b[49:])  # the tail itself does differ
    alone = token_nlls(model, prefix, window_size=16, stride=5)
    assert torch.allclose(alone, a[:49], atol=1e-5)
    assert perplexity(model, prefix + tail_a, 16, 5).nll == pytest.approx(float(a.double().sum()), rel=1e-9)


def test_unigram_baseline_is_exp_entropy():
    assert unigram_perplexity([1, 1, 2, 2]) == pytest.approx(2.0)
    assert unigram_perplexity([5, 5, 5]) == pytest.approx(1.0)
    assert unigram_perplexity([1, 2, 3, 4]) == pytest.approx(4.0)


def test_bad_window_settings_are_refused():
    with pytest.raises(ConfigError, match="stride"):
        sliding_windows(10, 4, 4)
    with pytest.raises(ConfigError, match="window_size"):
        sliding_windows(10, 1, 1)
