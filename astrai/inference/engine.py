"""InferenceEngine: the user-facing entry point over the scheduler.

``submit`` is the token-level, thread-safe core (used by the server and by
``generate``); ``generate`` accepts text, a list of texts, chat messages or token
ids, and returns text, a list of texts, or a generator of text pieces that never
split a UTF-8 character. The scheduler thread starts with the engine and stops on
``shutdown`` (or leaving the ``with`` block).

Building an engine changes nothing outside it: it serves its own copy of the model
(``in_place=True`` consents to preparing the given object instead) and sets no process-wide
option; the device's backend's ``prepare_process`` (astrai/backends) is the explicit call for those.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shlex
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

import torch

from astrai.backends import backend_for
from astrai.errors import ConfigError, OverloadedError, RequestError
from astrai.inference.draft_model import DraftModel
from astrai.inference.handle import RequestHandle
from astrai.inference.head_drafter import HeadDrafter
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.types import GenerationRequest, SamplingParams, StreamEvent
from astrai.model import AutoModel
from astrai.model.draft_head import is_draft_head, load_draft_head
from astrai.model.quantized import cast_linear_weights, format_bits, quantize_model
from astrai.tokenize import AutoTokenizer

PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
SETTING_NAMES = frozenset(inspect.signature(InferenceScheduler).parameters) - {"model", "tokenizer"}
Prompt = Union[str, list[int], list[dict]]
PROMPT_LOGITS_POSITIONS = 128  # positions whose logits prompt_logits computes at a time


class InferenceEngine:
    """Serves ``model`` with continuous batching. ``settings`` are ``InferenceScheduler``'s
    (max_batch_size, max_seq_len, page_size, num_pages, prefix_cache, in_place, ...), given
    to it as they are; ``default_params`` fill the sampling fields a request leaves out."""

    def __init__(self, model, tokenizer=None, default_params: Optional[SamplingParams] = None, **settings: Any):
        unknown = sorted(set(settings) - SETTING_NAMES)
        if unknown:
            raise RequestError(f"unknown engine setting(s): {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(SETTING_NAMES))}")
        self.tokenizer = tokenizer
        self.default_params = default_params or SamplingParams()
        self.scheduler = InferenceScheduler(model, tokenizer, **settings)
        self.model = self.scheduler.model
        self.scheduler.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: Optional[torch.dtype] = None,
                        device: str | torch.device = "cpu", quantize: Optional[str] = None,
                        draft_model: Optional[str | Path] = None, **limits: Any) -> "InferenceEngine":
        """Model, tokenizer and (optional) generation_config.json defaults from one directory.

        ``quantize`` ("int8" or "int4") quantizes the float weights as they load (see
        ``astrai.model.quantized``); ``dtype`` then applies to what stays float (bfloat16 on the
        CPU to the linear weights only: ``cast_linear_weights``). A directory
        that is already quantized opens as it is, without the argument.
        ``draft_model`` drafts for speculative decoding (``speculative="draft"``,
        astrai/inference/speculative.py): a smaller model's directory with the same tokenizer
        (loaded with the same ``dtype`` and ``quantize``), or a draft head trained for this model
        (``astrai train --train_type draft_head``).
        """
        model = load_model(model_dir, dtype, device, quantize)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        limits.setdefault("default_params", _read_generation_config(Path(model_dir)))
        limits.setdefault("in_place", True)  # the model was loaded for this engine alone
        if draft_model is not None:
            limits["drafter"] = _drafter(draft_model, model, dtype, device, quantize, limits)
        return cls(model, tokenizer, **limits)

    # --- token level ----------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: Optional[SamplingParams] = None) -> RequestHandle:
        """Queue one request; thread-safe. Raises RequestError / OverloadedError at once."""
        params = dataclasses.replace(params) if params is not None else dataclasses.replace(self.default_params)
        handle = RequestHandle("", len(prompt_ids) if isinstance(prompt_ids, list) else 0, self.scheduler.remove_task)
        task = self.scheduler.submit_task(prompt_ids, params, handle._push)
        handle.request_id = task.task_id
        handle._bind(task)
        return handle

    # --- text level -------------------------------------------------------------------
    def make_params(self, **sampling: Any) -> SamplingParams:
        """Engine defaults overridden by the given (non-None) sampling fields."""
        unknown = sorted(set(sampling) - PARAM_NAMES)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(PARAM_NAMES))}")
        return dataclasses.replace(self.default_params, **{k: v for k, v in sampling.items() if v is not None})

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text → ids; chat messages → ids via the chat template with the generation prompt."""
        if isinstance(prompt, str):
            self._need_tokenizer("text prompts")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            self._need_tokenizer("chat messages")
            for i, m in enumerate(prompt):
                if "role" not in m or "content" not in m:
                    raise RequestError(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
            ids = self.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            return list(ids)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise RequestError(f"prompt must be text, chat messages (list of dicts) or token ids, got {type(prompt).__name__}")

    def generate(self, prompt: Union[Prompt, list[Prompt]], stream: bool = False, max_tokens: Optional[int] = None,
                 temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                 **sampling: Any) -> Union[str, list[str], Iterator[str]]:
        """Complete one prompt (→ str, or a generator of pieces with stream=True) or a list (→ list[str])."""
        params = self.make_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, **sampling)
        if _is_batch(prompt):
            if stream:
                raise RequestError("stream=True takes one prompt; call generate once per prompt to stream several")
            handles: list[RequestHandle] = []
            for p in prompt:
                handles.append(self.submit_waiting(self.encode_prompt(p), params, handles))
            return [h.result().text for h in handles]
        handle = self.submit(self.encode_prompt(prompt), params)
        if stream:
            return _text_pieces(handle)
        return handle.result().text

    def submit_waiting(self, prompt_ids: list[int], params: SamplingParams,
                       earlier: list[RequestHandle]) -> RequestHandle:
        """``submit``, waiting while the queue is full for the caller's ``earlier`` requests to
        finish, oldest first: a list of prompts longer than the queue runs through instead of
        failing with "retry later". OverloadedError still when none of them is left to wait for
        (the queue is full of other callers' requests)."""
        waiting = (handle for handle in earlier if not handle.finished)
        while True:
            try:
                return self.submit(prompt_ids, params)
            except OverloadedError:
                oldest = next(waiting, None)
                if oldest is None:
                    raise
                oldest.result()

    async def generate_async(self, prompt: Prompt, max_tokens: Optional[int] = None, temperature: Optional[float] = None,
                             top_p: Optional[float] = None, top_k: Optional[int] = None, **sampling: Any) -> AsyncIterator[str]:
        """Stream one prompt's text pieces on the caller's event loop."""
        params = self.make_params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, **sampling)
        handle = self.submit(self.encode_prompt(prompt), params)
        async for event in handle.aiter():
            _raise_on_error(event)
            if event.text:
                yield event.text

    def generate_with_request(self, request: GenerationRequest) -> Union[str, Iterator[str]]:
        return self.generate(request.messages, stream=request.stream, max_tokens=request.max_tokens,
                             temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                             stop=request.stop or None, seed=request.seed)

    # --- management ---------------------------------------------------------------------
    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def check_prompt(self, prompt_ids: list[int], scoring: bool = False) -> list[int]:
        """The checks ``submit`` (or, with ``scoring``, ``prompt_logits``) makes of a prompt, alone:
        for a caller with several prompts that wants them all refused before any runs."""
        return self.scheduler.check_prompt(prompt_ids, scoring)

    def prompt_logits(self, prompt_ids: list[int], consume: Callable[[int, torch.Tensor], None],
                      positions: int = PROMPT_LOGITS_POSITIONS) -> None:
        """The logits of every prompt position, from one plain forward run between the engine's
        steps, given to ``consume(first, logits)`` ``positions`` rows [n, vocab] at a time (so a
        long prompt never holds [len, vocab] at once): for scoring a prompt's own tokens, which
        the steps (they compute only what sampling needs) do not give. The prompt must pass
        ``check_prompt(ids, scoring=True)``."""
        self.scheduler.prompt_logits(prompt_ids, consume, positions)

    def update_weights(self, model_or_state_dict) -> None:
        """The one way to change the served weights (e.g. a GRPO policy update): copied in between
        steps, into the engine's model as it was prepared; the prefix cache is dropped, since
        cached K/V came from the old weights. Running requests continue with the new weights."""
        state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
        self.scheduler.load_weights(state)

    def shutdown(self) -> None:
        self.scheduler.stop()

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise RequestError(f"{what} need a tokenizer; this engine was built without one (pass token ids)")


