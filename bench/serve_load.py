#!/usr/bin/env python3
"""Load test of ``expertfs serve`` on loopback: N concurrent clients for T seconds.

A share of the clients (``--disconnect-frac``) stream and hang up after 1-3 content chunks;
the rest send whole and streamed chat completions, every fifth one malformed, and retry a 503
after its Retry-After. Every request has a client timeout, so a hang is counted, not waited
on. ``/metrics`` is scraped every second and parsed with ``prometheus_client``'s parser.
Reported: status counts, 5xx, hangs, requests answered twice or not at all (the server's
``requests_total`` against what the clients sent), time to first content chunk and latency
percentiles, and leaked generations: isolated disconnect probes on the idle server read the
cancelled generation's tokens, time to first token and time per token from ``/metrics`` to
tell how many decodes started after the hang-up, and ``generation_tokens_total`` must stay
still for a second once the server is idle. ``--soak S`` runs S seconds; the server's RSS is
sampled every second (first-third and last-third medians, max).

    python bench/serve_load.py STORE --clients 16 --seconds 60 --json
    python bench/serve_load.py STORE --clients 16 --soak 180 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

try:
    import psutil
except ImportError:                            # pragma: no cover - /proc fallback
    psutil = None

P = "expertfs_"
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape by (name, labels); raises on text the parser refuses."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def val(m: dict, name: str, **labels: str) -> float:
    return m.get((P + name, frozenset(labels.items())), 0.0)


def answered(m: dict) -> float:
    """Chat requests the server has answered, whatever the status (499: the client left)."""
    return sum(v for (n, lab), v in m.items() if n == P + "requests_total" and ("endpoint", CHAT) in lab)


async def scrape(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(f"{base}/metrics") as r:
        return parse_metrics(await r.text())


def rss_of(pid: int) -> int:
    if psutil is not None:
        return psutil.Process(pid).memory_info().rss
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def events(raw: bytes) -> list[dict]:
    return [json.loads(b[6:]) for b in raw.decode("utf-8", "replace").split("\n\n")
            if b.startswith("data: {")]


def content_of(ev: dict) -> str:
    ch = ev.get("choices") or [{}]
    return (ch[0].get("delta") or {}).get("content") or ""


async def hang_up(s: aiohttp.ClientSession, url: str, body: dict, chunks: int) -> dict:
    """Stream ``body`` and close the connection after ``chunks`` content chunks."""
    rec = {"t_send": time.perf_counter(), "ttft": None, "seen": 0, "status": None}
    r = await s.post(url, json=body)
    rec["status"] = r.status
    rec["retry_after"] = r.headers.get("Retry-After")
    try:
        if r.status != 200:
            await r.read()
            return rec
        async for line in r.content:
            if line.startswith(b"data: {") and content_of(json.loads(line[6:])):
                rec["seen"] += 1
                if rec["ttft"] is None:
                    rec["ttft"] = time.perf_counter() - rec["t_send"]
                if rec["seen"] >= chunks:
                    break
    finally:
        r.close()                              # drops the connection, not back to the pool
        rec["t_close"] = time.perf_counter()
    return rec


async def client(i: int, base: str, until: float, a: argparse.Namespace, out: dict) -> None:
    rng, leaver = random.Random(i), i < round(a.clients * a.disconnect_frac)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.timeout)) as s:
        k = 0
        while time.monotonic() < until:
            k, t0 = k + 1, time.perf_counter()
            msg = [{"role": "user", "content": f"client {i} request {k}"}]
            out["sent"] += 1
            try:
                if leaver:
                    rec = await hang_up(s, base + CHAT, {"messages": msg, "stream": True, "max_tokens":
                                        a.leave_tokens, "temperature": 0.7}, rng.randint(1, 3))
                    out["status"][rec["status"]] += 1
                    if rec["status"] == 200:
                        out["disconnects"] += 1
                        if rec["ttft"] is not None:
                            out["ttft"].append(rec["ttft"])
                    await polite(rec["status"], {"Retry-After": rec["retry_after"]}, rng, out)
                    continue
                bad, stream = k % 5 == 0, rng.random() < 0.5
                body = ({"messages": "oops"} if bad else
                        {"messages": msg, "max_tokens": rng.randint(4, 24),
                         "temperature": rng.choice([0, 0.7]), "stream": stream,
                         **({"stream_options": {"include_usage": True}} if stream else {})})
                async with s.post(base + CHAT, json=body) as r:
                    first, chunks = None, []
                    if r.status == 200 and stream:
                        async for line in r.content:
                            chunks.append(line)
                            if first is None and line.startswith(b"data: {") and \
                                    content_of(json.loads(line[6:])):
                                first = time.perf_counter() - t0
                        raw = b"".join(chunks)
                    else:
                        raw = await r.read()
                    out["lat"].append((r.status, time.perf_counter() - t0))
                    out["status"][r.status] += 1
                    if first is not None:
                        out["ttft"].append(first)
                    judge(r.status, stream and not bad, raw, out)
                    await polite(r.status, r.headers, rng, out)
            except asyncio.TimeoutError:
                out["hangs"] += 1
            except aiohttp.ClientError as e:
                out["conn_errors"][type(e).__name__] += 1


def judge(status: int, stream: bool, raw: bytes, out: dict) -> None:
    """Count completion tokens, and bodies that are not one whole answer."""
    try:
        if status == 200 and stream:
            ev, done = events(raw), raw.count(b"data: [DONE]")
            fins = sum(1 for e in ev for c in e.get("choices") or [] if c.get("finish_reason"))
            usage = [e["usage"] for e in ev if e.get("usage")]
            if done > 1 or fins > 1 or len(usage) > 1:
                out["twice"] += 1
            elif not (done == 1 and raw.rstrip().endswith(b"data: [DONE]") and fins == 1
                      and usage):
                out["bad_body"] += 1
            else:
                out["tokens"] += usage[0]["completion_tokens"]
            return
        obj = json.loads(raw)
        if status == 200:
            out["tokens"] += obj["usage"]["completion_tokens"]
        elif "error" not in obj:
            out["bad_body"] += 1
    except (ValueError, KeyError, TypeError):
        out["bad_body"] += 1


async def polite(status: int, headers, rng: random.Random, out: dict | None = None) -> None:
    if status != 503:
        return
    ra = headers.get("Retry-After")
    if out is not None:
        out["retry_after"] += ra is not None
    await asyncio.sleep(float(ra or 1) * rng.uniform(0.5, 1.5))


async def watcher(base: str, stop: asyncio.Event, pid: int, out: dict) -> None:
    """Scrape and parse ``/metrics`` every second; sample the server's RSS alongside."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        while not stop.is_set():
            try:
                async with s.get(f"{base}/metrics") as r:
                    text = await r.text()
                    ok = r.status == 200
                parse_metrics(text)
                out["scrapes"] += 1
                out["scrape_fail"] += 0 if ok else 1
            except Exception:                  # noqa: BLE001 - any failure is counted
                out["scrape_fail"] += 1
            with contextlib.suppress(OSError, ValueError):
                out["rss"].append(rss_of(pid))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def idle(s: aiohttp.ClientSession, base: str, wait: float = 30.0) -> dict:
    """The metrics once nothing runs or waits (or ``wait`` seconds passed)."""
    end = time.monotonic() + wait
    while not (val(m := await scrape(s, base), "requests_running") == 0
               and val(m, "queue_waiting") == 0) and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return m


