#!/usr/bin/env python3
"""Repack throughput and memory against ``cp`` of the same GGUF to the same disk.

For each model size: synthesise a model (``expertfs synth --like ... --size``), then, with the
page cache dropped before each run, time ``cp MODEL COPY && sync`` (the peer: the same bytes
read and written durably; plain ``cp`` without the sync is reported too) and
``expertfs repack MODEL -o STORE`` (which syncs before publishing), and read each process's
peak RSS from the kernel (wait4). Prints a table and, with ``--json``, the raw figures.

    sudo .venv/bin/python bench/bench_repack.py --sizes 1G,4G,10G --dir /work/scratch

Needs root for drop_caches (without it the runs are warm and say so).

``--in-place MODEL.gguf`` measures ``repack --consume-source`` instead, on an existing model
(which it destroys): a normal repack of it first, then the in-place one, each with the file
system's used bytes sampled (statvfs) in a thread, the source hashed before and the in-place
store unpacked and hashed after. Prints the peak disk as a multiple of the model's size and
the time ratio.

    sudo .venv/bin/python bench/bench_repack.py --in-place /work/big.gguf

``--compare MODEL.gguf`` times, round after round (the order rotating), ``cp MODEL COPY &&
sync``, a normal repack, ``repack --consume-source`` and, with ``--full-readback``, the same
reading every window back whole, each of a fresh copy of the model made untimed just before
(the in-place run destroys its source; the copy then replaces the model for the others). The
page cache is dropped before each, the peak disk is sampled, the first in-place store is
checked byte for byte against the model (``expertfs verify --source``), and the medians are
printed. Needs twice the model's size free; the model is kept. ``--with-delete`` adds the
other way to end with the store alone: a normal repack of the copy, then the copy deleted
and the file system synced, timed together (on a mount with online ``discard`` the delete
sends the freed blocks to the device, as the in-place run's hole punches do).

    sudo .venv/bin/python bench/bench_repack.py --compare /work/m.gguf --rounds 3 --full-readback
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

from expertfs.units import fmt_bytes, parse_size

BIN = os.path.join(os.path.dirname(sys.executable), "expertfs")


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a command and its children."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    return dt, ru.ru_maxrss * 1024


def run_size(size: int, like: str, d: str, repeats: int) -> dict:
    model = os.path.join(d, f"bench-{size >> 20}M.gguf")
    if not os.path.exists(model):
        subprocess.run([BIN, "synth", "--like", like, "--size", str(size), "-o", model],
                       check=True, stdout=subprocess.DEVNULL)
    real = os.path.getsize(model)
    copy, store = model + ".copy", model + ".efs"
    rows = []
    for _ in range(repeats):
        for path in (copy, store):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
                (os.path.exists(path) and os.unlink(path))
        cold = drop_caches()
        cp, _ = timed(["cp", model, copy])
        t0 = time.perf_counter()
        subprocess.run(["sync"], check=True)
        cp_sync = cp + (time.perf_counter() - t0)
        os.unlink(copy)
        drop_caches()
        rp, rss = timed([BIN, "repack", model, "-o", store, "--json"])
        shutil.rmtree(store)
        rows.append({"cp_s": cp, "cp_sync_s": cp_sync, "repack_s": rp, "repack_rss": rss, "cold": cold})
    best = min(rows, key=lambda r: r["repack_s"])
    return {"model_bytes": real, "runs": rows,
            "repack_over_cp_sync": [r["repack_s"] / r["cp_sync_s"] for r in rows],
            "repack_over_cp": [r["repack_s"] / r["cp_s"] for r in rows],
            "peak_rss": max(r["repack_rss"] for r in rows), "best": best}


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def sampled(cmd: list[str], where: str) -> tuple[float, int]:
    """Wall seconds of ``cmd`` and the peak used bytes of ``where``'s file system meanwhile."""
    import threading
    peak, stop = [_used(where)], threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], _used(where))
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        dt, _ = timed(cmd)
    finally:
        stop.set()
        t.join()
    return dt, max(peak[0], _used(where))


def _xxh(path: str) -> str:
    import xxhash
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while b := f.read(16 << 20):
            h.update(b)
    return h.hexdigest()


def run_in_place(model: str) -> dict:
    d = os.path.dirname(os.path.abspath(model))
    size = os.path.getsize(model)
    store, back = model + ".efs", model + ".back.gguf"
    want = _xxh(model)
    drop_caches()
    base = _used(d)
    normal_s, normal_peak = sampled([BIN, "repack", model, "-o", store, "--json"], d)
    shutil.rmtree(store)
    drop_caches()
    base2 = _used(d)
    inplace_s, inplace_peak = sampled([BIN, "repack", model, "-o", store, "--consume-source",
                                       "--json"], d)
    gone = not os.path.exists(model)
    subprocess.run([BIN, "unpack", store, "-o", back], check=True, stdout=subprocess.DEVNULL)
    same = _xxh(back) == want
    os.unlink(back)
    shutil.rmtree(store)
    return {"model_bytes": size, "normal_s": normal_s, "in_place_s": inplace_s,
            "time_ratio": inplace_s / normal_s,
            "normal_peak_x_model": (normal_peak - base + size) / size,
            "in_place_peak_x_model": (inplace_peak - base2 + size) / size,
            "in_place_peak_extra_bytes": inplace_peak - base2,
            "source_deleted": gone, "unpack_bit_exact": same}


