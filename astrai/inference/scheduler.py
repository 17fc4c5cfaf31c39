"""InferenceScheduler: continuous batching on a background thread.

Every step the loop (1) admits waiting tasks in FIFO order while the batch has room
and pages are available, (2) picks either a prefill step (chunks of prompts still to
compute, at most ``prefill_chunk_size`` padded tokens per step) or a decode step (every task
with exactly one uncomputed token), (3) runs that step in one forward, and (4) turns
the sampled tokens into events, finishing and releasing tasks as they end. When both kinds
wait, a runner that mixes them (``mixes_decode``: the CPU runner, for GQA models) gets
prefill steps whose rows end with every decoding task, one token each, so prompts never
stall the running decodes and no decode step waits for a prompt chunk; other runners
alternate prefill and decode steps.

A lone greedy request, on a runner that takes runs of greedy steps, is given up to
``greedy_run_steps`` (default 8) tokens per step instead of one, each the argmax the last
one gave: the loop's bookkeeping then comes once per run instead of once per token. A run
also ends after the step that brings it to ``greedy_run_seconds`` (default 0.05), so a
streamed token, and a request arriving meanwhile, wait that long at most whatever the
model's size. Runs never pass max_tokens or the context limit, and the tokens after a stop
string are the only ones computed and thrown away.

With speculative decoding (``speculative``, astrai/inference/speculative.py) a decode step
whose tasks have drafted tokens becomes a verify step: each task feeds its last token and
its drafts, and keeps the tokens the acceptance rules give (1 to drafts + 1). A task that
may draft takes single steps rather than runs of greedy steps, so that no match is passed by;
but a lone greedy task whose drafts the runner can make itself (the CPU runner: a draft head it
fuses, prompt lookup) takes runs of verify steps, drafting between them in the runner
(``speculative_run``), up to ``greedy_run_steps`` x (draft_tokens + 1) tokens and
``greedy_run_seconds`` a run.

A task computes only the prompt tokens no running task has: its leading full pages come from
the prefix cache (waiting, if another task is still prefilling them), and the rest of what a
running task has computed of the same tokens (its last page, not yet full, which the prefix
cache does not share) is copied into the task's own page when it is admitted. So the samples of
one prompt (a GRPO group, ``n`` completions) compute it once.

When decoding needs a page and none is left, the newest running task is preempted:
its pages are released (full ones stay in the prefix cache) and it goes back to the
front of the queue to be recomputed from prompt + output later. Results are
unchanged by preemption; only time is lost. Bookkeeping happens under one lock; the
forward runs outside it so ``add_task``/``remove_task`` never wait for the model (drafts are
made while planning, under the lock: a draft model's or head's few milliseconds do delay them).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from typing import Callable, Iterable, Optional, Union

import torch

from astrai.backends import backend_for
from astrai.errors import OverloadedError, RequestError
from astrai.inference.cache import KVCache
from astrai.inference.cache.storage import kv_cache_dtype as kv_cache_dtype_named
from astrai.inference.constraints import ConstraintCompiler
from astrai.inference.executor import Executor
from astrai.inference.runner import ModelRunner
from astrai.inference.speculative import (DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SPECULATIVE_METHODS, Drafter,
                                          PromptLookup, SpeculationControl)
from astrai.inference.task import Task, TaskManager, TaskStatus
from astrai.inference.types import SamplingParams, StreamEvent
from astrai.inference.validation import check_fits, check_params, check_prompt

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 2 * 1024**3
RATE_WINDOW_S = 10.0
GREEDY_RUN_STEPS = 8  # default: decode steps a lone greedy request takes per loop step (see above)
GREEDY_RUN_SECONDS = 0.05  # default: a run ends after the step that brings it to this long (see above)
SPECULATIVE_RUN = "speculative run"  # _draft's answer for a lone greedy row whose drafts the runner makes itself


def default_num_pages(kv_bytes_per_token: int, max_batch_size: int, max_seq_len: int, page_size: int,
                      budget_bytes: int = DEFAULT_CACHE_BYTES) -> int:
    """Enough pages for a full batch of full-length sequences, capped by a memory budget
    (but always at least one full-length sequence)."""
    wanted = -(-max_batch_size * max_seq_len // page_size)
    affordable = budget_bytes // max(1, kv_bytes_per_token * page_size)
    return max(-(-max_seq_len // page_size), min(wanted, affordable))


def create_runner(model: torch.nn.Module, cache: KVCache, in_place: bool = False) -> ModelRunner:
    """The runner the backend of ``model``'s device registers (astrai/backends), else the
    device-neutral one."""
    runner = backend_for(next(model.parameters()).device).runner_class() or ModelRunner
    return runner(model, cache, in_place)


class InferenceScheduler:
    """Continuous batching over a model runner (see the module's docstring).

    ``kv_cache_dtype`` ("float32", "bfloat16" or "float16"; default the model's dtype) is the
    KV cache's: a 16-bit cache halves the bytes a decode step reads from a long context.
    ``in_place=True`` lets the runner prepare ``model`` itself for serving instead of a copy
    of it (astrai/inference/runner.py): for a caller that has no further use for the object.
    """

    def __init__(self, model, tokenizer=None, max_batch_size: int = 16, max_seq_len: Optional[int] = None,
                 max_prompt_len: Optional[int] = None, page_size: int = 16, num_pages: Optional[int] = None,
                 prefill_chunk_size: int = 512, max_queue: int = 256, prefix_cache: bool = True,
                 stop_ids: Optional[Iterable[int]] = None, greedy_run_steps: int = GREEDY_RUN_STEPS,
                 greedy_run_seconds: float = GREEDY_RUN_SECONDS, in_place: bool = False,
                 speculative: Optional[str] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 drafter: Optional[Drafter] = None,
                 kv_cache_dtype: Optional[str | torch.dtype] = None):
        for name, value in (("max_batch_size", max_batch_size), ("page_size", page_size),
                            ("prefill_chunk_size", prefill_chunk_size), ("max_queue", max_queue),
                            ("greedy_run_steps", greedy_run_steps)):
            if not isinstance(value, int) or value < 1:
                raise RequestError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(greedy_run_seconds, bool) or not isinstance(greedy_run_seconds, (int, float)) \
                or not greedy_run_seconds >= 0:
            raise RequestError(f"greedy_run_seconds must be a number of seconds >= 0 (inf: no limit), "
                               f"got {greedy_run_seconds!r}")
        self._drafter, self._speculation = _speculation(speculative, draft_tokens, drafter)
        # tokens a run of verify steps may give: as many steps as a greedy run's, each of up to k + 1
        self._speculative_run_steps = greedy_run_steps * (draft_tokens + 1)
        self._draft_seconds = 0.0  # the last planned step's drafting time, which its verify step is timed with
        self._catch_up_seconds = 0.0  # of that planning, the drafter's catch-up with new requests' prompts
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_batch_size = max_batch_size
        self.max_seq_len = int(max_seq_len or model.config.max_len)
        self.max_prompt_len = int(max_prompt_len or self.max_seq_len - 1)
        self.page_size = page_size
        self.prefill_chunk_size = prefill_chunk_size
        self.max_queue = max_queue
        self.greedy_run_steps = greedy_run_steps
        self.greedy_run_seconds = float(greedy_run_seconds)
        if stop_ids is None and tokenizer is not None:
            stop_ids = getattr(tokenizer, "stop_ids", None) or [tokenizer.eos_id]
        self.stop_ids = frozenset(int(i) for i in (stop_ids or ()) if i is not None)
        param = next(model.parameters())
        cache_dtype = kv_cache_dtype_named(kv_cache_dtype)
        if num_pages is None:
            probe = KVCache.for_model(model, num_pages=1, page_size=page_size, prefix_cache=False, dtype=cache_dtype)
            num_pages = default_num_pages(probe.storage.bytes_per_token(), max_batch_size, self.max_seq_len, page_size)
        self._page_cache = KVCache.for_model(model, num_pages=num_pages, page_size=page_size, prefix_cache=prefix_cache,
                                             dtype=cache_dtype)
        self._runner = create_runner(model, self._page_cache, in_place)
        prepare = getattr(self._drafter, "prepare", None)
        if prepare is not None:  # a draft head's matmuls take the runner's serving kernels
            prepare(self._runner)
        self.model = self._runner.model
        self._executor = Executor(self._runner, tokenizer)
        self._constraints = ConstraintCompiler(tokenizer, self.stop_ids)
        self._task_mgr = TaskManager()
        self._lock = threading.RLock()  # reentrant: a stream callback may abort its own task
        self._wake = threading.Condition(self._lock)
        self.model_lock = threading.Lock()
        self._running = False
        self._loop_thread: Optional[threading.Thread] = None
        self._last_was_prefill = False
        self._device = param.device
        self._stats = {"requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0, "cached_tokens": 0,
                       "preemptions": 0, "ttft_sum": 0.0, "ttft_count": 0, "output_tokens": 0}
        self._rate: deque[tuple[float, int]] = deque()
        # preparing the model ran parallel ops on this thread; its idle pool would throttle the
        # loop's (a server's loader thread lives on, and never submits, which releases it too)
        self._runner.release_idle()

    @property
    def page_cache(self) -> KVCache:
        return self._page_cache

    # --- public API ---------------------------------------------------------------
    def add_task(self, prompt_ids: list[int], params: Optional[SamplingParams] = None,
                 stream_callback: Optional[Callable[[StreamEvent], None]] = None, task_id: Optional[str] = None) -> str:
        """Validate and queue a request; returns its id. Events go to ``stream_callback``."""
        return self.submit_task(prompt_ids, params, stream_callback, task_id).task_id

    def submit_task(self, prompt_ids: list[int], params: Optional[SamplingParams] = None,
                    stream_callback: Optional[Callable[[StreamEvent], None]] = None,
                    task_id: Optional[str] = None) -> Task:
        """``add_task`` returning the Task itself (its final state outlives the scheduler's bookkeeping)."""
        params = params if params is not None else SamplingParams()
        check_params(params, self.vocab_size, self.tokenizer is not None)
        ids = self.check_prompt(prompt_ids)
        check_fits(len(ids), params, self.max_seq_len, self.page_size, self._page_cache.num_pages)
        constraint = self._constraints.compile(params)
        generator = None
        if params.temperature > 0 and params.seed is not None:  # reproducible whoever shares the batch
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        task = Task(task_id or uuid.uuid4().hex, ids, params, stream_callback, self.tokenizer, generator, constraint)
        self._runner.release_idle()  # the caller's idle compute threads would slow the loop's
        with self._lock:
            if not self._running:
                raise RequestError("the engine is not running (it was shut down or never started)")
            if len(self._task_mgr.waiting) >= self.max_queue:
                raise OverloadedError(f"the request queue is full ({self.max_queue} waiting); retry later")
            if task.task_id in self._task_mgr.tasks:
                raise RequestError(f"task id {task.task_id!r} is already in use")
            self._task_mgr.add(task)
            self._wake.notify()
        return task

    def remove_task(self, task_id: str) -> bool:
        """Abort a task: its pages are released now and it ends with finish_reason 'abort'."""
        with self._lock:
            task = self._task_mgr.get(task_id)
            if task is None or task.done:
                return False
            self._abort(task)
            return True

    def start(self) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
        self._loop_thread = threading.Thread(target=self._loop, name="astrai-scheduler", daemon=True)
        self._loop_thread.start()

    def stop(self) -> None:
        """Stop the loop; every unfinished task ends with 'abort' so no consumer waits forever."""
        with self._lock:
            self._running = False
            self._wake.notify_all()
        if self._loop_thread is not None and self._loop_thread is not threading.current_thread():
            self._loop_thread.join()
        with self._lock:
            for task in list(self._task_mgr.tasks.values()):
                if not task.done:
                    self._abort(task)

    @property
    def running(self) -> bool:
        return self._running

    def get_stats(self) -> dict:
        with self._lock:
            s = self._stats
            now = time.monotonic()
            while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
                self._rate.popleft()
            span = now - self._rate[0][0] if self._rate else 0.0
            produced = sum(n for _, n in self._rate)
            return {
                "queue_len": len(self._task_mgr.waiting),
                "running": len(self._task_mgr.running),
                **self._page_cache.stats(),
                "prefix_hit_rate": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
                "tokens_per_s": produced / span if span > 0 else 0.0,
                "ttft_avg_s": s["ttft_sum"] / s["ttft_count"] if s["ttft_count"] else 0.0,
                "requests_finished": s["requests_finished"],
                "requests_aborted": s["requests_aborted"],
                "preemptions": s["preemptions"],
                "output_tokens": s["output_tokens"],
                "decode_paths": self._runner.decode_path_counts(),
                "decode_attention": self._runner.decode_attention_counts(),
                "sample_paths": dict(self._executor.sample_paths),
                **({"speculative": self._speculation.stats()} if self._speculation is not None else {}),
            }

    def check_prompt(self, prompt_ids: list[int], scoring: bool = False) -> list[int]:
        """The prompt's ids after the checks a request's prompt gets (token ids in the vocabulary,
        ``max_prompt_len``, ``max_seq_len``); with ``scoring`` also the model's ``max_len``, past
        which its plain forward (``prompt_logits``) does not go. RequestError otherwise."""
        ids = check_prompt(prompt_ids, self.vocab_size, self.max_prompt_len, self.max_seq_len)
        limit = self.model.config.max_len
        if scoring and len(ids) > limit:
            raise RequestError(f"prompt has {len(ids)} tokens; scoring it takes at most the model's max_len {limit}")
        return ids

    def prompt_logits(self, prompt_ids: list[int], consume: Callable[[int, torch.Tensor], None],
                      positions: int) -> None:
        """The logits of every position of ``prompt_ids`` from the model's plain forward (no KV
        cache), between steps, given to ``consume(first, logits[first:first + positions])`` a chunk
        of ``positions`` at a time: only the hidden states [len, dim] are held whole, never the
        [len, vocab] logits. The calling thread's scratch memory is freed afterwards, since
        such a caller (a server's scoring worker) runs the model only now and then."""
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise RequestError(f"positions must be a positive integer, got {positions!r}")
        ids = torch.tensor([self.check_prompt(prompt_ids, scoring=True)], dtype=torch.long, device=self._device)
        try:
            with self.model_lock, torch.no_grad():
                hidden = self.model(ids, compute_logits=False)["hidden_states"]
                for first in range(0, ids.shape[1], positions):
                    consume(first, self.model.lm_head(hidden[:, first:first + positions])[0])
        finally:
            self._runner.release_idle()  # the caller's idle compute threads would slow the loop's
            self._runner.release_scratch()

    def load_weights(self, state: dict) -> None:
        """New weights for the served model, between steps; the prefix cache goes with the old ones."""
        with self.model_lock:
            self._runner.load_weights(state)
            self.clear_prefix_cache()

    def clear_prefix_cache(self) -> None:
        with self._lock:
            self._page_cache.clear_prefix()

    # --- the loop -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._running and not self._task_mgr.waiting and not self._task_mgr.running:
                    self._runner.release_idle()  # idle: let other threads' work run unthrottled
                while self._running and not self._task_mgr.waiting and not self._task_mgr.running:
                    self._wake.wait()
                if not self._running:
                    return
                try:
                    self._admit()
                    kind, batch, n_new, drafts = self._plan_step()
                except Exception as exc:  # a bug or out-of-memory must end the requests, not hang them
                    logger.exception("planning an inference step failed")
                    self._end_with_error([*self._task_mgr.running, *self._task_mgr.waiting], exc)
                    continue
            if batch:
                try:
                    self._run_step(kind, batch, n_new, drafts)
                except Exception as exc:  # the step, or handing out its tokens, failed: end its requests
                    logger.exception("inference step failed")
                    with self._lock:
                        self._end_with_error(batch, exc)

    def _end_with_error(self, tasks: list[Task], exc: Exception) -> None:
        """Abort each unfinished task of ``tasks`` with ``exc`` as its error (the lock held)."""
        for task in tasks:
            if not task.done:
                self._abort(task, error=f"{type(exc).__name__}: {exc}")

    def _observe_prompts(self, batch: list[Task], results: list[list]) -> None:
        """Hand a drafter that drafts from hidden states (a draft head) the state at the end of
        each prompt just prefilled, the one that chose the first token: the row's first verify
        step then drafts, where it would otherwise only fetch that state."""
        observe, hidden = getattr(self._drafter, "observe", None), self._runner.last_hidden
        if observe is None or hidden is None or len(hidden) != len(batch):
            return
        for task, sampled, state in zip(batch, results, hidden):
            if sampled and not task.done and self._executor.speculates(task):
                observe(task, state)

    def _runs_speculative(self, decode: list[Task]) -> bool:
        """Whether the decoding tasks are one greedy task whose verify steps the runner can run
        several to one call, drafting itself (a draft head it fuses, prompt lookup)."""
        run_drafter = getattr(self._drafter, "run_drafter", None)
        return (len(decode) == 1 and self.greedy_run_steps > 1 and self._runner.runs_speculative
                and self._executor.runs_greedy_steps(decode[0]) and run_drafter is not None
                and run_drafter(decode[0]) is not None)

    def _speculative_run(self, task: Task, steps: int):
        """A lone greedy task's verify steps, drafting in the runner, in one call (the model lock held)."""
        hidden = getattr(self._drafter, "hidden", None)
        return self._executor.execute_speculative_run(task, steps, self._run_stop_ids(task), self.greedy_run_seconds,
                                                      self._drafter.run_drafter(task),
                                                      hidden(task) if hidden is not None else None,
                                                      self._speculation.draft_row(task.task_id))

    def _run_stop_ids(self, task: Task) -> frozenset[int]:
        """The tokens after which a run of ``task``'s steps ends: the engine's stop tokens (unless
        it ignores them) and its own."""
        return (self.stop_ids if not task.params.ignore_eos else frozenset()).union(task.params.stop_token_ids)

    def _run_step(self, kind: str, batch: list[Task], n_new: list[int], drafts: Optional[list[list[int]]] = None) -> None:
        started = time.perf_counter()
        run = None
        with self.model_lock:
            if kind == "prefill":
                results = [[] if r is None else [r] for r in self._executor.execute_prefill(batch, n_new)]
            elif kind == "verify":
                results, last_hidden = self._executor.execute_verify(batch, drafts)
            elif kind == "speculate":
                run = self._speculative_run(batch[0], n_new[0])
                results = [[(token, None) for token in run.tokens]] if run is not None else \
                    [[r] for r in self._executor.execute_decode(batch)]
            elif kind == "greedy":
                results = [self._executor.execute_greedy_steps(batch[0], n_new[0], self._run_stop_ids(batch[0]),
                                                               self.greedy_run_seconds)]
            else:
                results = [[r] for r in self._executor.execute_decode(batch)]
        now = time.monotonic()
        with self._lock:
            produced = 0
            if kind == "prefill":
                self._observe_prompts(batch, results)
            elif kind == "speculate" and run is not None:
                if not batch[0].done:  # else aborted during the run: its records are gone and stay gone
                    self._speculation.ran(batch[0].task_id, time.perf_counter() - started, run.drafted,
                                          run.kept_drafts, len(run.tokens))
                    if run.hidden is not None:
                        self._drafter.observe(batch[0], run.hidden)
            elif self._speculation is not None:
                # a verify step without drafts (a draft head fetching its first hidden state) is
                # a plain step for the measure of what drafting gains, as is the plain step a
                # run of verify steps falls back to; one with drafts costs its drafting too (a
                # draft model's or head's steps, run while planning the step)
                timed_as = "decode" if kind == "speculate" or (kind == "verify" and not any(drafts)) else kind
                drafting = self._draft_seconds if timed_as == "verify" else 0.0
                self._speculation.timed(timed_as, len(batch), time.perf_counter() - started + drafting,
                                        sum(map(len, results)) / len(batch))
            if kind == "verify":
                self._speculation.verify_steps += 1
                observe = getattr(self._drafter, "observe", None)
                for task, draft, sampled, hidden in zip(batch, drafts, results, last_hidden):
                    if task.done:  # aborted while the step ran: its records are gone and stay gone
                        continue
                    self._speculation.record(task.task_id, len(draft), len(sampled) - 1, len(sampled))
                    if observe is not None:
                        observe(task, hidden)
            for task, sampled in zip(batch, results):
                if task.done:
                    continue
                event = None
                for token, logprob in sampled:
                    if event is not None:
                        task.emit(event)
                    event = task.accept(token, logprob, self.stop_ids, self.max_seq_len)
                    produced += 1
                    if len(task.output_ids) == 1:
                        self._stats["ttft_sum"] += task.first_token_time - task.arrival_time
                        self._stats["ttft_count"] += 1
                    if task.done:
                        break  # a stop string inside a run of greedy steps: the rest are dropped
                # the pages whose K/V are computed for tokens now in the context
                computed = min(task.num_computed, len(task.context))
                self._page_cache.task_record_hashes(task.task_id, task.context, computed)
                if task.done:
                    self._release(task)
                    self._stats["requests_finished"] += 1
                if event is not None:
                    task.emit(event)  # the last event after the pages are released
            self._stats["output_tokens"] += produced
            self._rate.append((now, produced))

    # --- admission, planning, preemption (called with the lock held) ----------------
    def _admit(self) -> None:
        mgr, cache = self._task_mgr, self._page_cache
        for task in list(itertools.islice(mgr.waiting, self.max_batch_size)):
            if len(mgr.running) >= self.max_batch_size:
                return
            if self._should_wait_for_shared_prefix(task):
                continue
            if not cache.task_alloc(task.task_id, task.context, reserve=len(mgr.running), donor=self._donor(task)):
                return
            task.num_computed = task.cached_tokens = cache.task_cached(task.task_id)
            if task.preemptions == 0:
                self._stats["prompt_tokens"] += len(task.context)
                self._stats["cached_tokens"] += task.cached_tokens
            mgr.start(task)

    def _sharers(self, task: Task):
        """``(other, shared)`` for each running task whose context starts with the same page as
        ``task``'s, ``shared`` being how many leading tokens the two have in common (at most all
        but ``task``'s last, whose logits it must compute itself)."""
        ps = self.page_size
        head = task.context[:ps]
        if len(head) < ps:
            return
        for other in self._task_mgr.running:
            if other.context[:ps] == head:
                yield other, common_prefix(task.context, other.context, len(task.context) - 1)

    def _should_wait_for_shared_prefix(self, task: Task) -> bool:
        """Hold a task whose leading full pages another running task is still prefilling, or
        whose whole prompt is another's (a group of samples of one prompt): waiting for them to
        be computed is cheaper than computing them twice."""
        if not self._page_cache.pool.prefix_enabled:
            return False
        ps = self.page_size
        for other, shared in self._sharers(task):
            if other.remaining > 1 and (shared // ps * ps > other.num_computed
                                        or shared == len(task.context) - 1 > other.num_computed):
                return True
        return False

    def _donor(self, task: Task) -> Optional[tuple[str, int]]:
        """The running task that has computed most of ``task``'s leading tokens, and how many
        (for ``KVCache.task_alloc`` to copy what the prefix cache does not share), or None."""
        if not self._page_cache.pool.prefix_enabled:
            return None
        best = None
        for other, shared in self._sharers(task):
            usable = min(shared, other.num_computed)
            if usable > (best[1] if best else 0):
                best = (other.task_id, usable)
        return best

    def _plan_step(self) -> tuple[str, list[Task], list[int], Optional[list[list[int]]]]:
        """The next step: its kind, tasks, tokens each feeds, and (a verify step) each one's drafts."""
        running = self._task_mgr.running
        prefill = [t for t in running if t.remaining > 1]
        if prefill and self._runner.mixes_decode:
            riders = self._reserve_decode_pages()  # may preempt: the prompts are listed after it
            prefill = [t for t in self._task_mgr.running if t.remaining > 1]
            if prefill:
                batch, n_new = self._plan_prefill(prefill, self.prefill_chunk_size - len(riders))
                return "prefill", batch + riders, n_new + [1] * len(riders), None
        if prefill and (self._last_was_prefill is False or all(t.remaining > 1 for t in running)):
            self._last_was_prefill = True
            return "prefill", *self._plan_prefill(prefill), None
        self._last_was_prefill = False
        decode = self._reserve_decode_pages()
        drafted_at = time.perf_counter()
        self._catch_up_seconds = 0.0
        drafting, drafts = self._draft(decode) if self._drafter is not None and decode else (False, None)
        self._draft_seconds = time.perf_counter() - drafted_at - self._catch_up_seconds
        if drafts is SPECULATIVE_RUN:  # a lone greedy row and a fused head: verify steps and drafts in one call
            return "speculate", decode, [self._greedy_run_steps(decode, longest=self._speculative_run_steps)], None
        if drafts is not None:
            return "verify", decode, [1 + len(d) for d in drafts], drafts
        # a row that may draft runs few greedy steps at a time: a run passes by the points where a
        # draft appears (prompt lookup's next match); more while none does (undrafted_steps)
        most = None  # no row drafts: as long a run as the request allows
        if drafting:
            most = self._speculation.undrafted_steps(decode[0].task_id) if len(decode) == 1 else 1
        steps = self._greedy_run_steps(decode, most)
        if steps > 1:
            return "greedy", decode, [steps], None
        return "decode", decode, [1] * len(decode), None

    def _draft(self, decode: list[Task]) -> tuple[bool, Union[list[list[int]], str, None]]:
        """Whether any decoding task wanted drafts this step, and each one's drafted tokens
        (astrai/inference/speculative.py) with pages reserved for checking them, or None when no
        task has any (a plain decode step then); SPECULATIVE_RUN for a lone greedy task whose
        drafts the runner makes itself between verify steps (``_runs_speculative``)."""
        if not self._speculation.batch_wanted(len(decode), [t.task_id for t in decode]):
            return False, None
        wanted = []
        for task in decode:
            room = min(task.params.max_tokens - len(task.output_ids), self.max_seq_len - len(task.context)) - 1
            wanted.append(self._speculation.wanted(task, room) if self._executor.speculates(task) else 0)
        if not any(wanted):
            return False, None
        if self._runs_speculative(decode):
            return True, SPECULATIVE_RUN
        try:
            catch_up = getattr(self._drafter, "catch_up", None)
            if catch_up is not None:  # once per request: not part of what a step's drafting costs
                started = time.perf_counter()
                catch_up([task for task, w in zip(decode, wanted) if w])
                self._catch_up_seconds = time.perf_counter() - started
            drafts = self._drafter.propose(decode, wanted)
        except Exception as exc:  # drafting only saves time: a drafter that fails is dropped, decoding goes on
            logger.exception("drafting failed; decoding continues without speculation")
            self._drafter = None
            self._speculation.stopped = f"{type(exc).__name__}: {exc}"
            return False, None
        for i, (task, draft) in enumerate(zip(decode, drafts)):
            del draft[wanted[i]:]
            if draft and not self._page_cache.task_extend(task.task_id, task.num_computed + 1 + len(draft)):
                draft.clear()  # no page for the drafts: this row decodes one token
        if any(drafts):
            return True, drafts
        # a drafter that drafts from the hidden state a verify step leaves (a draft head) gets one,
        # for a row that wants drafts and has none yet, from a verify step without drafts
        ready = getattr(self._drafter, "ready", None)
        if ready is not None and any(w and not ready(t) for t, w in zip(decode, wanted)):
            return True, drafts
        return True, None

    def _greedy_run_steps(self, decode: list[Task], most: Optional[int] = None, longest: Optional[int] = None) -> int:
        """How many decode steps a lone greedy request takes this loop step (1: the usual one),
        at most ``most`` when given, and at most ``longest`` (default ``greedy_run_steps``); see
        the module's docstring."""
        if len(decode) != 1 or not self._executor.runs_greedy_steps(decode[0]) or most == 1:
            return 1
        task = decode[0]
        longest = self.greedy_run_steps if longest is None else longest
        steps = min(longest if most is None else min(most, longest),
                    task.params.max_tokens - len(task.output_ids), self.max_seq_len - len(task.context))
        if steps > 1 and self._page_cache.task_extend(task.task_id, task.num_computed + steps):
            return steps
        return 1

    def _plan_prefill(self, prefill: list[Task], budget: Optional[int] = None) -> tuple[list[Task], list[int]]:
        """Rows of prompt chunks, FIFO, whose padded size (rows x longest chunk) stays
        within ``budget`` tokens (``prefill_chunk_size``; less the decoding rows riding along);
        a task alone may use the whole budget, and the first task gets a token at least. When
        the runner packs prefill rows (no padding), the budget counts real tokens."""
        batch, n_new, width = [], [], 0
        budget = max(self.prefill_chunk_size if budget is None else budget, 1)
        if self._runner.packs_prefill:
            for task in prefill:
                n = min(task.remaining, budget - sum(n_new))
                if n < 1:
                    break
                batch.append(task)
                n_new.append(n)
            return batch, n_new
        for task in prefill:
            rows = len(batch) + 1
            n = min(task.remaining, budget // rows)
            if batch and (n < 1 or max(width, n) * rows > budget):
                break
            batch.append(task)
            n_new.append(n)
            width = max(width, n)
        return batch, n_new

    def _reserve_decode_pages(self) -> list[Task]:
        """Give every decoding task room for its next token, preempting the newest tasks if needed."""
        cache = self._page_cache
        for task in [t for t in self._task_mgr.running if t.remaining == 1]:
            if task.status is not TaskStatus.RUNNING:
                continue
            while not cache.task_extend(task.task_id, task.num_computed + 1):
                victim = self._task_mgr.running[-1]
                self._preempt(victim)
                if victim is task:
                    break
        return [t for t in self._task_mgr.running if t.remaining == 1]

    def _preempt(self, task: Task) -> None:
        self._page_cache.task_free(task.task_id)
        task.num_computed = 0
        task.preemptions += 1
        self._stats["preemptions"] += 1
        self._task_mgr.requeue_front(task)

    def _release(self, task: Task) -> None:
        """Free a finished or aborted task's pages and forget it."""
        self._page_cache.task_free(task.task_id)
        self._task_mgr.drop(task)
        if self._drafter is not None:
            self._drafter.forget(task.task_id)
        if self._speculation is not None:
            self._speculation.forget(task.task_id)

    def _abort(self, task: Task, error: Optional[str] = None) -> None:
        self._release(task)
        task.error = error
        task.finish("abort")
        self._stats["requests_aborted"] += 1
        task.emit(StreamEvent(finished=True, finish_reason="abort", error=error, prompt_tokens=len(task.prompt_ids),
                              completion_tokens=len(task.output_ids)))


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` have in common, at most ``limit`` (a binary search
    over slice comparisons, which run in C: contexts are thousands of tokens long)."""
    lo, hi = 0, max(0, min(limit, len(a), len(b)))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _speculation(method: Optional[str], draft_tokens: int,
                 drafter: Optional[Drafter]) -> tuple[Optional[Drafter], Optional[SpeculationControl]]:
    """The drafter and its control for ``speculative`` decoding (None, None when off); RequestError
    for a method, a draft length or a drafter that do not go together."""
    if method is None:
        if drafter is not None:
            raise RequestError("a drafter was given without speculative='draft'")
        return None, None
    if method not in SPECULATIVE_METHODS:
        raise RequestError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (or None), got {method!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise RequestError(f"draft_tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, got {draft_tokens!r}")
    if method == "ngram":
        if drafter is not None:
            raise RequestError("speculative='ngram' drafts by prompt lookup and takes no drafter")
        drafter = PromptLookup()
    elif drafter is None:
        raise RequestError("speculative='draft' needs a drafter (a draft model or draft head: --draft-model DIR)")
    floor = getattr(drafter, "min_kept", None)  # a drafter whose drafts cost little keeps drafting on fewer kept
    return drafter, SpeculationControl(method, draft_tokens, **({} if floor is None else {"min_kept": floor}))
