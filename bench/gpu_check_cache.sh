#!/usr/bin/env bash
# GPU check of the expert cache (run on a machine with an NVIDIA GPU and driver; under 3 minutes).
#  1. the cache, tiered-provider and prefetch tests (CPU paths, and the fake-GPU ordering test);
#  2. on CUDA: a pinned host slab within the pin budget, and the fallback to pageable memory
#     (with a warning) when the budget is too small;
#  3. the device tier: uploads on the copy stream with events, demotions, the slot table on the
#     device; a random workload whose reads of the weights are queued on a deliberately slow
#     compute stream (a long matmul first), checked against the store's bytes only at the end,
#     so a missing stream wait (compute before an upload, an upload into a slot a queued kernel
#     still reads, a read into a host slot a copy still reads) shows up as wrong sums;
#  4. gathering weights by the device slot table, without a host sync;
#  5. no device tier on CUDA (per-get copies), and hit/upload timings.
# Results go to $OUT (or /tmp/gpu_check_cache). Exit status is non-zero if any check fails.
# A dry run of steps 2-5 on the CPU (device tier on CPU): EXPERTFS_GPU_CHECK_DEVICE=cpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_cache}
mkdir -p "$OUT"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
fail=0
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt" || true

echo "== 1. cache tests" | tee "$OUT/log.txt"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -x tests/runtime/cache/test_cache*.py tests/runtime/sim/test_cache*.py tests/runtime/cache/test_tiered*.py \
    tests/runtime/prefetch/test_prefetch*.py 2>&1 | tee -a "$OUT/log.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || fail=1

echo "== 2-5. CUDA tiers" | tee -a "$OUT/log.txt"
timeout 150 "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/log.txt"
import dataclasses, logging, os, random, sys, tempfile, time
import torch
from expertfs.store.repack import repack
from expertfs.runtime.cache.provider import TieredProvider
from expertfs.runtime.io import PinBudget
from expertfs.store.reader import Store
from expertfs.synth import SynthConfig, synthesize

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
DEV = os.environ.get("EXPERTFS_GPU_CHECK_DEVICE", "cuda")
cuda = DEV == "cuda"
assert not cuda or torch.cuda.is_available(), "no CUDA (dry run: EXPERTFS_GPU_CHECK_DEVICE=cpu)"
if cuda:
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
else:
    torch.set_num_threads(1)      # tiny CPU ops beside I/O threads: the intra-op pool stalls
STEPS = 600 if cuda else 120
tmp = tempfile.mkdtemp(prefix="gpu_check_cache_")
cfg = dataclasses.replace(SynthConfig(), n_layer=6, n_expert=32, n_expert_used=8, n_embd=512,
                          n_ff_exp=256, n_vocab=300, n_ff=64, head_dim=64, n_head=8, n_head_kv=2,
                          quant="Q8_0")
files = synthesize(cfg, os.path.join(tmp, "m.gguf"), overwrite=True)
repack(files, os.path.join(tmp, "m.efs"))
store = Store.open(os.path.join(tmp, "m.efs"))
data = open(store.experts_path, "rb").read()
slot = max(store.extent(la, 0).length for la in store.layers)
L, E, K = store.layers, 32, 8
print(f"store: {len(L)} layers x {E} experts, slot {slot} bytes")

import numpy as np
raw = np.frombuffer(data, dtype=np.uint8)
SUMS = {}
for la in L:
    for e in range(E):
        ext = store.extent(la, e)
        SUMS[la, e] = sum(int(raw[ext.offset + p.rel_offset:ext.offset + p.rel_offset + p.nbytes]
                              .sum(dtype=np.int64)) for p in ext.parts)

failures = []
def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)

# -- 2. pinning within the budget, and the fallback ---------------------------------------------
p = TieredProvider(store, device=DEV, ram_bytes=40 * slot, vram_bytes=24 * slot, backend="buffered",
                   warm_start=False, record_usage=False, pin_budget=PinBudget(1 << 30))
d = p.describe()
print("tiers:", d)
check(d["pinned"] == cuda, f"host slab pinned with CUDA ({d['pin_note']})")
check(p.compute_slab.device.type == DEV and p.slot_table.device.type == DEV,
      "device slab and slot table on the compute device")
p.close()
q = TieredProvider(store, device=DEV, ram_bytes=40 * slot, vram_bytes=24 * slot, backend="buffered",
                   warm_start=False, record_usage=False, pin_budget=PinBudget(slot))
