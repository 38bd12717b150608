"""``expertfs run``: generation, --json, --tokens/--logits-out, --trace, and typed errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_to_gguf import convert  # noqa: E402

from expertfs.cli import main  # noqa: E402
from expertfs.runtime.trace.file import read_trace  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return convert("glm4moe", str(tmp_path_factory.mktemp("run")), seed=31)


def test_logits_out_matches_transformers(model, tmp_path, capsys):
    hf, _, store = model
    toks = [3, 14, 15, 92, 65, 35]
    out = tmp_path / "l.npy"
    assert main(["run", store, "--tokens", ",".join(map(str, toks)), "--logits-out", str(out),
                 "--provider", "direct"]) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (len(toks), hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].numpy()
    assert np.abs(got - ref).max() < 1e-4
    assert capsys.readouterr().out.split() == [str(i) for i in ref.argmax(-1)]


def test_generate_json(model, capsys):
    _, _, store = model
    assert main(["run", store, "-p", "Beautiful is better", "-n", "5", "--json",
                 "--provider", "direct", "-t", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == len(r["prompt"]) > 0
    assert 1 <= r["generated_tokens"] <= 5 and len(r["tokens"]) == r["generated_tokens"]
    assert r["time_to_first_token_s"] > 0
    assert r["stats"]["provider_stats"]["bytes_read"] > 0
    assert isinstance(r["text"], str)


def test_preload_reads_every_expert_before_the_prompt(model, capsys):
    """--preload: the RAM tier holds the model before the prompt, so generation reads nothing
    and every expert get hits; the preload's reads and gets are reported apart."""
    _, _, store = model
    assert main(["run", store, "-p", "Beautiful is better", "-n", "4", "--json", "-t", "1",
                 "--provider", "tiered", "--ram", "1G", "--preload", "--ignore-eos"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["preload_s"] > 0 and r["generated_tokens"] == 4
    assert r["mb_read_per_token"] == 0 and r["hit_rate"]["ram"] == 1.0 and r["stall_s"] == 0
    assert r["decode_stall_s"] == 0
    assert r["stats"]["provider_stats"]["bytes_read"] > 0      # the preload's reads


def test_engine_holds_the_warm_start_until_the_first_logits(model):
    """The warm start's reads wait while the engine loads and runs the prompt (the prompt's
    own experts first), and go on after its logits."""
    from expertfs.runtime.engine import Engine
    _, _, store = model
    with Engine.open(store, provider="tiered", ram_bytes=1 << 30) as e:
        loader = e.provider.cache.loader
        assert loader.held and loader.drip_pending > 0
        e.prefill([3, 14, 15])
        assert not loader.held
        e.decode(9)
    with Engine.open(store, provider="tiered", ram_bytes=1 << 30) as e:
        e.start_warm()                                     # a server, before any request
        assert not e.provider.cache.loader.held


def test_chat_sampling_streams_text(model, capsys):
    _, _, store = model
    assert main(["run", store, "--chat", "-p", "hi", "-n", "4", "--temp", "0.8", "--top-p", "0.9",
                 "--top-k", "20", "--seed", "3", "--provider", "direct", "--lookahead"]) == 0
    cap = capsys.readouterr()
    assert "first token after" in cap.err and "lookahead: coverage" in cap.err


def test_trace_records_every_routing(model, tmp_path, capsys):
    _, _, store = model
    tr = tmp_path / "run.eftrace"
    toks = [1, 2, 3, 4, 5]
    assert main(["run", store, "--tokens", ",".join(map(str, toks)), "--trace", str(tr),
                 "--provider", "direct", "--batch", "2"]) == 0
    header, c = read_trace(str(tr))
    rows = [(int(t), int(la)) for t, la in zip(c.tokens, c.layers)]
    moe_layers = [i for i in range(header.n_layers) if header.expert_bytes[i]]
    assert header.expert_bytes[0] == 0 and moe_layers                # glm4moe: layer 0 dense
    assert sorted(rows) == sorted((t, la) for t in range(len(toks)) for la in moe_layers)
    assert c.experts.shape[1] == header.k


@pytest.mark.parametrize("argv,msg", [
    (["--tokens", "1,x"], "not a list of integers"),
    (["--tokens", "1,99999"], "outside the vocabulary"),
    (["-p", "hi", "--logits-out", "x.npy"], "--logits-out needs --tokens"),
    pytest.param(["-p", "hi", "--device", "cuda"], "CUDA is not available", marks=pytest.mark.nogpu),
    (["-p", "hi", "--dtype", "int3"], "unknown compute dtype"),
    (["--tokens", "1,2", "--ctx", "1"], "exceeds n_ctx"),
    (["-p", "hi", "--preload", "--provider", "direct"], "--preload needs the RAM tier"),
])
def test_bad_input_is_one_line_exit_2(model, capsys, argv, msg):
    _, _, store = model
    assert main(["run", store, "--provider", "direct", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and err[0].startswith("expertfs run: error:")


def test_missing_store_exit_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.efs"), "-p", "x"]) == 2
    assert "no such store" in capsys.readouterr().err


def test_json_reports_the_tiers_and_pinned_bytes(model, capsys):
    _, _, store = model
    assert main(["run", store, "-p", "Beautiful", "-n", "2", "--json", "-t", "1",
                 "--device", "cpu"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["vram_tier_bytes"] == 0 and r["vram_plan"] is None      # CPU: no VRAM tier
    assert r["pinned_bytes"] == 0 == r["stats"]["tiers"]["pinned_bytes"]  # CPU: nothing pinned
    assert r["stats"]["tiers"]["ram_bytes"] > 0


def test_default_vram_tier_from_free_device_memory(model, monkeypatch):
    """``--vram`` unset on CUDA: free memory (faked) less trunk, KV, workspace and reserve."""
    import argparse

    from expertfs.cli import _tiers
    from expertfs.runtime.plan.model import geometry_of_store
    from expertfs.store.reader import Store
    _, _, store = model
    with Store.open(store) as s:
        g = geometry_of_store(s)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (40 << 30, 48 << 30))
    args = argparse.Namespace(store=store, vram=None, ctx=4096, dtype="auto", trunk="auto")
    tier = _tiers.vram_tier(args, "cuda", g)
    p = args.vram_plan
    assert tier == p["tier"] == g.slot_bytes * g.n_decode_experts      # all experts fit
    assert p["trunk"] > 0 and p["kv"] > 0 and p["reserve"] >= 512 << 20
    args.dq_cache = 1 << 30                     # the dequantized experts live on the device
    _tiers.vram_tier(args, "cuda", g)
    assert args.vram_plan["workspace"] == p["workspace"] + (1 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 30, 48 << 30))
    assert _tiers.vram_tier(args, "cuda", g) == 0                       # nothing left: 0


def test_json_reports_the_prefills_reads_against_the_drive(model, capsys, tmp_path, monkeypatch):
    """A cold tier: the prompt's reads (MB, MB/s) are reported, beside the drive's rate when
    plan has measured this device (here: a cache entry written as plan writes it)."""
    from expertfs.runtime.plan import boxcache
    from expertfs.runtime.plan.model import load_geometry
    _, _, store = model
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    argv = ["run", store, "-p", "Beautiful is better", "-n", "2", "--json", "-t", "1",
            "--provider", "tiered", "--ram", "1G", "--no-warm-start", "--ignore-eos"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prefill_read_mb"] > 0 and r["prefill_read_mb_s"] > 0 and r["drive_mb_s"] is None
    assert 0 <= r["decode_stall_s"] <= r["stall_s"]     # the decode's share of the waits
    g, data = load_geometry(store)
    boxcache.save({boxcache.storage_key(data, g.slot_bytes): {"slow": 0.5, "fast": 1.5}})
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["drive_mb_s"] == pytest.approx(1500)


@pytest.mark.parametrize("arch,ram,flag,want", [
    ("glm5-next", "small", None, "forced"), ("glm5-next", "small", "--no-lookahead", None),
    ("glm5-next", "all", None, None), ("glm5-next", "trunk-evicted", None, None),
    ("qwen3moe", "small", None, "tuned off"), ("qwen3moe", "small", "--lookahead", "forced")])
def test_lookahead_is_tuned_by_default_where_experts_stream(tmp_path, capsys, monkeypatch, arch,
                                                            ram, flag, want):
    """The lookahead's default while the experts stream (a tier smaller than them) beside a
    resident trunk: on for glm5-next, tuned in decode (``runtime.prefetch.tuner``, starting
    off) for the others; not built when every expert fits or the memory limit leaves the trunk
    to be re-read; the flags force it either way."""
    from expertfs.runtime.memory import LIMIT_ENV
    if ram == "trunk-evicted":
        monkeypatch.setenv(LIMIT_ENV, "64M")        # below the runtime's own allowance
    from expertfs.store.reader import Store
    from expertfs.synth import SynthConfig, synthesize
    from expertfs.store.repack import repack
    cfg = SynthConfig.tiny(arch)
    synthesize(cfg.replace(n_layers=max(3, cfg.n_dense_lead + 2)), str(tmp_path / "m.gguf"))
    repack([str(tmp_path / "m.gguf")], str(tmp_path / "m.efs"))
    with Store.open(str(tmp_path / "m.efs")) as s:
        stride = max(s.extent(la, 0).length for la in s.layers)
        n = sum(s.n_experts(la) for la in s.layers)
    slots = n + 4 if ram == "all" else cfg.n_expert_used + 2
    argv = ["run", str(tmp_path / "m.efs"), "-p", "hello there", "-n", "3", "--json",
            "--ram", str(slots * stride)] + ([flag] if flag else [])
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    la = r["stats"].get("lookahead")
    if want is None:
        assert la is None
    elif want == "forced":
        assert la is not None and "tuned" not in la
    else:                  # 3 tokens: too few to repay a trial, the arm it starts from kept
        assert la["tuned"] and la["tuned_on"] == (want == "tuned on") and la["trials"] == 0
        assert la["pending"]
        from expertfs.cli._tiers import lookahead_line
        assert lookahead_line(la).endswith("not tried: too short a decode to repay a trial")
