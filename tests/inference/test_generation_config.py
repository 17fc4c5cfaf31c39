"""generation_config.json read with Hugging Face's meaning: sampling only when do_sample is true."""

import json

from astrai.inference.engine import _read_generation_config


def write(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return _read_generation_config(tmp_path)


def test_missing_do_sample_decodes_greedily(tmp_path):
    params = write(tmp_path, {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 12})
    assert params.temperature == 0.0 and params.max_tokens == 12


def test_do_sample_false_decodes_greedily(tmp_path):
    assert write(tmp_path, {"do_sample": False, "temperature": 0.6}).temperature == 0.0


def test_do_sample_true_takes_the_sampling_fields(tmp_path):
    params = write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
