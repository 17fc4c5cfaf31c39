"""The OpenAPI document and the server agree: what the document allows the server takes,
what it forbids the server refuses; and the operations routes sit behind the API key."""

from __future__ import annotations

import pytest
from server_helpers import MODEL_NAME
from starlette.testclient import TestClient

from astrai.cli import build_parser, main
from astrai.serving import create_app

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PYDANTIC_KEYWORDS = {"ge", "gt", "le", "lt", "min_length", "max_length", "multiple_of"}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with TestClient(create_app(tiny_engine, model_name=MODEL_NAME), base_url="http://localhost") as client:
        yield client


@pytest.fixture(scope="module")
def schemas(client) -> dict:
    return client.get("/openapi.json").json()["components"]["schemas"]


def keywords(node) -> set[str]:
    """Every key of every schema object below ``node`` (property names excepted)."""
    found, pending = set(), [(node, False)]
    while pending:
        value, named = pending.pop()
        if isinstance(value, dict):
            found |= set() if named else set(value)
            pending.extend((item, key == "properties" and not named) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((item, False) for item in value)
    return found


def option(schema: dict) -> dict:
    """The non-null branch of an optional field."""
    return next(branch for branch in schema["anyOf"] if branch.get("type") != "null")


def test_limits_are_published_as_json_schema_keywords(schemas):
    assert not keywords(schemas) & PYDANTIC_KEYWORDS
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert option(chat["max_tokens"])["minimum"] == 1 and option(chat["max_completion_tokens"])["minimum"] == 1
    assert option(completion["logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 20}
    assert option(chat["seed"])["minimum"] == -(2**63) and option(chat["seed"])["maximum"] == 2**63 - 1


def test_the_document_names_the_served_model_and_the_vocabulary(schemas, tokenizer):
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["enum"] == [MODEL_NAME]
    token_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert token_ids == {"type": "integer", "minimum": 0, "maximum": tokenizer.vocab_size - 1}


@pytest.mark.parametrize("field,value", [("stream", "yes"), ("logprobs", "on"), ("n", "2"), ("temperature", "0.5"),
                                         ("n", 1.5), ("stream_options", {"include_usage": "true"})])
def test_strings_and_fractions_are_not_booleans_or_integers(client, field, value):
    resp = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert resp.status_code == 422 and field in resp.json()["error"]["message"], resp.text


def test_an_integral_float_is_an_integer_as_json_schema_says(client):
    resp = client.post("/v1/chat/completions", json={**CHAT, "n": 2.0, "max_tokens": 1.0})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""]])
def test_an_empty_prompt_breaks_the_schema(client, schemas, prompt):
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert resp.status_code == 422 and "must not be empty" in resp.json()["error"]["message"], resp.text
    shapes = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert shapes[0]["minLength"] == 1 and all(shape["minItems"] == 1 for shape in shapes[1:])


def test_scoring_only_is_published_with_the_echo_it_needs(client, schemas):
    rule = schemas["CompletionRequest"]
    assert rule["if"]["properties"]["max_tokens"] == {"const": 0}
    assert rule["then"]["properties"]["echo"] == {"const": True} and rule["then"]["required"] == ["echo"]
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0})
    assert resp.status_code == 400


def test_content_parts_are_published_as_text_parts(client, schemas):
    for name in ("ContentPart", "AnthropicContentBlock"):
        assert schemas[name]["properties"]["type"]["const"] == "text" and schemas[name]["required"] == ["type", "text"]
    image = {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}
    assert client.post("/v1/chat/completions", json=image).status_code == 400
    empty = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert client.post("/v1/chat/completions", json=empty).status_code == 400
    for blocks in ([{"type": "image", "source": {}}], [{"type": "text"}]):
        resp = client.post("/v1/messages", json={**CHAT, "messages": [{"role": "user", "content": blocks}]})
        assert resp.status_code == 400 and "text blocks only" in resp.json()["error"]["message"], resp.text
    resp = client.post("/v1/messages", json={**CHAT, "system": [{"type": "image"}]})
    assert resp.status_code == 400 and "system.0" in resp.json()["error"]["message"]


def test_count_tokens_takes_max_tokens_null_as_its_document_says(client, schemas):
    assert {"type": "null"} in schemas["CountTokensRequest"]["properties"]["max_tokens"]["anyOf"]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({}, {"max_tokens": None}):
        resp = client.post("/v1/messages/count_tokens", json={**body, **extra})
        assert resp.status_code == 200 and resp.json()["input_tokens"] > 0, resp.text


def test_405_names_the_allowed_methods(client):
    resp = client.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert client.post("/health").headers["allow"] == "GET"


@pytest.mark.parametrize("bias,words", [({"not-a-token": 5}, "'not-a-token'"), ({"-1": 5}, "'-1'"),
                                        ({"999999": 1}, "'999999'")])
def test_logit_bias_keys_that_are_no_token_id_are_refused(client, bias, words):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi"})):
        resp = client.post(path, json={**body, "logit_bias": bias})
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.text
    score_only = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0, "echo": True, "logit_bias": bias}
    assert client.post("/v1/completions", json=score_only).status_code == 400


