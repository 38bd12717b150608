"""The steps of bench/gpu_check.sh that are Python: ``env``, ``logits``, ``stream [ARGS...]``,
``syncs`` (host syncs per decode token), ``misses`` (a get's device misses concurrent),
``launches`` (kernels a decode token, a get's experts dequantized one by one and grouped) and
``plan`` (``expertfs plan``'s band against the run it recommends, reported).
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


def _engine(s: str, vram_slots: int):
    from expertfs.runtime.engine import Engine
    from expertfs.store.reader import Store
    with Store.open(s) as st:
        slot = max(st.extent(la, 0).length for la in st.layers)
    return Engine.open(s, provider="tiered", device=DEV, ram_bytes=48 * slot,
                       vram_bytes=vram_slots * slot, fused="off",
                       provider_options={"warm_start": False, "backend": "buffered",
                                         "record_usage": False})


def syncs() -> None:
    """Host syncs per decode token on a tiered decode (small RAM and VRAM tiers): the call
    sites that copy a tensor's value to the host (HostSyncCounter, any device) and, on CUDA,
    the syncs torch.cuda.set_sync_debug_mode reports. Fails above MoE layers + 3 a token."""
    import warnings
    import torch
    from expertfs.runtime.generate import generate
    from expertfs.runtime.hostsync import HostSyncCounter
    from expertfs.runtime.sampling import Sampler, SamplingParams
    s = _store("small", big=False)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
        with _engine(s, 24) as e:
            moe = sum(b.moe is not None for b in e.trunk.blocks)
            g = generate(e, [3, 17, 99, 250], Sampler(params), 17)
            next(g)
            with HostSyncCounter() as c, warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                if DEV != "cpu":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    n = len(list(g))
                finally:
                    if DEV != "cpu":
                        torch.cuda.set_sync_debug_mode("default")
            # a dry run's sampler takes its CPU branch (nucleus: host reads of host tensors);
            # a device's logits take nucleus_dense, which reads nothing back (tests/runtime)
            sites = {k: v for k, v in c.by_site().items() if "@ buffers.py:" not in k
                     and not (DEV == "cpu" and "@ sampling.py:" in k)}
            cuda = sum("synchroniz" in str(x.message) for x in w)
            per, limit = sum(sites.values()) / n, moe + 3
            print(f"{'greedy' if params.greedy else 'sampled'}: {n} tokens, {moe} MoE layers: "
                  f"{per:.2f} host-copy sites a token {sites}"
                  + (f"; CUDA sync warnings {cuda / n:.2f} a token" if DEV != "cpu" else ""))
            assert per <= limit, f"{per:.2f} host syncs a token > MoE layers + 3 = {limit}"
            assert DEV == "cpu" or cuda / n <= limit, f"{cuda / n:.2f} CUDA syncs a token"


def misses() -> None:
    """One get with RAM hits and cold misses on the device tier: the RAM hits come back from
    get_begin already uploaded, the misses as their reads land; every byte equals the store."""
    import time
    from expertfs.runtime.cache import State
    s = _store("small", big=False)
    with _engine(s, 16) as e:
        p, st = e.provider, e.store
        layer = st.layers[1]
        hits, cold = [0, 1], [5, 6, 7, 8]
        p.prefetch(layer, hits)
        end = time.monotonic() + 30
        while not all(p.cache.state_of(p.cache.key(layer, x)) is State.HOST for x in hits):
            assert time.monotonic() < end, "prefetches did not land"
            time.sleep(0.001)
        t0 = time.perf_counter()
        ready, finish = p.get_begin(layer, cold[:2] + hits + cold[2:])
        t1 = time.perf_counter()
        rest = finish()
        t2 = time.perf_counter()
        got = {**ready, **rest}
        assert set(hits) <= set(ready) and set(got) == set(hits + cold), (ready, rest)
        with open(st.experts_path, "rb") as f:
            data = f.read()
        for x, w in got.items():
            ext = st.extent(layer, x)
            for part in ext.parts:
                want = data[ext.offset + part.rel_offset:ext.offset + part.rel_offset + part.nbytes]
                assert bytes(w.parts[part.role].raw.cpu().numpy()) == want, (x, part.role)
        p.release(layer)
        ps = p.stats
        print(f"get_begin {1e3 * (t1 - t0):.2f} ms with {len(ready)} ready ({len(hits)} RAM hits "
              f"uploaded), finish {1e3 * (t2 - t1):.2f} ms for {len(rest)}; uploads "
              f"{ps.uploads}, misses {ps.misses}, stall {ps.stall_seconds * 1e3:.2f} ms")


def launches() -> None:
    """Kernels and time a resident decode token on the device path, a get's experts dequantized
    one by one against per role in one call (``bench/expert_launches.py``); fails unless the
    grouped path launches fewer kernels and gives the same logits to float32 tolerance."""
    s, out = _store("stream", big=True), os.path.join(W, "launches.json")
    subprocess.run([PY, os.path.join(os.path.dirname(__file__), "expert_launches.py"), s,
                    "--device", DEV, "-n", "8", "--json", out], check=True)
    r = json.load(open(out))
    k, d = r["kernels"], r["logits_max_abs_diff"]
    assert k["grouped"] < k["one_by_one"], "grouped dequantization launched no fewer kernels"
    assert d < 1e-2, f"grouped logits differ by {d:.2e}"


def plan_vs_run() -> None:
    """``expertfs plan`` on this box (its GPU probed) for the stream store, then the ``run``
    line it recommends: the predicted decode band and first token against the measured ones
    (issue 19 on a GPU; reported, not judged: a first GPU run is where the figures come from).
    Fails only when either command does or the plan is not JSON."""
    import shlex
    s = _store("stream", big=True)
    prompt = "The quick brown fox jumps over the lazy dog"
    r = subprocess.run([PY, "-m", "expertfs", "plan", s, "--json", "-n", "32", "--prompt-tokens",
                        "12"], check=True, capture_output=True, text=True)
    p = json.loads(r.stdout)
    pred, ft = p.get("prediction") or {}, p.get("first_token") or {}
    line = shlex.split(p["run"])
    assert line[:2] == ["expertfs", "run"], p["run"]
    out = os.path.join(W, "plan_run.json")
    with open(out, "w") as f:
        _run(*line[2:], "-p", prompt, "--ignore-eos", "--json", out=f)
    m = json.load(open(out))
    print(f"plan: {p.get('status')}, {p['run']}")
    print(f"decode: band {pred.get('tok_s_low', 0):.2f}-{pred.get('tok_s_high', 0):.2f} tok/s, "
          f"run {m['decode_tokens_per_s']:.2f}; first token: band {ft.get('s_fast') or 0:.2f}-"
          f"{ft.get('s_slow') or 0:.2f} s, run {m['time_to_first_token_s']:.2f} s")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "env":
        env()
    elif what == "logits":
        logits()
    elif what == "stream":
        stream(sys.argv[2:])
    elif what == "syncs":
        syncs()
    elif what == "misses":
        misses()
    elif what == "launches":
        launches()
    elif what == "plan":
        plan_vs_run()
    else:
        raise SystemExit("usage: gpu_check_steps.py env | logits | stream [ARGS...] | syncs | "
                         "misses | launches | plan")
