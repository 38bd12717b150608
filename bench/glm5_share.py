#!/usr/bin/env python3
"""Where a GLM-5 token's time goes: the KDA, indexer, MLA and mHC shares of a decode step.

The runtime keeps no per-layer-kind timers, so this wraps the functions the glm5-next and
glm-dsa forwards call (``runtime.model.archs.glm5_next`` / ``glm_dsa``: ``kda_attention``,
``kpool_select`` / ``indexer_select``, ``mla_attention``, ``hc_block``) with wall-clock timers,
in one process, the store resident (every expert in the RAM tier before the prompt), after
an untimed warm-up. MLA is reported without the indexer it calls; mHC is ``hc_block`` less the
attention or FFN it wraps; "rest" is everything else of the step (MoE and dense FFN, router,
embedding, output head, sampling-free argmax). CPU only (no device sync). The timers
themselves cost a few microseconds per call, so the sum runs slightly slow; shares are what
this prints, beside plain (untimed) rounds for reference.

    .venv/bin/python bench/glm5_share.py STORE.efs -n 16 --prompt-tokens 128 -t 2

``--before DIR`` (copies of earlier ``runtime/model/{kda,mla,mhc}.py``, e.g. from ``git show``)
instead alternates whole rounds (a prefill of the prompt, then ``-n`` decode steps) between
those modules and the working tree's in the same engine, ``--rounds`` each: the earlier
version runs with float ``attn_k_b``/``attn_v_b``, as its loader held them. Medians per token.
"""

from __future__ import annotations

import json
import os
import sys
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch


class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.inner = 0.0                     # time of callees to subtract from the current span

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            outer, self.inner = self.inner, 0.0
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.t[name] = self.t.get(name, 0.0) + dt - self.inner
                self.inner = outer + dt
        return timed


def install(timers: Timers) -> None:
    from expertfs.runtime.model.archs import glm5_next as g5
    from expertfs.runtime.model.archs import glm_dsa as gd
    for mod in (g5, gd):
        for fn, name in (("kda_attention", "KDA"), ("kpool_select", "indexer"),
                         ("indexer_select", "indexer"), ("mla_attention", "MLA")):
            if hasattr(mod, fn):
                setattr(mod, fn, timers.wrap(name, getattr(mod, fn)))
    orig = g5.hc_block

    def hc_block(s, w, cfg, fn):                # the wrapped attention/FFN is not mHC time
        inner = [0.0]

        def timed_fn(h):
            t1 = time.perf_counter()
            try:
                return fn(h)
            finally:
                inner[0] += time.perf_counter() - t1
        t0 = time.perf_counter()
        try:
            return orig(s, w, cfg, timed_fn)
        finally:
            dt = time.perf_counter() - t0 - inner[0]
            timers.t["mHC"] = timers.t.get("mHC", 0.0) + dt

    g5.hc_block = hc_block


def before_mode(eng, folder: str):
    """A switch between the earlier modules in ``folder`` and the working tree's (``on``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from glm5_parts_ab import load_before

    from expertfs.runtime.model.archs import glm5_next as g5
    from expertfs.runtime.model.archs import glm_dsa as gd
    old = {m: load_before(folder, m) for m in ("kda", "mla", "mhc")}
    names = [(g5, "kda_attention", old["kda"].kda_attention),
             (g5, "mla_attention", old["mla"].mla_attention),
             (g5, "hc_block", old["mhc"].hc_block), (gd, "mla_attention", old["mla"].mla_attention)]
    now = [(mod, n, getattr(mod, n)) for mod, n, _ in names]
    heads = []
    for blk in eng.model.trunk.blocks:
        w = getattr(blk.attn, "attn", blk.attn)
        if hasattr(w, "k_b"):
            heads.append((w, w.k_b, w.v_b, w.k_b.dense(), w.v_b.dense()))

    def switch(before: bool) -> None:
        for mod, n, fn in names if before else now:
            setattr(mod, n, fn)
        for w, kb, vb, kf, vf in heads:
            w.k_b, w.v_b = (kf, vf) if before else (kb, vb)
    return switch


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_products import resident, resident_args, timed_decode
    ap = resident_args(__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--before", help="folder of earlier kda/mla/mhc.py: alternate A/B rounds")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds per version")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    eng, prompt, steps = resident(a.store, a.act_quant, a.prompt_tokens, a.n)
    timed_decode(eng, prompt, steps[:2])             # warm-up
    if a.before:
        return ab(eng, a, prompt, steps)
    plain = min(timed_decode(eng, prompt, steps) for _ in range(2))
    timers = Timers()
    install(timers)
    total = timed_decode(eng, prompt, steps, timers.t.clear)
    eng.close()
    t = dict(timers.t)
    t["rest"] = total - sum(t.values())
    res = {"store": a.store, "n": a.n, "prompt_tokens": a.prompt_tokens, "threads": a.threads,
           "plain_ms_per_token": 1e3 * plain / a.n, "timed_ms_per_token": 1e3 * total / a.n,
           "ms_per_token": {k: 1e3 * v / a.n for k, v in t.items()},
           "share": {k: v / total for k, v in t.items()}, "load_avg": os.getloadavg()}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{a.store}: decode after a {a.prompt_tokens}-token prompt, {a.n} steps, "
          f"{a.threads} threads; plain {res['plain_ms_per_token']:.1f} ms/token, timed "
          f"{res['timed_ms_per_token']:.1f}; load average {res['load_avg'][0]:.1f}")
    for k, v in sorted(res["ms_per_token"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:8s} {v:8.2f} ms/token  {100 * res['share'][k]:5.1f}%")
    return 0


def ab(eng, a, prompt: list[int], steps: list[int]) -> int:
    import statistics
    switch = before_mode(eng, a.before)
    ts: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []}
                                             for k in ("before", "after")}
    for r in range(a.rounds):
        for k in (("before", "after") if r % 2 == 0 else ("after", "before")):
            switch(k == "before")
            eng.reset()
            t0 = time.perf_counter()
            eng.prefill(prompt)
            t1 = time.perf_counter()
            for t in steps:
                eng.decode(t)
            ts[k]["prefill"].append(1e3 * (t1 - t0) / len(prompt))
            ts[k]["decode"].append(1e3 * (time.perf_counter() - t1) / len(steps))
    switch(False)
    eng.close()
    res = {"store": a.store, "rounds": a.rounds, "n": a.n, "prompt_tokens": a.prompt_tokens,
           "threads": a.threads, "ms_per_token": {k: {p: {"median": statistics.median(v),
                                                          "all": v} for p, v in d.items()}
                                                  for k, d in ts.items()},
           "load_avg": os.getloadavg()}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{a.store}: {a.rounds} alternating rounds, {a.threads} threads, load average "
          f"{res['load_avg'][0]:.1f}")
    for p in ("prefill", "decode"):
        b, f = (res["ms_per_token"][k][p] for k in ("before", "after"))
        print(f"  {p:8s} ms/token before {b['median']:8.1f} "
              f"({', '.join(f'{x:.0f}' for x in b['all'])})  after {f['median']:8.1f} "
              f"({', '.join(f'{x:.0f}' for x in f['all'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
