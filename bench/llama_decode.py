#!/usr/bin/env python3
"""llama.cpp's decode speed on a GGUF, the peer every expertfs speed claim is measured against.

Loads the model with llama-cpp-python as a true mmap baseline (``use_mmap=True``, weight
repacking really off, see tools/llama_peer.py: the default repack copies experts into RAM and is
OOM-killed under a cap), evaluates a prompt (time to first token) and decodes N tokens, greedy or sampled
(``--temp``) by the same rule as ``expertfs run``.
Prints one JSON line: load_s, ttft_s, decode_tok_s, prompt_n, predicted_n, read_bytes.

    python bench/llama_decode.py MODEL.gguf --prompt-tokens 16 -n 32 -t 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def proc_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def pick(llm, temp: float, rng: np.random.Generator) -> int:
    """The next token from llama.cpp's last logits: argmax, or a draw from softmax(logits/temp)
    over the whole vocabulary (expertfs run's rule). llama-cpp-python's own ``sample`` is not
    used: at temperature 1 with top-k off it returns the same near-the-end token every time."""
    import llama_cpp
    n = llm.n_vocab()
    lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n,))
    if temp <= 0:
        return int(np.argmax(lg))
    z = lg.astype(np.float64) / temp
    p = np.exp(z - z.max())
    return int(rng.choice(n, p=p / p.sum()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--prompt", default=None, help="text prompt (default: token ids 1..N)")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-ids", help="prompt as token ids, comma-separated")
    ap.add_argument("--decode-ids", help="decode these token ids in turn (teacher-forced; -n "
                    "is their count) instead of sampling")
    ap.add_argument("--repack", action="store_true",
                    help="llama.cpp's default weight repacking (copies experts into RAM)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    from llama_peer import open_llama
    t0 = time.perf_counter()
    llm = open_llama(a.model, repack=a.repack, n_ctx=a.ctx, n_threads=a.threads,
                     n_threads_batch=a.threads, use_mmap=True, logits_all=False, seed=a.seed)
    load = time.perf_counter() - t0
    forced = [int(t) for t in a.decode_ids.split(",")] if a.decode_ids else None
    if forced is not None:
        a.n = len(forced)
    if a.prompt_ids:
        toks = [int(t) for t in a.prompt_ids.split(",")]
    elif a.prompt:
        toks = llm.tokenize(a.prompt.encode(), add_bos=False)
    else:
        toks = [(i * 7 + 3) % (llm.n_vocab() - 1) + 1 for i in range(a.prompt_tokens)]
    r0 = proc_read_bytes()
    t1 = time.perf_counter()
    llm.eval(toks)
    ttft = time.perf_counter() - t1
    r1 = proc_read_bytes()
    out = []
    rng = np.random.default_rng(a.seed)
    t2 = time.perf_counter()
    for i in range(a.n):
        tok = forced[i] if forced is not None else pick(llm, a.temp, rng)
        out.append(int(tok))
        llm.eval([tok])
    dec = time.perf_counter() - t2
    r2 = proc_read_bytes()
    json.dump({"peer": "llama.cpp", "load_s": load, "ttft_s": ttft, "prompt_n": len(toks),
               "predicted_n": a.n, "decode_s": dec, "decode_tok_s": a.n / dec,
               "prefill_read_bytes": r1 - r0, "decode_read_bytes": r2 - r1,
               "decode_read_bytes_per_token": (r2 - r1) / a.n, "tokens": out}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
