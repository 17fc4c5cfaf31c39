"""The OpenAPI document describes every route, and schemathesis, sending bodies generated
from it (valid and invalid), never gets a 5xx from the app around the real engine."""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.generation import GenerationMode
from server_helpers import MODEL_NAME

from astrai.inference import InferenceEngine
from astrai.serving import create_app

ROUTES = {"/health": "get", "/health/ready": "get", "/stats": "get", "/metrics": "get", "/v1/models": "get",
          "/v1/models/{model_id}": "get", "/v1/chat/completions": "post", "/v1/completions": "post",
          "/v1/messages": "post", "/v1/messages/count_tokens": "post"}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    """A short context keeps whatever max_tokens the generated bodies ask for cheap."""
    engine = InferenceEngine.from_pretrained(str(tiny_model_dir), max_batch_size=8, max_seq_len=40, page_size=8,
                                             max_queue=64)
    yield create_app(engine, model_name=MODEL_NAME, default_max_tokens=4, allowed_hosts=["*"])
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(app):
    """The document as schemathesis reads it, with requests sent straight to the app (ASGI)."""
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_the_documents_version_is_the_packages_from_one_source(app):
    """astrai.__version__ names the API's version and, through pyproject's dynamic version, the
    installed package's (a checkout run without installing has no package metadata to read)."""
    from importlib.metadata import version

    import astrai

    assert app.openapi()["info"]["version"] == astrai.__version__ == version("astrai")


def test_document_lists_every_route_with_request_and_response_schemas(app):
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        document = client.get("/openapi.json").json()
        assert client.get("/docs").status_code == 200
    for path, method in ROUTES.items():
        operation = document["paths"][path][method]
        assert "200" in operation["responses"], path
        if method == "post":
            body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert body.rsplit("/", 1)[1] in document["components"]["schemas"]
            assert "application/json" in operation["responses"]["200"]["content"], path
    completion = document["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "echo", "logprobs", "max_tokens"} <= set(completion["properties"])


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_no_generated_request_gets_a_server_error(api_schema):
    """Each operation gets a bounded number of generated cases, run through hypothesis here."""
    from hypothesis import given

    tried = []
    cases = [(op, mode) for op in operations(api_schema)
             for mode in (GenerationMode if op.method.lower() == "post" else [GenerationMode.POSITIVE])]
    for operation, mode in cases:  # bodies break the schema in negative mode; GET routes take no body
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def call(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = MODEL_NAME  # past the model check, into the engine
            response = case.call()
            tried.append(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> " \
                                               f"{response.status_code}: {response.text[:300]}"

        call()
    print(sorted(collections.Counter(tried).items()))
    assert len(tried) >= 4 * len(ROUTES) and tried.count(200) >= len(ROUTES) and tried.count(422) >= 4
