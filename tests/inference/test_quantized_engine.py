"""The engine serving int8, int4 (Q4_0's and Q4_1's numbers) and bf16 weights: greedy tokens equal the plain model's
full recomputation under the same weights, whichever way the weights got there."""

from __future__ import annotations

import json
import random
import shlex

import pytest
import torch

from astrai.cli import main
from astrai.errors import AstraiError
from astrai.inference import InferenceEngine, SamplingParams
from astrai.model.quantized import QuantizedLinear, cast_linear_weights, quantize_model
from inference_helpers import greedy_reference, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(lengths, seed=5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def engine_tokens(model, requests, n) -> list[list[int]]:
    with InferenceEngine(model, None, max_batch_size=4, page_size=4, num_pages=64, prefill_chunk_size=8) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, **GREEDY)) for p in requests]
        return [h.result(timeout=60).token_ids for h in handles]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,precision", [("tiny", "int8"), ("tiny", "int4"), ("tiny", "int4-asym"), ("tiny", "bf16"),
                                            ("tiny-moe", "int4")])
def test_greedy_tokens_equal_the_plain_model_under_the_same_weights(kind, precision):
    model = make_model(kind)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    else:
        quantize_model(model, precision)
        assert any(isinstance(m, QuantizedLinear) for m in model.layers.modules())
    requests = prompts([5, 19, 1])
    expected = [greedy_reference(model, p, 8) for p in requests]
    assert engine_tokens(model, requests, 8) == expected


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    import shutil

    out = tmp_path_factory.mktemp("float")
    make_model("tiny", vocab_size=1000).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out


def reference_text(model_dir, tokenizer, prompt, fmt=None, dtype=None, n=6) -> str:
    from astrai.model import AutoModel

    model = AutoModel.from_pretrained(model_dir).eval()
    if fmt:
        quantize_model(model, fmt)
    if dtype == torch.bfloat16:  # the engine casts only the linear weights on the CPU; the same values in fp32
        for module in cast_linear_weights(model, dtype).modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype == dtype:
                module.weight.data = module.weight.data.float()
    return tokenizer.decode(greedy_reference(model, tokenizer.encode(prompt), n))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,fmt,dtype", [(["--quantize", "int4"], "int4", None),
                                             (["--quantize", "int4-asym"], "int4-asym", None),
                                             (["--quantize", "int8", "--dtype", "bfloat16"], "int8", torch.bfloat16),
                                             (["--dtype", "bfloat16"], None, torch.bfloat16)])
def test_generate_flags_quantize_and_cast_as_they_load(flags, fmt, dtype, model_dir, tokenizer, capsys):
    prompt = "The cat sat on"
    assert main(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "6", "--temperature", "0",
                 "--json", "--device", "cpu", *flags]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["completion_tokens"] == 6
    assert row["text"] == reference_text(model_dir, tokenizer, prompt, fmt, dtype)


@pytest.mark.timeout(120)
def test_a_quantized_directory_opens_without_the_option(model_dir, tokenizer, tmp_path, capsys):
    quantized = tmp_path / "int8"
    assert main(["model", "quantize", str(model_dir), "--to", "int8", "--out", str(quantized)]) == 0
    with InferenceEngine.from_pretrained(quantized, max_batch_size=1, num_pages=16) as engine:
        assert isinstance(engine.model.layers[0].mlp.down, QuantizedLinear)
        text = engine.generate("The cat sat on", max_tokens=6, temperature=0.0, ignore_eos=True)
    assert text == reference_text(model_dir, tokenizer, "The cat sat on", "int8")
    with InferenceEngine.from_pretrained(quantized, quantize="int8", max_batch_size=1, num_pages=16) as engine:
        assert engine.model.quantization["format"] == "int8"
    with pytest.raises(AstraiError, match="holds int8 weights; it cannot be served as int4"):
        InferenceEngine.from_pretrained(quantized, quantize="int4")
    with pytest.raises(AstraiError, match="unknown quantization 'int2'"):
        InferenceEngine.from_pretrained(model_dir, quantize="int2")


def test_serve_passes_quantize_and_dtype_to_the_engine(model_dir, monkeypatch):
    from astrai.serving import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda model, **kwargs: seen.update(kwargs, model=model))
    assert main(["serve", "--model", str(model_dir), "--quantize", "int4", "--dtype", "bfloat16", "--device", "cpu"]) == 0
    assert (seen["quantize"], seen["dtype"]) == ("int4", torch.bfloat16)


@pytest.mark.timeout(120)
def test_bf16_on_the_cpu_casts_linear_weights_only_and_decodes_fused(model_dir):
    with InferenceEngine.from_pretrained(model_dir, dtype=torch.bfloat16, device="cpu") as engine:
        model = engine.model
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
        assert model.embed_tokens.weight.dtype == torch.float32
        norms = [p for name, p in model.named_parameters() if "norm" in name]
        assert norms and all(p.dtype == torch.float32 for p in norms)
        engine.submit(list(range(3, 12)), SamplingParams(max_tokens=6, **GREEDY)).result(timeout=60)
        assert engine.get_stats()["decode_paths"]["fused"] > 0


@pytest.mark.timeout(120)
def test_another_format_for_a_quantized_directory_names_the_command_that_requantizes_it(model_dir, tmp_path, capsys):
    quantized = tmp_path / "int8 copy"
    assert main(["model", "quantize", str(model_dir), "--to", "int8", "--out", str(quantized)]) == 0
    with pytest.raises(AstraiError) as refused:
        InferenceEngine.from_pretrained(quantized, quantize="int4")
    command = f"astrai model quantize '{quantized}' --to int4 --out NEW_DIR"
    assert f"Requantize it once with `{command}`" in str(refused.value)
    requantized = tmp_path / "int4"
    assert main(shlex.split(command.replace("NEW_DIR", shlex.quote(str(requantized))))[1:]) == 0
    with InferenceEngine.from_pretrained(requantized, quantize="int4", max_batch_size=1, num_pages=16) as engine:
        assert engine.model.quantization["format"] == "int4"
