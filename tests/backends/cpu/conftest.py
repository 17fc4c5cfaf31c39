"""Fixtures of the CPU backend's tests, which build models as the inference tests do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "inference"))  # inference_helpers

from inference_helpers import make_model  # noqa: E402


@pytest.fixture(scope="module")
def gqa_model():
    return make_model("tiny")
