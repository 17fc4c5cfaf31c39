"""ChatTemplate: Jinja2 chat templates in the Hugging Face convention.

Templates are rendered in a sandboxed, immutable Jinja2 environment (the same
settings transformers uses: ``trim_blocks``, ``lstrip_blocks``, ``tojson`` and
``raise_exception``), so a template from a downloaded ``tokenizer_config.json``
renders identically here and cannot touch Python objects beyond its inputs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from astrai.errors import ConfigError, DataError


def default_template() -> str:
    """The ChatML-like template astrai's own models are trained with."""
    return resources.files("astrai.tokenize").joinpath("templates/chatml.jinja").read_text(encoding="utf-8")


def _raise_exception(message: str):
    raise DataError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile(template_str: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template_str)
    except TemplateError as exc:
        raise ConfigError(f"chat template does not compile: {exc}") from None


def validate_messages(messages: Any) -> list[dict]:
    """Check the shape of a conversation so a bad record names its problem.

    ``content: null`` (an assistant turn that only calls tools) becomes "" so
    templates can concatenate it; other keys (``tool_calls``, ``name``) pass through.
    """
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"messages[{i}] is missing '{key}'")
        if message["content"] is None:
            message = {**message, "content": ""}
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise DataError(f"messages[{i}].{key} must be a string, got {type(message[key]).__name__}")
        checked.append(message)
    return checked


class ChatTemplate:
    """A compiled chat template; ``render`` turns a conversation into prompt text."""

    def __init__(self, template_str: str | None = None, special_tokens: dict[str, str] | None = None):
        self.template_str = template_str if template_str is not None else default_template()
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(self.template_str)

    @classmethod
    def from_string(cls, template: str, special_tokens: dict[str, str] | None = None) -> "ChatTemplate":
        return cls(template, special_tokens)

    def render(self, messages, system_prompt: str | None = None, add_generation_prompt: bool = False,
               tools: list | None = None, **extra_variables) -> str:
        """Render ``messages``; ``system_prompt`` is prepended as a system turn when given."""
        messages = validate_messages(messages)
        if system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}] + messages
        variables = {**self.special_tokens, **extra_variables}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **variables)
        except TemplateError as exc:
            raise DataError(f"chat template failed to render: {exc}") from None

    def assistant_spans(self, messages, **extra_variables) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans produced by each assistant turn.

        Derived from the template itself: the conversation up to an assistant turn
        rendered with a generation prompt must be a prefix of the conversation
        including that turn; the difference is what the assistant "said". This works
        for any template whose renderings are prefix-stable (ChatML and most others).
        """
        messages = validate_messages(messages)
        full = self.render(messages, **extra_variables)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, **extra_variables)
            upto = self.render(messages[: i + 1], **extra_variables)
            if not full.startswith(upto) or not upto.startswith(before):
                raise DataError("chat template is not prefix-stable, so assistant tokens cannot be located; "
                                "use a template where earlier turns render the same regardless of later ones")
            spans.append((len(before), len(upto)))
        return full, spans