async def probe(s: aiohttp.ClientSession, base: str, chunks: int, max_tokens: int) -> dict:
    """One disconnect on an idle server: tokens decoded after the hang-up, from ``/metrics``."""
    m0, msg = await idle(s, base), [{"role": "user", "content": f"probe {time.time()}"}]
    rec = await hang_up(s, base + CHAT, {"messages": msg, "max_tokens": max_tokens,
                                         "stream": True, "temperature": 0.7}, chunks)
    await asyncio.sleep(0.3)                   # no scrape competes with the server meanwhile
    end = time.monotonic() + 30
    while True:                                # until the generation is accounted for
        m1 = await scrape(s, base)
        if val(m1, "time_to_first_token_seconds_count") > \
                val(m0, "time_to_first_token_seconds_count") and \
                val(m1, "requests_running") == 0 or time.monotonic() > end:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    m2 = await scrape(s, base)
    d = lambda m, n: val(m, n) - val(m0, n)    # noqa: E731
    n = d(m1, "generation_tokens_total")
    ttft = d(m1, "time_to_first_token_seconds_sum")
    tpot = d(m1, "time_per_output_token_seconds_sum")
    stop_at = rec["t_send"] + ttft + tpot * max(1, n)   # when the server's decoding ended
    after = (stop_at - rec["t_close"]) / tpot if tpot > 0 else float("inf")
    # decodes start one token time apart and the last ends at stop_at: floor(after) of them
    # started after the hang-up; the one in flight when it came is not counted
    started = max(0, math.floor(after)) if math.isfinite(after) else 10**9
    return {"chunks_seen": rec["seen"], "tokens": int(n), "per_token_ms": 1e3 * tpot,
            "ended_before_hang_up": rec["seen"] < chunks,     # not a disconnect: not judged
            "decode_after_disconnect_token_times": round(after, 2),
            "tokens_started_after_disconnect": started,
            "cancelled": int(d(m1, "generations_cancelled_total")),
            "moved_after_1s": int(val(m2, "generation_tokens_total")
                                  - val(m1, "generation_tokens_total")),
            "running_after_1s": int(val(m2, "requests_running"))}


