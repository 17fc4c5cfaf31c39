"""The paths a GPU takes, on the device the suite is given: ``pytest tests/device --device cuda``
on a GPU machine, the CPU by default (so CI runs the same assertions).

Covered: logits against transformers in fp32 and bf16; the engine's greedy output against
full recomputation (GQA, MLA, MoE; staggered joins, shared prefixes) with the cache's pages
all returned; a 16-bit KV cache against the fp32 one; bf16 weights; int8/int4 layers;
bf16-autocast training that learns; compile with gradient checkpointing against eager; the
trainer in a process group with the device's backend (NCCL for CUDA tensors beside gloo for
the host's); and the HTTP server with its engine on the device, through the ``openai`` client.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel
from astrai.model.quantized import quantize_model
from astrai.parallel import cleanup_parallel
from astrai.parallel.setup import free_port, setup_parallel
from astrai.trainer import TrainCallback, Trainer
from inference_helpers import make_model
from trainer_helpers import TokenWindows, config, tiny_model

HF_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """fp32 means fp32: no TF32 rounding of CUDA matmuls (PyTorch's default, stated here)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A random transformers Llama (norms and biases randomised) and astrai's import of it, on the CPU."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE)).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("llama")
    reference.save_pretrained(path)
    return reference, AutoModel.from_pretrained(path).eval()


def _ids(shape, vocab=128, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_match_transformers_in_fp32(device, hf_pair):
    reference, ours = (copy.deepcopy(m).to(device) for m in hf_pair)
    ids = _ids((2, 48)).to(device)
    got, expected = ours(ids)["logits"], reference(ids).logits
    assert got.device.type == device.type
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@torch.no_grad()
def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(device, hf_pair):
    """Tolerance: astrai in bf16 is no further from the fp32 logits than transformers in bf16
    is, times 1.5 (both round every product's inputs to 8 bits of mantissa; the order of
    their sums differs), and its next-token choices agree with fp32's on at least 90% of positions."""
    reference, ours = hf_pair
    ids = _ids((2, 64))
    exact = reference(ids).logits
    ref16 = copy.deepcopy(reference).to(device, torch.bfloat16)(ids.to(device)).logits.float().cpu()
    ours16 = copy.deepcopy(ours).to(device, torch.bfloat16)(ids.to(device))["logits"].float().cpu()
    err_ref, err_ours = (ref16 - exact).abs().max(), (ours16 - exact).abs().max()
    assert 0 < err_ours <= 1.5 * err_ref, (err_ours, err_ref)
    assert (ours16.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation on the model's device."""
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=device))["logits"][0, -1].argmax()))
    return ids[len(prompt):]


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["tiny", "tiny-mla", "tiny-moe"])
def test_engine_greedy_equals_full_recomputation(device, kind):
    """Requests joining while others decode, two of them sharing a prefix, each equal to the
    plain model's recomputation; afterwards every page is free again."""
    model = make_model(kind).to(device)
    shared = _prompts(3, [24])[0]
    prompts = _prompts(1, [5, 13, 1, 21]) + [shared + [7, 8], shared + [9]]
    n_out = [12, 7, 10, 9, 8, 8]
    expected = [_greedy(model, p, n) for p, n in zip(prompts, n_out)]
    with InferenceEngine(model, None, max_batch_size=4, page_size=4, num_pages=96, prefill_chunk_size=8) as engine:
        cache = engine.scheduler.page_cache
        assert cache.storage.k_cache.device.type == device.type
        first = engine.submit(prompts[0], SamplingParams(max_tokens=n_out[0], **GREEDY))
        events = iter(first)
        head = [next(events) for _ in range(3)]
        handles = [engine.submit(p, SamplingParams(max_tokens=n, **GREEDY)) for p, n in zip(prompts[1:], n_out[1:])]
        got = [[t for ev in head + list(events) for t in ev.token_ids]] + [h.result(timeout=120).token_ids
                                                                           for h in handles]
        stats, pages = engine.get_stats(), cache.stats()
    assert pages["pages_used"] == 0 and pages["pages_free"] + pages["pages_cached"] == pages["pages_total"], pages
    assert got == expected
    assert sum(stats["decode_paths"].values()) > 0


