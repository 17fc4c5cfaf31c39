"""Server counters and histograms, rendered in the Prometheus text exposition format.

Written by hand (a few dozen lines) rather than pulling in prometheus_client: the
server needs counters, two histograms and the engine's gauges, nothing more.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from typing import Optional

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=_LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def render(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        lines = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.total}')
        suffix = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{suffix} {self.sum:.6f}", f"{name}_count{suffix} {self.total}"]
        return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """Thread-safe counters the app updates per HTTP request and per generation."""

    def __init__(self):
        self._lock = threading.Lock()
        self.http_requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.http_latency: dict[str, Histogram] = defaultdict(Histogram)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.generations = 0
        self.generations_cancelled = 0
        self.ttft = Histogram()
        self.started = time.time()

    def record_http(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.http_requests[(method, route, status)] += 1
            self.http_latency[route].observe(seconds)

    def record_request(self, prompt_tokens: int, completion_tokens: int, ttft_s: Optional[float],
                       finished: bool) -> None:
        with self._lock:
            self.generations += 1
            self.generations_cancelled += 0 if finished else 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self, engine_stats: Optional[dict], model_name: str) -> str:
        """The Prometheus text for these counters plus the engine's numeric statistics."""
        out: list[str] = []

        def header(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            header("astrai_http_requests_total", "counter", "HTTP requests by method, route and status.")
            for (method, route, status), count in sorted(self.http_requests.items()):
                out.append(f'astrai_http_requests_total{{method="{method}",route="{_escape(route)}",'
                           f'status="{status}"}} {count}')
            header("astrai_http_request_duration_seconds", "histogram", "Time to the end of the response body.")
            for route, hist in sorted(self.http_latency.items()):
                out += hist.render("astrai_http_request_duration_seconds", f'route="{_escape(route)}"')
            for name, value, help_text in (
                ("astrai_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of generation requests."),
                ("astrai_generation_tokens_total", self.completion_tokens, "Tokens generated."),
                ("astrai_generation_requests_total", self.generations, "Generation requests served."),
                ("astrai_generation_requests_cancelled_total", self.generations_cancelled,
                 "Generation requests whose client went away before the end."),
            ):
                header(name, "counter", help_text)
                out.append(f"{name} {value}")
            header("astrai_time_to_first_token_seconds", "histogram", "Time from submission to the first token.")
            out += self.ttft.render("astrai_time_to_first_token_seconds")
        header("astrai_model_info", "gauge", "The served model (value is always 1).")
        out.append(f'astrai_model_info{{model="{_escape(model_name)}"}} 1')
        header("astrai_uptime_seconds", "gauge", "Seconds since the server started.")
        out.append(f"astrai_uptime_seconds {time.time() - self.started:.3f}")
        for key, value in sorted((engine_stats or {}).items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            name = f"astrai_engine_{key}"
            header(name, "gauge", f"Engine statistic {key}.")
            out.append(f"{name} {value}")
        return "\n".join(out) + "\n"