async def drive(base: str, a: argparse.Namespace, seconds: float, pid: int) -> dict:
    out = {"status": Counter(), "lat": [], "ttft": [], "tokens": 0, "bad_body": 0, "hangs": 0,
           "twice": 0, "sent": 0, "disconnects": 0, "retry_after": 0,
           "conn_errors": Counter(), "scrapes": 0, "scrape_fail": 0, "rss": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        m0, stop = await scrape(s, base), asyncio.Event()
        w = asyncio.ensure_future(watcher(base, stop, pid, out))
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(i, base, until, a, out) for i in range(a.clients)))
        m1 = await idle(s, base)
        await asyncio.sleep(1.0)
        m2 = await scrape(s, base)
        stop.set()
        await w
        out["probes"] = [await probe(s, base, c % 3 + 1, a.leave_tokens)
                         for c in range(a.probes)]
    out["server_answered"] = int(answered(m1) - answered(m0))
    out["server_status"] = {dict(lab)["status"]: int(v - m0.get((n, lab), 0)) for (n, lab), v
                            in m1.items() if n == P + "requests_total" and ("endpoint", CHAT) in lab}
    gen = val(m1, "generation_tokens_total") - val(m0, "generation_tokens_total")
    out["cancelled"] = int(val(m1, "generations_cancelled_total")
                           - val(m0, "generations_cancelled_total"))
    out["tokens_in_cancelled"] = int(gen - out["tokens"])
    out["idle_moved_after_1s"] = int(val(m2, "generation_tokens_total")
                                     - val(m1, "generation_tokens_total"))
    out["idle_running"] = int(val(m1, "requests_running") + val(m1, "queue_waiting"))
    return out


def pct(xs: list[float]) -> dict:
    xs = sorted(xs) or [0.0]
    q = lambda p: round(xs[min(len(xs) - 1, int(p * len(xs)))], 4)  # noqa: E731
    return {"n": len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(xs[-1], 4)}


def memory(rss: list[int]) -> dict:
    if len(rss) < 3:
        return {"samples": len(rss)}
    t, mib = len(rss) // 3, lambda v: round(v / 2**20, 1)
    first, last = statistics.median(rss[:t]), statistics.median(rss[-t:])
    return {"samples": len(rss), "first_third_median_mib": mib(first),
            "last_third_median_mib": mib(last), "max_mib": mib(max(rss)),
            "growth_pct": round(100 * (last - first) / first, 2)}


