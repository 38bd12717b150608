"""``expertfs plan`` against ``expertfs run`` under the same memory cap (issue 19's matrix).

    sudo .venv/bin/python bench/bench_plan.py --dir /work/scratch/bench_plan \
        --store 'q30b14:--like Qwen3-30B-A3B --layers 14 --quant q4_k_m' \
        --store 'air5:--like GLM-4.5-Air --layers 5 --quant maya-s' --caps none,0.333,0.25

For each store (synthesised and repacked when missing) and cap (``none``, or a fraction of the
store's size): ``plan STORE --memory-limit CAP`` once, as a user would before a first run, then
``run`` ``--rounds`` times in a memory cgroup of that size (page cache included, caches dropped
before each run, as ``bench_lowram.py`` does); ``cached``: no cap, the store's files read back
into the page cache after the drop (as a copy or an earlier run leaves them: ``run`` maps its
RAM tier), before the plan as before each run. Rows alternated round by round so a drifting disk
moves every row alike; ``--act-quant q8`` gives both ``plan`` and ``run`` the 8-bit
activations. ``run`` gets no ``--ram``: the tier it sizes for itself under the cap is
compared with the one ``plan`` recommends. Printed per row: the tier each chose (in whole
slots), the decode band ``plan`` predicts against the measured median (and the median over the
band's geometric midpoint), the same for the first token of a prompt of about
``--prompt-tokens`` tokens (prose whose words rarely repeat, as users' requests: a repeated
sentence's tokens touch fewer experts), the peak memory against the cap, and any run that
failed: killed (exit -9: the cap's OOM kill) or past ``--timeout`` ("timed out": a run that
thrashes without end), where ``plan`` should say CANNOT RUN.
``--json`` writes every round, and each row's plan term by term as it was priced before
the rounds (``plan`` run afterwards prices what the rounds taught the store): each term's
seconds a token at both ends, the expert bytes a token read and the drive's GB/s at each end.
``--learn N`` first runs each store N times under its tightest cap, so that ``plan`` prices
the routing those runs taught the store (its learned usage and decode dynamics) instead of a
synthetic preset; those runs take another prompt and other sampling seeds than the measured
rounds (each round its own seed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lowram import PROMPT, PROSE, long_prompt, prompt_tokens  # noqa: E402
from lowram import TIMED_OUT, block_device_of, drop_caches, page_in, run_capped  # noqa: E402

BIN = os.path.dirname(sys.executable)
#: the learning runs' first sampling seed (the measured rounds take 1, 2, ...)
LEARN_SEED = 1000
EXPERTFS = os.path.join(BIN, "expertfs")


def _ef(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([EXPERTFS, *argv], capture_output=True, text=True, timeout=timeout)


def _store(d: str, spec: str) -> tuple[str, str]:
    name, _, synth = spec.partition(":")
    store = os.path.join(d, name + ".efs")
    if not os.path.isdir(store):
        gguf = os.path.join(d, name + ".gguf")
        for argv in (("synth", "-o", gguf, "--force", *synth.split()), ("repack", gguf, "-o", store)):
            r = _ef(*argv)
            if r.returncode:
                raise SystemExit(f"expertfs {' '.join(argv)} failed: {r.stderr[-600:]}")
        os.unlink(gguf)
    return name, store


def _size(store: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(store) for f in fs)


def _plan(store: str, limit: int | None, a: argparse.Namespace, n_prompt: int) -> dict:
    argv = ["plan", store, "--ctx", str(a.ctx), "-n", str(a.n), "--json",
            "--prompt-tokens", str(n_prompt)]
    argv += ["--memory-limit", str(limit)] if limit else []
    argv += ["--act-quant", a.act_quant] if a.act_quant != "off" else []
    r = _ef(*argv, timeout=600)
    try:
        p = json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"status": f"failed ({r.returncode}): {r.stderr[-300:]}"}
    pred = p.get("prediction") or {}
    ft = p.get("first_token") or {}
    routing = p.get("routing") or {}
    storage = (p.get("rates") or {}).get("storage_gbps") or {}
    return {"status": p.get("status"), "low": pred.get("tok_s_low"), "high": pred.get("tok_s_high"),
            "ttft": (ft.get("s_fast"), ft.get("s_slow")),
            "tier_bytes": ((p.get("budget") or {}).get("ram") or {}).get("tier_bytes"),
            "slot_bytes": (p.get("budget") or {}).get("slot_bytes"), "run": p.get("run"),
            "terms": {n: (t.get("slow_s"), t.get("fast_s"))
                      for n, t in (pred.get("terms") or {}).items()},
            "read_bytes_per_token": tuple((routing.get(e) or {}).get("nvme_bytes_per_token")
                                          for e in ("slow", "fast")),
            "storage_gbps": (storage.get("slow"), storage.get("fast"))}


def _files(store: str, cap: str) -> tuple[str, ...]:
    """The store's files a row reads back into the page cache after the drop (``cached``)."""
    return tuple(os.path.join(store, f) for f in ("experts.bin", "trunk.bin")) \
        if cap == "cached" else ()


