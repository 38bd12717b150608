"""``expertfs demo``: the main job end to end on a small built-in model.

Synthesises a qwen3moe-shaped GGUF (random weights, real llama.cpp layout), repacks it into a
store, verifies the store against the GGUF byte for byte, then generates from it with a RAM
tier a quarter the size of its experts, so most experts stream from disk, and prints the
figures (tokens/s, hit rate, MB read per token, time to first token).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from ..store.inspect import inspect_path
from ..store.repack import repack
from ..units import fmt_bytes
from ..store.verify import verify
from ._common import progress_bar
from .inspect import describe


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="synthesise a small MoE, repack, verify, print the figures",
                       description="The main job on a small built-in model: synthesise a "
                       "qwen3moe-shaped GGUF, repack it into a store, verify every byte, print "
                       "what is inside and how fast each step ran.")
    p.add_argument("--dir", default="demo-out", help="working folder (default ./demo-out)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers (default 8: a 515 MB GGUF)")
    p.add_argument("--keep", action="store_true", help="keep the GGUF and the store")
    p.add_argument("-n", type=int, default=32, help="tokens to generate (32)")
    p.set_defaults(func=run)


def _config(layers: int):
    from ..synth import SynthConfig
    return SynthConfig.tiny("qwen3moe").replace(
        name="expertfs demo qwen3moe", n_layers=layers, n_embd=1024, n_head=8, n_head_kv=4,
        head_dim=128, n_ff_exp=512, n_experts=64, n_expert_used=8, quant="q4_k_m")


def run(args: argparse.Namespace) -> int:
    from ..synth import synthesize
    os.makedirs(args.dir, exist_ok=True)
    gguf = os.path.join(args.dir, "demo.gguf")
    store = os.path.join(args.dir, "demo.efs")
    for p in (gguf, store):
        shutil.rmtree(p) if os.path.isdir(p) else (os.path.exists(p) and os.unlink(p))
    cfg = _config(args.layers)
    t0 = time.perf_counter()
    with progress_bar("synth") as bar:
        synthesize(cfg, gguf, progress=bar)
    t_synth = time.perf_counter() - t0
    size = os.path.getsize(gguf)
    with progress_bar("repack") as bar:
        res = repack([gguf], store, progress=bar)
    t1 = time.perf_counter()
    with progress_bar("verify") as bar:
        rep = verify(store, [gguf], progress=bar)
    t_verify = time.perf_counter() - t1
    for line in describe(inspect_path(store)):
        print(line)
    print(f"synth   {fmt_bytes(size)} GGUF in {t_synth:.2f} s ({fmt_bytes(size / t_synth)}/s)")
    print(f"repack  {fmt_bytes(res.bytes_copied)} in {res.seconds:.2f} s "
          f"({fmt_bytes(res.bytes_copied / res.seconds)}/s, "
          f"{'O_DIRECT' if res.direct_io else 'buffered'} writes)")
    print(f"verify  {fmt_bytes(rep.bytes_checked)} in {t_verify:.2f} s, byte-equal to the GGUF: "
          f"{'yes' if rep.ok else 'NO'}")
    for p in rep.problems:
        print(f"  {p}")
    if rep.ok:
        _generate(store, res.summary["expert_bytes"] // 4, args.n)
    if not args.keep:
        os.unlink(gguf)
        shutil.rmtree(store)
    return 0 if rep.ok else 1


def _generate(store: str, ram: int, n: int) -> None:
    """Streamed generation with a RAM tier smaller than the experts: the runtime's figures."""
    from ..runtime.engine import Engine
    from ..runtime.generate import generate
    from ..runtime.sampling import Sampler
    from ..runtime.tokenizer.gguf import GGUFTokenizer
    with Engine.open(store, ram_bytes=ram) as eng:
        tok = GGUFTokenizer(eng.kv)
        prompt = tok.encode("Beautiful is better than ugly. Explicit is better than implicit.")
        stats = eng.provider.stats
        steps = list(generate(eng, prompt, Sampler(), n))
        ttft = steps[0].seconds
        decode_s = sum(s.seconds for s in steps[1:])
        req = max(1, stats.requests)
        hits = " ".join(f"{k} {100 * v / req:.0f}%" for k, v in stats.hits.items()) or "-"
        print(f"run     RAM tier {fmt_bytes(ram)} for {fmt_bytes(4 * ram)} of experts: "
              f"{len(steps)} tokens, first after {ttft:.2f} s, then "
              f"{(len(steps) - 1) / decode_s if decode_s else 0:.1f} tok/s; expert hits {hits}; "
              f"{stats.bytes_read / 1e6 / len(steps):.1f} MB read per token")