def summarize(a: argparse.Namespace, res: dict, wall: float, alive: bool) -> dict:
    st = res["status"]
    fivexx, all5 = (sum(n for c, n in st.items() if c >= 500 and c != x) for x in (503, 0))
    probes, lost = res["probes"], res["sent"] - res["server_answered"]
    worst = max((p["tokens_started_after_disconnect"] for p in probes), default=None)
    leaks = sum(1 for p in probes if p["moved_after_1s"] or not p["ended_before_hang_up"] and (
        p["tokens_started_after_disconnect"] > a.max_after
        or p["cancelled"] != 1 or p["running_after_1s"]))
    s = {"clients": a.clients, "disconnect_frac": a.disconnect_frac, "seconds": round(wall, 1),
         "requests_sent": res["sent"], "server_answered": res["server_answered"],
         "status": {str(k): v for k, v in sorted(st.items(), key=lambda kv: str(kv[0]))},
         "server_status": res["server_status"], "5xx": all5, "server_errors_5xx_not_503": fivexx,
         "overload_503": st.get(503, 0), "overload_503_with_retry_after": res["retry_after"],
         "hangs": res["hangs"], "conn_errors": dict(res["conn_errors"]),
         "answered_twice": res["twice"], "unanswered_or_lost": lost,
         "bad_bodies": res["bad_body"], "disconnects": res["disconnects"],
         "generations_cancelled": res["cancelled"],
         "tokens_per_cancelled_generation": round(
             res["tokens_in_cancelled"] / res["cancelled"], 2) if res["cancelled"] else None,
         "idle_tokens_moved_after_1s": res["idle_moved_after_1s"],
         "disconnect_probes": probes, "worst_tokens_started_after_disconnect": worst,
         "leaked_generations": leaks + (1 if res["idle_moved_after_1s"] else 0),
         "completion_tokens_per_s": round(res["tokens"] / wall, 1),
         "ttft_s": pct(res["ttft"]), "latency_s": pct([d for _, d in res["lat"]]),
         "latency_200_s": pct([d for c, d in res["lat"] if c == 200]),
         "metrics_scrapes": res["scrapes"], "metrics_parse_failures": res["scrape_fail"],
         "rss": memory(res["rss"]), "server_alive": alive}
    ok = (alive and not fivexx and not res["hangs"] and not res["conn_errors"]
          and not res["bad_body"] and not res["twice"] and lost == 0 and not res["idle_running"]
          and not s["leaked_generations"] and not res["scrape_fail"] and res["scrapes"] > 0
          and set(st) <= {200, 400, 503} and (st.get(503, 0) == res["retry_after"]))
    if a.max_growth is not None:
        ok = ok and s["rss"].get("growth_pct", 0) <= a.max_growth
    return {**s, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                    help="run this long instead of --seconds, sampling the server's RSS")
    ap.add_argument("--disconnect-frac", type=float, default=0.33,
                    help="share of clients that hang up after 1-3 content chunks")
    ap.add_argument("--leave-tokens", type=int, default=256, help="max_tokens of a hang-up")
    ap.add_argument("--probes", type=int, default=6, help="disconnect probes on the idle server")
    ap.add_argument("--max-after", type=int, default=1,
                    help="most decodes a probe may start after its client hung up")
    ap.add_argument("--max-growth", type=float, help="fail past this RSS growth (percent)")
    ap.add_argument("--timeout", type=float, default=120, help="per-request client timeout")
    ap.add_argument("--max-waiting", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    port, exe = free_port(), os.path.join(os.path.dirname(sys.executable), "expertfs")
    log = tempfile.TemporaryFile(mode="w+")    # a pipe nobody reads could stall the server
    srv = subprocess.Popen([exe, "serve", a.store, "--host", "127.0.0.1", "--port", str(port),
                            "--max-waiting", str(a.max_waiting), "--queue-timeout", "60"],
                           stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if srv.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"server exited: {log.read()}")
                time.sleep(0.1)
        t0 = time.perf_counter()
        res = asyncio.run(drive(base, a, a.soak or a.seconds, srv.pid))
        wall, alive = time.perf_counter() - t0, srv.poll() is None
    finally:
        srv.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            srv.wait(timeout=30)
        srv.kill()
    log.seek(0)
    lines, summary = log.read().splitlines(), summarize(a, res, wall, alive)
    # the exception line that ends each traceback the server logged
    excs = Counter(x.split(":")[0] for i, x in enumerate(lines) if x and x[0] != " " and i
                   and lines[i - 1].startswith(" ") and "Traceback" not in x)
    summary["server_tracebacks"] = dict(excs)
    gone = ("aiohttp.client_exceptions.ClientConnectionResetError", "ConnectionResetError")
    summary["ok"] = summary["ok"] and all(k in gone for k in excs)
    for k, v in ([] if a.json else summary.items()):
        print(f"{k:>40}: {v}")
    if a.json:
        print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
