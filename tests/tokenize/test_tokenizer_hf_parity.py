"""A tokenizer trained here opens in `tokenizers` and `transformers` with the same ids,
and its chat template renders the same string through transformers' apply_chat_template."""

import pytest
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["In the beginning God created the heavens and the earth.", "白日依山尽，黄河入海流。",
         "emoji 🙂 and code: for i in range(10): print(i)", "<|im_start|>user\nhi<|im_end|>\n", "  spaces  "]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "3+4="},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "你好"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def test_tokenizers_library_gives_same_ids(tokenizer, tokenizer_dir):
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for text in TEXTS:
        assert raw.encode(text, add_special_tokens=False).ids == tokenizer.encode(text)
        assert raw.encode(text).ids == tokenizer.encode(text, add_special_tokens=True)


def test_transformers_gives_same_ids_and_text(tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert hf_tokenizer.bos_token_id == tokenizer.bos_id
    assert hf_tokenizer.eos_token_id == tokenizer.eos_id
    assert hf_tokenizer.pad_token_id == tokenizer.pad_id


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_renders_identically(tokenizer, hf_tokenizer, add_generation_prompt):
    ours = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tokenizer.encode(theirs, add_special_tokens=False)


def test_chat_template_with_tools_renders_identically(tokenizer, hf_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    ours = tokenizer.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=True)
    theirs = hf_tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "add"' in ours and ours.count("<|im_start|>system") == 1


def test_directory_saved_by_transformers_loads_back(tokenizer, hf_tokenizer, tmp_path):
    from astrai.tokenize import AutoTokenizer

    hf_tokenizer.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])
    assert loaded.apply_chat_template(CONVERSATION) == tokenizer.apply_chat_template(CONVERSATION)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.stop_ids) == \
        (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.stop_ids)
