"""Structured outputs through the server, against the real engine with a random-weight model
(which on its own would almost never write JSON): response_format, forced tool calls in
both protocols, and a schema the engine cannot compile."""

from __future__ import annotations

import json
from typing import Literal, Optional

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL_NAME

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}, {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)
    colour: Literal["red", "green", "blue"]


class Order(BaseModel):
    items: list[Item] = Field(max_length=3)
    note: Optional[str] = Field(max_length=10)
    urgent: bool


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("seed", range(4))
def test_the_openai_clients_parse_helper_gets_its_pydantic_model(client, seed):
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=ASK, response_format=Order,
                                               max_tokens=400, seed=seed)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Order)


def test_json_object_gives_a_json_object_on_both_openai_endpoints(server_url):
    body = {"model": MODEL_NAME, "max_tokens": 300, "seed": 1, "response_format": {"type": "json_object"}}
    chat = httpx.post(f"{server_url}/v1/chat/completions", json={**body, "messages": ASK}, timeout=60).json()
    assert isinstance(json.loads(chat["choices"][0]["message"]["content"]), dict)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}
    text = httpx.post(f"{server_url}/v1/completions", timeout=60, json={
        **body, "prompt": "Numbers:", "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "digits", "schema": schema}}}).json()
    jsonschema.validate(json.loads(text["choices"][0]["text"]), schema)


def _check_call(name: str, arguments: dict, allowed: tuple[str, ...]) -> None:
    assert name in allowed
    jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("choice, allowed", [
    ("required", ("get_weather", "get_time")),
    ({"type": "function", "function": {"name": "get_time"}}, ("get_time",)),
])
@pytest.mark.parametrize("seed", range(3))
def test_openai_forced_tool_call_arguments_validate(client, choice, allowed, seed):
    completion = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=OPENAI_TOOLS,
                                                tool_choice=choice, max_tokens=200, seed=seed)
    result = completion.choices[0]
    assert result.finish_reason == "tool_calls"
    (call,) = result.message.tool_calls
    _check_call(call.function.name, json.loads(call.function.arguments), allowed)


def test_openai_forced_tool_call_streams_as_a_tool_call_delta(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=OPENAI_TOOLS, tool_choice="required",
                                            max_tokens=200, seed=5, stream=True)
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    _check_call(calls[0].function.name, json.loads(calls[0].function.arguments), ("get_weather", "get_time"))


@pytest.mark.parametrize("choice, allowed", [
    ({"type": "any"}, ("get_weather", "get_time")),
    ({"type": "tool", "name": "get_weather"}, ("get_weather",)),
])
@pytest.mark.parametrize("seed", range(3))
def test_anthropic_forced_tool_use_input_validates(claude, choice, allowed, seed):
    message = claude.messages.create(model=MODEL_NAME, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                     max_tokens=200, extra_body={"seed": seed})
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    _check_call(block.name, block.input, allowed)


def test_anthropic_forced_tool_use_streams_as_a_tool_use_block(claude):
    with claude.messages.stream(model=MODEL_NAME, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                                max_tokens=200, extra_body={"seed": 2}) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    _check_call(block.name, block.input, ("get_weather", "get_time"))


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "odd", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}}),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "odd", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}}),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "dependentSchemas": {}}}}]}),
    ("/v1/messages", {"messages": ASK, "tool_choice": {"type": "any"}, "tools": [
        {"name": "f", "input_schema": {"type": "object", "dependentSchemas": {}}}]}),
])
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_keyword(server_url, path, body):
    response = httpx.post(server_url + path, json={"model": MODEL_NAME, "max_tokens": 20, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert "dependentSchemas" in response.json()["error"]["message"]


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"messages": ASK, "tools": OPENAI_TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "lists no tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": OPENAI_TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "one of them"),
    ("/v1/messages", {"messages": ASK, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "not among"),
])
def test_a_forced_call_that_cannot_be_made_is_a_400(server_url, path, body, words):
    response = httpx.post(server_url + path, json={"model": MODEL_NAME, "max_tokens": 20, **body}, timeout=60)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
