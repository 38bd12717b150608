#!/usr/bin/env python3
"""Decode speed of the engine against llama.cpp with the whole model resident (same GGUF,
same threads, same tokens, model in the page cache), as ratios measured in one run.

Peers, each warmed up first, then timed over ``-n`` single-token decode steps after a
``--prompt-tokens`` prefill, ``--rounds`` times interleaved (best round kept, since other
processes on a shared box only ever slow a round down):

- ``llama.cpp``: llama-cpp-python, mmap, weight repacking off (``tools/llama_peer.py``: the
  real ``use_extra_bufts=False``, the baseline the low-RAM comparison uses) and, with
  ``--llama-repack`` (peer ``llama-repack``), on: its default and fastest CPU path; each round
  in a process of its own (``llama_decode.py``, its own OpenMP defaults, model load untimed);
- ``expertfs quant``: experts (and the quantized trunk) multiplied from their ggml bytes every
  step (``runtime.model.qmatvec``: the native kernels of ``runtime.kernels`` when built, in
  their exact mode; else the compiled one-token products), the tiered provider holding all
  experts in RAM; ``quant-q8`` the same with the opt-in ``act_quant="q8"`` (llama.cpp's 8-bit
  activations, lossy); ``quant-eager`` the same through eager ``dequant.linear``;
- ``expertfs dq-f32`` / ``dq-bf16``: the same with the dequantized-expert cache holding every
  expert in float32 / bfloat16 (``--dq-cache``; RAM ~7x / ~3.6x the Q4 bytes).

The GGUF is ``--gguf`` or a qwen3moe synthesised to ``--size`` under ``--dir`` (kept for the
next run). Prints a table with ratios to llama.cpp; ``--json`` the figures.

    .venv/bin/python bench/bench_decode.py --size 600M -t 2 -n 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# before torch loads: the runtime's OpenMP wait policy (and what it set, kept from llama.cpp)
from expertfs.runtime.openmp import configure, peer_environ  # noqa: I001

configure()

import torch

from expertfs.units import fmt_bytes, parse_size

PEERS = ("llama", "quant", "dq-f32", "dq-bf16")
EXTRA = ("quant-q8", "quant-eager", "llama-repack")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def synth(size: int, d: str, quant: str) -> str:
    from expertfs.synth import SynthConfig, synthesize
    from expertfs.synth.writer import layers_for_size
    path = os.path.join(d, f"decode-{size >> 20}M-{quant}.gguf")
    if not os.path.exists(path):
        cfg = SynthConfig.tiny("qwen3moe").replace(
            name="bench decode", n_embd=1024, n_head=8, n_head_kv=4, head_dim=128, n_ff_exp=512,
            n_experts=64, n_expert_used=8, n_vocab=4096, quant=quant)
        synthesize(layers_for_size(cfg, size), path)
    return path


def store_for(gguf: str) -> str:
    from expertfs.store.repack import repack
    store = gguf[:-5] + ".efs"
    if not os.path.isdir(store):
        repack([gguf], store)
    return store


def page_in(*paths: str) -> None:
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(r, f) for r, _, fs in os.walk(p)
                                               for f in fs]
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 1000), (n,), generator=g).tolist()


class Llama:
    """llama.cpp in a process of its own (``llama_decode.py``, the low-RAM bench's peer): it
    uses GNU OpenMP too, so in this process it would inherit the wait policy
    ``expertfs.runtime`` set for torch; there it runs with its own defaults."""

    def __init__(self, gguf: str, threads: int, repack: bool) -> None:
        self.argv = [sys.executable, os.path.join(HERE, "llama_decode.py"), gguf, "-t",
                     str(threads)] + (["--repack"] if repack else [])

    def run(self, prompt: list[int], steps: list[int]) -> float:
        r = subprocess.run(self.argv + ["--prompt-ids", ",".join(map(str, prompt)),
                                        "--decode-ids", ",".join(map(str, steps))],
                           capture_output=True, text=True, env=peer_environ(), check=False)
        if r.returncode != 0:
            raise SystemExit(f"llama_decode.py failed ({r.returncode}): {r.stderr[-400:]}")
        return float(json.loads(r.stdout.strip().splitlines()[-1])["decode_tok_s"])

    def close(self) -> None:
        pass


class Ours:
    def __init__(self, store: str, dq: int, dtype: str, fused: str = "auto",
                 act_quant: str = "off") -> None:
        from expertfs.runtime.engine import Engine
        size = sum(os.path.getsize(os.path.join(store, f)) for f in ("experts.bin",))
        self.e = Engine.open(store, provider="tiered", ram_bytes=size + (64 << 20), dq_cache=dq,
                             dtype=dtype, fused=fused, act_quant=act_quant)
        self.e.warm()

    def run(self, prompt: list[int], steps: list[int]) -> float:
        self.e.reset()
        self.e.prefill(prompt)
        t0 = time.perf_counter()
        for t in steps:
            self.e.decode(t)
        return len(steps) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.e.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="a GGUF (default: synthesise one of --size)")
    ap.add_argument("--size", default="600M", help="synthetic model size (600M)")
    ap.add_argument("--quant", default="q4_k_m", help="synthetic model quantization (q4_k_m)")
    ap.add_argument("--dir", default="/work/scratch", help="where synthetic models live")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-n", type=int, default=32, help="decode steps timed per round")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="subset of " + ",".join(PEERS + EXTRA))
    ap.add_argument("--llama-repack", action="store_true", help="also llama.cpp with repacking")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gguf = a.gguf or synth(parse_size(a.size), a.dir, a.quant)
    store = store_for(gguf)
    page_in(gguf, store)
    peers = [p for p in a.peers.split(",") if p]
    if a.llama_repack and "llama-repack" not in peers:
        peers.append("llama-repack")
    from expertfs.store.reader import Store
    with Store.open(store) as st:
        vocab = int(st.gguf_kv()[f"{st.architecture}.vocab_size"].value) \
            if f"{st.architecture}.vocab_size" in st.gguf_kv() else 1000
        expert_bytes = st.summary["expert_bytes"]
    prompt = tokens(a.prompt_tokens, vocab, 1)
    steps = tokens(a.n, vocab, 2)
    made = {}
    for p in peers:
        if p == "llama":
            made[p] = Llama(gguf, a.threads, False)
        elif p == "llama-repack":
            made[p] = Llama(gguf, a.threads, True)
        elif p == "quant":
            made[p] = Ours(store, 0, "float32")
        elif p == "quant-q8":
            made[p] = Ours(store, 0, "float32", act_quant="q8")
        elif p == "quant-eager":
            made[p] = Ours(store, 0, "float32", fused="off")
        elif p == "dq-f32":
            made[p] = Ours(store, 8 * expert_bytes, "float32")
        elif p == "dq-bf16":
            made[p] = Ours(store, 4 * expert_bytes, "bfloat16")
        else:
            raise SystemExit(f"unknown peer {p}")
    for m in made.values():                         # warm-up round
        m.run(prompt, steps[:4])
    best: dict[str, float] = {}
    rounds: dict[str, list[float]] = {p: [] for p in made}
    for _ in range(a.rounds):
        for p, m in made.items():
            tps = m.run(prompt, steps)
            rounds[p].append(tps)
            best[p] = max(best.get(p, 0.0), tps)
    for m in made.values():
        m.close()
    base = best.get("llama")
    rbase = best.get("llama-repack")
    res = {"gguf": gguf, "gguf_bytes": os.path.getsize(gguf), "threads": a.threads, "n": a.n,
           "load_avg": os.getloadavg(), "best_tok_s": best, "rounds_tok_s": rounds,
           "ratio_to_llama": {p: v / base for p, v in best.items()} if base else {},
           "ratio_to_llama_repack": {p: v / rbase for p, v in best.items()} if rbase else {}}
    try:
        from expertfs.runtime import kernels
        res["native_kernels"] = kernels.status()
    except ImportError:
        pass
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{os.path.basename(gguf)} ({fmt_bytes(res['gguf_bytes'])}), {a.threads} threads, "
          f"{a.n} decode steps, best of {a.rounds} rounds; load average {res['load_avg'][0]:.1f}")
    for p, v in best.items():
        r = f"  {v / base:5.2f}x llama.cpp" if base else ""
        r += f"  {v / rbase:5.2f}x llama.cpp-repack" if rbase else ""
        print(f"  {p:14s} {v:7.2f} tok/s{r}   rounds: " + " ".join(f"{x:.2f}" for x in rounds[p]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
