"""Fixtures of the inference tests."""

from __future__ import annotations

import pytest

from inference_helpers import make_model


@pytest.fixture(scope="module")
def gqa_model():
    return make_model("tiny")