check(not q.describe()["pinned"], "over the pin budget: pageable fallback (warning above)")
q.close()

# -- 3. a random workload read on a slow compute stream ---------------------------------------------
def workload(provider, steps, seed, slow=True):
    rng = random.Random(seed)
    sums, want = [], []
    for i in range(steps):
        li = i % len(L)
        layer = L[li]
        ids = rng.sample(range(E), K)
        if rng.random() < 0.5:
            provider.prefetch(L[(li + 1) % len(L)], rng.sample(range(E), K))
        w = provider.get(layer, ids)
        if slow and cuda and i % 5 == 0:
            torch.cuda._sleep(4_000_000)            # ~2 ms of GPU spin: compute falls behind
        for e in ids:
            for q in w[e].parts.values():
                sums.append(q.raw.to(torch.int64).sum())
            want.append((layer, e))
        provider.release(layer)
    got = torch.stack(sums).view(len(want), -1).sum(dim=1).tolist()   # one sync, at the end
    exp = [SUMS[la, e] for la, e in want]
    return sum(g != x for g, x in zip(got, exp))

for ram, vram in ((40, 24), (20, 12), (12, 40)):
    p = TieredProvider(store, device=DEV, ram_bytes=ram * slot, vram_bytes=vram * slot,
                       backend="buffered", warm_start=False, record_usage=False, history=True)
    t0 = time.perf_counter()
    bad = workload(p, STEPS, seed=ram)
    dt = time.perf_counter() - t0
    st = p.stats
    check(bad == 0, f"ram {ram} vram {vram} slots: {st.requests} experts read by queued kernels, "
          f"{bad} wrong (hits vram {st.hits.get('vram', 0)} ram {st.hits.get('ram', 0)}, "
          f"misses {st.misses}, uploads {st.uploads}, demotions {st.demotions}; {dt:.1f} s)")
    # -- 4. gather by the device slot table, no host sync until the compare
    li = 2
    layer = L[li]
    ids = random.Random(1).sample(range(E), K)
    w = p.get(layer, ids)
    slots = p.slot_table[li][torch.tensor(ids, device=DEV)]
    n = store.extent(layer, ids[0]).length
    gathered = p.compute_slab[slots.long(), :n]
    direct = torch.stack([torch.cat([w[e].parts[r].raw for r in sorted(w[e].parts)]) for e in ids])
    ext = store.extent(layer, ids[0])
    offs = [(pp.rel_offset, pp.nbytes) for pp in sorted(ext.parts, key=lambda x: x.role)]
    via_table = torch.cat([gathered[:, o:o + nb] for o, nb in offs], dim=1)
    check(bool(torch.equal(via_table, direct)), f"slot table gather == get() views (ram {ram}, vram {vram})")
    p.release(layer)
    p.close()

# -- 5. CUDA without a device tier; timings ------------------------------------------------------------
p = TieredProvider(store, device=DEV, ram_bytes=64 * slot, backend="buffered", warm_start=False,
                   record_usage=False)
bad = workload(p, STEPS // 2, seed=5)
check(bad == 0, f"no device tier: per-get copies, {bad} wrong of {p.stats.requests}")
p.close()
n_all = len(L) * E
p = TieredProvider(store, device=DEV, ram_bytes=16 * slot, vram_bytes=(n_all + 8) * slot,
                   backend="buffered", warm_start=False, record_usage=False)
for la in L:
    for e0 in range(0, E, K):
        p.get(la, list(range(e0, e0 + K)))
        p.release(la)
if cuda:
    torch.cuda.synchronize()
h2d = p.stats.bytes_h2d
rng = random.Random(9)
routes = [(L[i % len(L)], rng.sample(range(E), K)) for i in range(STEPS * 5)]
t0 = time.perf_counter()
for la, ids in routes:
    p.get(la, ids)
    p.release(la)
if cuda:
    torch.cuda.synchronize()
dt = time.perf_counter() - t0
check(p.stats.bytes_h2d == h2d, "all-resident routes moved nothing")
print(f"hit cost on {DEV}: {dt / (len(routes) * K) * 1e6:.1f} µs per expert (target < 20)")
p.close()
store.close()
print("FAILED:", failures) if failures else print("all CUDA cache checks passed")
sys.exit(1 if failures else 0)
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
echo "exit $fail" | tee -a "$OUT/log.txt"
exit $fail