def _decode(model, prompt, kv_cache_dtype: str, steps: int = 8):
    params = SamplingParams(max_tokens=steps, logprobs=True, top_logprobs=5, **GREEDY)
    with InferenceEngine(model, None, max_batch_size=2, page_size=16, kv_cache_dtype=kv_cache_dtype) as engine:
        assert engine.scheduler.page_cache.storage.k_cache.dtype == getattr(torch, kv_cache_dtype)
        result = engine.submit(prompt, params).result(timeout=120)
    return result.token_ids, torch.tensor([[lp for _, _, lp in entry.top] for entry in result.logprobs])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_stays_close_to_the_fp32_cache(device, kv_cache_dtype):
    """Tolerance: every step's five largest log-probabilities within 0.01 of the fp32 cache's
    for bf16 and 1e-3 for fp16, after a 600-token prompt; the same tokens."""
    model = make_model("tiny", max_len=1024).to(device)
    prompt = _prompts(4, [600])[0]
    tokens32, tops32 = _decode(model, prompt, "float32")
    tokens16, tops16 = _decode(model, prompt, kv_cache_dtype)
    assert tokens16 == tokens32 == _greedy(model, prompt, 8)
    error = (tops16 - tops32).abs().max()
    assert 0 < error < (0.01 if kv_cache_dtype == "bfloat16" else 1e-3)


@pytest.mark.timeout(180)
def test_bf16_weights_decode_like_their_own_recomputation(device):
    """bf16 weights and a bf16 cache: the engine's first tokens are the bf16 model's own greedy
    recomputation (paged attention rounds differently from one full pass, so later tokens may
    part at a near-tie), and its log-probabilities stay within 0.1 of the fp32 model's."""
    model = make_model("tiny", max_len=512).to(device)
    prompt = _prompts(5, [200])[0]
    tokens32, tops32 = _decode(model, prompt, "float32", steps=4)
    half = copy.deepcopy(model).to(torch.bfloat16)
    tokens16, tops16 = _decode(half, prompt, "bfloat16", steps=4)
    assert tokens16 == _greedy(half, prompt, 4)
    assert tokens16 == tokens32
    assert (tops16 - tops32).abs().max() < 0.1


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_layers_compute_on_the_device_as_on_the_cpu(device, fmt):
    """int8/int4 blocks moved to the device keep their format and give the CPU's logits; the
    engine over them gives their recomputation's tokens."""
    model = quantize_model(make_model("tiny"), fmt)
    ids = _ids((1, 40), vocab=256)
    expected = model(ids)["logits"]
    moved = copy.deepcopy(model).to(device)
    layer = moved.layers[0].attention.q_proj
    assert layer.qweight.device.type == device.type and layer.qweight.dtype in (torch.int8, torch.uint8)
    torch.testing.assert_close(moved(ids.to(device))["logits"].cpu(), expected, rtol=0, atol=1e-4)
    prompt = ids[0].tolist()
    with InferenceEngine(moved, None, max_batch_size=2, page_size=8) as engine:
        got = engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY)).result(timeout=120).token_ids
    assert got == _greedy(moved, prompt, 6)


def _train(tmp_path, device, name, **overrides):
    cfg = config(tmp_path / name, device=str(device), save_final_model=False, **overrides)
    return Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows(n=8)).train()


@pytest.mark.timeout(240)
def test_bf16_autocast_training_learns_with_fp32_master_weights(device, tmp_path):
    context = _train(tmp_path, device, "bf16", precision="bf16", max_steps=80, n_epoch=100)
    model = context.model
    assert next(model.parameters()).device.type == device.type
    assert all(p.dtype == torch.float32 for p in model.parameters())
    first = _train(tmp_path, device, "bf16-first", precision="bf16", max_steps=1).loss
    assert context.loss < 0.5 * first, (first, context.loss)