def _run(store: str, limit: int | None, dev: str, a: argparse.Namespace, prompt: str,
         warm: tuple[str, ...] = (), seed: int = 0) -> dict:
    argv = [EXPERTFS, "run", store, "-p", prompt, "-n", str(a.n), "--ignore-eos", "--temp", "1.0",
            "--seed", str(seed), "--ctx", str(a.ctx), "-t", str(a.threads), "--json"]
    argv += ["--act-quant", a.act_quant] if a.act_quant != "off" else []
    r = run_capped(argv, limit, dev, timeout=a.timeout, warm=warm)
    if r.returncode:
        return {"failed": r.returncode, "stderr": r.stderr[-400:], "peak": r.peak_bytes}
    d = json.loads(r.stdout[r.stdout.index("{"):])
    return {"decode": d["decode_tokens_per_s"], "ttft": d["time_to_first_token_s"],
            "prompt_tokens": d["prompt_tokens"], "tier_bytes": d.get("ram_tier_bytes"),
            "mb_per_token": d["mb_read_per_token"], "peak": r.peak_bytes}


def _learn(store: str, size: int, a: argparse.Namespace, prompt: str) -> None:
    """``--learn`` runs of ``store`` under the tightest of ``--caps`` (a user who ran the model
    before planning): ``run`` adds each one's routes and dynamics to the store's usage table.
    Their prompt and sampling seeds are not the measured runs' (``prompt``: the prose's words in
    reverse order; seeds from ``LEARN_SEED``), so ``plan`` prices what earlier, different
    requests taught it, not a replay of the very tokens the rounds then decode."""
    caps = [float(c) for c in a.caps.split(",") if c not in ("none", "cached")]
    limit = int(min(caps) * size) if caps else None
    for i in range(a.learn):
        x = _run(store, limit, block_device_of(store), a, prompt, seed=LEARN_SEED + i)
        print(f"  learning run {i + 1} of {os.path.basename(store)}: "
              + (f"failed {x['failed']}" if "failed" in x else f"{x['decode']:.2f} tok/s, "
                 f"{x['mb_per_token']:.1f} MB a token"), flush=True)


def _gib(n: float | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f}G"


def _against(lo: float, hi: float, measured: float, ok: bool) -> str:
    """``measured`` over the band's geometric midpoint, and whether the band holds it."""
    mid = math.sqrt(lo * hi) if lo and hi else 0.0
    return f"{measured / mid if mid else 0:5.2f} {'yes' if ok and lo <= measured <= hi else 'no':>3}"


