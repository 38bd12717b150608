"""``/metrics``: the Prometheus text format, parsed by ``prometheus_client``'s parser, with the
requests counted by endpoint and status, the tokens, the latency histograms and the expert
provider's counters."""

from __future__ import annotations

import json

import pytest

from expertfs.runtime.server.metrics import Histogram
from expertfs.runtime.server.session import Session

from fuzz_serve import FastEngine, Harness, tiny_tokenizer

parser = pytest.importorskip("prometheus_client.parser")


def families(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(fams, name, **labels):
    """The sum of the samples called ``name`` with ``labels`` (one must exist)."""
    got = [s.value for f in fams.values() for s in f.samples if s.name == name
           and all(s.labels.get(k) == v for k, v in labels.items())]
    assert got, f"no sample {name} {labels}"
    return sum(got)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tok = tiny_tokenizer(tmp_path_factory.mktemp("metrics"))
    eng = FastEngine(tok.n_vocab)
    h = Harness(Session(eng, tok), timeout=20)
    yield h, eng
    h.close()


def _call(h, method, path, body=None):
    async def go():
        async with h.client.request(method, path, data=json.dumps(body) if body else None,
                                    headers={"Content-Type": "application/json"}) as r:
            return r.status, r.headers, await r.read()
    return h.loop.run_until_complete(go())


def test_metrics_parse_and_count_what_was_served(harness):
    h, eng = harness
    eng.provider.stats.requests, eng.provider.stats.hits = 40, {"vram": 10, "ram": 20}
    eng.provider.stats.bytes_read = 12345
    msg = [{"role": "user", "content": "hi"}]
    out = []
    for _ in range(2):
        status, _, raw = _call(h, "POST", "/v1/chat/completions", {"messages": msg, "max_tokens": 3})
        assert status == 200
        out.append(json.loads(raw)["usage"])
    status, _, raw = _call(h, "POST", "/v1/messages", {"messages": msg, "max_tokens": 3})
    assert status == 200
    u = json.loads(raw)["usage"]
    assert _call(h, "POST", "/v1/messages", {"messages": msg})[0] == 400
    assert _call(h, "GET", "/nowhere")[0] == 404
    status, headers, raw = _call(h, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    fams = families(raw.decode())
    req = "expertfs_requests_total"
    assert value(fams, req, endpoint="/v1/chat/completions", status="200") == 2
    assert value(fams, req, endpoint="/v1/messages", status="200") == 1
    assert value(fams, req, endpoint="/v1/messages", status="400") == 1
    assert value(fams, req, endpoint="other", status="404") == 1
    assert value(fams, "expertfs_generation_tokens_total") == \
        sum(o["completion_tokens"] for o in out) + u["output_tokens"]
    assert value(fams, "expertfs_prompt_tokens_total") == \
        sum(o["prompt_tokens"] for o in out) + u["input_tokens"]
    ttft = "expertfs_time_to_first_token_seconds"
    assert value(fams, ttft + "_count") == 3
    assert value(fams, ttft + "_bucket", le="+Inf") == 3
    assert value(fams, "expertfs_expert_hit_rate", tier="ram") == pytest.approx(0.5)
    assert value(fams, "expertfs_expert_hits_total", tier="vram") == 10
    assert value(fams, "expertfs_expert_read_bytes_total") == 12345
    assert value(fams, "expertfs_queue_waiting") == 0
    assert value(fams, "expertfs_requests_running") == 0


def test_histogram_buckets_are_cumulative():
    hist = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 7.0, float("nan")):
        hist.observe(v)
    lines = hist.lines("x")
    assert lines[:3] == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1"} 3', 'x_bucket{le="+Inf"} 4']
    assert lines[-1] == "x_count 4"
