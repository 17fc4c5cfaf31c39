"""A model holding int8/int4 blocks (``astrai model quantize``, an imported GGUF) is refused
before the first step, for full training and for LoRA alike, with one message saying what to
train instead: its packed weights take no gradient, int4's activation rounding passes none to
earlier layers, and such a run used to go through all its steps and then fail at the save."""

import pytest
from trainer_helpers import TokenWindows, config, tiny_model

from astrai.alignment.run import prepare_model
from astrai.errors import ConfigError
from astrai.model.quantized import quantize_model
from astrai.trainer import Trainer

REFUSAL = r"the model holds \d+ quantized linear layers \(int\d.*astrai trains float weights only \(LoRA too\)"


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-asym"])
def test_training_a_quantized_model_object_stops_before_the_first_step(fmt, tmp_path):
    model = quantize_model(tiny_model(), fmt)
    with pytest.raises(ConfigError, match=REFUSAL):
        Trainer(config(tmp_path, max_steps=2), model=model, train_dataset=TokenWindows()).train()
    assert not (tmp_path / "ckpt").exists()  # no step ran, nothing was logged or saved


@pytest.fixture
def quantized_dir(tmp_path):
    path = tmp_path / "q4"
    quantize_model(tiny_model(), "int4").save_pretrained(path)
    return path


def test_param_path_to_a_quantized_directory_is_refused(quantized_dir, tmp_path):
    run = config(tmp_path, max_steps=2, param_path=str(quantized_dir))
    with pytest.raises(ConfigError, match=REFUSAL):
        Trainer(run, train_dataset=TokenWindows()).train()


def test_lora_over_a_quantized_base_is_refused_before_the_adapters_are_injected(quantized_dir, tmp_path):
    run = config(tmp_path, max_steps=2, param_path=str(quantized_dir),
                 strategy_kwargs={"lora": {"rank": 2, "targets": ["q_proj", "v_proj"]}})
    with pytest.raises(ConfigError, match=REFUSAL):
        prepare_model(run)
