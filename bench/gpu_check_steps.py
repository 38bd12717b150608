"""The steps of bench/gpu_check.sh that are Python: ``env``, ``logits``, ``stream [ARGS...]``.
Reads W (the work folder), DEV (cuda, or cpu for a dry run) and PY from the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

W, DEV = os.environ.get("W", "/tmp/expertfs-gpu-check"), os.environ.get("DEV", "cuda")
PY = os.environ.get("PY", sys.executable)
TOKS = "3,17,99,250,4,8,15,16,23,42,108,7,300,512,64,1"


def env() -> None:
    import torch
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, device {DEV}")
    if DEV != "cpu":
        if not torch.cuda.is_available():
            raise SystemExit("CUDA is not available to torch: install a CUDA build of torch")
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        print(f"{p.name}: {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    try:
        import kvikio
        print("kvikio", getattr(kvikio, "__version__", "?"))
    except ImportError:
        print("kvikio not installed")


def _store(name: str, big: bool) -> str:
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    from expertfs.synth.writer import layers_for_size
    g, s = os.path.join(W, f"{name}.gguf"), os.path.join(W, f"{name}.efs")
    if not os.path.isdir(s):
        cfg = SynthConfig.tiny("qwen3moe")
        if big:
            cfg = layers_for_size(cfg.replace(n_embd=1024, n_head=8, n_head_kv=4, head_dim=128,
                                              n_ff_exp=512, n_experts=64, n_expert_used=8,
                                              n_vocab=4096, quant="q4_k_m"), 400 << 20)
        else:
            cfg = cfg.replace(n_layers=6, n_experts=32, n_expert_used=4, quant="q4_k_m")
        synthesize(cfg, g)
        repack([g], s, force=True)
    return s


def _run(*args: str, out=subprocess.DEVNULL) -> None:
    subprocess.run([PY, "-m", "expertfs", "run", *args], check=True, stdout=out)


def logits() -> None:
    import numpy as np
    s = _store("small", big=False)
    _run(s, "--tokens", TOKS, "--logits-out", f"{W}/cpu.npy", "--device", "cpu",
         "--provider", "direct")
    _run(s, "--tokens", TOKS, "--logits-out", f"{W}/d32.npy", "--device", DEV, "--dtype", "float32")
    _run(s, "--tokens", TOKS, "--logits-out", f"{W}/d16.npy", "--device", DEV, "--dtype", "bfloat16")
    cpu, d32, d16 = (np.load(f"{W}/{n}.npy") for n in ("cpu", "d32", "d16"))
    diff, top = float(np.abs(cpu - d32).max()), float((cpu.argmax(-1) == d16.argmax(-1)).mean())
    print(f"float32 max |CPU - {DEV}| {diff:.2e}; bfloat16 top-1 agreement {top:.2f}")
    assert diff < 1e-3 * max(1.0, float(np.abs(cpu).max())), "float32 logits differ from CPU"
    assert top >= 0.8, "bfloat16 top-1 agreement too low"


def stream(extra: list[str]) -> None:
    s = _store("stream", big=True)
    path = os.path.join(W, "stream_" + ("vram_set" if extra else "vram_auto") + ".json")
    with open(path, "w") as f:
        _run(s, "-p", "The quick brown fox jumps over the lazy dog", "-n", "32", "--ignore-eos",
             "--device", DEV, "--ram", "96M", *extra, "--json", out=f)
    r = json.load(open(path))
    ps, t = r["stats"]["provider_stats"], r["stats"].get("tiers", {})
    print(f"decode {r['decode_tokens_per_s']:.2f} tok/s, first token "
          f"{r['time_to_first_token_s']:.2f} s; H2D {ps.get('bytes_h2d', 0) / 1e6:.1f} MB in "
          f"{ps.get('uploads', 0)} uploads; VRAM tier {r['vram_tier_bytes'] / 2**20:.0f} MiB; "
          f"pinned {r['pinned_bytes'] / 2**20:.0f} of {t.get('ram_bytes', 0) / 2**20:.0f} MiB "
          f"RAM tier ({t.get('pin_note')}); hit {r['hit_rate']}, stall {r['stall_s']:.2f} s")
    if r.get("vram_plan"):
        print("VRAM plan:", r["vram_plan"])
    assert r["generated_tokens"] == 32 and r["decode_tokens_per_s"] > 0
    if DEV != "cpu":
        assert r["pinned_bytes"] > 0, "nothing of the RAM tier is pinned on CUDA"
        if not extra:
            assert r["vram_tier_bytes"] > 0, "--vram unset on CUDA gave no VRAM tier"


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "env":
        env()
    elif what == "logits":
        logits()
    elif what == "stream":
        stream(sys.argv[2:])
    else:
        raise SystemExit("usage: gpu_check_steps.py env | logits | stream [ARGS...]")
