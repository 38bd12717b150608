#!/usr/bin/env bash
# The CUDA path on its first GPU, in one command and under 10 minutes (issue 17). Every step
# has its own timeout; a failed step is reported and the next one runs. Steps:
#
#  1. environment: torch, CUDA, the GPU, free device memory, kvikio;
#  2. the gpu-marked tests (tests/runtime/cache, tests/runtime/io, tests/runtime/model);
#  3. CPU vs CUDA logits on a synthetic Q4_K_M qwen3moe (float32 to tolerance, bf16 top-1);
#  4. a streamed decode on CUDA with small RAM and VRAM tiers (--vram set: experts really go
#     NVMe -> pinned RAM -> VRAM), and 5. the same with --vram unset (the default tier sized
#     from free device memory); each prints tok/s, H2D bytes, uploads and pinned bytes;
#  6. host syncs per decode token on a tiered decode, greedy and sampled (the call sites that
#     read a tensor's value on the host; on CUDA also set_sync_debug_mode's count), failing
#     above MoE layers + 3 a token;
#  7. one get with RAM hits and cold misses on the device tier: the hits uploaded before any
#     miss is awaited, the misses as their reads land, every byte equal to the store's;
#  8. kernels and time a resident decode token, a get's experts dequantized one by one against
#     per role in one call (bench/expert_launches.py), the logits compared;
#  9. expertfs plan on this box (its GPU probed) against the run line it recommends: the
#     predicted decode band and first token beside the measured ones (reported).
#
# Usage:  bench/gpu_check.sh [--dry-run] [WORKDIR]
#         --dry-run (or DEV=cpu) runs every step on the CPU to check the script itself.
#         PY=path/to/python chooses the interpreter. The figures go to WORKDIR/report.txt.
# Exit status 0 when every step passed, else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEV=${DEV:-cuda}
if [ "${1:-}" = "--dry-run" ]; then DEV=cpu; shift; fi
W=${1:-${TMPDIR:-/tmp}/expertfs-gpu-check}
mkdir -p "$W"
REPORT="$W/report.txt"
: > "$REPORT"
FAILED=()
export W DEV PY
S=bench/gpu_check_steps.py

step() {          # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    printf '\n== %s (limit %ss)\n' "$name" "$limit" | tee -a "$REPORT"
    local t0=$SECONDS rc
    timeout "$limit" "$@" 2>&1 | tee -a "$REPORT"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name")
        echo "-- FAILED: $name (exit $rc; 124: timed out)" | tee -a "$REPORT"
    else
        echo "-- ok: $name ($((SECONDS - t0)) s)" | tee -a "$REPORT"
    fi
}

step "1/9 environment" 60 "$PY" "$S" env
if [ "$DEV" = cpu ]; then
    step "2/9 gpu-marked tests (dry run: collected only)" 120 "$PY" -m pytest -q \
        -p no:cacheprovider -m gpu --collect-only tests/runtime/cache tests/runtime/io \
        tests/runtime/model
else
    step "2/9 gpu-marked tests" 240 env EXPERTFS_TEST_DEVICE=cuda "$PY" -m pytest -q \
        -p no:cacheprovider -m gpu tests/runtime/cache tests/runtime/io tests/runtime/model
fi
step "3/9 CPU vs $DEV logits, Q4_K_M synthetic qwen3moe" 150 "$PY" "$S" logits
step "4/9 streamed decode on $DEV, --vram 64M" 150 "$PY" "$S" stream --vram 64M
step "5/9 streamed decode on $DEV, --vram unset (sized from free memory)" 150 "$PY" "$S" stream
step "6/9 host syncs per decode token on $DEV" 150 "$PY" "$S" syncs
step "7/9 a get's device misses concurrent on $DEV" 90 "$PY" "$S" misses
step "8/9 kernels a decode token on $DEV, experts one by one and grouped" 150 "$PY" "$S" launches
step "9/9 plan against run on $DEV" 150 "$PY" "$S" plan

if [ ${#FAILED[@]} -eq 0 ]; then
    echo "== all steps passed (report: $REPORT)"
else
    echo "== ${#FAILED[@]} step(s) failed: ${FAILED[*]} (report: $REPORT)"
fi
exit ${#FAILED[@]}