class FirstStep(TrainCallback):
    """The first step's loss and gradients (by plain parameter names), before the optimizer uses them."""

    def __init__(self):
        self.loss, self.grads = None, None

    def on_optimizer_step(self, context):
        if self.grads is None:
            self.loss = context.loss
            self.compiled = isinstance(context.model, torch._dynamo.eval_frame.OptimizedModule)
            self.grads = {k.replace("_orig_mod.", ""): p.grad.detach().cpu().clone()
                          for k, p in context.model.named_parameters()}


@pytest.mark.timeout(300)
def test_compile_with_gradient_checkpointing_trains_as_eager(device, tmp_path):
    """The first step's loss within 1e-5 and every gradient within 1e-4 (relative, 1e-6 absolute)
    of eager's. (Later steps are not compared: Adam turns the rounding of a near-zero gradient
    into a whole step of its sign.)"""
    steps = {}
    for name, extra in (("eager", {}), ("compiled", dict(compile=True, gradient_checkpointing=True))):
        steps[name] = FirstStep()
        cfg = config(tmp_path / name, device=str(device), save_final_model=False, precision="fp32", max_steps=2, **extra)
        Trainer(cfg, model=tiny_model(), train_dataset=TokenWindows(n=8), callbacks=[steps[name]]).train()
    eager, compiled = steps["eager"], steps["compiled"]
    assert compiled.compiled and not eager.compiled
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-5)
    assert set(compiled.grads) == set(eager.grads)
    apart = {name: f"max difference {(compiled.grads[name] - grad).abs().max():.3g} of max {grad.abs().max():.3g}"
             for name, grad in eager.grads.items()
             if not torch.allclose(compiled.grads[name], grad, rtol=1e-4, atol=1e-6)}
    assert not apart, apart


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_training_in_a_process_group_uses_the_devices_backend(device, tmp_path, mode):
    """One rank in a group made as ``torchrun`` makes it (NCCL for CUDA tensors and gloo for
    the host's on a GPU, gloo on the CPU) trains as a plain process does."""
    plain = _train(tmp_path, device, "plain", precision="fp32", max_steps=3)
    setup_parallel(0, 1, "auto", "127.0.0.1", free_port(), device_type=device.type)
    try:
        import torch.distributed as dist

        expected = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        assert dist.get_backend() == expected
        grouped = _train(tmp_path, device, mode, precision="fp32", max_steps=3, parallel_mode=mode)
    finally:
        cleanup_parallel()
    assert grouped.loss == pytest.approx(plain.loss, rel=1e-5)
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), grouped.model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(240)
def test_the_server_answers_from_an_engine_on_the_device(device, tokenizer, tmp_path):
    import openai
    from server_helpers import live_server

    from astrai.config import preset
    from astrai.serving import create_app

    torch.manual_seed(0)
    AutoModel.from_config(preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2, dim=64, n_heads=4,
                                 n_kv_heads=2, dim_ffn=128, max_len=512)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with InferenceEngine.from_pretrained(str(tmp_path), device=device, max_batch_size=4, max_seq_len=512) as engine:
        assert next(engine.model.parameters()).device.type == device.type
        messages = [{"role": "user", "content": "Tell me a story 讲个故事"}]
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
        expected = engine.submit(ids, SamplingParams(max_tokens=10, temperature=0)).result(timeout=60)
        with live_server(create_app(engine, model_name="tiny-device")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            reply = client.chat.completions.create(model="tiny-device", messages=messages, max_tokens=10,
                                                   temperature=0)
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                model="tiny-device", messages=messages, max_tokens=10, temperature=0, stream=True) if chunk.choices)
    assert reply.choices[0].message.content == expected.text == streamed
    assert reply.usage.completion_tokens == len(expected.token_ids)
