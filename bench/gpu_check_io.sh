#!/usr/bin/env bash
# GPU check of the I/O engine (run on a machine with an NVIDIA GPU and driver; ~3 minutes).
#  1. the io tests with a real libcuda (kvikio's host path for real, pinning for real);
#  2. pinned host slabs (cudaHostRegister) within the budget, and the budget fallback;
#  3. kvikio reads into a CUDA tensor == direct reads into host memory, byte for byte;
#  4. `expertfs bench io --backend all` on a 1 GiB file: kvikio host path vs the best POSIX path.
# kvikio must be installed (pip install --no-deps kvikio-cu12 libkvikio-cu12 rapids-logger
# cuda-pathfinder nvidia-cufile-cu12, or wheels carried in .whl/). Results go to $OUT (or
# /tmp/gpu_check_io). Exit status is non-zero if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_io}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
fail=0
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt" || true

echo "== 1. io tests" | tee "$OUT/log.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/runtime/io/test_io*.py 2>&1 | tee -a "$OUT/log.txt" | tail -5 || fail=1

echo "== 2-3. pinning and kvikio into device memory" | tee -a "$OUT/log.txt"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/log.txt"
import os, sys, tempfile, time
import numpy as np, torch
from expertfs.runtime.io import (HostSlab, PinBudget, KvikioBackend, aligned_empty, get_backend,
                                 backend_status)
assert torch.cuda.is_available(), "no CUDA"
print("backends:", {k: (v.available, v.reason) for k, v in backend_status().items()})
b = PinBudget(64 << 20)
s = HostSlab(4, 8 << 20, budget=b)
print("slab pinned:", s.pinned, s.pin_note, "budget used", b.used)
assert s.pinned and b.used == 32 << 20
s2 = HostSlab(8, 8 << 20, budget=b)
print("over budget:", s2.pinned, s2.pin_note)
assert not s2.pinned
t = s.slot(0)
t.copy_(torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8))
d = t.to("cuda", non_blocking=True); torch.cuda.synchronize()
assert torch.equal(d.cpu(), t); s.close(); assert b.used == 0
d = tempfile.mkdtemp(); p = os.path.join(d, "f.bin")
data = np.random.default_rng(0).integers(0, 256, (64 << 20) + 4096 * 3 + 7, dtype=np.uint8)
data.tofile(p)
kv = get_backend("kvikio")
print("kvikio:", kv.describe())
with kv.open(p, queue_depth=8) as fk, get_backend("direct").open(p) as fd:
    for size, off in ((1, 0), (4095, 1), (4096, 4096), (4097, 8191), (3 * 4096 + 7, 12288),
                      (16 << 20, 4096), ((16 << 20) + 7, 3)):
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        fk.read(dev, off, size)
        host = aligned_empty(size); fd.read(host, off, size)
        assert torch.equal(dev.cpu(), host), (size, off)
    futs = [fk.pread(torch.empty(4 << 20, dtype=torch.uint8, device="cuda"), i << 22, 4 << 20)
            for i in range(16)]
    assert all(f.result() == 4 << 20 for f in futs)
print("kvikio -> CUDA tensor: identical bytes")
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || fail=1

echo "== 4. bench io, all backends, cold" | tee -a "$OUT/log.txt"
F=$(mktemp -d)/bench.bin
head -c 1G /dev/urandom > "$F"
"$PY" -m expertfs bench io "$F" --size 4M --qd 1,4,16,32 --total 512M --backend all --json \
  > "$OUT/bench_io.json" 2>>"$OUT/log.txt" || fail=1
"$PY" - "$OUT/bench_io.json" <<'PYEOF' 2>&1 | tee -a "$OUT/log.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print("auto:", r["auto"]["backend"], "-", r["auto"]["reason"])
for qd in sorted({p["qd"] for p in r["points"]}):
    pts = {p["backend"]: p["gbps"] for p in r["points"] if p["qd"] == qd}
    best_posix = max(v for k, v in pts.items() if k in ("direct", "buffered"))
    kv = pts.get("kvikio")
    print(f"qd {qd}: " + ", ".join(f"{k} {v:.2f}" for k, v in pts.items()) +
          (f"; kvikio / best POSIX = {kv / best_posix:.2f}" if kv else "; kvikio skipped"))
PYEOF
rm -rf "$(dirname "$F")"
echo "gpu_check_io: $([ $fail = 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/log.txt"
exit $fail
