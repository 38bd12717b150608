#!/usr/bin/env python3
"""Quality cost of the opt-in ``act_quant="q8"`` mode (llama.cpp's 8-bit activations in the
native expert products) against the default exact mode, and how closely each follows llama.cpp.

The same token sequence (``-n`` positions) is decoded one position at a time, as in generation,
by the engine in exact mode, by the engine in q8 mode and by llama.cpp (llama-cpp-python, weight
repacking off, F32 KV cache so that only the matrix products differ; one ``eval`` per token).
The tokens are the exact engine's greedy continuation of a short prompt (so the positions are
ones the model actually produces), teacher-forced for every peer. Reported for each pair: top-1
agreement over positions, max and mean |Δlogit|, mean KL(p_a || p_b), and the logit scale.

Models: the synthetic qwen3moe of ``--size`` (random weights, Q4_K_M; made under ``--dir`` when
missing, as bench_decode.py does) and any ``--gguf`` given (e.g. the trained tiny glm4moe of
tools/train_tiny_moe_model.py, whose logits are those of a trained model).

    .venv/bin/python bench/bench_decode_actquant.py --size 600M -n 256 [--gguf M.gguf] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import expertfs.runtime  # noqa: F401,I001 - its OpenMP wait policy must be set before torch loads

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def engine_logits(store: str, tokens: list[int], act_quant: str) -> np.ndarray:
    from expertfs.runtime.engine import Engine
    with Engine.open(store, provider="direct", act_quant=act_quant) as e:
        out = [e.prefill(tokens[:1])]
        out += [e.decode(t) for t in tokens[1:]]
        return torch.stack(out).numpy()


def greedy_tokens(store: str, prompt: list[int], n: int) -> list[int]:
    from expertfs.runtime.engine import Engine
    with Engine.open(store, provider="direct") as e:
        toks = list(prompt)
        lg = e.prefill(prompt)
        while len(toks) < n:
            t = int(lg.argmax())
            toks.append(t)
            lg = e.decode(t)
        return toks[:n]


def llama_logits(gguf: str, tokens: list[int], threads: int) -> np.ndarray:
    from llama_peer import open_llama
    m = open_llama(gguf, n_ctx=max(256, len(tokens) + 8), n_threads=threads,
                   n_threads_batch=threads, type_k=0, type_v=0, logits_all=True)
    try:
        out = []
        for i, t in enumerate(tokens):
            m.eval([t])
            out.append(np.array(m.scores[i], dtype=np.float32))
        return np.stack(out)
    finally:
        m.close()


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a - b)
    la = a - a.max(-1, keepdims=True)
    lb = b - b.max(-1, keepdims=True)
    pa = np.exp(la)
    pa /= pa.sum(-1, keepdims=True)
    lpa = la - np.log(np.exp(la).sum(-1, keepdims=True))
    lpb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (pa * (lpa - lpb)).sum(-1)
    return {"top1": float((a.argmax(-1) == b.argmax(-1)).mean()), "max_abs": float(d.max()),
            "mean_abs": float(d.mean()), "kl_mean": float(kl.mean()),
            "scale": float(np.abs(a).max())}


def run_model(gguf: str, n: int, threads: int, with_llama: bool) -> dict:
    from bench_decode import store_for
    store = store_for(gguf)
    from expertfs.store.reader import Store
    with Store.open(store) as st:
        kv = st.gguf_kv()
        key = f"{st.architecture}.vocab_size"
        vocab = int(kv[key].value) if key in kv else len(kv["tokenizer.ggml.tokens"].value)
    prompt = [int(t) for t in torch.randint(1, min(vocab, 1000), (8,),
                                            generator=torch.Generator().manual_seed(7))]
    t0 = time.perf_counter()
    tokens = greedy_tokens(store, prompt, n)
    runs = {"exact": engine_logits(store, tokens, "off"), "q8": engine_logits(store, tokens, "q8")}
    if with_llama:
        runs["llama.cpp"] = llama_logits(gguf, tokens, threads)
    pairs = [("exact", "q8"), ("llama.cpp", "exact"), ("llama.cpp", "q8")]
    res = {"gguf": gguf, "positions": len(tokens), "seconds": time.perf_counter() - t0,
           "pairs": {f"{a} vs {b}": compare(runs[a], runs[b])
                     for a, b in pairs if a in runs and b in runs}}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF (repeatable)")
    ap.add_argument("--size", default="600M", help="synthetic qwen3moe size ('' to skip)")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--dir", default="/work/scratch")
    ap.add_argument("-n", type=int, default=256, help="positions decoded (256)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp peer")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime import kernels
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.status()['reason']}")
    models = list(a.gguf)
    if a.size:
        from bench_decode import synth
        from expertfs.units import parse_size
        models.insert(0, synth(parse_size(a.size), a.dir, a.quant))
    out = [run_model(g, a.n, a.threads, not a.no_llama) for g in models]
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    for r in out:
        print(f"{os.path.basename(r['gguf'])}: {r['positions']} decode positions "
              f"({r['seconds']:.0f} s)")
        for k, v in r["pairs"].items():
            print(f"  {k:22s} top-1 {100 * v['top1']:6.2f}%  max|Δ| {v['max_abs']:.4f}  "
                  f"mean|Δ| {v['mean_abs']:.5f}  KL {v['kl_mean']:.2e}  (logit scale "
                  f"{v['scale']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
