"""Running llama.cpp's binaries from a benchmark: ``llama-bench`` for one-stream figures and
any OpenAI-compatible server process (``llama-server`` or ``astrai serve``) for load tests,
with its resident memory read from /proc.

Failures are returned as data (``{"error": ...}``), not raised: llama.cpp's optional CPU
paths can crash on some machines, and one crashed configuration should be reported
beside the others rather than end the run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx


def llama_bench(binary: Path, gguf: Path, threads: int, args: list[str], timeout: float = 900) -> dict:
    """One ``llama-bench`` call (JSON output); returns its single result row, or {"error": ...}.

    ``args`` pick the test, e.g. ``["-p", "0", "-n", "128", "-d", "32", "-r", "1"]``; the
    tok/s of the row is ``avg_ts`` (and ``samples_ts`` per repetition)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-o", "json", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "command": cmd}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        return {"error": f"exit status {done.returncode}: {' | '.join(tail)}", "command": cmd}
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": "llama-bench printed no JSON", "command": cmd}
    if len(rows) != 1:
        return {"error": f"expected one result row, got {len(rows)}", "command": cmd}
    return rows[0]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (a server that forks workers counts them all)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name in parentheses may hold spaces: the parent id follows its closing one
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while the table was read
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += parents.get(tree[-1], [])
    return tree


def resident_memory(pid: int) -> dict:
    """Resident memory now (VmRSS) and at its peak (VmHWM) in bytes, summed over the process tree
    of ``pid``; the summed peaks bound the tree's joint peak from above."""
    totals = {"vm_rss_bytes": 0, "vm_hwm_bytes": 0, "processes": 0}
    for member in process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        for key, name in (("vm_rss_bytes", "VmRSS"), ("vm_hwm_bytes", "VmHWM")):
            if name in fields:  # given in kB (KiB)
                totals[key] += int(fields[name].split()[0]) * 1024
        totals["processes"] += 1
    return totals


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess on a free local port, ready once ``ready_path`` answers 200.

    Used as a context manager; leaving it stops the process (the one started here, by its id)."""

    def __init__(self, command: list[str], port: int, ready_path: str, env: Optional[dict] = None,
                 log: Optional[Path] = None, start_timeout: float = 300):
        self.command, self.port, self.ready_path = command, port, ready_path
        self.env, self.log, self.start_timeout = env, log, start_timeout
        self.process: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, **(self.env or {})))
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with status {self.process.returncode}: {' '.join(self.command)}"
                                   + (f" (log: {self.log})" if self.log else ""))
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"server not ready after {self.start_timeout:.0f} s: {' '.join(self.command)}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
