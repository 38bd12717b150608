#!/usr/bin/env python3
"""The per-sequence state a long context costs, measured, against what ``expertfs plan`` says.

For a store (default: a GLM-5.3-Flash cut synthesised with the real attention geometry: KDA
layers with their recurrent state and conv windows, MLA layers with the compressed latent
cache and the DSA indexer's pooled keys), in one process on the CPU:

1. ``Engine.open`` at ``--ctx`` and a short prompt (everything built and compiled);
2. the KV cache grown to the whole context the way a long conversation grows it (doubling,
   each step copying what is held: the growth peak ``plan`` reserves for), every position
   then written (as 64K tokens would have written them: the cache's pages are the kernel's
   zero pages until written), and one decode step at the last position of the context (the
   indexer's selection and the attention over every position: the activations a full
   context needs);
3. the state held (the cache's tensors and the recurrent state, ``KVCache.nbytes``), the
   process's resident memory it added (``VmRSS``), and the peak during 2 (``VmHWM``, reset
   before), each against ``plan``'s ``kv_cache_bytes`` at the same ``--ctx`` (and the peak
   against its reserve, ``kv_cache_bytes`` x ``kv_growth_peak`` for the part that grows).

    .venv/bin/python bench/state_at_ctx.py --dir /work/scratch/ctx --ctx 65536 [--layers 8]
    .venv/bin/python bench/state_at_ctx.py --store S.efs --ctx 65536 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start ``VmHWM`` over from the current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_store(a: argparse.Namespace) -> str:
    from expertfs.synth import SynthConfig, synthesize
    os.makedirs(a.dir, exist_ok=True)
    gguf = os.path.join(a.dir, f"{a.like}-{a.layers}l.gguf".replace("/", "_"))
    store = gguf[:-5] + ".efs"
    if not os.path.exists(store):
        if not os.path.exists(gguf):
            cfg = SynthConfig.like(a.like, layers=a.layers, quant=a.quant, n_experts=a.experts,
                                   n_vocab=a.vocab, n_nextn=0)
            synthesize(cfg, gguf)
        subprocess.run([os.path.join(BIN, "expertfs"), "repack", gguf, "-o", store],
                       check=True, stdout=subprocess.DEVNULL)
    return store


def plan_prediction(store: str, ctx: int) -> dict:
    out = subprocess.run([os.path.join(BIN, "expertfs"), "plan", store, "--ctx", str(ctx),
                          "--vram", "0", "--no-probe", "--json"],
                         capture_output=True, text=True, check=True).stdout
    j = json.loads(out)
    return {"kv_cache_bytes": j["budget"]["kv_cache_bytes"], "kv_type": j["budget"]["kv_type"],
            "state_bytes": j["model"]["state_bytes"],
            "growth_peak": j["assumptions"]["kv_growth_peak"]}


def measure(store: str, ctx: int, threads: int) -> dict:
    import torch
    from expertfs.runtime.engine import Engine
    from expertfs.runtime.memory import kv_reserve
    torch.set_num_threads(threads)
    eng = Engine.open(store, n_ctx=ctx, ram_bytes=256 << 20,
                      provider_options={"warm_start": False, "record_usage": False})
    try:
        prompt = list(range(10, 74))
        logits = eng.prefill(prompt)
        cache = eng.model.cache
        held0 = cache.nbytes                  # the cache at its first capacity, the state
        gc.collect()
        rss0 = status("VmRSS")
        reset_peak()
        cap = cache.capacity
        while cap < ctx:                      # the growth a long conversation makes
            cap = min(ctx, 2 * cap)
            cache.reserve(cap - cache.pos)
        grown = status("VmRSS") - rss0 + held0
        for t in (*cache.k, *cache.v, *(t for ts in cache.streams.values() for t in ts)):
            if t is not None:
                t[:, cache.pos:].zero_()      # written, as a full context writes them
        cache.pos = ctx - 1                   # the last position of a full context
        logits = eng.decode(int(logits.argmax()))
        assert cache.pos == ctx and bool(torch.isfinite(logits).all())
        gc.collect()
        rss1, hwm = status("VmRSS"), status("VmHWM")
        held = cache.nbytes
        return {"held_bytes": held, "rss_bytes": rss1 - rss0 + held0, "rss_grown_bytes": grown,
                "peak_bytes": hwm - rss0 + held0, "capacity": cache.capacity,
                "state_bytes": cache.state_bytes,
                "reserve_bytes": kv_reserve(held, cache.state_bytes)}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="an existing store (default: synthesise one in --dir)")
    ap.add_argument("--dir", default="/tmp/expertfs-ctx", help="where to synthesise")
    ap.add_argument("--like", default="GLM-5.3-Flash")
    ap.add_argument("--layers", type=int, default=8,
                    help="decoder layers of the synthesised cut (8: 6 KDA + 2 MLA)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (state does not "
                    "depend on them)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--quant", default="maya-s")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    store = a.store or make_store(a)
    plan = plan_prediction(store, a.ctx)
    m = measure(store, a.ctx, a.threads)
    want = plan["kv_cache_bytes"]
    res = {"store": store, "ctx": a.ctx, "plan": plan, "measured": m,
           "held_over_plan": m["held_bytes"] / want, "rss_over_plan": m["rss_bytes"] / want,
           "peak_over_plan_reserve": m["peak_bytes"] / m["reserve_bytes"]}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    mib = 1 << 20
    print(f"{store}, --ctx {a.ctx}: plan {want / mib:.1f} MiB ({plan['kv_type']}; "
          f"{plan['state_bytes'] / mib:.1f} MiB of it recurrent state)")
    print(f"  held by the runtime   {m['held_bytes'] / mib:9.1f} MiB  "
          f"{res['held_over_plan']:.4f}x plan")
    print(f"  resident after growth {m['rss_grown_bytes'] / mib:9.1f} MiB  (nothing written yet)")
    print(f"  resident memory added {m['rss_bytes'] / mib:9.1f} MiB  "
          f"{res['rss_over_plan']:.4f}x plan")
    print(f"  peak while growing    {m['peak_bytes'] / mib:9.1f} MiB  "
          f"{res['peak_over_plan_reserve']:.4f}x plan's reserve "
          f"({m['reserve_bytes'] / mib:.1f} MiB, growth peak {plan['growth_peak']})")


if __name__ == "__main__":
    main()
