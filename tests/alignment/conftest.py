"""Fixtures for the alignment tests: the bundled preference pairs."""

from __future__ import annotations

import json
import random

import pytest


@pytest.fixture(scope="session")
def preference_records(bundled_data):
    """The bundled pairs, shuffled once with a fixed seed (train and held-out slices come from this)."""
    with open(bundled_data / "dpo" / "train.jsonl", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    random.Random(0).shuffle(records)
    return records
