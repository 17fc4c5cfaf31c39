"""Held-out preference accuracy: the share of pairs whose chosen answer the model finds likelier."""

import pytest
import torch

from astrai.config.model_config import preset
from astrai.eval.generation import chat_prompt
from astrai.eval.preference import answer_logprob, preference_accuracy
from astrai.model import AutoModel

PAIRS = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "chosen": f"so {a + b}",
          "rejected": f"so {a + b + 1}"} for a, b in ((23, 45), (7, 5), (60, 31), (12, 9), (40, 40))]


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=tokenizer.vocab_size, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, dim_ffn=128)
    return AutoModel.from_config(config).eval()


def test_answer_logprob_sums_the_answer_tokens_log_probabilities(model, tokenizer):
    prompt, answer = chat_prompt(tokenizer, "What is 7+5?"), "7+5=12, so 12"
    p, a = tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(answer, add_special_tokens=False)
    logits = model(torch.tensor([p + a]))["logits"][0].float().log_softmax(-1)
    expected = sum(logits[len(p) - 1 + i, token].item() for i, token in enumerate(a))
    assert answer_logprob(model, tokenizer, prompt, answer) == pytest.approx(expected, rel=1e-5)


def test_preference_accuracy_counts_the_pairs_whose_chosen_answer_is_likelier(model, tokenizer):
    result = preference_accuracy(model, tokenizer, PAIRS)
    margins = [answer_logprob(model, tokenizer, chat_prompt(tokenizer, p["prompt"][0]["content"]), p["chosen"])
               - answer_logprob(model, tokenizer, chat_prompt(tokenizer, p["prompt"][0]["content"]), p["rejected"])
               for p in PAIRS]
    assert result["n"] == 5 and result["accuracy"] == sum(m > 0 for m in margins) / 5
    assert result["mean_margin"] == pytest.approx(sum(margins) / 5, rel=1e-5)
    assert result["interval"][0] <= result["accuracy"] <= result["interval"][1]
    swapped = preference_accuracy(model, tokenizer, [{**p, "chosen": p["rejected"], "rejected": p["chosen"]}
                                                     for p in PAIRS])
    assert swapped["accuracy"] == 1 - result["accuracy"]  # no ties between different answers
    assert swapped["mean_margin"] == pytest.approx(-result["mean_margin"], rel=1e-5)
    # plain text: the prompt followed by a space, as a pre-trained model read its worked lines
    plain = preference_accuracy(model, tokenizer, PAIRS[:1], chat=False)
    prompt = "What is 23+45? "
    assert plain["mean_margin"] == pytest.approx(answer_logprob(model, tokenizer, prompt, "so 68")
                                                 - answer_logprob(model, tokenizer, prompt, "so 69"), rel=1e-5)
