"""Task: one request's state inside the scheduler, and the TaskManager queues.

A task's context is prompt + output so far; ``num_computed`` counts how many of
those tokens are in the KV cache. Whatever is not yet computed is fed in the next
step - a chunk of prompt (prefill), the last sampled token (decode), or after
preemption the whole context again - so prefill, decode and recomputation are one
code path. Turning a sampled token into text, checking stop conditions and building
the StreamEvent also happen here.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Callable, Optional

import torch

from astrai.inference.constraints import TokenConstraint
from astrai.inference.stop import StopChecker
from astrai.inference.types import SamplingParams, StreamEvent, TokenLogprob


class TaskStatus(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class Task:
    def __init__(self, task_id: str, prompt_ids: list[int], params: SamplingParams,
                 stream_callback: Optional[Callable[[StreamEvent], None]] = None, tokenizer=None,
                 generator: Optional[torch.Generator] = None, constraint: Optional[TokenConstraint] = None):
        self.task_id = task_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stream_callback = stream_callback
        self.generator = generator
        self.constraint = constraint
        self.status = TaskStatus.PENDING
        self.context: list[int] = list(prompt_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.num_computed = 0
        self.cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.finish_reason: Optional[str] = None
        self.matched_stop: Optional[str] = None
        self.preemptions = 0
        self.error: Optional[str] = None
        self._tokenizer = tokenizer
        self._decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self._stopper = StopChecker(params.stop)

    # --- the spec's fields ----------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def top_p(self) -> float:
        return self.params.top_p

    @property
    def top_k(self) -> int:
        return self.params.top_k

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def next_pos(self) -> int:
        return self.num_computed

    @property
    def remaining(self) -> int:
        """Context tokens not yet in the cache (1 while decoding)."""
        return len(self.context) - self.num_computed

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def done(self) -> bool:
        return self.status in (TaskStatus.FINISHED, TaskStatus.ABORTED)

    def is_finished(self, stop_ids) -> bool:
        if self.done:
            return True
        return bool(self.output_ids) and self.output_ids[-1] in stop_ids

    # --- output ---------------------------------------------------------------
    def accept(self, token_id: int, logprob: Optional[TokenLogprob], stop_ids: frozenset[int],
               max_seq_len: int) -> StreamEvent:
        """Append a sampled token, update text and finish state, and return its event."""
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_ids.append(token_id)
        self.context.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        p = self.params
        text, reason = "", None
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in stop_ids):
            reason = "stop"
        elif self.constraint is not None and (broken := self.constraint.consume(token_id)) is not None:
            self.error, reason = f"constrained decoding: {broken}", "abort"
        else:
            if self._decoder is not None:
                text = self._stopper.push(self._decoder.push(token_id))
                self.matched_stop = self._stopper.matched
                if self.matched_stop is not None:
                    reason = "stop"
            if reason is None and self.constraint is not None and self.constraint.finished:
                reason = "stop"  # the language allows nothing more
            if reason is None and (len(self.output_ids) >= p.max_tokens or len(self.context) >= max_seq_len):
                reason = "length"
        if reason is not None:
            if self.matched_stop is None and self._decoder is not None:
                text += self._stopper.push(self._decoder.flush()) + self._stopper.flush()
                self.matched_stop = self._stopper.matched
            self.finish(reason)
        self.text += text
        return StreamEvent(text=text, token_ids=[token_id], logprobs=[logprob] if logprob is not None else [],
                           finished=reason is not None, finish_reason=reason, matched_stop=self.matched_stop,
                           prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids),
                           error=self.error)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.status = TaskStatus.ABORTED if reason == "abort" else TaskStatus.FINISHED
        self.finish_time = time.monotonic()

    def final_event(self) -> StreamEvent:
        """The whole result as one event (what ``RequestHandle.result`` returns)."""
        return StreamEvent(text=self.text, token_ids=list(self.output_ids), logprobs=list(self.logprobs),
                           finished=self.done, finish_reason=self.finish_reason, matched_stop=self.matched_stop,
                           prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.output_ids),
                           error=self.error)

    def emit(self, event: StreamEvent) -> None:
        if self.stream_callback is not None:
            self.stream_callback(event)


class TaskManager:
    """Waiting queue (FIFO, preempted tasks go back to the front) and the running list."""

    def __init__(self):
        self.waiting: deque[Task] = deque()
        self.running: list[Task] = []
        self.tasks: dict[str, Task] = {}

    def add(self, task: Task) -> None:
        self.tasks[task.task_id] = task
        self.waiting.append(task)

    def requeue_front(self, task: Task) -> None:
        task.status = TaskStatus.PENDING
        self.running.remove(task)
        self.waiting.appendleft(task)

    def start(self, task: Task) -> None:
        self.waiting.remove(task)
        task.status = TaskStatus.RUNNING
        self.running.append(task)

    def drop(self, task: Task) -> None:
        """Forget a finished or aborted task."""
        self.tasks.pop(task.task_id, None)
        if task in self.running:
            self.running.remove(task)
        else:
            try:
                self.waiting.remove(task)
            except ValueError:
                pass

    def get(self, task_id: str) -> Optional[Task]:
        return self.tasks.get(task_id)
