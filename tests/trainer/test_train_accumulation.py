"""Gradient accumulation is exactly the larger batch: 4 micro-batches of 2 == one batch of 8 (on the
CPU, whose sums repeat; on a GPU, Adam turns the rounding of near-zero gradients into whole steps)."""

import pytest
import torch
from trainer_helpers import TokenWindows, config, tiny_model

from astrai.trainer import TrainCallback, Trainer


class GradCapture(TrainCallback):
    def __init__(self):
        self.grads = None
        self.losses = []
        self.micro_losses = []

    def on_batch_end(self, context):
        self.micro_losses.append(context.micro_loss)

    def on_optimizer_step(self, context):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in context.model.named_parameters()}
        self.losses.append(context.loss)


def first_step_grads(tmp_path, train_type, batch, accum):
    capture = GradCapture()
    cfg = config(tmp_path / f"{batch}x{accum}", train_type=train_type, batch_per_device=batch, grad_accum_steps=accum,
                 max_steps=2, max_grad_norm=0.0, save_final_model=False, device="cpu")
    Trainer(cfg, callbacks=[capture], model=tiny_model(), train_dataset=TokenWindows(n=32, sft=train_type == "sft")).train()
    return capture


@pytest.mark.parametrize("train_type", ["seq", "sft"])
def test_accumulated_gradients_equal_big_batch(tmp_path, train_type):
    small = first_step_grads(tmp_path, train_type, batch=2, accum=4)
    big = first_step_grads(tmp_path, train_type, batch=8, accum=1)
    assert small.losses == pytest.approx(big.losses, rel=1e-5)
    for name, grad in big.grads.items():
        torch.testing.assert_close(small.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_step_loss_is_the_mean_of_its_micro_batch_losses(tmp_path):
    """seq: every micro-batch has the same number of loss tokens, so their plain mean is the step's."""
    capture = first_step_grads(tmp_path, "seq", batch=2, accum=4)
    assert len(capture.micro_losses) == 8 and all(isinstance(v, float) for v in capture.micro_losses)
    for step, loss in enumerate(capture.losses):
        assert loss == pytest.approx(sum(capture.micro_losses[4 * step:4 * step + 4]) / 4, rel=1e-6)
