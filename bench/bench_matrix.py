#!/usr/bin/env python3
"""The quant-type matrix of issue 15: expertfs against llama.cpp on the mixes real MoE
downloads use, each row a full-vocabulary model of several GB, every column a ratio measured in
the same run (``bench_lowram.py`` does each row: same GGUF, threads, prompt and tokens, caches
dropped, the peers alternating, medians).

Rows (``--rows``, comma-separated names; all by default):

- ``q4_k_m``: qwen3moe at Qwen3-30B-A3B geometry, llama.cpp's Q4_K_M mix;
- ``iq2-maya``: glm4moe at GLM-4.5-Air geometry, the Maya-S mix (IQ2_XXS gate/up, IQ2_S down
  with IQ3_XXS on llama-quantize's use_more_bits layers, Q6_K trunk);
- ``iq1-dynamic``: deepseek2 at DeepSeek-V3 geometry, an unsloth-dynamic-style IQ1 mix
  (IQ1_S gate/up, IQ1_M down, Q4_K attention and dense layers, Q6_K output), one leading
  dense block and 8 GB (two MoE layers: DeepSeek-V3's three dense blocks would leave a 6 GB
  cut one);
- ``q4_0``: qwen3moe at Qwen3-30B-A3B geometry, every tensor Q4_0 but the Q6_K output.
- ``q2_k-xl``: glm4moe at GLM-4.5-Air geometry, a Q2_K_XL-style mix (the low-bit K-quant
  downloads of the big MoE models: Q2_K gate/up, Q3_K down, Q4_K trunk, Q6_K output).

Columns: resident decode and prefill (``--prompt-tokens``, 128 by default) against llama.cpp
with the model in memory; decode under ``--cap`` of the model's size against llama.cpp at
128 KB and at the device's default readahead. Each row's model is synthesised under ``--dir``,
repacked, measured and (with ``--clean``) deleted before the next, so the disk holds one row at
a time. Needs root (cgroups, drop_caches, readahead) and llama-cpp-python, as bench_lowram does.

    sudo .venv/bin/python bench/bench_matrix.py --dir /work/scratch/matrix --size 6G --clean

``--expertfs-args "--act-quant q8"`` gives expertfs llama.cpp's 8-bit activations;
``--resident-only`` skips the capped columns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

ROWS: dict[str, tuple[str, str, list[str]]] = {     # name -> (--like, --quant, more flags)
    "q4_k_m": ("Qwen3-30B-A3B", "q4_k_m", []),
    "iq2-maya": ("GLM-4.5-Air", "maya-s", []),
    # one leading dense block and 8 GB: two MoE layers (its three would leave a cut none)
    "iq1-dynamic": ("DeepSeek-V3", "Q4_K,experts=IQ1_S,down=IQ1_M,embd=Q6_K,output=Q6_K",
                    ["--dense-lead", "1", "--size", "8G"]),
    "q4_0": ("Qwen3-30B-A3B", "Q4_0,output=Q6_K", []),
    "q2_k-xl": ("GLM-4.5-Air", "Q4_K,experts=Q2_K,down=Q3_K,output=Q6_K", []),
}


def prefill_tok_s(r: dict) -> float:
    sys.path.insert(0, HERE)
    from bench_lowram import prefill_tok_s as f
    return f(r)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def row_figures(res: dict) -> dict:
    """The matrix's columns from one ``bench_lowram.py --json`` result."""
    def dec(k: str) -> float | None:
        r = res.get(k) or {}
        return None if "failed" in r else r.get("decode_tok_s", r.get("decode_tokens_per_s"))

    def pre(peer: str) -> float | None:
        """The median prompt rate over the resident rounds (as bench_lowram.py prints it; its
        JSON's ``*_resident`` is the round that is the median by decode)."""
        ok = [r[peer] for r in res.get("resident_rounds") or [] if "failed" not in r[peer]]
        return statistics.median(prefill_tok_s(r) for r in ok) if ok else None
    e, er = dec("expertfs"), dec("expertfs_resident")
    return {
        "model_gb": res["model_bytes"] / 1e9,
        "resident_decode": (er, dec("llama_resident"), ratio(er, dec("llama_resident"))),
        "resident_prefill": (pre("expertfs"), pre("llama"), ratio(pre("expertfs"), pre("llama"))),
        "capped_ra128": (e, dec("llama_ra128"), ratio(e, dec("llama_ra128"))),
        "capped_default": (e, dec("llama_default"), ratio(e, dec("llama_default"))),
        "mb_per_token": (res.get("expertfs") or {}).get("mb_read_per_token"),
    }


def fmt(cell: tuple) -> str:
    ours, peer, r = cell
    if r is None:
        return "failed"
    return f"{ours:.2f} / {peer:.2f} = {r:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where each row's model is synthesised")
    ap.add_argument("--rows", default=",".join(ROWS), help="rows to run (" + ", ".join(ROWS) + ")")
    ap.add_argument("--size", default="6G", help="each model's size (6G)")
    ap.add_argument("--cap", type=float, default=1 / 3)
    ap.add_argument("--rounds", type=int, default=2, help="capped alternating rounds (2)")
    ap.add_argument("--resident-rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("-n", type=int, default=16, help="decode tokens per run (16)")
    ap.add_argument("--expertfs-args", default="",
                    help="extra flags for expertfs run, e.g. \"--act-quant q8\"")
    ap.add_argument("--resident-only", action="store_true",
                    help="only the resident columns (no capped runs)")
    ap.add_argument("--clean", action="store_true", help="delete each row's model after it")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    out: dict[str, dict] = {}
    for name in a.rows.split(","):
        like, quant, more = ROWS[name]
        gguf = os.path.join(a.dir, f"{name}.gguf")
        cmd = [sys.executable, os.path.join(HERE, "bench_lowram.py"), "--model", gguf,
               "--size", a.size, "--like", like, "--quant", quant, "--vocab", "0",
               "--experts", "0", "--cap", "0" if a.resident_only else str(a.cap),
               "--rounds", str(a.rounds), "-n", str(a.n),
               "--prompt-tokens", str(a.prompt_tokens), "--resident", "--resident-rounds",
               str(a.resident_rounds), "--json", *more]
        if a.expertfs_args:
            cmd += ["--expertfs-args", a.expertfs_args]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            out[name] = {"failed": r.returncode, "stderr": r.stderr[-800:]}
        else:
            res = json.loads(r.stdout[r.stdout.index("{"):])
            out[name] = {"raw": res, **row_figures(res)}
        print(f"{name}: " + (json.dumps({k: v for k, v in out[name].items() if k != "raw"},
                                        default=str)), file=sys.stderr, flush=True)
        if a.clean:
            for p in (gguf, gguf[:-5] + ".efs"):
                if os.path.isdir(p):
                    shutil.rmtree(p)
                elif os.path.exists(p):
                    os.remove(p)
    if a.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    cols = ("resident_decode", "resident_prefill", "capped_ra128", "capped_default")
    print(f"{'row':<12} {'GB':>5}  " + "  ".join(f"{c:<26}" for c in cols) + "  MB/token")
    for name, f in out.items():
        if "failed" in f:
            print(f"{name:<12} failed ({f['failed']}): {f['stderr'][-200:]!r}")
            continue
        print(f"{name:<12} {f['model_gb']:5.2f}  " + "  ".join(f"{fmt(f[c]):<26}" for c in cols)
              + f"  {f['mb_per_token'] or 0:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
