"""fio and ``expertfs bench io`` side by side: same file, block size and queue depth, cold.

    python bench/fio_io_compare.py [--file F | --file-size 1G] [--bs 4M] [--qd 1,4,16,32]
                                   [--total 512M] [--json OUT.json]

For each queue depth, in this order and with the page cache dropped before every run: fio
``randread`` with io_uring (direct=1, iodepth=QD), fio psync with QD threads (direct=1: what
a thread pool of O_DIRECT preads can do), fio psync with QD threads through the page cache
(direct=0); psync threads each read their own slice of the file, so no block is read twice, then ``expertfs bench io`` for the engine's backends. The table gives GB/s, IOPS,
p50/p99 and each backend's ratio to the matching fio run (direct and kvikio against fio
io_uring direct, buffered and mmap against fio buffered). Runs vary by +-40% on shared disks:
read the ratios of one run. Needs root (drop_caches) and fio; bench/fio_io.sh installs fio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

from expertfs.units import parse_size


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def make_file(path: str, size: int) -> None:
    chunk = 64 << 20
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def fio(path: str, size: int, bs: int, qd: int, total: int, engine: str, direct: bool) -> dict:
    args = ["fio", "--name=randread", f"--filename={path}", "--rw=randread", f"--bs={bs}",
            f"--size={size}", f"--direct={int(direct)}", f"--ioengine={engine}",
            "--randrepeat=1", "--group_reporting", "--output-format=json", "--invalidate=1"]
    if engine == "psync":      # qd threads, each on its own slice: no block read twice
        region = max(bs, size // qd // bs * bs)
        args[args.index(f"--size={size}")] = f"--size={region}"
        args += ["--thread", f"--numjobs={qd}", "--iodepth=1", f"--offset_increment={region}",
                 f"--io_size={max(bs, total // qd // bs * bs)}"]
    else:
        args += [f"--iodepth={qd}", f"--io_size={total}"]
    drop_caches()
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    pct = job["clat_ns"].get("percentile", {})
    return {"gbps": job["bw_bytes"] / 1e9, "iops": job["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3}


def expertfs_bench(path: str, bs: int, qd: int, total: int, backends: str) -> dict:
    args = [sys.executable, "-m", "expertfs", "bench", "io", path, "--size", str(bs), "--qd",
            str(qd), "--total", str(total), "--seq", str(min(total, 512 << 20)), "--backend",
            backends, "--no-auto", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="an existing file to read (default: a fresh random file)")
    ap.add_argument("--file-size", default="1G")
    ap.add_argument("--bs", default="4M")
    ap.add_argument("--qd", default="1,4,16,32")
    ap.add_argument("--total", default="512M", help="bytes per run")
    ap.add_argument("--backends", default="direct,buffered,mmap,kvikio")
    ap.add_argument("--json", help="write all results here")
    a = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed: run bench/fio_io.sh (it installs fio) or apt-get install -y fio",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("dropping the page cache needs root", file=sys.stderr)
        return 2
    bs, total, qds = parse_size(a.bs), parse_size(a.total), [int(q) for q in a.qd.split(",")]
    tmp = None
    if a.file:
        path = a.file
    else:
        tmp = tempfile.mkdtemp(prefix="efs-fio-", dir=os.environ.get("EXPERTFS_BENCH_DIR", "/tmp"))
        path = os.path.join(tmp, "bench.bin")
        make_file(path, parse_size(a.file_size))
    size = os.stat(path).st_size // bs * bs
    rows, results = [], {"file": path, "file_size": size, "bs": bs, "total": total, "points": []}
    try:
        for qd in qds:
            ref = {"fio io_uring direct": fio(path, size, bs, qd, total, "io_uring", True),
                   "fio psync direct": fio(path, size, bs, qd, total, "psync", True),
                   "fio psync buffered": fio(path, size, bs, qd, total, "psync", False)}
            rep = expertfs_bench(path, bs, qd, total, a.backends)
            results["points"].append({"qd": qd, "fio": ref, "expertfs": rep})
            for name, r in ref.items():
                rows.append((qd, name, r["gbps"], r["iops"], r["p50_us"], r["p99_us"], ""))
            for p in rep["points"]:
                base = ref["fio io_uring direct" if p["backend"] in ("direct", "kvikio")
                           else "fio psync buffered"]
                rows.append((qd, f"expertfs {p['backend']}", p["gbps"], p["iops"], p["lat_us"]["p50"],
                             p["lat_us"]["p99"], f"{p['gbps'] / base['gbps']:.2f}x"))
            if rep.get("seq"):
                rows.append((qd, "expertfs seq ceiling", rep["seq"]["gbps"], 0, 0, 0, ""))
            for b, why in rep.get("skipped", {}).items():
                rows.append((qd, f"expertfs {b}: skipped ({why[:60]})", 0, 0, 0, 0, ""))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"file {path}: {size / 2**30:.2f} GiB, bs {bs >> 10} KiB, {total >> 20} MiB per run, cold")
    print(f"{'qd':>3}  {'run':<34} {'GB/s':>6} {'IOPS':>7} {'p50 us':>8} {'p99 us':>8}  vs fio")
    for qd, name, g, iops, p50, p99, ratio in rows:
        print(f"{qd:>3}  {name:<34} {g:6.2f} {iops:7.0f} {p50:8.0f} {p99:8.0f}  {ratio}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
