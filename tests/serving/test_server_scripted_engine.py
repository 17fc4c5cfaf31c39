"""Server behaviour that needs a reply on demand, served from the scripted test engine.

A random-weight model cannot be made to emit a tool call or to stream slowly on
demand, so these tests put ``ScriptedEngine`` (tests/serving/conftest.py) behind the
real app and real uvicorn, and talk to it with the official clients and raw HTTP.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_helpers import MODEL_NAME, ScriptedEngine, live_server

from astrai.serving import create_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_REPLY = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_scripted_tool_call_reply_is_parsed_for_the_openai_client(tokenizer):
    engine = ScriptedEngine(tokenizer, TOOL_REPLY)
    with live_server(create_app(engine, model_name=MODEL_NAME)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}

        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, stream=True))
        streamed_calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
        assert [json.loads(tc.function.arguments) for tc in streamed_calls] == [{"city": "Paris"}]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the prompt carried the tool list (rendered by the chat template)
        assert "get_weather" in tokenizer.decode(engine.handles[0].prompt_ids, skip_special_tokens=False)
        history = messages + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        follow = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none")
        assert follow.choices[0].finish_reason == "stop"
        assert follow.choices[0].message.tool_calls is None
        assert "<tool_call>" in follow.choices[0].message.content
        # the earlier call and its result were rendered into the follow-up prompt
        follow_prompt = tokenizer.decode(engine.handles[-1].prompt_ids, skip_special_tokens=False)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in follow_prompt
        assert "<|im_start|>tool\nsunny" in follow_prompt


def test_client_disconnect_mid_stream_aborts_the_engine_task(tokenizer):
    engine = ScriptedEngine(tokenizer, "word " * 200, delay_s=0.02)
    with live_server(create_app(engine, model_name=MODEL_NAME)) as url:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {") and '"content":"word' in line.replace(" ", ""):
                        break
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        handle = engine.handles[0]
        assert handle.aborted and not engine.running
        assert handle.events_sent < 200


def test_client_hanging_up_on_a_non_streaming_request_aborts_the_engine_task(tokenizer):
    engine = ScriptedEngine(tokenizer, "word " * 200, delay_s=0.02)
    with live_server(create_app(engine, model_name=MODEL_NAME)) as url:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.handles[0].aborted and not engine.running
        assert engine.handles[0].events_sent < 200


def test_queue_full_answers_503_with_retry_after_in_both_protocols(tokenizer):
    engine = ScriptedEngine(tokenizer, "x", max_queue=0)
    with live_server(create_app(engine, model_name=MODEL_NAME)) as url:
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "busy" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/messages", json={"model": MODEL_NAME, "max_tokens": 5,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


def test_api_key_is_required_on_v1_routes_only(tokenizer):
    engine = ScriptedEngine(tokenizer, "ok")
    with live_server(create_app(engine, model_name=MODEL_NAME, api_key="s3cret")) as url:
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        r = httpx.post(url + "/v1/messages", headers={"x-api-key": "bad"},
                       json={"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_health_reports_readiness_while_the_model_loads(tokenizer):
    release = threading.Event()
    engine = ScriptedEngine(tokenizer, "ready")

    def slow_load():
        release.wait(10)
        return engine

    with live_server(create_app(load_engine=slow_load, model_name=MODEL_NAME)) as url:
        assert httpx.get(url + "/health").json()["ready"] is False
        assert httpx.get(url + "/health/ready").status_code == 503
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 5
        while not httpx.get(url + "/health").json()["ready"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(url + "/health/ready").status_code == 200
        assert not engine.shut_down
    assert engine.shut_down  # an engine the app loaded is shut down with the app