def _is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def _raise_on_error(event: StreamEvent) -> None:
    if event.error:
        raise RuntimeError(f"generation failed: {event.error}")


def _text_pieces(handle: RequestHandle) -> Iterator[str]:
    """Text pieces of a request; closing the generator early aborts the request."""
    try:
        for event in handle:
            _raise_on_error(event)
            if event.text:
                yield event.text
    finally:
        handle.abort()


def _drafter(directory: str | Path, target, dtype: Optional[torch.dtype], device: str | torch.device,
             quantize: Optional[str], limits: dict):
    """The drafter ``directory`` holds for ``target``: a draft head, else a draft model."""
    if limits.setdefault("speculative", "draft") != "draft":
        raise RequestError(f"a draft model drafts with speculative='draft', not {limits['speculative']!r}")
    if is_draft_head(directory):
        head = load_draft_head(directory, target)
        return HeadDrafter(head.quantize() if quantize else head)
    draft = load_model(directory, dtype, device, quantize, keep_quantized=True)
    return DraftModel(draft, target.config.vocab_size, int(limits.get("max_seq_len") or target.config.max_len),
                      limits.get("max_batch_size", 16), limits.get("page_size", 16), in_place=True)


def _read_generation_config(directory: Path) -> SamplingParams:
    """Sampling defaults from generation_config.json (HF field names), if the directory has one."""
    path = directory / "generation_config.json"
    params = SamplingParams()
    if not path.is_file():
        return params
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RequestError(f"{path}: not valid JSON ({exc})") from None
    mapping = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty"}
    for src, dst in mapping.items():
        if raw.get(src) is not None:
            setattr(params, dst, raw[src])
    if not raw.get("do_sample", False):  # Hugging Face decodes greedily unless do_sample is true
        params.temperature = 0.0
    return params


