"""The allocator tuning is applied on Linux/glibc and can be switched off."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

CODE = "import astrai.runtime as r; print(r.tune_allocator(), r.tune_allocator())"


def run(env_value: str) -> str:
    import os

    env = {**os.environ, "ASTRAI_TUNE_MALLOC": env_value}
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
                    reason="mallopt is glibc's")
def test_tuning_applies_once_and_can_be_disabled():
    assert run("1") == "True True"
    assert run("0") == "False False"
