#!/usr/bin/env python3
"""In-process A/B of the glm5-next layer kinds: the working tree's KDA, MLA and mHC against an
earlier version of their modules, on one store's weights, alternating, medians.

The earlier modules are plain copies of ``runtime/model/{kda,mla,mhc}.py`` in a folder, e.g.::

    mkdir -p /tmp/before && for m in kda mla mhc; do
        git show HEAD:runtime/model/$m.py > /tmp/before/$m.py; done
    .venv/bin/python bench/glm5_parts_ab.py STORE.efs --before /tmp/before -T 1 -T 128

Per layer kind, one layer of the store is run on the same input and state by both versions in
turn (``--rounds`` each, the order alternating): KDA (``kda_attention``; the state restored
before every call), MLA (``mla_attention`` at position ``--pos``, dense; an earlier version without
``HeadMatrices`` is given float ``attn_k_b``/``attn_v_b``, as its loader made them), and one mHC mix around an
identity block (``hc_block``). Decode-sized steps (``-T`` up to 8) run torch on one thread, as
the engine does; bigger ones on ``-t`` threads. Prints ms per call and, times the store's
layers of that kind, per forward of T tokens; and the largest difference between the outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import statistics
import sys
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch


def load_before(folder: str, name: str):
    """``folder/name.py`` as a module, its relative imports made absolute."""
    src = open(os.path.join(folder, name + ".py")).read()
    src = re.sub(r"^from \.\.\.(\w)", r"from expertfs.\1", src, flags=re.M)
    src = re.sub(r"^from \.\. import", "from expertfs.runtime import", src, flags=re.M)
    src = re.sub(r"^from \.\.(\w)", r"from expertfs.runtime.\1", src, flags=re.M)
    src = re.sub(r"^from \.(\w)", r"from expertfs.runtime.model.\1", src, flags=re.M)
    spec = importlib.util.spec_from_loader("before_" + name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    exec(compile(src, os.path.join(folder, name + ".py"), "exec"), mod.__dict__)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--before", required=True, help="folder with the earlier kda/mla/mhc.py")
    ap.add_argument("-T", type=int, action="append", help="tokens per call (repeatable)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pos", type=int, default=128, help="cached positions before the call")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from expertfs.runtime import kernels as native
    from expertfs.runtime.model import kda, mhc, mla
    from expertfs.runtime.model.attention import KVCache, causal_mask
    from expertfs.runtime.model.config import ModelConfig
    from expertfs.runtime.model.loader import load_trunk
    from expertfs.runtime.model.rope import Rope
    from expertfs.runtime.model.weights import TrunkReader
    from expertfs.store.reader import Store
    old = {m: load_before(a.before, m) for m in ("kda", "mla", "mhc")}
    native.set_threads(a.threads)
    store = Store.open(a.store)
    reader = TrunkReader(store)
    cfg = ModelConfig.from_gguf(store.gguf_kv(), reader.names(), store.path)
    cpu = torch.device("cpu")
    trunk = load_trunk(reader, cfg, dtype=torch.float32, device=cpu, fused=True, nextn=False)
    g = cfg.ext
    kl = [i for i, m in enumerate(g.mla) if not m]
    ml = [i for i, m in enumerate(g.mla) if m]
    kw, mw = trunk.blocks[kl[0]].attn.attn, trunk.blocks[ml[0]].attn.attn
    hw = trunk.blocks[kl[0]].attn.hc_attn
    mw_old = dataclasses.replace(mw)
    for n in ("k_b", "v_b"):     # an earlier loader's float tensors, before MLA's HeadMatrices
        if not hasattr(old["mla"], "HeadMatrices"):
            raw = reader.get(f"blk.{ml[0]}.attn_{n}.weight")
            object.__setattr__(mw_old, n, raw.to_float(torch.float32, cpu))
    hw_old = old["mhc"].HCWeights(hw.fn, hw.base, hw.scale)
    hcfg_old = old["mhc"].HCConfig(*dataclasses.astuple(g.hc))
    gen = torch.Generator().manual_seed(0)
    states = {}
    for k, mod in (("new", kda), ("old", old["kda"])):
        st = mod.KDAState(g.kda, [kl[0]])
        st.ssm[kl[0]].normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
        st.conv[kl[0]].normal_(0, 1, generator=torch.Generator().manual_seed(4))
        states[k] = (st, st.snapshot())
    rope = Rope(cfg, cpu)
    cache = KVCache(cfg, cfg.n_layers, a.pos + max(a.T or [1]) + 1, torch.float32, cpu)
    cache.k[ml[0]][0, :a.pos] = torch.randn(a.pos, cache.k[ml[0]].shape[-1], generator=gen)
    cache.pos = a.pos
    res: dict = {"store": a.store, "threads": a.threads, "pos": a.pos,
                 "layers": {"KDA": len(kl), "MLA": len(ml), "mHC": 2 * cfg.n_layers}, "T": {}}
    for T in a.T or [1, 128]:
        torch.set_num_threads(1 if T <= 8 else a.threads)
        x = torch.randn(T, cfg.n_embd, generator=gen)
        s = torch.randn(T, g.hc.n_streams, cfg.n_embd, generator=gen)
        cos, sin = rope.tables(a.pos, T)
        mask = causal_mask(a.pos, T, cpu)

        def kda_call(mod, key):
            st, snap = states[key]
            st.restore(snap)
            return mod.kda_attention(x, kw, g.kda, st, kl[0])
        calls = {
            "KDA": {"new": lambda: kda_call(kda, "new"), "old": lambda: kda_call(old["kda"], "old")},
            "MLA": {"new": lambda: mla.mla_attention(x, mw, cfg, rope, cos, sin, cache, ml[0],
                                                     mask, None),
                    "old": lambda: old["mla"].mla_attention(x, mw_old, cfg, rope, cos, sin, cache,
                                                            ml[0], mask, None)},
            "mHC": {"new": lambda: mhc.hc_block(s, hw, g.hc, lambda h: h),
                    "old": lambda: old["mhc"].hc_block(s, hw_old, hcfg_old, lambda h: h)},
        }
        out = {}
        with torch.inference_mode():
            for part, fns in calls.items():
                diff = (fns["new"]() - fns["old"]()).abs().max().item()
                ts = {"old": [], "new": []}
                for r in range(a.rounds):
                    for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        t0 = time.perf_counter()
                        fns[k]()
                        ts[k].append(1e3 * (time.perf_counter() - t0))
                n = res["layers"][part]
                out[part] = {"max_abs_diff": diff, **{
                    k: {"ms_per_call": statistics.median(v), "q1": sorted(v)[len(v) // 4],
                        "q3": sorted(v)[3 * len(v) // 4], "ms_per_forward": n * statistics.median(v)}
                    for k, v in ts.items()}}
        res["T"][T] = out
    res["load_avg"] = os.getloadavg()
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{a.store}: {res['layers']} layers, {a.threads} threads, load {res['load_avg'][0]:.1f}")
    for T, out in res["T"].items():
        for part, r in out.items():
            o, n = r["old"], r["new"]
            print(f"  T={T:<4} {part:4s} before {o['ms_per_call']:8.2f} ms ({o['q1']:.2f}-{o['q3']:.2f})"
                  f"  after {n['ms_per_call']:8.2f} ms ({n['q1']:.2f}-{n['q3']:.2f})  per forward "
                  f"{o['ms_per_forward']:8.1f} -> {n['ms_per_forward']:8.1f}  max|d| {r['max_abs_diff']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
