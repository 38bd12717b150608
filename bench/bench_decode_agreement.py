#!/usr/bin/env python3
"""How closely the engine's logits follow llama.cpp's (and transformers') on the same GGUFs.

For each model, the same token sequence goes through llama-cpp-python (F32 KV cache, no weight
repacking, ``logits_all``), through ``Engine.logits`` and, for models converted from
transformers by tools/hf_to_gguf.py, through the transformers model. Reported per model: top-1
agreement over positions, max and median |Δlogit|, and the logit scale (against transformers
the reference keeps the unquantized float weights, so quantized rows show the quantization
error; the tests check quantized weights exactly). Models: Qwen3Moe,
Glm4Moe (+NextN) and Mixtral converted with experts in F32, Q8_0, Q4_0 and MXFP4 (other matrices
Q8_0 when the experts are quantized), synthetic qwen3moe/glm4moe/llama in Q4_K_M, and any
``--gguf`` given (a store is made beside it when missing).

``--presets``: instead, every ``synth --like`` geometry (or those named) in every ``--quants``
mix, cut to a few layers (one MoE layer at least; GLM-5's four: three dense, the fourth holding
its first MLA layer), 16 experts and an 8192-token vocabulary, each file deleted after its row.
Each row compares llama.cpp with expertfs twice: exact (the default) and ``--act-quant q8``
(llama.cpp's own 8-bit activations), so a gap that only the exact row shows is the activation
quantization's, and one both show is a difference in the model's arithmetic.

    .venv/bin/python bench/bench_decode_agreement.py [--gguf MODEL.gguf ...] [--json]
    .venv/bin/python bench/bench_decode_agreement.py --presets [Kimi-K2,...] \
        [--quants q4_k_m,iq2_m,maya-s,q3_k_m,mixed]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from llama_peer import llama_logits  # noqa: E402


def ours(store: str, tokens: list[int], **opts) -> np.ndarray:
    from expertfs.runtime.engine import Engine
    with Engine.open(store, provider="direct", **({"fused": "off"} | opts)) as e:
        return e.logits(tokens).numpy()


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a - b)
    return {"top1": float((a.argmax(-1) == b.argmax(-1)).mean()), "max": float(d.max()),
            "median": float(np.median(d)), "scale": float(np.abs(b).max())}


def converted(d: str, tokens: list[int]) -> list[dict]:
    import torch
    from gguf import GGMLQuantizationType as T
    from hf_to_gguf import KINDS, convert
    rows = []
    for kind in KINDS:
        for et in (T.F32, T.Q8_0, T.Q4_0, T.MXFP4):
            mt = T.F32 if et == T.F32 else T.Q8_0
            model, gguf, store = convert(kind, d, seed=7, expert_type=et, matrix_type=mt,
                                         nextn=kind == "glm4moe")
            got = ours(store, tokens)
            with torch.no_grad():
                hf = model(torch.tensor([tokens])).logits[0].float().numpy()
            rows.append({"model": f"{kind} experts {et.name}, matrices {mt.name}",
                         "vs_llama": compare(got, llama_logits(gguf, tokens)),
                         "vs_transformers": compare(got, hf)})
    return rows


def synthetic(d: str, tokens: list[int]) -> list[dict]:
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    rows = []
    for arch in ("qwen3moe", "glm4moe", "llama"):
        cfg = SynthConfig.tiny(arch).replace(quant="q4_k_m", n_layers=4)
        g, s = os.path.join(d, f"synth-{arch}.gguf"), os.path.join(d, f"synth-{arch}.efs")
        synthesize(cfg, g)
        repack([g], s, force=True)
        rows.append({"model": f"synth {arch} Q4_K_M",
                     "vs_llama": compare(ours(s, tokens), llama_logits(g, tokens))})
    return rows


def given(paths: list[str], text: str) -> list[dict]:
    from expertfs.store.repack import repack
    rows = []
    for g in paths:
        s = g[:-5] + ".efs" if g.endswith(".gguf") else g + ".efs"
        if not os.path.isdir(s):
            repack([g], s)
        toks = tokenize(s, text)
        rows.append({"model": os.path.basename(g), "tokens": len(toks),
                     "vs_llama": compare(ours(s, toks), llama_logits(g, toks))})
    return rows


def presets(d: str, likes: list[str], quants: list[str], text: str) -> list[dict]:
    """Each ``--like`` geometry in each quant mix, cut small (``--presets``): exact and q8
    logits against llama.cpp's on a text prompt."""
    import shutil

    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    rows = []
    for like in likes:
        for quant in quants:
            cfg = SynthConfig.like(like, layers=4 if like.startswith("GLM-5") else 2,
                                   n_experts=16, n_vocab=8192, quant=quant)
            g, s = os.path.join(d, "p.gguf"), os.path.join(d, "p.efs")
            synthesize(cfg, g)
            repack([g], s, force=True)
            try:
                toks = tokenize(s, text)
                ref = llama_logits(g, toks)
                rows.append({"model": f"{like} {quant}", "tokens": len(toks),
                             "vs_llama": compare(ours(s, toks, fused="auto"), ref),
                             "q8_vs_llama": compare(ours(s, toks, fused="auto",
                                                         act_quant="q8"), ref)})
            finally:
                os.unlink(g)
                shutil.rmtree(s)
    return rows


def tokenize(store: str, text: str) -> list[int]:
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.store.reader import Store
    with Store.open(store) as st:
        return GGUFTokenizer(st.gguf_kv()).encode(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUFs to compare (text prompt)")
    ap.add_argument("--text", default="def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n")
    ap.add_argument("--skip-builtin", action="store_true", help="only the --gguf models")
    ap.add_argument("--presets", nargs="?", const="all", metavar="LIKE,...",
                    help="instead: every synth --like geometry (or these) in every --quants mix")
    ap.add_argument("--quants", default="q4_k_m,iq2_m,maya-s,q3_k_m,mixed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.presets:
        from expertfs.synth.presets import PRESETS
        likes = list(PRESETS) if a.presets == "all" else a.presets.split(",")
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
            rows = presets(d, likes, a.quants.split(","), a.text)
        if a.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"{'model':32s} {'exact: top1':>11s} {'max|Δ|':>8s} {'q8: top1':>9s} {'max|Δ|':>8s}")
        for r in rows:
            v, q = r["vs_llama"], r["q8_vs_llama"]
            print(f"{r['model']:32s} {v['top1']:11.2f} {v['max']:8.3f} {q['top1']:9.2f} "
                  f"{q['max']:8.3f}")
        return 0
    tokens = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500, 9, 64, 128, 256, 33, 44]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        if not a.skip_builtin:
            rows += converted(d, tokens) + synthetic(d, tokens)
        rows += given(a.gguf, a.text)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':44s} {'vs llama.cpp: top1':>18s} {'max|Δ|':>9s} {'median':>9s}  "
          f"{'vs float transformers':>24s}")
    for r in rows:
        v, t = r["vs_llama"], r.get("vs_transformers")
        tt = f"{t['max']:.2e} (top1 {t['top1']:.2f})" if t else "-"
        print(f"{r['model']:44s} {v['top1']:18.2f} {v['max']:9.2e} {v['median']:9.2e}  {tt:>24s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
