#!/usr/bin/env python3
"""Load test of ``expertfs serve`` on loopback: N concurrent clients for T seconds.

Starts the server on a store, then each client loops: a chat completion (half of them
streamed), and every fifth request a malformed one; a 503 is retried after its Retry-After. Every request has a client timeout, so a
hang shows up as a failure, not a stuck benchmark. Reports per status code counts, latency
percentiles, tokens/s, and whether anything went unanswered or was not JSON.

    python bench/serve_load.py STORE --clients 16 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client(i: int, base: str, until: float, timeout: float, out: dict) -> None:
    rng = random.Random(i)
    to = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=to) as s:
        k = 0
        while time.monotonic() < until:
            k += 1
            bad = k % 5 == 0
            stream = rng.random() < 0.5
            body = ({"messages": "oops"} if bad else
                    {"messages": [{"role": "user", "content": f"client {i} request {k}"}],
                     "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7]),
                     "stream": stream})
            t0 = time.perf_counter()
            try:
                async with s.post(f"{base}/v1/chat/completions", json=body) as r:
                    raw = await r.read()
                    dt = time.perf_counter() - t0
                    out["status"][r.status] += 1
                    out["lat"].append(dt)
                    if r.status == 503:            # a polite client honours Retry-After
                        await asyncio.sleep(float(r.headers.get("Retry-After", 1)) * rng.uniform(0.5, 1.5))
                    if r.status == 200 and stream:
                        ok = raw.rstrip().endswith(b"data: [DONE]")
                        out["bad_body"] += 0 if ok else 1
                    else:
                        try:
                            obj = json.loads(raw)
                            if r.status == 200:
                                out["tokens"] += obj["usage"]["completion_tokens"]
                            elif "error" not in obj:
                                out["bad_body"] += 1
                        except (ValueError, KeyError):
                            out["bad_body"] += 1
            except asyncio.TimeoutError:
                out["timeouts"] += 1
            except aiohttp.ClientError as e:
                out["conn_errors"][type(e).__name__] += 1


async def drive(base: str, clients: int, seconds: float, timeout: float) -> dict:
    out = {"status": Counter(), "lat": [], "tokens": 0, "bad_body": 0, "timeouts": 0,
           "conn_errors": Counter()}
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(i, base, until, timeout, out) for i in range(clients)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--timeout", type=float, default=120, help="per-request client timeout")
    ap.add_argument("--max-waiting", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "expertfs")
    srv = subprocess.Popen([exe, "serve", a.store, "--port", str(port), "--max-waiting",
                            str(a.max_waiting), "--queue-timeout", "60"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if srv.poll() is not None:
                    raise SystemExit(f"server exited: {srv.stderr.read()}")
                time.sleep(0.1)
        t0 = time.perf_counter()
        res = asyncio.run(drive(base, a.clients, a.seconds, a.timeout))
        wall = time.perf_counter() - t0
        alive = srv.poll() is None
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    lat = sorted(res["lat"]) or [0.0]
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
    summary = {"clients": a.clients, "seconds": wall, "requests": len(res["lat"]),
               "status": dict(res["status"]), "timeouts": res["timeouts"],
               "conn_errors": dict(res["conn_errors"]), "bad_bodies": res["bad_body"],
               "completion_tokens_per_s": res["tokens"] / wall, "server_alive": alive,
               "latency_s": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": lat[-1]}}
    ok = alive and not res["timeouts"] and not res["conn_errors"] and not res["bad_body"] \
        and set(res["status"]) <= {200, 400, 503}
    summary["ok"] = ok
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:>24}: {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
