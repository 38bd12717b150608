#!/usr/bin/env python3
"""A CPU run's anonymous memory by stage: what a memory cap cannot evict (no swap), unlike the
trunk's file pages. The RAM tier is anonymous too: it is in the "open" stage.

In one process, ``RssAnon`` from ``/proc/self/status`` after ``import torch``, after the
tokenizer, after ``Engine.open`` (``run``'s fallback tier, no warm start, nothing recorded;
once the tier's background fault-in is done), at the
peak of a prompt's prefill (sampled every half millisecond on a thread) and after it and a
few decode tokens. ``expertfs plan``'s resident floor (``runtime.memory.runtime_resident``)
and workspace (``plan.host.workspace_bytes``) are the model of these figures; where a run
under a cap dies is ``bench/working_set.py``'s to find.

    .venv/bin/python bench/resident_stages.py STORE.efs [STORE.efs ...] --prompt-tokens 103
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lowram import PROSE  # noqa: E402  (bench_plan's prompt: words that rarely repeat)


def anon_mib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) >> 10


def settled_anon_mib(timeout: float = 30.0) -> int:
    """``anon_mib`` once it held still for 0.3 s (the RAM tier's pages are faulted in by a
    background thread after open: a prefill measured before it ends counts them as its own)."""
    end, last, same = time.monotonic() + timeout, anon_mib(), 0
    while same < 3 and time.monotonic() < end:
        time.sleep(0.1)
        now = anon_mib()
        same, last = (same + 1, now) if now == last else (0, now)
    return last


def stages(path: str, n: int) -> dict[str, int]:
    from expertfs.runtime.engine import Engine
    from expertfs.runtime.memory import fallback_slab
    from expertfs.runtime.plan.model import geometry_of_store
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.store.reader import Store
    out = {"torch": anon_mib()}
    with Store.open(path) as st:
        tok = GGUFTokenizer(st.gguf_kv(), path)
        out["tokenizer"] = anon_mib()
        g = geometry_of_store(st)                 # run's slot and k (cli._tiers)
    eng = Engine.open(path, provider="tiered", ram_bytes=fallback_slab(g.slot_bytes, g.k),
                      provider_options={"warm_start": False, "record_usage": False})
    out["open"] = settled_anon_mib()          # the tier's background fault-in finished
    ids = tok.encode(" ".join([PROSE] * (1 + n // 150)))[:n]
    peak, stop = [out["open"]], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.0005)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    eng.prefill(ids)
    for _ in range(4):
        eng.decode(ids[-1])
    stop.set()
    th.join()
    out["prefill_peak"], out["after"] = peak[0], anon_mib()
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--prompt-tokens", type=int, default=103)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child's row
    a = ap.parse_args()
    if a.one:
        import torch  # noqa: F401  (the first stage is torch's own)
        r = stages(a.stores[0], a.prompt_tokens)
        s = a.stores[0]
        print(f"{s[-24:]:>24} {r['torch']:>6} {r['tokenizer'] - r['torch']:>5} "
              f"{r['open'] - r['tokenizer']:>6} {r['prefill_peak'] - r['open']:>6} "
              f"{r['after'] - r['open']:>7}", flush=True)
        return 0
    print(f"{'store':>24} {'torch':>6} {'+tok':>5} {'+open':>6} {'+peak':>6} {'+after':>7} MiB",
          flush=True)
    for s in a.stores:                       # each in a process of its own, from a clean start
        subprocess.run([sys.executable, __file__, s, "--one", "--prompt-tokens",
                        str(a.prompt_tokens)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