def test_logit_bias_steers_the_tokens(client, schemas, tiny_engine):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    forced = tiny_engine.tokenizer.encode("x")[-1]
    steered = client.post("/v1/completions", json={**body, "logit_bias": {str(forced): 100}}).json()
    assert steered["choices"][0]["logprobs"]["tokens"] == [tiny_engine.tokenizer.decode([forced])] * 4 != plain
    chat = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True,
                                                     "logit_bias": {str(forced): 100}}).json()
    tokens = [t["token"] for t in chat["choices"][0]["logprobs"]["content"]]
    assert tokens == [tiny_engine.tokenizer.decode([forced])] * 3
    assert schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["propertyNames"]["pattern"] == "^[0-9]{1,9}$"


@pytest.mark.parametrize("path", ["/stats", "/metrics"])
def test_stats_and_metrics_need_the_key_unless_made_public(tiny_engine, path):
    app = create_app(tiny_engine, model_name=MODEL_NAME, api_key="sk-test")
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer sk-test"}).status_code == 200
        assert client.get(path, headers={"x-api-key": "sk-test"}).status_code == 200
        assert client.get("/health").status_code == 200
    public = create_app(tiny_engine, model_name=MODEL_NAME, api_key="sk-test", metrics_public=True)
    with TestClient(public, base_url="http://localhost") as client:
        assert client.get(path).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 401


def test_serve_takes_metrics_public(monkeypatch):
    seen = {}
    monkeypatch.setattr("astrai.serving.launch.run_server", lambda model, **kw: seen.update(kw))
    assert build_parser("serve").parse_args(["serve", "--model", "m"]).metrics_public is False
    assert main(["serve", "--model", "m", "--metrics-public"]) == 0 and seen["metrics_public"] is True


def test_checks_across_fields_and_stop_strings_are_published(client, schemas):
    response_format, tool_choice = schemas["ResponseFormat"], schemas["AnthropicToolChoice"]
    assert response_format["if"]["properties"]["type"] == {"const": "json_schema"}
    assert response_format["then"]["required"] == ["json_schema"]
    assert tool_choice["if"]["properties"]["type"] == {"const": "tool"} and tool_choice["then"]["required"] == ["name"]
    for name in ("ChatCompletionRequest", "MessagesRequest"):  # a forced call needs tools
        assert schemas[name]["then"] == {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    assert "if" not in schemas["CountTokensRequest"]  # counting forces nothing
    forced = {**CHAT, "tool_choice": "required"}
    assert "lists no tools" in client.post("/v1/chat/completions", json=forced).json()["error"]["message"]
    counted = {**CHAT, "tool_choice": {"type": "any"}}
    assert client.post("/v1/messages/count_tokens", json=counted).status_code == 200
    stop_shapes = schemas["ChatCompletionRequest"]["properties"]["stop"]["anyOf"]
    assert stop_shapes[0] == {"type": "string", "minLength": 1}
    assert stop_shapes[1]["maxItems"] == 16 and stop_shapes[1]["items"]["minLength"] == 1
    assert schemas["MessagesRequest"]["properties"]["stop_sequences"]["anyOf"][0]["maxItems"] == 16
    for stop in ("", [""], ["x"] * 17):
        assert client.post("/v1/chat/completions", json={**CHAT, "stop": stop}).status_code == 422


def test_token_ids_are_checked_against_the_tokenizer_the_echo_decodes_with(tokenizer, tmp_path):
    """A model whose embedding is wider than its tokenizer: ids past the tokenizer are refused,
    as the document's maximum says, though the engine would take them."""
    from astrai.config import preset
    from astrai.inference import InferenceEngine
    from astrai.model import AutoModel

    cfg = preset("tiny", vocab_size=tokenizer.vocab_size + 64, n_layers=1, dim=32, n_heads=2, n_kv_heads=1,
                 dim_ffn=64, max_len=64)
    AutoModel.from_config(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with InferenceEngine.from_pretrained(str(tmp_path), max_seq_len=64, page_size=16) as engine:
        with TestClient(create_app(engine, model_name=MODEL_NAME), base_url="http://localhost") as client:
            beyond = tokenizer.vocab_size + 10
            resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [[5], [6, beyond]],
                                                        "max_tokens": 1, "echo": True})
            assert resp.status_code == 400 and f"prompt 1 has token ids outside [0, {tokenizer.vocab_size})" \
                in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "n", 17), ("/v1/chat/completions", "temperature", 2.5),
    ("/v1/chat/completions", "top_logprobs", 21), ("/v1/chat/completions", "top_p", 0),
    ("/v1/chat/completions", "top_k", -2), ("/v1/chat/completions", "min_p", 1.5),
    ("/v1/chat/completions", "presence_penalty", 2.5), ("/v1/chat/completions", "frequency_penalty", -2.5),
    ("/v1/chat/completions", "repetition_penalty", 0), ("/v1/chat/completions", "max_completion_tokens", 0),
    ("/v1/completions", "logprobs", 21), ("/v1/completions", "max_tokens", -1),
    ("/v1/messages", "temperature", 1.5), ("/v1/messages", "top_k", -1), ("/v1/messages", "max_tokens", 0)])
def test_every_published_bound_is_enforced(client, path, field, value):
    body = {**CHAT, "prompt": "hi"} if path == "/v1/completions" else CHAT
    resp = client.post(path, json={**body, field: value})
    assert resp.status_code == 422 and field in str(resp.json()), resp.text


def test_a_prompt_of_the_wrong_shape_gets_one_sentence(client):
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ["a", 1]})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 422 and "expected a string, a list of strings, a list of token ids" in message
    assert message.count("prompt") == 1


def test_streams_are_published_as_server_sent_events(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        event = paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        assert event["type"] == "object" and event["required"] == ["data"]
        assert set(event["properties"]) == {"event", "data"}
