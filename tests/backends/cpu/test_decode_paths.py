"""Which decode path each model the CPU serves takes, as the engine's stats report it.

Every preset (tiny, tiny-mla, tiny-moe) and every family imported from Hugging Face (Llama,
Qwen2, Qwen3, Mistral: tiny random configs saved as transformers writes them), loaded the
way the engine loads them (``load_model``: fp32, int8 and int4 blocks, bf16 linear weights),
decodes one request alone and two together. A change to a model component that the CPU
backend no longer recognises (the fused step's structure check, serving.py's modules) moves
the steps to another path, and the table below says where they belonged.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from astrai.backends.cpu.dense_matmul import bf16_matmul_available, integer_int8_available
from astrai.backends.cpu.kernels import kernels_available
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.engine import load_model
from inference_helpers import make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs a C compiler (CI has one)")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STEPS = GREEDY.max_tokens - 1  # the first token comes from the prefill
PROMPTS = ([5, 9, 20, 3], [17] * 7)
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),  # q/k/v biases
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {}),  # QK-norm
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": 128}),
}
PRESETS = ("tiny", "tiny-mla", "tiny-moe")
WEIGHTS = ("fp32", "int8", "int4", "bf16")
GQA_MODELS = ("tiny", *FAMILIES)

# (model, weights) -> (the path of a lone request's decode steps, the paths a batch of two takes)
EXPECTED = {
    **{(model, weights): ("fused", {"row_kernels"}) for model in GQA_MODELS for weights in WEIGHTS},
    # the fused C step is GQA + SwiGLU only; MoE's experts and MLA's projections take the row kernels
    **{("tiny-moe", weights): ("row_kernels", {"row_kernels"}) for weights in WEIGHTS},
    # a batch's MLA step expands every cached position's latent (kv_b_proj over batch x context
    # rows): oneDNN's packed copy in fp32, the integer matmul in int4 (and int8 on a CPU with
    # VNNI; see the test), and in bf16, once the context outgrows the dequantizing matmul's
    # rows, the weight widened for torch (counted "torch"; the bf16 matmul on a CPU with
    # AVX512-BF16, see the test)
    ("tiny-mla", "fp32"): ("row_kernels", {"batched"}),
    ("tiny-mla", "int4"): ("row_kernels", {"row_kernels"}),
    ("tiny-mla", "int8"): ("row_kernels", {"row_kernels"}),
    ("tiny-mla", "bf16"): ("row_kernels", {"row_kernels", "torch"}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Each model's directory: a preset saved by astrai, a family saved by transformers."""
    dirs = {}
    for name in PRESETS:
        dirs[name] = str(tmp_path_factory.mktemp(name))
        make_model(name).save_pretrained(dirs[name])
    for name, (model_class, config_class, extra) in FAMILIES.items():
        dirs[name] = str(tmp_path_factory.mktemp(name))
        torch.manual_seed(0)
        model_class(config_class(**HF_SHAPE, **extra)).save_pretrained(dirs[name])
    return dirs


def decode_paths(model: torch.nn.Module, rows: int) -> dict[str, int]:
    """The engine's decode-path counts after ``rows`` greedy requests decoded together."""
    with InferenceEngine(model, None, max_batch_size=rows, page_size=4, num_pages=64) as engine:
        with engine.scheduler._lock:  # all queued before the loop plans a step: they decode together
            handles = [engine.submit(list(prompt), GREEDY) for prompt in PROMPTS[:rows]]
        for handle in handles:
            handle.result(timeout=60)
        return engine.get_stats()["decode_paths"]


def test_the_table_covers_every_preset_family_and_weight_format():
    assert set(EXPECTED) == {(m, w) for m in (*PRESETS, *FAMILIES) for w in WEIGHTS}


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("name", [*PRESETS, *FAMILIES])
def test_each_model_decodes_on_its_expected_path(name, weights, model_dirs):
    dtype = torch.bfloat16 if weights == "bf16" else None
    model = load_model(model_dirs[name], dtype, "cpu", weights if weights.startswith("int") else None)
    lone, batch = EXPECTED[name, weights]
    if (name, weights) == ("tiny-mla", "int8") and not integer_int8_available():
        batch = {"row_kernels", "torch"}  # without VNNI a prompt's int8 weight is widened for torch, as bf16's
    if (name, weights) == ("tiny-mla", "bf16") and bf16_matmul_available():
        batch = {"row_kernels"}  # the prompt's bf16 rows in vdpbf16ps
    assert decode_paths(model, 1) == {path: STEPS if path == lone else 0 for path in ("fused", "row_kernels",
                                                                                        "batched", "torch")}
    assert {path for path, steps in decode_paths(model, 2).items() if steps} == batch
