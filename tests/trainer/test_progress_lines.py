"""Training progress off a terminal: plain lines at an interval and at the last step, no bar frames."""

import io
from types import SimpleNamespace

from astrai.trainer.callbacks.logging import ProgressBarCallback


def test_a_log_gets_a_line_per_interval_and_the_last_step():
    now = [0.0]
    stream = io.StringIO()  # not a terminal
    callback = ProgressBarCallback(stream=stream, line_seconds=30.0, clock=lambda: now[0])
    context = SimpleNamespace(is_main=True, step=0, total_steps=10, loss=2.0, lr=1e-3, metrics={"tokens_per_s": 500.0})
    callback.on_train_begin(context)
    for step in range(1, 11):
        now[0] += 7.0  # a step every 7 s: lines at 35 s and 70 s (steps 5 and 10)
        context.step = step
        callback.on_step_end(context)
    callback.on_train_end(context)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and callback.bar is None
    assert [line.split()[2] for line in lines] == ["5/10", "10/10"]
    assert lines[-1] == "train: step 10/10  loss 2.0000  lr 1.00e-03  500 tokens/s"


def test_disabled_writes_nothing():
    stream = io.StringIO()
    callback = ProgressBarCallback(enabled=False, stream=stream)
    context = SimpleNamespace(is_main=True, step=1, total_steps=1, loss=1.0, lr=1e-3, metrics={})
    callback.on_train_begin(context)
    callback.on_step_end(context)
    assert stream.getvalue() == ""
