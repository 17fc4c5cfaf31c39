"""Fixtures for the server tests: a tiny random-weight model, the real engine around it,
and a live server (shared by the session) that the protocol tests talk to."""

from __future__ import annotations

import os

import pytest
from server_helpers import MODEL_NAME, live_server

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A random-weight 2-layer model saved with the session tokenizer (one directory)."""
    import torch

    from astrai.config import preset
    from astrai.model import AutoModel

    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=tokenizer.vocab_size, n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                 dim_ffn=128, max_len=2048)
    model = AutoModel.from_config(cfg)
    path = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from astrai.inference import InferenceEngine

    engine = InferenceEngine.from_pretrained(str(tiny_model_dir), max_batch_size=32, max_seq_len=2048,
                                             page_size=16, max_queue=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server_url(tiny_engine):
    """A live server around the real engine with the tiny model (shared by the session)."""
    from astrai.serving import create_app

    with live_server(create_app(tiny_engine, model_name=MODEL_NAME, max_body_bytes=64 * 1024)) as url:
        yield url
