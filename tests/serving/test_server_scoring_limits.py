"""Prompt scoring (``echo`` + ``logprobs``) holds to the limits generation holds to: the prompt
limits before any forward runs, the model's ``max_len``, ``--max-queue``; and it never
materialises more than a chunk of [positions, vocabulary] logits, on one worker thread that
frees its scratch memory afterwards."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from server_helpers import MODEL_NAME, live_server
from starlette.testclient import TestClient

from astrai.backends.cpu import dense_matmul, serving
from astrai.config import preset
from astrai.inference import InferenceEngine
from astrai.inference.engine import load_model
from astrai.serving import create_app
from astrai.serving.errors import APIError
from astrai.serving.scoring import PromptScorer, score_prompt
from astrai.model import AutoModel

LONG = list(range(5, 45))  # 40 token ids


@pytest.fixture(scope="module")
def limited_engine(tiny_model_dir):
    engine = InferenceEngine.from_pretrained(str(tiny_model_dir), max_prompt_len=16, max_seq_len=64, page_size=16,
                                             max_queue=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    return AutoModel.from_pretrained(tiny_model_dir).eval()


def client_for(engine) -> TestClient:
    return TestClient(create_app(engine, model_name=MODEL_NAME), base_url="http://localhost")


def score(client, prompt, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "echo": True, "logprobs": 1,
                                                "max_tokens": 0, **fields})


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_scoring_refuses_a_prompt_over_max_prompt_len_before_any_forward(limited_engine, monkeypatch, max_tokens):
    forwards = []
    monkeypatch.setattr(limited_engine, "prompt_logits", lambda *args: forwards.append(args))
    with client_for(limited_engine) as client:
        resp = score(client, [[5, 6, 7], LONG], max_tokens=max_tokens)
    assert resp.status_code == 400, resp.text
    assert "max_prompt_len=16" in resp.json()["error"]["message"]
    assert forwards == []  # the short first prompt was not scored either


def test_a_generation_the_engine_refuses_is_never_scored(tiny_model_dir, monkeypatch):
    """The KV cache (one page of 16 tokens) cannot hold 3 + 30 tokens: the engine refuses at
    submission, which comes before the prompt's scoring forward."""
    with InferenceEngine.from_pretrained(str(tiny_model_dir), max_seq_len=64, page_size=16, num_pages=1) as engine:
        forwards = []
        monkeypatch.setattr(engine, "prompt_logits", lambda *args: forwards.append(args))
        with client_for(engine) as client:
            resp = score(client, [5, 6, 7], max_tokens=30)
    assert resp.status_code == 400 and "KV pages" in resp.json()["error"]["message"], resp.text
    assert forwards == []


def test_scoring_refuses_a_prompt_longer_than_the_model_reads(tiny_model_dir, tokenizer, tmp_path):
    """``--max-seq-len`` may pass the model's ``max_len``; its plain forward may not."""
    cfg = preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=1, dim=32, n_heads=2, n_kv_heads=1, dim_ffn=64,
                 max_len=32)
    AutoModel.from_config(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with InferenceEngine.from_pretrained(str(tmp_path), max_seq_len=64, page_size=16) as engine:
        with client_for(engine) as client:
            resp = score(client, LONG)
            assert resp.status_code == 400 and "max_len 32" in resp.json()["error"]["message"], resp.text
            assert score(client, LONG[:32]).status_code == 200


def test_prompt_logits_come_a_chunk_of_positions_at_a_time(tiny_engine, plain_model):
    ids = list(range(3, 103))
    chunks, head_rows = [], []
    hook = tiny_engine.model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[-2]))
    try:
        tiny_engine.prompt_logits(ids, lambda first, logits: chunks.append((first, logits.clone())), 16)
    finally:
        hook.remove()
    assert [first for first, _ in chunks] == list(range(0, 100, 16)) and max(head_rows) == 16
    with torch.no_grad():
        expected = plain_model(torch.tensor([ids]))["logits"][0]
    assert torch.allclose(torch.cat([logits for _, logits in chunks]), expected, atol=1e-4)


