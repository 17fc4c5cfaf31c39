"""The stop-string checker the engine's tasks and the server share (astrai/inference/stop.py)."""

from __future__ import annotations

from astrai.inference.stop import StopChecker


def test_stop_checker_holds_back_partial_matches():
    s = StopChecker(["</a>", "END"])
    out = [s.push(p) for p in ["hel", "lo <", "/", "a> tail"]]
    assert "".join(out) == "hello "
    assert s.matched == "</a>"
    s = StopChecker(["</a>"])
    assert s.push("x <") == "x " and s.push("b") == "<b" and s.matched is None and s.flush() == ""


def test_check_and_trim_are_the_spec_names():
    s = StopChecker(["ab", "abc", "x"])
    assert s.check("zzabcx") == "abc"  # earliest, and the longest of those starting there
    assert StopChecker.trim("zzabcx", "abc") == "zz"
    assert s.check("none here") is None
