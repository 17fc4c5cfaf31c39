"""Chat templates: ChatML rendering, the assistant mask for SFT, sandboxing and bad input."""

import pytest

from astrai.errors import ConfigError, DataError
from astrai.tokenize import ChatTemplate

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3+4?"},
    {"role": "assistant", "content": "3+4 is 7."},
    {"role": "user", "content": "用中文说"},
    {"role": "assistant", "content": "三加四等于七。"},
]


def test_default_template_is_chatml():
    text = ChatTemplate().render(CONVERSATION[:2], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ChatTemplate().render(CONVERSATION[1:2], system_prompt="S").startswith("<|im_start|>system\nS<|im_end|>")
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add"}}]}
    assert ChatTemplate().render([tool_turn]) == "<|im_start|>assistant\n<|im_end|>\n"


def test_assistant_mask_covers_exactly_the_assistant_tokens(tokenizer):
    out = tokenizer.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True)
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    learnt = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert learnt == "3+4 is 7.<|im_end|>三加四等于七。<|im_end|>"
    rest = tokenizer.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert "What is 3+4?" in rest and "用中文说" in rest and "assistant\n" in rest
    assert tokenizer.decode(ids[-1:]) == "\n"
    assert mask[-1] == 0  # the newline after <|im_end|> is never generated, so never trained on


def test_templates_are_sandboxed_and_errors_are_clear():
    with pytest.raises(DataError, match="failed to render"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(CONVERSATION)
    with pytest.raises(DataError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(CONVERSATION)
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(DataError, match=r"messages\[1\] is missing 'content'"):
        ChatTemplate().render([{"role": "user", "content": "a"}, {"role": "assistant"}])
    with pytest.raises(DataError, match=r"messages\[0\].content must be a string"):
        ChatTemplate().render([{"role": "user", "content": 3}])


def test_custom_template_and_hf_variables(tokenizer):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    tokenizer_copy = type(tokenizer)(tokenizer.backend, dict(tokenizer.config, chat_template=template))
    assert tokenizer_copy.apply_chat_template(CONVERSATION[1:3]) == \
        "<|bos|>[user] What is 3+4?<|eos|>[assistant] 3+4 is 7.<|eos|>"
    ids, mask = tokenizer_copy.encode_chat(CONVERSATION[1:3])
    assert tokenizer_copy.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == " 3+4 is 7.<|eos|>"
