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

    .venv/bin/python bench/bench_decode_agreement.py [--gguf MODEL.gguf ...] [--json]
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


def ours(store: str, tokens: list[int]) -> np.ndarray:
    from expertfs.runtime.engine import Engine
    with Engine.open(store, provider="direct", fused="off") as e:
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
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.store.reader import Store
    rows = []
    for g in paths:
        s = g[:-5] + ".efs" if g.endswith(".gguf") else g + ".efs"
        if not os.path.isdir(s):
            repack([g], s)
        with Store.open(s) as st:
            toks = GGUFTokenizer(st.gguf_kv()).encode(text)
        rows.append({"model": os.path.basename(g), "tokens": len(toks),
                     "vs_llama": compare(ours(s, toks), llama_logits(g, toks))})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUFs to compare (text prompt)")
    ap.add_argument("--text", default="def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n")
    ap.add_argument("--skip-builtin", action="store_true", help="only the --gguf models")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
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