def test_scores_from_many_chunks_equal_the_plain_forward(tiny_engine, plain_model):
    ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    entries = score_prompt(tiny_engine, ids, n_top=2, positions=7)
    with torch.no_grad():
        logprobs = plain_model(torch.tensor([ids]))["logits"][0, :-1].log_softmax(-1)
    assert [e.token_id for e in entries] == ids[1:]
    expected = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), expected, atol=1e-4)
    assert [[t for t, _, _ in e.top] for e in entries] == logprobs.topk(2, dim=-1).indices.tolist()


def test_scoring_frees_the_scratch_of_the_thread_that_ran_it(tiny_model_dir, monkeypatch):
    """A bf16 model's prompt matmuls widen weights into a per-thread slab (dense_matmul.py;
    on a CPU without AVX512-BF16, made so here); the thread that scored keeps none of it afterwards."""
    monkeypatch.setattr(serving, "bf16_matmul_available", lambda: False)
    model = load_model(tiny_model_dir, torch.bfloat16, "cpu")
    seen = {}
    with InferenceEngine(model, max_seq_len=64, page_size=16, in_place=True) as engine:
        def run():
            def consume(first, logits):
                seen.setdefault("during", getattr(dense_matmul._scratch, "buffer", None) is not None)
            engine.prompt_logits(list(range(5, 40)), consume, 8)
            seen["after"] = getattr(dense_matmul._scratch, "buffer", None) is not None

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    assert seen == {"during": dense_matmul.dense_matmul_available(), "after": False}


def test_scoring_runs_on_one_worker_thread(tiny_engine, monkeypatch):
    threads = []
    real = tiny_engine.prompt_logits

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(tiny_engine, "prompt_logits", spy)
    with client_for(tiny_engine) as client:
        for _ in range(2):
            assert score(client, [[5, 6, 7], [8, 9, 10, 11]]).status_code == 200
    assert len(threads) == 4 and len(set(threads)) == 1 and threads[0].startswith("astrai-scoring")


def test_scorer_admits_no_more_prompts_than_the_queue_holds(tiny_engine):
    scorer = PromptScorer(tiny_engine)
    scorer.admit(3, capacity=4)
    with pytest.raises(APIError) as refused:
        scorer.admit(2, capacity=4)
    assert refused.value.status == 503 and "3 prompts waiting" in refused.value.message
    scorer.waiting = 0
    assert len(asyncio.run(scorer.score_all([[5, 6, 7], [8, 9]], 1, capacity=2))[0]) == 2
    assert scorer.waiting == 0  # each prompt leaves the count once scored
    scorer.shutdown()


def test_a_scoring_request_past_max_queue_gets_503_while_others_are_scored(limited_engine, monkeypatch):
    """--max-queue is 4: one request's four prompts wait on the worker, the next request is refused."""
    release = threading.Event()
    real = limited_engine.prompt_logits

    def slow(*args):
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(limited_engine, "prompt_logits", slow)
    with live_server(create_app(limited_engine, model_name=MODEL_NAME)) as url:
        body = {"model": MODEL_NAME, "echo": True, "logprobs": 1, "max_tokens": 0}
        first = {}
        waiting = threading.Thread(target=lambda: first.update(resp=httpx.post(
            url + "/v1/completions", json={**body, "prompt": [[5, 6]] * 4}, timeout=60)))
        waiting.start()
        time.sleep(0.5)
        refused = httpx.post(url + "/v1/completions", json={**body, "prompt": [5, 6, 7]}, timeout=60)
        release.set()
        waiting.join()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert first["resp"].status_code == 200


def test_generation_taken_before_scoring_is_aborted_when_scoring_is_refused(tiny_engine, monkeypatch):
    async def refuse(self, prompts, n_top, capacity):
        raise APIError("overloaded", "scoring is full")

    monkeypatch.setattr(PromptScorer, "score_all", refuse)
    aborted = tiny_engine.get_stats()["requests_aborted"]
    with client_for(tiny_engine) as client:
        resp = score(client, [[5, 6, 7], [8, 9]], max_tokens=200, n=2, ignore_eos=True)
    assert resp.status_code == 503
    assert tiny_engine.get_stats()["requests_aborted"] == aborted + 4  # two prompts, two choices each


def test_more_prompts_to_score_than_the_queue_ever_holds_is_the_requests_fault(limited_engine):
    with client_for(limited_engine) as client:
        resp = score(client, [[5, 6]] * 5)  # --max-queue 4
    assert resp.status_code == 400 and "--max-queue" in resp.json()["error"]["message"], resp.text
