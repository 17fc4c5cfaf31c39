"""LoraSaveCallback: at the end of a LoRA run, write the adapters and a merged model directory.

The adapters alone (``<ckpt_dir>/adapter``: adapter_model.safetensors +
adapter_config.json) are what LoRA training produces; ``<ckpt_dir>/final`` holds
base + adapters merged into plain weights, so ``astrai generate``/``serve`` and the
next stage open it like any model. The training model keeps its adapters.
"""

from __future__ import annotations

import copy
from pathlib import Path

from astrai.model.lora import merge_lora, save_adapter
from astrai.parallel import unwrap_model
from astrai.trainer.callbacks.base import TrainCallback


class LoraSaveCallback(TrainCallback):
    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = Path(ckpt_dir)

    def on_train_end(self, context) -> None:
        if context.stop_requested or not context.is_main:
            return
        model = unwrap_model(context.model)
        save_adapter(model, self.ckpt_dir / "adapter")
        merged = merge_lora(copy.deepcopy(model))
        merged.save_pretrained(self.ckpt_dir / "final")
        if context.tokenizer is not None:
            context.tokenizer.save_pretrained(self.ckpt_dir / "final")
