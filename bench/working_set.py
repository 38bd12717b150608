"""``expertfs plan``'s verdict against ``expertfs run`` under caps down to where runs die (issue 19:
never CANNOT RUN where ``run`` completes, never "fits" where it is killed).

    sudo .venv/bin/python bench/working_set.py STORE --caps 800M,600M,500M,450M,400M [--floor]

For each cap, largest first: ``plan STORE --memory-limit CAP`` (its status, the warning that
says why, the decode band) and one ``run`` in a memory cgroup of that size (page cache
included, caches dropped first, as ``bench_lowram.py``), with the tier ``run`` picks for itself
or ``--ram``: its decode tok/s, the bytes it read from the drive, and how it ended (exit 0,
killed by the cap's OOM killer, or past ``--timeout``: a thrash that does not finish).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lowram import prompt_tokens  # noqa: E402
from lowram import TIMED_OUT, block_device_of, run_capped  # noqa: E402

from expertfs.units import parse_size  # noqa: E402

EXPERTFS = os.path.join(os.path.dirname(sys.executable), "expertfs")
PROMPT = ("Summarise the main arguments of the attached report on regional water policy, list "
          "each recommendation with the evidence behind it, and flag statistical weaknesses.")


def _plan(store: str, cap: int, a: argparse.Namespace) -> tuple[str, str, str]:
    """(status, the first warning or error code, the decode band) of ``plan`` at ``cap``, for
    the prompt ``run`` gets (``a.prompt_tokens`` of it)."""
    out = subprocess.run([EXPERTFS, "plan", store, "--memory-limit", str(cap), "--ctx",
                          str(a.ctx), "-n", str(a.n), "--prompt-tokens",
                          str(a.prompt_tokens), "--json"],
                         capture_output=True, text=True)
    d = json.loads(out.stdout)
    notes = [n["code"] for n in d.get("notes", []) if n["level"] in ("error", "warning")]
    pred = d.get("prediction") or {}
    band = f"{pred['tok_s_low']:.2f}-{pred['tok_s_high']:.2f}" if pred.get("tok_s_low") else "-"
    return d["status"], notes[0] if notes else "", band


def _floor(store: str, a: argparse.Namespace) -> int:
    """The smallest cap, in MiB, at which ``plan`` says the run fits (a bisection)."""
    lo, hi = 64, 1 << 14
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _plan(store, mid << 20, a)[0] == "cannot_run" else (lo, mid)
    return hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--caps", required=True, help="memory caps, largest first (800M,600M,...)")
    ap.add_argument("--ram", help="run's --ram (default: the tier run sizes under the cap)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--floor", action="store_true",
                    help="first print the smallest cap plan says the run fits in")
    a = ap.parse_args()
    a.prompt_tokens = prompt_tokens(a.store, PROMPT)        # once: every plan call asks for it
    if a.floor:
        print(f"plan's floor: {_floor(a.store, a)} MiB", flush=True)
    dev = block_device_of(a.store)
    argv = [EXPERTFS, "run", a.store, "-p", PROMPT, "-n", str(a.n), "--ignore-eos", "--temp", "1",
            "--seed", "1", "-t", "2", "--ctx", str(a.ctx), "--json"] + (["--ram", a.ram] if a.ram else [])
    print(f"{'cap':>7} {'plan':>10} {'why':>20} {'band tok/s':>12} {'run':>10} {'tok/s':>6} "
          f"{'read GB':>8} {'peak MiB':>8}")
    for text in a.caps.split(","):
        cap = parse_size(text)
        status, why, band = _plan(a.store, cap, a)
        r = run_capped(argv, cap, dev, timeout=a.timeout)
        how = ("ok" if r.returncode == 0 else "timed out" if r.returncode == TIMED_OUT
               else "killed" if r.returncode in (-9, 137) else f"exit {r.returncode}")
        tps = json.loads(r.stdout[r.stdout.index("{"):])["decode_tokens_per_s"] if how == "ok" else 0.0
        print(f"{text:>7} {status:>10} {why[:20]:>20} {band:>12} {how:>10} {tps:6.2f} "
              f"{r.disk_read / 1e9:8.2f} {r.peak_bytes >> 20:8d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
