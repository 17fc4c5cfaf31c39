"""Request bodies of the OpenAI and Anthropic protocols, as pydantic models.

Validation here is what turns a wrong type or an out-of-range number into a 422
that names the field, before anything reaches the engine. Unknown fields are
ignored (clients send vendor extras such as ``metadata`` or ``parallel_tool_calls``)
but every field astrai acts on is typed and bounded. Types are strict (``"yes"`` is not a
boolean, ``"5"`` not a number), so the OpenAPI document generated from these models
says exactly what the server takes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as OpenAI documents it


def _json_integer(value):
    """JSON Schema counts 2.0 as an integer, so it is taken as 2 (true, "2" and 2.5 are still refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """A strict integer (JSON's true/false would otherwise pass as 1/0) within ``bounds`` (ge, le),
    published as JSON Schema's minimum/maximum."""
    return Annotated[int, Strict(), Field(**bounds), BeforeValidator(_json_integer)]


Int = integer()
Float = Annotated[float, Strict()]  # an integer is still a number here
Seed = integer(ge=SEED_RANGE[0], le=SEED_RANGE[1])
Text = Annotated[str, Field(min_length=1)]
StopStrings = Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)]


def _text_parts_only(schema: dict) -> None:
    """Publish what the handlers read: parts of type ``text`` that carry their text. The model
    itself takes any type, so that an image part gets a 400 saying that this model reads
    text only, rather than a bare schema error."""
    schema["properties"]["type"] = {"const": "text", "title": "Type", "type": "string"}
    schema["properties"]["text"] = {"title": "Text", "type": "string"}
    schema["required"] = ["type", "text"]


def _rule(condition: dict, consequence: dict):
    """A ``json_schema_extra`` that publishes a check across fields (a validator's, or a
    handler's) as JSON Schema's if/then, so the document does not allow what is refused."""
    def publish(schema: dict) -> None:
        schema["if"], schema["then"] = condition, consequence
    return publish


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    model_config = ConfigDict(extra="ignore", json_schema_extra=_text_parts_only)

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
    include_usage: StrictBool = False


class JSONSchemaFormat(_Body):
    """``response_format.json_schema``: a named schema the reply must validate against."""

    name: str = Field(min_length=1)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_rule(
        {"properties": {"type": {"const": "json_schema"}}},
        {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}))

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
    max_tokens: Optional[integer(ge=1)] = None
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: integer(ge=-1) = 0
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    n: integer(ge=1, le=MAX_CHOICES) = 1
    stop: Union[Text, StopStrings, None] = None
    seed: Optional[Seed] = None
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # token id (as a string) -> bias added to its logit before sampling
    logit_bias: Optional[dict[str, Annotated[Float, Field(ge=-100, le=100)]]] = Field(
        default=None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,9}$"}})
    ignore_eos: StrictBool = False  # an extension (as in vLLM): generate to max_tokens even past end tokens
    response_format: Optional[ResponseFormat] = None

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_OpenAISampling):
    """Body of ``POST /v1/chat/completions``."""

    # a forced call ("required", or a named function) needs tools to call (structured.forced_tools)
    model_config = ConfigDict(extra="ignore", json_schema_extra=_rule(
        {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                                             {"type": "object"}]}}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}))

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[integer(ge=1)] = None
    logprobs: StrictBool = False
    top_logprobs: integer(ge=0, le=20) = 0
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None


class CompletionRequest(_OpenAISampling):
    """Body of ``POST /v1/completions``: a prompt string, several, or token ids."""

    # max_tokens 0 scores the prompt and generates nothing: it needs echo, and no stream (the handler checks)
    model_config = ConfigDict(extra="ignore", json_schema_extra=_rule(
        {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
        {"properties": {"echo": {"const": True}, "stream": {"const": False}}, "required": ["echo"]}))

    prompt: Union[Text, Annotated[list[Text], Field(min_length=1)], Annotated[list[Int], Field(min_length=1)],
                  Annotated[list[Annotated[list[Int], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[integer(ge=0)] = None  # 0 with echo: score the prompt only (as vLLM allows)
    logprobs: Optional[integer(ge=0, le=20)] = None
    echo: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        """One sentence for a prompt of the wrong shape, instead of one per union member."""
        def token_ids(items) -> bool:
            return isinstance(items, list) and all(isinstance(_json_integer(t), int) and not isinstance(t, bool)
                                                   for t in items)

        if not (isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or token_ids(value) or all(token_ids(p) for p in value)))):
            raise ValueError("expected a string, a list of strings, a list of token ids (integers, not booleans) "
                             "or a list of token-id lists")
        if not value or (not isinstance(value, str) and any(isinstance(p, (str, list)) and not p for p in value)):
            raise ValueError("a prompt must not be empty: give at least one character or token id")
        return value


class AnthropicContentBlock(_Body):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_text_parts_only)

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

    model_config = ConfigDict(extra="ignore", json_schema_extra=_rule(
        {"properties": {"type": {"const": "tool"}}},
        {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}))

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

    # a forced call (tool_choice "any" or "tool") needs tools to call (structured.forced_tools)
    model_config = ConfigDict(extra="ignore", json_schema_extra=_rule(
        {"required": ["tool_choice"], "properties": {"tool_choice": {
            "type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}))

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: integer(ge=1)
    system: Union[str, list[AnthropicContentBlock], None] = None
    temperature: Float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: integer(ge=0) = 0
    stop_sequences: Optional[StopStrings] = None
    stream: StrictBool = False
    seed: Optional[Seed] = None  # an astrai extension: reproducible sampling, as in the OpenAI protocol
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None


class CountTokensRequest(MessagesRequest):
    """Body of ``POST /v1/messages/count_tokens``: a message request whose ``max_tokens`` is optional
    (and whose tool_choice forces nothing: no reply is generated)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=None)
    max_tokens: Optional[integer(ge=1)] = None
