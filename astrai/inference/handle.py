"""RequestHandle: the caller's end of one request.

The scheduler thread pushes StreamEvents; the caller iterates them synchronously
(``for ev in handle``), asynchronously (``async for ev in handle.aiter()``), or waits
for the aggregate with ``result()``. Events go to exactly one consumer: once
``aiter()`` starts, pending and future events are delivered on its event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Optional

from astrai.inference.types import StreamEvent

if TYPE_CHECKING:
    from astrai.inference.task import Task


class RequestHandle:
    def __init__(self, request_id: str, prompt_tokens: int, abort_fn):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._abort_fn = abort_fn
        self._queue: "queue.Queue[StreamEvent]" = queue.Queue()
        self._lock = threading.Lock()
        self._async: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = None
        self._done = threading.Event()
        self._task: Optional["Task"] = None
        self._consumed_final = False

    def _bind(self, task: "Task") -> None:
        self._task = task

    def _push(self, event: StreamEvent) -> None:
        """Called by the scheduler thread for every event of this request."""
        with self._lock:
            if self._async is not None:
                loop, aqueue = self._async
                try:
                    loop.call_soon_threadsafe(aqueue.put_nowait, event)
                except RuntimeError:  # the consumer's loop is closed; nobody is listening
                    pass
            else:
                self._queue.put(event)
        if event.finished:
            self._done.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def time_to_first_token(self) -> Optional[float]:
        """Seconds from submission to the moment the first token was sampled (None until then).

        Taken on the scheduler thread, so it does not depend on when the caller gets
        around to reading the event (a loop reading requests one after another would
        otherwise see later requests' first tokens only once the earlier ones end).
        """
        task = self._task
        if task is None or task.first_token_time is None:
            return None
        return task.first_token_time - task.arrival_time

    @property
    def duration(self) -> Optional[float]:
        """Seconds from submission to the request's end (None until it ends), taken on the scheduler thread."""
        task = self._task
        if task is None or task.finish_time is None:
            return None
        return task.finish_time - task.arrival_time

    def __iter__(self) -> Iterator[StreamEvent]:
        while not self._consumed_final:
            event = self._queue.get()
            if event.finished:
                self._consumed_final = True
            yield event

    async def aiter(self) -> AsyncIterator[StreamEvent]:
        loop = asyncio.get_running_loop()
        aqueue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            while not self._queue.empty():
                aqueue.put_nowait(self._queue.get_nowait())
            self._async = (loop, aqueue)
        try:
            while not self._consumed_final:
                event = await aqueue.get()
                if event.finished:
                    self._consumed_final = True
                yield event
        finally:
            if not self._consumed_final:
                self.abort()

    def abort(self) -> None:
        """Stop generating; the request's pages are released at once."""
        if not self._done.is_set():
            self._abort_fn(self.request_id)

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> StreamEvent:
        """Block until the request ends; the whole output as one event."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._task.final_event()
