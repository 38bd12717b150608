"""``GET /metrics``: the server's counters in the Prometheus text exposition format (0.0.4).

Families (all prefixed ``expertfs_``):

- ``requests_total{endpoint,status}``: answered requests by route and HTTP status (``499``: the
  client went away first); ``generations_cancelled_total``: generations stopped by a disconnect;
- ``prompt_tokens_total``, ``prompt_cached_tokens_total`` (reused from the previous request's
  KV cache), ``generation_tokens_total``;
- histograms ``time_to_first_token_seconds`` (arrival to the first sampled token: queueing plus
  prefill), ``prefill_seconds``, ``time_per_output_token_seconds`` (one observation per request:
  its mean decode time per token);
- ``expert_requests_total``, ``expert_hits_total{tier}``, ``expert_hit_rate{tier}`` (since
  start), ``expert_read_bytes_total`` (bytes read from storage), from the expert provider;
- gauges ``queue_waiting`` and ``requests_running``.

Observations are made on the event loop; the provider's counters are read when scraped.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Sequence

from aiohttp import web

__all__ = ["Metrics", "Histogram", "ARRIVAL"]

#: the request key for when it arrived (``time.perf_counter``)
ARRIVAL: Any = (web.RequestKey("expertfs_arrival", float) if hasattr(web, "RequestKey")
                else "expertfs_arrival")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        if not math.isfinite(v):
            return
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_num(self.sum)}",
                f"{name}_count {self.count}"]
        return out


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """The counters, a middleware that counts requests, and the ``/metrics`` handler."""

    def __init__(self, stats: Callable[[], Any], waiting: Callable[[], int],
                 running: Callable[[], int]) -> None:
        self._stats, self._waiting, self._running = stats, waiting, running
        self.requests: Counter[tuple[str, str]] = Counter()
        self.tokens = Counter({"prompt": 0, "cached": 0, "generated": 0, "cancelled": 0})
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.prefill = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_BUCKETS)

    def observe(self, out: Any, arrival: float, started: float) -> None:
        """A finished generation (``session.Outcome``) that arrived at ``arrival`` and started
        running at ``started`` (``time.perf_counter`` times)."""
        t = out.timings
        self.tokens["prompt"] += out.prompt_tokens
        self.tokens["cached"] += int(t.get("cache_n", 0))
        self.tokens["generated"] += out.completion_tokens
        if out.finish_reason == "cancelled":
            self.tokens["cancelled"] += 1
        prompt_s = float(t.get("prompt_ms", 0.0)) / 1e3
        self.prefill.observe(prompt_s)
        self.ttft.observe(max(0.0, started - arrival) + prompt_s)
        if t.get("predicted_n"):
            self.tpot.observe(float(t.get("predicted_per_token_ms", 0.0)) / 1e3)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        request[ARRIVAL] = time.perf_counter()
        info = request.match_info
        route = getattr(getattr(info, "route", None), "resource", None)
        path = getattr(route, "canonical", None)
        endpoint = path if path and "{" not in path else "other"
        status = "499"
        try:
            resp = await handler(request)
            status = str(resp.status)
            return resp
        finally:
            self.requests[(endpoint, status)] += 1

    def _provider(self) -> tuple[int, dict[str, int], int]:
        s = self._stats()
        for _ in range(3):                     # the generation thread may add a tier meanwhile
            try:
                return (int(getattr(s, "requests", 0)), dict(getattr(s, "hits", {}) or {}),
                        int(getattr(s, "bytes_read", 0)))
            except RuntimeError:
                continue
        return int(getattr(s, "requests", 0)), {}, int(getattr(s, "bytes_read", 0))

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, doc: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples])

        p = "expertfs_"
        family(p + "requests_total", "counter", "Requests answered, by endpoint and HTTP status.",
               [f'{p}requests_total{{endpoint="{_label(e)}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.requests.items())])
        for key, name, doc in (
                ("prompt", "prompt_tokens_total", "Prompt tokens of the generations run."),
                ("cached", "prompt_cached_tokens_total",
                 "Prompt tokens reused from the KV cache instead of prefilled."),
                ("generated", "generation_tokens_total", "Tokens generated."),
                ("cancelled", "generations_cancelled_total",
                 "Generations stopped because the client disconnected.")):
            family(p + name, "counter", doc, [f"{p}{name} {self.tokens[key]}"])
        family(p + "time_to_first_token_seconds", "histogram",
               "From arrival to the first sampled token (queueing and prefill).",
               self.ttft.lines(p + "time_to_first_token_seconds"))
        family(p + "prefill_seconds", "histogram", "Prompt processing time per request.",
               self.prefill.lines(p + "prefill_seconds"))
        family(p + "time_per_output_token_seconds", "histogram",
               "Mean decode time per generated token, one observation per request.",
               self.tpot.lines(p + "time_per_output_token_seconds"))
        reqs, hits, read = self._provider()
        family(p + "expert_requests_total", "counter", "Experts asked of the provider.",
               [f"{p}expert_requests_total {reqs}"])
        family(p + "expert_hits_total", "counter", "Experts found resident, by tier.",
               [f'{p}expert_hits_total{{tier="{_label(k)}"}} {v}' for k, v in sorted(hits.items())])
        family(p + "expert_hit_rate", "gauge", "Share of expert requests a tier served, since start.",
               [f'{p}expert_hit_rate{{tier="{_label(k)}"}} {_num(v / reqs if reqs else 0.0)}'
                for k, v in sorted(hits.items())])
        family(p + "expert_read_bytes_total", "counter", "Bytes of experts read from storage.",
               [f"{p}expert_read_bytes_total {read}"])
        family(p + "queue_waiting", "gauge", "Requests waiting for the model.",
               [f"{p}queue_waiting {self._waiting()}"])
        family(p + "requests_running", "gauge", "Generations running.",
               [f"{p}requests_running {self._running()}"])
        return "\n".join(lines) + "\n"

    async def handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.render().encode(), headers={"Content-Type": CONTENT_TYPE})
