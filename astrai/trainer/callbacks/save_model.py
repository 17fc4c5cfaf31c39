"""SaveModelCallback: write the trained model as a loadable model directory at the end."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from astrai.parallel import unwrap_model
from astrai.parallel.wrap import full_model_state
from astrai.trainer.callbacks.base import CallbackFactory, TrainCallback


@CallbackFactory.register("save_model")
class SaveModelCallback(TrainCallback):
    """``<dir>/config.json + model.safetensors`` (+ the tokenizer), so ``astrai generate``
    and the next training stage can open the result directly. Skipped when interrupted."""

    def __init__(self, save_dir: str):
        self.save_dir = Path(save_dir)

    def on_train_end(self, context) -> None:
        if context.stop_requested:
            return
        state = full_model_state(context.model)
        if context.is_main:
            inner = unwrap_model(context.model)
            fresh = type(inner).from_config(inner.config)  # an AutoModel, or a model of its own kind (a draft head)
            fresh.load_state_dict(state)
            fresh.save_pretrained(self.save_dir)
            if context.tokenizer is not None:
                context.tokenizer.save_pretrained(self.save_dir)
        if dist.is_initialized():
            dist.barrier()