def _rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
        (os.path.exists(path) and os.unlink(path))


def _one(kind: str, model: str, d: str) -> tuple[float, float]:
    """(seconds, peak extra disk as a multiple of the model) of one cold run of ``kind``.

    Every run reads a copy of the model written just before it (untimed): the in-place one
    must, since it destroys its source, so the others do too (the copy replaces the model),
    and no run is timed while the disk still absorbs a write the others did not make."""
    size = os.path.getsize(model)
    copy, store = model + ".copy.gguf", model + ".cmp.efs"
    for p in (copy, store):
        _rm(p)
    shutil.copyfile(model, copy)
    if kind in ("cp", "normal"):
        os.replace(copy, model)
    drop_caches()
    base = _used(d)
    if kind == "cp":
        t0 = time.perf_counter()
        subprocess.run(["cp", model, copy], check=True)
        subprocess.run(["sync"], check=True)
        dt, peak = time.perf_counter() - t0, _used(d)
    elif kind == "normal":                       # peaks count the model: (model + extra) / model
        dt, peak = sampled([BIN, "repack", model, "-o", store, "--json"], d)
        base -= size
    elif kind == "normal+delete":                # then the source goes, durably
        base -= size
        dt, peak = sampled([BIN, "repack", copy, "-o", store, "--json"], d)
        t0 = time.perf_counter()
        os.unlink(copy)
        subprocess.run(["sync"], check=True)
        dt += time.perf_counter() - t0
    else:
        base -= size                             # the copy being consumed is the model here
        dt, peak = sampled([BIN, "repack", copy, "-o", store, "--consume-source", "--json"]
                           + (["--full-readback"] if kind == "consume-full" else []), d)
    return dt, (peak - base) / size


def run_compare(model: str, rounds: int, full: bool, delete: bool = False) -> dict:
    import statistics
    d = os.path.dirname(os.path.abspath(model))
    kinds = (["cp", "normal"] + (["normal+delete"] if delete else []) + ["consume"]
             + (["consume-full"] if full else []))
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    checked = None
    for r in range(rounds):
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            runs[k].append(_one(k, model, d))
            store = model + ".cmp.efs"
            if k.startswith("consume") and checked is None:
                checked = subprocess.run([BIN, "verify", store, "--source", model],
                                         stdout=subprocess.DEVNULL).returncode == 0
            for p in (model + ".copy.gguf", store):
                _rm(p)
    med = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
    return {"model_bytes": os.path.getsize(model), "rounds": rounds, "runs": runs,
            "median_s": med, "over_normal": {k: med[k] / med["normal"] for k in kinds},
            "peak_disk_x_model": {k: max(p for _, p in v) for k, v in runs.items() if k != "cp"},
            "in_place_store_equals_model": checked}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1G,4G", help="model sizes, e.g. 1G,4G,10G")
    ap.add_argument("--like", default="qwen3-30b-a3b", help="synth preset for the geometry")
    ap.add_argument("--dir", default=".", help="where models, copies and stores go (one disk)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the synthesised models")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--in-place", metavar="MODEL.gguf",
                    help="measure repack --consume-source on this model (destroys it)")
    ap.add_argument("--compare", metavar="MODEL.gguf",
                    help="cp vs repack vs repack --consume-source of copies of this model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full-readback", action="store_true",
                    help="with --compare, also time --consume-source --full-readback")
    ap.add_argument("--with-delete", action="store_true",
                    help="with --compare, also time a normal repack then deleting its source")
    a = ap.parse_args()
    if a.compare:
        res = run_compare(a.compare, a.rounds, a.full_readback, a.with_delete)
        if a.json:
            print(json.dumps(res, indent=2))
            return 0
        print(f"model {fmt_bytes(res['model_bytes'])}, {a.rounds} rounds, medians")
        print(f"{'run':>14} {'median s':>9} {'x normal':>9} {'peak disk':>10}  each run (s)")
        for k, v in res["runs"].items():
            peak = res["peak_disk_x_model"].get(k)
            print(f"{k:>14} {res['median_s'][k]:9.2f} {res['over_normal'][k]:9.2f} "
                  f"{'' if peak is None else f'{peak:9.3f}x':>10}  "
                  + " ".join(f"{t:.2f}" for t, _ in v))
        print(f"in-place store equals the model byte for byte: {res['in_place_store_equals_model']}")
        return 0
    if a.in_place:
        print(json.dumps(run_in_place(a.in_place), indent=2))
        return 0
    results = {}
    for s in a.sizes.split(","):
        size = parse_size(s)
        results[s] = run_size(size, a.like, a.dir, a.repeats)
        if not a.keep:
            os.unlink(os.path.join(a.dir, f"bench-{size >> 20}M.gguf"))
    if a.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'model':>10} {'cp':>8} {'cp+sync':>8} {'repack':>8} {'repack/cp+sync':>15} "
          f"{'repack/cp':>10} {'peak RSS':>10}")
    for s, r in results.items():
        for run in r["runs"]:
            print(f"{fmt_bytes(r['model_bytes']):>10} {run['cp_s']:8.2f} {run['cp_sync_s']:8.2f} "
                  f"{run['repack_s']:8.2f} {run['repack_s'] / run['cp_sync_s']:15.2f} "
                  f"{run['repack_s'] / run['cp_s']:10.2f} {fmt_bytes(run['repack_rss']):>10}"
                  + ("" if run["cold"] else "  (warm: no drop_caches)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
