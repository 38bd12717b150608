#!/usr/bin/env bash
# CUDA checks of the model runtime (issue 5, item 6), about 3-5 minutes on one GPU:
#
#  1. logits on CUDA (float32) equal transformers' for Qwen3Moe, Glm4Moe and Mixtral
#     (tests/runtime/model/test_vs_transformers.py with EXPERTFS_TEST_DEVICE=cuda);
#  2. a synthetic qwen3moe in Q4_K_M: `expertfs run --tokens ... --logits-out` on CPU, on CUDA
#     in float32 (must agree to float tolerance) and in bfloat16 (top-1 agreement);
#  3. a streamed decode on CUDA with small RAM and VRAM tiers (so experts really stream
#     NVMe -> RAM -> VRAM), lookahead on, a routing trace written and replayed by bench cache.
#
# Usage:  bench/gpu_check.sh [WORKDIR]      (PY=path/to/python to choose the interpreter;
#         DEV=cpu runs the same steps on the CPU, to check the script itself)
# Exit status 0 when every check passed; the figures are printed and saved in WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
W=${1:-${TMPDIR:-/tmp}/expertfs-gpu-check}
mkdir -p "$W"
EFS=("$PY" -m expertfs)
DEV=${DEV:-cuda}
log() { printf '\n== %s\n' "$*"; }

log "environment"
"$PY" - "$DEV" <<'EOF'
import sys, torch
if sys.argv[1] == "cpu":
    print(f"torch {torch.__version__}: dry run on the CPU"); sys.exit(0)
if not torch.cuda.is_available():
    sys.exit("CUDA is not available to torch: install a CUDA build of torch on a GPU machine")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, "
      f"{p.total_memory / 2**30:.0f} GiB")
EOF

log "1/3 logits on CUDA vs transformers (float32)"
EXPERTFS_TEST_DEVICE=$DEV timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/runtime/model/test_vs_transformers.py

log "2/3 CPU vs CUDA logits on a Q4_K_M synthetic qwen3moe"
"$PY" - "$W" <<'EOF'
import os, sys
from expertfs.store.repack import repack
from expertfs.synth import SynthConfig, synthesize
w = sys.argv[1]
g, s = os.path.join(w, "small.gguf"), os.path.join(w, "small.efs")
if not os.path.isdir(s):
    synthesize(SynthConfig.tiny("qwen3moe").replace(n_layer=6, n_expert=32, n_expert_used=4,
                                                    quant="q4_k_m"), g)
    repack([g], s, force=True)
EOF
TOKS=3,17,99,250,4,8,15,16,23,42,108,7,300,512,64,1
"${EFS[@]}" run "$W/small.efs" --tokens $TOKS --logits-out "$W/cpu.npy" --device cpu \
    --provider direct >/dev/null
"${EFS[@]}" run "$W/small.efs" --tokens $TOKS --logits-out "$W/cuda32.npy" --device "$DEV" \
    --dtype float32 >/dev/null
"${EFS[@]}" run "$W/small.efs" --tokens $TOKS --logits-out "$W/cuda16.npy" --device "$DEV" \
    --dtype bfloat16 >/dev/null
"$PY" - "$W" <<'EOF'
import sys, numpy as np
w = sys.argv[1]
cpu, c32, c16 = (np.load(f"{w}/{n}.npy") for n in ("cpu", "cuda32", "cuda16"))
d32 = float(np.abs(cpu - c32).max())
top16 = float((cpu.argmax(-1) == c16.argmax(-1)).mean())
print(f"float32: max |CPU - CUDA| = {d32:.2e} (scale {np.abs(cpu).max():.2f}); "
      f"bfloat16: top-1 agreement {top16:.2f}, max |diff| {np.abs(cpu - c16).max():.3f}")
assert d32 < 1e-3 * max(1.0, float(np.abs(cpu).max())), "CUDA float32 logits differ from CPU"
assert top16 >= 0.8, "CUDA bfloat16 top-1 agreement too low"
EOF

log "3/3 streamed decode on CUDA (RAM and VRAM tiers smaller than the experts)"
"$PY" - "$W" <<'EOF'
import os, sys
from expertfs.store.repack import repack
from expertfs.synth import SynthConfig, synthesize
from expertfs.synth.writer import layers_for_size
w = sys.argv[1]
g, s = os.path.join(w, "stream.gguf"), os.path.join(w, "stream.efs")
if not os.path.isdir(s):
    cfg = SynthConfig.tiny("qwen3moe").replace(n_embd=1024, n_head=8, n_head_kv=4, head_dim=128,
                                               n_ff_exp=512, n_expert=64, n_expert_used=8,
                                               n_vocab=4096, quant="q4_k_m")
    synthesize(layers_for_size(cfg, 400 << 20), g)
    repack([g], s, force=True)
EOF
timeout 240 "${EFS[@]}" run "$W/stream.efs" -p "The quick brown fox jumps over the lazy dog" \
    -n 64 --ignore-eos --device "$DEV" --ram 96M --vram 64M --lookahead \
    --trace "$W/stream.eftrace" --json > "$W/stream.json"
"$PY" - "$W" <<'EOF'
import json, sys
r = json.load(open(f"{sys.argv[1]}/stream.json"))
print(f"decode {r['decode_tokens_per_s']:.2f} tok/s, first token {r['time_to_first_token_s']:.2f} s, "
      f"{r['mb_read_per_token']:.1f} MB read/token, hit {r['hit_rate']}, stall {r['stall_s']:.2f} s")
print("lookahead", r["stats"].get("lookahead"))
assert r["generated_tokens"] == 64 and r["decode_tokens_per_s"] > 0
EOF
"${EFS[@]}" bench cache --trace "$W/stream.eftrace" --capacity 12.5%,25% --policies lru \
    | tail -n 5
log "all CUDA checks passed (figures in $W)"
