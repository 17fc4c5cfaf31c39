"""Request bodies of the OpenAI and Anthropic protocols, as pydantic models.

Validation here is what turns a wrong type or an out-of-range number into a 422
that names the field, before anything reaches the engine. Unknown fields are
ignored (clients send vendor extras such as ``metadata`` or ``parallel_tool_calls``)
but every field astrai acts on is typed and bounded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as OpenAI documents it


def _not_a_bool(value):
    """JSON's true/false would otherwise pass as 1/0 wherever a number is expected."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_a_bool)]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
Seed = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _stop_list(value: Union[str, list[str], None]) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Body):
    class _Name(_Body):
        name: str

    type: Literal["function"] = "function"
    function: _Name


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    """One OpenAI chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    """``response_format.json_schema``: a named schema the reply must validate against."""

    name: str = Field(min_length=1)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self


class _OpenAISampling(_Body):
    """Sampling fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: Optional[Int] = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1)
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    n: Int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: Union[str, list[str], None] = None
    seed: Optional[Seed] = None
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    ignore_eos: bool = False  # an extension (as in vLLM): generate to max_tokens even past end tokens
    response_format: Optional[ResponseFormat] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        _stop_list(value)
        return value

    def stop_list(self) -> list[str]:
        return _stop_list(self.stop)


class ChatCompletionRequest(_OpenAISampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int = Field(default=0, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None


class CompletionRequest(_OpenAISampling):
    """Body of ``POST /v1/completions``: a prompt string, several, or token ids."""

    prompt: Union[str, list[str], list[Int], list[list[Int]]]
    max_tokens: Optional[Int] = Field(default=None, ge=0)  # 0 with echo: score the prompt only (as vLLM allows)
    logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        """One sentence for a prompt of the wrong shape, instead of one per union member."""
        def token_ids(items) -> bool:
            return isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)

        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or token_ids(value) or all(token_ids(p) for p in value))):
            return value
        raise ValueError("expected a string, a list of strings, a list of token ids (integers, not booleans) "
                         "or a list of token-id lists")


class AnthropicContentBlock(_Body):
    type: str
    text: Optional[str] = None


class AnthropicMessage(_Body):
    """One Anthropic message; content is a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicContentBlock]]


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one named), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _name_given(self):
        if self.type == "tool" and not self.name:
            raise ValueError('type "tool" needs the name of the tool to call')
        return self


class MessagesRequest(_Body):
    """Body of ``POST /v1/messages``."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: Int = Field(ge=1)
    system: Union[str, list[AnthropicContentBlock], None] = None
    temperature: Float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=0)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    seed: Optional[Seed] = None  # an astrai extension: reproducible sampling, as in the OpenAI protocol
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop(cls, value):
        _stop_list(value)
        return value


class CountTokensRequest(MessagesRequest):
    """Body of ``POST /v1/messages/count_tokens``: a message request whose ``max_tokens`` is optional."""

    max_tokens: Optional[Int] = Field(default=None, ge=1)