def load_model(model_dir: str | Path, dtype: Optional[torch.dtype], device: str | torch.device,
               quantize: Optional[str] = None, keep_quantized: bool = False):
    """The model of ``model_dir``, quantized to ``quantize`` from its float32 weights when asked;
    with ``keep_quantized`` a model saved in another quantized format opens in its own (a draft
    model: an int8 target may draft with its own weights in int4)."""
    if quantize is None:
        if _linear_weights_only(dtype, device):
            return cast_linear_weights(AutoModel.from_pretrained(model_dir, device=device), dtype)
        return AutoModel.from_pretrained(model_dir, dtype=dtype, device=device)
    format_bits(quantize)  # an unknown format stops before the weights are read
    model = AutoModel.from_pretrained(model_dir)
    saved = getattr(model, "quantization", None)
    if saved is None:
        model = quantize_model(model, quantize)
    elif saved["format"] != quantize and not keep_quantized:
        command = f"astrai model quantize {shlex.quote(str(model_dir))} --to {quantize} --out NEW_DIR"
        raise ConfigError(f"{model_dir} holds {saved['format']} weights; it cannot be served as {quantize}. "
                          f"Requantize it once with `{command}` "
                          f"(it rounds twice: quantize the float model where there is one), "
                          f"or leave out the quantize option")
    if _linear_weights_only(dtype, device):
        return cast_linear_weights(model.to(device), dtype)
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


def _linear_weights_only(dtype: Optional[torch.dtype], device: str | torch.device) -> bool:
    """bf16 casts the linear weights only where the device's backend says so
    (``Backend.bf16_linears_only``; the CPU's, as llama.cpp's BF16 files keep norms in fp32:
    activations and the KV cache stay fp32, so the fused decode step takes the model and
    half the bytes it streams)."""
    return dtype == torch.bfloat16 and backend_for(torch.device(device)).bf16_linears_only
