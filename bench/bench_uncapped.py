#!/usr/bin/env python3
"""expertfs against llama.cpp with no cap, on a box whose RAM holds the model, started three
ways: cold (caches dropped), warm (the same command again at once, the page cache as the cold
run left it) and cached (caches dropped, then the model's files read into the page cache, as
a copy or an earlier reader leaves them). expertfs twice: as it chooses its RAM tier (``auto``:
the mapped experts file where the page cache holds most of it, ``runtime.io.mapped``; else a
slab) and always a slab (``EXPERTFS_MAPPED_TIER=0``).

Each round runs the three in rotated order, each cold, warm, then cached; the same prompt text
(``bench_lowram.long_prompt``), threads and token count for all. Reported per run and as
medians: the whole run's wall time, the first token (expertfs: from the prompt, its store
opened lazily; llama.cpp: its load plus its prompt), decode tok/s, and the CPU time (user +
system) of the process. Needs root (drop_caches) and llama-cpp-python.

    sudo .venv/bin/python bench/bench_uncapped.py --store q14.efs --gguf q14.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lowram import last_json, long_prompt  # noqa: E402
from lowram import drop_caches, page_in  # noqa: E402

from expertfs.runtime.openmp import configure, peer_environ  # noqa: E402

configure()

BIN = os.path.dirname(sys.executable)
PEERS = ("auto", "slab", "llama")
PHASES = ("cold", "warm", "cached")


def command(peer: str, a: argparse.Namespace, prompt: str) -> tuple[list[str], dict[str, str]]:
    if peer == "llama":
        return ([sys.executable, os.path.join(os.path.dirname(__file__), "llama_decode.py"),
                 a.gguf, "--prompt", prompt, "-n", str(a.n), "-t", str(a.threads), "--ctx",
                 str(a.ctx), "--temp", "1.0"], peer_environ())
    env = dict(os.environ, EXPERTFS_MAPPED_TIER="1" if peer == "auto" else "0")
    return ([os.path.join(BIN, "expertfs"), "run", a.store, "-p", prompt, "-n", str(a.n), "-t",
             str(a.threads), "--ctx", str(a.ctx), "--ignore-eos", "--temp", "1.0", "--seed", "1",
             "--json"], env)


def run(peer: str, a: argparse.Namespace, prompt: str) -> dict:
    """One run: wall and CPU seconds, first token, decode tok/s."""
    argv, env = command(peer, a, prompt)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        return {"failed": p.stderr[-2000:]}
    d = last_json(p.stdout)
    first = (d["time_to_first_token_s"] if peer != "llama"
             else d.get("load_s", 0.0) + d["ttft_s"])
    return {"wall_s": wall, "first_token_s": first,
            "decode_tok_s": d.get("decode_tokens_per_s", d.get("decode_tok_s")),
            "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "ram_tier": d.get("stats", {}).get("tiers", {}).get("ram_tier")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--gguf", required=True, help="the GGUF the store was repacked from")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    prompt = long_prompt(a.store, a.prompt_tokens)
    res: dict[str, dict[str, list[dict]]] = {p: {ph: [] for ph in PHASES} for p in PEERS}
    files = {"llama": (a.gguf,), "store": tuple(os.path.join(a.store, f)
                                                for f in ("experts.bin", "trunk.bin"))}
    for rnd in range(a.rounds):
        order = PEERS[rnd % 3:] + PEERS[:rnd % 3]
        for peer in order:
            for phase in PHASES:
                if phase != "warm":
                    drop_caches()
                if phase == "cached":
                    page_in(files["llama" if peer == "llama" else "store"])
                r = run(peer, a, prompt)
                res[peer][phase].append(r)
                if "failed" in r:
                    print(f"round {rnd} {peer} {phase}: failed\n{r['failed']}", flush=True)
                    continue
                print(f"round {rnd} {peer:6s} {phase}: whole {r['wall_s']:.2f} s, first token "
                      f"{r['first_token_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s, CPU "
                      f"{r['user_s']:.1f} user + {r['sys_s']:.1f} sys"
                      + (f", RAM tier {r['ram_tier']}" if r["ram_tier"] else ""), flush=True)
    keys = ("wall_s", "first_token_s", "decode_tok_s", "user_s", "sys_s")
    med = {p: {ph: {k: statistics.median(r[k] for r in rs if "failed" not in r) for k in keys}
               for ph, rs in v.items() if any("failed" not in r for r in rs)}
           for p, v in res.items()}
    print("\nmedians | whole s | first token s | decode tok/s | CPU user + sys s")
    for p, v in med.items():
        for ph, m in v.items():
            print(f"{p:6s} {ph}: {m['wall_s']:.2f} | {m['first_token_s']:.2f} | "
                  f"{m['decode_tok_s']:.2f} | {m['user_s']:.1f} + {m['sys_s']:.1f}")
    for ph in PHASES:
        try:
            e, s, ll = (med[p][ph] for p in PEERS)
        except KeyError:
            continue
        print(f"{ph}: whole run auto / llama.cpp {e['wall_s'] / ll['wall_s']:.2f}x the time "
              f"(slab {s['wall_s'] / ll['wall_s']:.2f}x); decode auto / llama.cpp "
              f"{e['decode_tok_s'] / ll['decode_tok_s']:.2f}x (slab "
              f"{s['decode_tok_s'] / ll['decode_tok_s']:.2f}x)")
    if a.json:
        print(json.dumps({"runs": res, "medians": med}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
