"""A bug or an out-of-memory error inside the engine's loop ends the requests it touched, with
the error, and the engine serves the next ones: the scheduler thread never dies and leaves
requests waiting forever."""

from __future__ import annotations

import pytest

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.task import Task
from inference_helpers import greedy_reference, make_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [1, 2, 3]


def assert_first_request_ends_with(engine, model, message: str) -> None:
    """The first request ends with ``message`` as its error, the next decodes as usual, no page is left."""
    first = engine.submit(PROMPT, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=20)
    assert first.finish_reason == "abort" and message in (first.error or "")
    second = engine.submit(PROMPT, SamplingParams(max_tokens=8, **GREEDY)).result(timeout=20)
    assert second.token_ids == greedy_reference(model, PROMPT, 8)
    assert engine.get_stats()["pages_used"] == 0


@pytest.mark.timeout(60)
def test_an_error_while_planning_a_step_ends_the_requests_and_the_engine_serves_on(monkeypatch):
    model = make_model("tiny", seed=5)
    with InferenceEngine(model, None, max_batch_size=2, page_size=4, num_pages=64) as engine:
        scheduler = engine.scheduler
        plan = scheduler._plan_step
        failures = iter([RuntimeError("planning bug")])

        def plan_once_failing():
            error = next(failures, None)
            if error is not None:
                raise error
            return plan()

        monkeypatch.setattr(scheduler, "_plan_step", plan_once_failing)
        assert_first_request_ends_with(engine, model, "planning bug")


@pytest.mark.timeout(60)
def test_an_error_while_handing_out_a_steps_tokens_ends_its_requests_and_the_engine_serves_on(monkeypatch):
    model = make_model("tiny", seed=5)
    real_accept = Task.accept
    calls = []

    def accept_failing_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stop-string bug")
        return real_accept(self, *args, **kwargs)

    with InferenceEngine(model, None, max_batch_size=2, page_size=4, num_pages=64) as engine:
        monkeypatch.setattr(Task, "accept", accept_failing_third)
        assert_first_request_ends_with(engine, model, "stop-string bug")