def report(rows: list[dict], a: argparse.Namespace) -> None:
    print(f"plan against run, {a.rounds} round(s) of {a.n} tokens each, medians; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'store':<8} {'cap':>6} {'plan':>10} {'tier plan/run':>15} {'band tok/s':>13} "
          f"{'run':>6} {'/mid':>5} {'in':>3} {'first token band s':>18} {'run':>6} {'/mid':>5} "
          f"{'in':>3} {'peak/cap':>9}")
    for r in rows:
        ok = [x for x in r["runs"] if "failed" not in x]
        p = r["plan"]
        lo, hi = p.get("low") or 0.0, p.get("high") or 0.0
        med = statistics.median(x["decode"] for x in ok) if ok else 0.0
        slot = p.get("slot_bytes") or 1      # run's budget in whole slots, as plan counts it
        tiers = {x["tier_bytes"] // slot * slot for x in ok if x.get("tier_bytes")}
        run_tier = _gib(next(iter(tiers))) if len(tiers) == 1 else "/".join(map(_gib, tiers)) or "-"
        peak = max((x["peak"] for x in r["runs"]), default=0)
        cap = f"{peak / r['limit']:.3f}" if r["limit"] else _gib(peak) if peak else "-"
        ttft = statistics.median(x["ttft"] for x in ok) if ok else 0.0
        t_lo, t_hi = (v or 0.0 for v in p.get("ttft", (None, None)))
        failed = len(r["runs"]) - len(ok)
        print(f"{r['store']:<8} {r['cap']:>6} {str(p.get('status'))[:10]:>10} "
              f"{_gib(p.get('tier_bytes')) + '/' + run_tier:>15} {lo:6.2f}-{hi:<6.2f} {med:6.2f} "
              f"{_against(lo, hi, med, bool(ok))} {t_lo:8.2f}-{t_hi:<9.2f} {ttft:6.2f} "
              f"{_against(t_lo, t_hi, ttft, bool(ok))} {cap:>9}"
              + (f"  ({failed} run(s) failed: " + ", ".join(sorted(
                  {"timed out" if x["failed"] == TIMED_OUT else f"exit {x['failed']}"
                   for x in r["runs"] if "failed" in x})) + ")" if failed else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the stores are synthesised and kept")
    ap.add_argument("--store", action="append", required=True, metavar="NAME:SYNTH ARGS")
    ap.add_argument("--caps", default="none,0.333,0.25",
                    help="none (no cgroup), cached (none, the store's files in the page "
                         "cache), or fractions of the store's size")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("-n", type=int, default=16, help="tokens generated per run (16)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="a prompt of about this many tokens for both (64)")
    ap.add_argument("--prompt-text", choices=("prose", "repeat"), default="prose",
                    help="prose: a request as users write one (default); repeat: one "
                         "sentence repeated, as bench_lowram.py's, whose tokens touch fewer experts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--act-quant", choices=("off", "q8"), default="off",
                    help="both plan and run in these numerics (run's --act-quant)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", metavar="OUT", help="write every round here")
    ap.add_argument("--clean", action="store_true", help="delete the stores at the end")
    ap.add_argument("--learn", type=int, default=0, metavar="N",
                    help="run each store N times under its tightest cap before planning, so "
                         "plan prices the usage and decode dynamics those runs taught it (0)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rows: list[dict] = []
    prompts: dict[str, str] = {}
    text = PROSE if a.prompt_text == "prose" else PROMPT
    learn_text = " ".join(reversed(text.split()))     # the learning runs' other request
    try:
        for spec in a.store:
            name, store = _store(a.dir, spec)
            prompts[name] = long_prompt(store, a.prompt_tokens, text)
            n_prompt = prompt_tokens(store, prompts[name])
            size = _size(store)
            _learn(store, size, a, long_prompt(store, a.prompt_tokens, learn_text))
            for cap in a.caps.split(","):
                limit = None if cap in ("none", "cached") else int(float(cap) * size)
                drop_caches()                    # the page cache as the row's runs find it
                page_in(_files(store, cap))
                rows.append({"store": name, "path": store, "size": size, "cap": cap,
                             "limit": limit, "plan": _plan(store, limit, a, n_prompt), "runs": []})
        dev = block_device_of(a.dir)
        for rnd in range(a.rounds):
            for r in (rows if rnd % 2 == 0 else rows[::-1]):
                r["runs"].append(_run(r["path"], r["limit"], dev, a, prompts[r["store"]],
                                      _files(r["path"], r["cap"]), seed=rnd + 1))
                x = r["runs"][-1]
                print(f"  round {rnd + 1} {r['store']} cap {r['cap']}: "
                      + (f"failed {x['failed']}" if "failed" in x else
                         f"{x['decode']:.2f} tok/s, first token {x['ttft']:.2f} s, tier "
                         f"{_gib(x['tier_bytes'])}, peak {_gib(x['peak'])}"), flush=True)
        report(rows, a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        if a.clean:
            shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
