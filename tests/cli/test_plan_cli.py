"""``expertfs plan``: exit status, JSON and text reports, inputs (store, GGUF, --like, profile,
trace) and clear errors. No timing assertions; the store probe test only checks the report's
shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertfs.cli import main
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.store.reader import Store
from expertfs.runtime.trace.synth import parse_spec, write_synthetic

FAST = ["--no-probe", "--tokens", "24"]


@pytest.fixture(autouse=True)
def _plan_cache(tmp_path, monkeypatch) -> None:
    """Each test its own per-box rate cache (none: --no-probe uses the stated defaults)."""
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "plan-rates.json"))


def run_json(capsys, *argv: str, code: int = 0) -> dict:
    assert main(["plan", *argv, "--json"]) == code
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory) -> Path:
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize

    d = tmp_path_factory.mktemp("plan")
    cfg = SynthConfig.tiny("qwen3moe", n_layers=3, n_experts=16, n_expert_used=4, n_embd=256,
                           n_ff_exp=256)
    gguf = synthesize(cfg, str(d / "tiny.gguf"))[0]
    repack(str(gguf), str(d / "tiny.efs"))
    return d / "tiny.efs"


def test_like_json_fits(capsys) -> None:
    d = run_json(capsys, "--like", "GLM-4.5-Air", "--ram", "32G", "--vram", "24G", *FAST)
    assert d["status"] == "fits" and d["exit_code"] == 0
    assert d["box"] == {"ram_bytes": 32 << 30, "vram_bytes": 24 << 30, "ctx": 4096, "kv_type": "auto",
                        "label": "as given", "pin_budget": 8 << 30}
    assert d["placement"]["where"] == "gpu" and d["budget"]["vram"]["tier_experts"] > 0
    assert d["budget"]["kv_type"] == "bf16"
    assert d["run"].startswith("expertfs run STORE --device cuda")
    assert d["prediction"]["tok_s_low"] <= d["prediction"]["tok_s_high"]
    assert d["routing"]["slow"]["label"] == "synthetic 'diffuse'"


def test_first_token_on_the_cpu_only(capsys) -> None:
    argv = ("--like", "Qwen3-30B-A3B", "--ram", "32G", "--prompt-tokens", "100", *FAST)
    d = run_json(capsys, *argv, "--vram", "0")
    ft = d["first_token"]
    assert ft["prompt_tokens"] == 100 and ft["s_slow"] >= ft["s_fast"] > 0
    assert ft["gemm_gflops"]["source"].startswith("stated")
    assert main(["plan", *argv, "--vram", "0"]) == 0
    assert "predicted first token (100-token prompt):" in capsys.readouterr().out
    assert run_json(capsys, *argv, "--vram", "24G")["first_token"] is None   # a GPU placement


def test_like_text_report(capsys) -> None:
    assert main(["plan", "--like", "Qwen3-235B-A22B", "--ram", "32G", "--vram", "24G", *FAST]) == 0
    out = capsys.readouterr().out
    for s in ("memory budget", "os_headroom", "expert tier", "kv_cache", "per token", "storage",
              "predicted decode:", "SYNTHETIC", "storage was not measured", "run it: expertfs run",
              "other placements:"):
        assert s in out, s


def test_cannot_run_exits_1(capsys) -> None:
    full = ("--ctx", "4096", "--prompt-tokens", "4000")     # a run that fills its context
    d = run_json(capsys, "--like", "Qwen3-235B-A22B", "--ram", "2G", "--vram", "0", *full, *FAST,
                 code=1)
    assert d["status"] == "cannot_run" and d["prediction"] is None
    assert main(["plan", "--like", "Qwen3-235B-A22B", "--ram", "2G", "--vram", "0", *full,
                 *FAST]) == 1
    assert "CANNOT RUN" in capsys.readouterr().out
    # a short run there writes a few positions of its KV cache: it runs (thrashing), and plan
    # names the context past which it would not
    short = run_json(capsys, "--like", "Qwen3-235B-A22B", "--ram", "2G", "--vram", "0",
                     "--ctx", "4096", "--prompt-tokens", "64", *FAST)
    assert short["status"] != "cannot_run"
    assert "ctx_beyond_working_set" in {n["code"] for n in short["notes"]}


@pytest.mark.parametrize("argv, msg", [
    (["--like", "NoSuchModel", "--ram", "32G"], "not a known model"),
    (["--like", "GLM-4.5-Air", "--ram", "lots"], "--ram"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--kv-type", "q3"], "KV cache type"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--ctx", "0"], "context length"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--synthetic", "spiky"], "preset"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--policy", "nope"], "policy"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--pcie", "7"], "PCIe"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--synthetic", "hot,mixed,diffuse"], "one or two"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--quant", "q9_z"], "--quant"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--vram", "0", "--placement", "hybrid"], "needs a GPU"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--tokens", "4"], "--tokens"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--prompt-tokens", "-1"], "--prompt-tokens"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--disk-gbps", "0"], "--disk-gbps"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--disk-gbps", "fast"], "--disk-gbps"),
    (["--like", "GLM-4.5-Air", "--ram", "32G", "--disk-gbps", "6-3"], "--disk-gbps"),
    (["--ram", "32G"], "nothing to plan"),
    (["/no/such/model.gguf", "--ram", "32G"], "no such file"),
])
def test_bad_input_exits_2(capsys, argv, msg) -> None:
    assert main(["plan", *FAST, *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_both_store_and_like_is_bad_input(capsys, tiny_store) -> None:
    assert main(["plan", str(tiny_store), "--like", "GLM-4.5-Air", "--ram", "32G", *FAST]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["plan", str(tiny_store), "--quant", "q4_k_m", "--ram", "32G", *FAST]) == 2
    assert "--like only" in capsys.readouterr().err
    assert main(["plan", str(tiny_store.parent), "--ram", "32G", *FAST]) == 2
    assert "not an expertfs store" in capsys.readouterr().err


def test_io_profile(tmp_path, capsys) -> None:
    prof = {"points": [{"backend": "direct", "qd": 8, "gbps": 5.0},
                       {"backend": "direct", "qd": 16, "gbps": 6.0}], "auto": {"backend": "direct"}}
    p = tmp_path / "io.json"
    p.write_text(json.dumps(prof))
    d = run_json(capsys, "--like", "GLM-4.5-Air", "--ram", "32G", "--vram", "24G",
                 "--io-profile", str(p), *FAST)
    s = d["rates"]["storage_gbps"]
    assert (s["slow"], s["fast"]) == (5.0, 6.0) and s["source"].startswith(f"profile {p}")
    assert "storage_default" not in {n["code"] for n in d["notes"]}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["plan", "--like", "GLM-4.5-Air", "--ram", "32G", "--io-profile", str(bad), *FAST]) == 2
    assert main(["plan", "--like", "GLM-4.5-Air", "--ram", "32G", "--io-profile",
                 str(tmp_path / "none.json"), *FAST]) == 2


def test_a_box_described_by_flags(tmp_path, capsys) -> None:
    """``--like`` at a box given by flags, its drive included (``--disk-gbps``: one figure is
    the fast end, the slow end 0.6 of it; or a range), nothing of this machine's drive used; a
    faster drive never predicts a slower decode; ``--io-profile`` and ``--disk-gbps`` together
    are bad input."""
    box = ("--like", "GLM-5.3-Flash", "--ram", "32G", "--vram", "24G", *FAST)
    d = run_json(capsys, *box, "--disk-gbps", "7")
    s = d["rates"]["storage_gbps"]
    assert (s["slow"], s["fast"]) == pytest.approx((4.2, 7.0)) and "--disk-gbps" in s["source"]
    assert "storage_default" not in {n["code"] for n in d["notes"]}
    slow = run_json(capsys, *box, "--disk-gbps", "1-1.5")
    assert (slow["rates"]["storage_gbps"]["slow"], slow["rates"]["storage_gbps"]["fast"]) == (1.0, 1.5)
    assert slow["prediction"]["tok_s_high"] <= d["prediction"]["tok_s_high"]
    assert slow["prediction"]["tok_s_low"] <= d["prediction"]["tok_s_low"]
    p = tmp_path / "io.json"
    p.write_text(json.dumps({"points": [{"backend": "direct", "qd": 8, "gbps": 5.0}]}))
    assert main(["plan", *box, "--disk-gbps", "7", "--io-profile", str(p)]) == 2
    assert "both describe the drive" in capsys.readouterr().err


def test_store_and_gguf_give_the_same_geometry(capsys, tiny_store) -> None:
    a = run_json(capsys, str(tiny_store), "--ram", "16G", "--vram", "0", *FAST)
    b = run_json(capsys, str(tiny_store.parent / "tiny.gguf"), "--ram", "16G", "--vram", "0", *FAST)
    assert a["model"]["source"].startswith("store") and b["model"]["source"].startswith("gguf")
    for key in ("n_layer", "n_expert", "k", "slot_bytes", "trunk_bytes", "decode_expert_bytes"):
        assert a["model"][key] == b["model"][key], key
    assert a["budget"] == b["budget"]
    assert a["run"].startswith(f"expertfs run {tiny_store} --device cpu --ram ")


def test_forced_placement_and_trunk(capsys) -> None:
    d = run_json(capsys, "--like", "Qwen3-30B-A3B", "--ram", "32G", "--vram", "24G",
                 "--placement", "cpu", "--trunk", "quant", *FAST)
    assert (d["placement"]["where"], d["placement"]["trunk_mode"]) == ("cpu", "quant")
    assert d["alternatives"] == [] and "--device cpu" in d["run"] and "--trunk quant" in d["run"]
    assert main(["plan", "--like", "Qwen3-30B-A3B", "--ram", "32G", "--vram", "0",
                 "--placement", "gpu", *FAST]) == 2


def test_trace_replaces_synthetic_routing(tmp_path, capsys, tiny_store) -> None:
    t = tmp_path / "run.eftrace"
    write_synthetic(t, parse_spec("hot,n_tokens=40,n_layers=3,n_experts=16,k=4"))
    d = run_json(capsys, str(tiny_store), "--ram", "16G", "--vram", "0", "--trace", str(t), *FAST)
    assert d["routing"]["slow"] == d["routing"]["fast"]
    assert d["routing"]["slow"]["synthetic"] is False and d["routing"]["slow"]["tokens"] == 30
    assert "routing_synthetic" not in {n["code"] for n in d["notes"]}
    other = tmp_path / "other.eftrace"
    write_synthetic(other, parse_spec("hot,n_tokens=8,n_layers=3,n_experts=8,k=2"))
    assert main(["plan", str(tiny_store), "--ram", "16G", "--trace", str(other), *FAST]) == 2


def test_store_probe_measures_storage_and_cpu(capsys, tiny_store) -> None:
    d = run_json(capsys, str(tiny_store), "--ram", "16G", "--vram", "0", "--tokens", "16")
    assert d["rates"]["storage_gbps"]["source"].startswith("measured now")
    assert d["rates"]["storage_gbps"]["slow"] > 0
    assert d["measurements"]["storage"]["points"]
    assert d["rates"]["cpu"]["mem_gbps"]["source"].startswith("measured now")
    cpu = d["rates"]["cpu"]
    if d["measurements"]["cpu"]["key"].split("|")[2] != "no-native":   # the runtime's own paths
        assert all("runtime.kernels.moe" in c["gbps"]["source"] for c in cpu["layers"].values())
        assert cpu["layers"] and cpu["fused"]["Q4_K"]["gbps"]["source"].startswith(
            "measured now: runtime.kernels.matvec Q4_K")
    assert cpu["layer_s"]["source"].startswith("measured now: decode of a tiny qwen3moe store")
    assert "expert_overhead" not in d["prediction"]["terms"]
    assert "(measured now, a tiny qwen3moe store)" in d["prediction"]["terms"]["dispatch"]["detail"]
    # cached per box: --no-probe now reads this machine's figures, measuring nothing
    again = run_json(capsys, str(tiny_store), "--ram", "16G", "--vram", "0", "--tokens", "16",
                     "--no-probe")
    assert again["measurements"]["cpu"]["from_cache"] is True
    assert again["rates"]["cpu"]["layer_s"]["slow"] == cpu["layer_s"]["slow"]
    assert again["rates"]["storage_gbps"]["source"].startswith("measured earlier")


def test_this_machine_defaults(capsys) -> None:
    d = run_json(capsys, "--like", "Qwen3-30B-A3B", *FAST)
    assert d["box"]["label"].startswith("this machine") and d["box"]["ram_bytes"] > 0


@pytest.mark.parametrize("vram", ["0", "2G"])
def test_run_flags_give_the_planned_tiers_in_the_runtime(capsys, tiny_store, vram) -> None:
    """The --ram/--vram the plan prints, sized by the runtime's own slot planner, give the
    planned tiers (sizes are rounded up to 0.01 GiB / 1 MiB, so a few more slots at most)."""
    from expertfs.runtime.cache.sizing import SlotGeometry, plan_slots
    from expertfs.store.reader import Store
    from expertfs.units import parse_size

    where = ("--placement", "gpu") if vram != "0" else ()       # a tiny model: the CPU may win
    d = run_json(capsys, str(tiny_store), "--ram", "4G", "--vram", vram, *where, *FAST)
    flags = dict(zip(d["run"].split()[3::2], d["run"].split()[4::2]))
    with Store.open(str(tiny_store)) as s:
        geo = SlotGeometry.from_store(s)
    assert geo.stride == d["budget"]["slot_bytes"]
    slots = plan_slots(geo, parse_size(flags["--ram"]), parse_size(flags.get("--vram", "0")),
                       queue_depth=16)
    slack = (1 << 20) // geo.stride + 1
    b = d["budget"]
    assert b["ram"]["tier_experts"] <= slots.ram <= b["ram"]["tier_experts"] + slack
    # the runtime turns a RAM remainder below k slots into staging, as the plan leaves it no tier
    assert slots.staging >= b["staging_slots"]
    spare = slots.host - slots.staging - slots.ram        # a CPU tier of every expert's window
    assert spare == 0 or (vram == "0" and slots.ram == sum(geo.experts))
    vt = b["vram"]["tier_experts"] if b["vram"] else 0
    assert vt <= slots.vram <= vt + slack
    assert flags["--device"] == ("cuda" if vram != "0" else "cpu")


# ------------------------------------------------------------------------------------------------
# one memory model: plan's RAM tier is the one expertfs run picks under the same limit


def _cap(capsys, store, ctx: int, share: float) -> str:
    """A cap (bytes) that leaves ``share`` of the store's experts beside the rest."""
    d = run_json(capsys, str(store), "--memory-limit", "64G", "--vram", "0", "--ctx", str(ctx),
                 "--placement", "cpu", "--trunk", "quant", *FAST)
    b = d["budget"]
    return str(b["ram"]["fixed_bytes"] + int(share * b["decode_experts"] * b["slot_bytes"]))


@pytest.mark.parametrize("ctx, share", [(128, 0.3), (4096, 0.5), (512, 0.8), (256, 4.0)])
def test_plan_tier_is_runs_default_under_the_same_cap(capsys, monkeypatch, tiny_store, ctx,
                                                      share) -> None:
    """``plan --memory-limit X`` and ``run`` under ``EXPERTFS_MEMORY_LIMIT=X`` (as a cgroup cap)
    size the same RAM tier: plan's "run it:" --ram is run's default."""
    import argparse

    from expertfs.cli._tiers import ram_and_lookahead

    limit = _cap(capsys, tiny_store, ctx, share)
    d = run_json(capsys, str(tiny_store), "--memory-limit", limit, "--vram", "0", "--ctx",
                 str(ctx), "--placement", "cpu", "--trunk", "quant", *FAST)
    monkeypatch.setenv("EXPERTFS_MEMORY_LIMIT", limit)
    ns = argparse.Namespace(store=str(tiny_store), ctx=ctx, dtype="auto", trunk="quant",
                            ram=None, vram=0, command="run")
    ram = ram_and_lookahead(ns, "cpu")[0]
    b = d["budget"]
    slot = b["slot_bytes"]
    assert b["ram"]["items"][0] == {"name": "os_headroom", "bytes": 0,
                                    "note": "none: the limit is a cap (limit)"}
    assert b["host_slab_bytes"] // slot == ram // slot
    if share < 1:
        assert 0 < b["ram"]["tier_experts"] < b["decode_experts"]         # the cap binds
        assert ram // slot == b["ram"]["tier_experts"]
    else:       # every expert (and the opt-in prompt window's spare slots, cache.window)
        assert b["ram"]["tier_experts"] == b["decode_experts"] <= ram // slot
    assert "--ram " in d["run"] and d["box"]["ram_bytes"] == int(limit)
    assert "warning" not in capsys.readouterr().err


def test_run_json_reports_the_tier_plan_predicted(capsys, monkeypatch, tiny_store) -> None:
    """... for the same prompt length: both budget a prompt batch of that many tokens."""
    limit = _cap(capsys, tiny_store, 64, 0.5)
    text = "hello " * 4
    with Store.open(str(tiny_store)) as st:
        n = len(GGUFTokenizer(st.gguf_kv(), st.path).encode(text))
    d = run_json(capsys, str(tiny_store), "--memory-limit", limit, "--vram", "0", "--ctx", "64",
                 "--placement", "cpu", "--trunk", "quant", "--prompt-tokens", str(n), *FAST)
    monkeypatch.setenv("EXPERTFS_MEMORY_LIMIT", limit)
    assert main(["run", str(tiny_store), "-p", text, "-n", "2", "--ctx", "64", "--trunk", "quant",
                 "--device", "cpu", "--json", "-t", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    slot = d["budget"]["slot_bytes"]
    assert r["ram_tier_bytes"] // slot == d["budget"]["host_slab_bytes"] // slot
    assert 0 < d["budget"]["ram"]["tier_experts"] < d["budget"]["decode_experts"]


def test_a_cap_below_a_layers_experts_runs_on_the_fallback_tier(capsys, monkeypatch,
                                                               tiny_store) -> None:
    """A cap that leaves room for fewer than a layer's k experts beside the trunk: ``run``'s
    own default is the fallback tier (the cap then evicts trunk pages), the tier ``plan``
    predicts there ("trunk_evicted"), not a tier of k - 2 experts that its cache refuses; the
    trunk bytes that leaves no room for are streamed (``runtime.model.trunk_stream``)."""
    from expertfs.runtime import memory

    monkeypatch.setattr(memory, "FALLBACK_SLAB", 0)     # the fallback: one layer's k experts
    text, k = "hello " * 4, 4
    with Store.open(str(tiny_store)) as st:
        n = str(len(GGUFTokenizer(st.gguf_kv(), st.path).encode(text)))
    argv = ("--vram", "0", "--ctx", "64", "--placement", "cpu", "--trunk", "quant",
            "--prompt-tokens", n, *FAST)
    d = run_json(capsys, str(tiny_store), "--memory-limit", "64G", *argv)
    slot = d["budget"]["slot_bytes"]
    limit = str(d["budget"]["ram"]["fixed_bytes"] + (k - 2) * slot)
    d = run_json(capsys, str(tiny_store), "--memory-limit", limit, *argv)
    assert "trunk_evicted" in json.dumps(d) and d["budget"]["host_slab_bytes"] // slot == k
    monkeypatch.setenv("EXPERTFS_MEMORY_LIMIT", limit)
    assert main(["run", str(tiny_store), "-p", text, "-n", "2", "--ctx", "64", "--trunk",
                 "quant", "--device", "cpu", "--json", "-t", "1"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert r["ram_tier_bytes"] // slot == k and r["generated_tokens"] == 2
    assert "the trunk is evicted" in out.err
    assert r["stats"]["trunk_stream"] is not None         # streamed, not left to the LRU


def test_plan_says_which_compute_path_each_type_takes(capsys, tiny_store) -> None:
    d = run_json(capsys, str(tiny_store), "--ram", "16G", "--vram", "0", *FAST)
    cp = d["measurements"]["compute_paths"]
    assert set(cp) == {"experts", "trunk", "prompts"} and cp["experts"]
    paths = {"native kernel", "compiled torch", "torch dequant", "float (torch)"}
    assert set(cp["experts"].values()) <= paths and set(cp["trunk"].values()) <= paths
    assert main(["plan", str(tiny_store), "--ram", "16G", "--vram", "0", *FAST]) == 0
    assert "CPU compute paths: experts " in capsys.readouterr().out


def test_plan_for_act_quant_q8_measures_the_q8_kernels(capsys, monkeypatch, tiny_store) -> None:
    """``plan --act-quant q8`` prices the native kernels as run's ``--act-quant q8`` computes
    them: measured in q8 numerics and cached apart from exact mode's figures (neither replaces
    the other), said in the figures' sources and the prompt paths, and its run line asks for
    the same numerics. (The box's speed check held still: a busy box's moving one drops the
    cached entry, both numerics' figures with it, by design.)"""
    from expertfs.runtime.plan import boxcache, native

    monkeypatch.setattr(native, "speed_check", lambda *_: 10.0)

    argv = [str(tiny_store), "--ram", "16G", "--vram", "0", "--tokens", "16"]
    q8 = run_json(capsys, *argv, "--act-quant", "q8")
    assert q8["run"].endswith("--act-quant q8")
    assert q8["measurements"]["compute_paths"]["prompts"].startswith("--act-quant q8 prompts")
    exact = run_json(capsys, *argv)
    assert "--act-quant" not in exact["run"]
    if q8["measurements"]["cpu"]["key"].split("|")[2] == "no-native":
        return
    for d, has in ((q8, True), (exact, False)):
        cpu = d["rates"]["cpu"]
        srcs = [c["gbps"]["source"] for c in (*cpu["layers"].values(), cpu["fused"]["Q4_K"])]
        assert srcs and all(("--act-quant q8" in s) == has for s in srcs), srcs
    entry = boxcache.load()[q8["measurements"]["cpu"]["key"]]
    assert entry["fused_q8"] and entry["layers_q8"] and entry["fused"] and entry["layers"]
    again = run_json(capsys, *argv, "--act-quant", "q8", "--no-probe")   # from the cache
    assert again["measurements"]["cpu"]["from_cache"] is True
    assert "--act-quant q8" in again["rates"]["cpu"]["fused"]["Q4_K"]["gbps"]["source"]


def test_inspect_says_which_compute_path_each_type_takes(capsys, tiny_store) -> None:
    """The store's inspect knows no runtime: the CLI passes the path table in."""
    from expertfs.runtime.plan.paths import DEQUANT, path_table
    from expertfs.store.inspect import inspect_path

    assert "compute_paths" not in inspect_path(str(tiny_store))
    table = dict(path_table("cpu"), Q8_0=DEQUANT)          # as if Q8_0 had no native path
    info = inspect_path(str(tiny_store), compute_paths=table)
    assert set(info["compute_paths"]["experts"]) == set(info["expert_types"])
    assert main(["inspect", str(tiny_store)]) == 0
    out = capsys.readouterr().out
    assert "experts compute (CPU): " in out and "trunk compute (CPU): " in out


def test_run_logs_a_type_without_a_native_path_once(caplog, monkeypatch, tiny_store) -> None:
    import logging

    try:                                    # where run's tier sizing lives
        from expertfs.cli import _tiers as run_cli
    except ImportError:
        from expertfs.cli import run as run_cli
    from expertfs.runtime.plan import paths
    from expertfs.runtime.plan.model import geometry_of_store
    from expertfs.store.reader import Store

    with Store.open(str(tiny_store)) as s:
        g = geometry_of_store(s)
    etype = sorted({m.ggml_type for layer in g.expert_parts for m in layer})[0]
    real = paths.path_table
    monkeypatch.setattr(paths, "path_table", lambda *a, **k: dict(real(*a, **k), **{etype: paths.DEQUANT}))
    with caplog.at_level(logging.INFO, logger=run_cli.__name__):
        run_cli._log_paths(g, "cpu", "auto")
    warn = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and etype in warn[0].getMessage() and "torch" in warn[0].getMessage()


def test_run_says_which_types_prompts_take_the_integer_panel_in_q8(caplog, tiny_store) -> None:
    import logging

    from expertfs.cli import _tiers
    from expertfs.runtime import kernels
    from expertfs.runtime.plan.model import geometry_of_store
    from expertfs.runtime.plan.paths import q8_prompt_paths
    from expertfs.store.reader import Store

    with Store.open(str(tiny_store)) as s:
        g = geometry_of_store(s)
    panel, exact = q8_prompt_paths(g)
    native = {t.name for t in kernels.TYPES} if kernels.available() else set()
    types = {m.ggml_type for layer in g.expert_parts for m in layer} | \
        {m.ggml_type for m in g.trunk_matrices}
    assert set(panel) | set(exact) == types & (native - {"F16", "BF16"})
    assert not set(panel) & set(exact)
    with caplog.at_level(logging.INFO, logger=_tiers.log.name):
        _tiers._log_paths(g, "cpu", "auto", "q8")
        _tiers._log_paths(g, "cpu", "auto", "off")
    lines = [r.getMessage() for r in caplog.records if "--act-quant q8" in r.getMessage()]
    assert len(lines) == 1 and all(t in lines[0] for t in panel + exact)


def test_run_says_which_types_prompts_take_amx_in_exact_mode(caplog, tiny_store) -> None:
    """Where the CPU has AMX the exact-mode log names the types whose prompts run on it (those
    of the store the kernels take there); nothing in q8 mode or without AMX."""
    import logging

    from expertfs.cli import _tiers
    from expertfs.formats.ggml import GGMLType
    from expertfs.runtime import kernels
    from expertfs.runtime.plan.model import geometry_of_store
    from expertfs.runtime.plan.paths import amx_prompt_types
    from expertfs.store.reader import Store

    with Store.open(str(tiny_store)) as s:
        g = geometry_of_store(s)
    mod = kernels.load()
    on = set(mod.info()["amx_types"]) if mod is not None else set()
    types = {m.ggml_type for layer in g.expert_parts for m in layer} | \
        {m.ggml_type for m in g.trunk_matrices}
    want = sorted(t for t in types if t in GGMLType.__members__ and int(GGMLType[t]) in on)
    assert amx_prompt_types(g) == want
    with caplog.at_level(logging.INFO, logger=_tiers.log.name):
        _tiers._log_paths(g, "cpu", "auto", "off")
        _tiers._log_paths(g, "cpu", "auto", "q8")
    lines = [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()]
    assert len(lines) == (1 if want else 0) and all(t in lines[0] for t in want)


def test_a_store_that_learned_its_usage_is_planned_from_it(capsys, tmp_path) -> None:
    """Runs teach a store its usage; once it has seen enough tokens, plan draws its routing
    from it (labelled, not synthetic) instead of the synthetic presets."""
    from expertfs.runtime.cache.usage import persist_usage
    from expertfs.runtime.plan.routing import MIN_USAGE_TOKENS
    from expertfs.store.reader import Store
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize

    cfg = SynthConfig.tiny("qwen3moe", n_layers=3, n_experts=16, n_expert_used=4, n_embd=256,
                           n_ff_exp=256)
    store = str(tmp_path / "u.efs")
    repack(str(synthesize(cfg, str(tmp_path / "u.gguf"))[0]), store)
    argv = (store, "--memory-limit", "2G", *FAST)
    assert run_json(capsys, *argv)["routing"]["slow"]["synthetic"] is True
    with Store.open(store) as st:
        layers = [layer for layer in range(3)]
        few = {(la, e): 1 for la in layers for e in range(4)}     # one token a layer: too few
        persist_usage(st, few)
        assert run_json(capsys, *argv)["routing"]["slow"]["synthetic"] is True
        hot = {(la, e): MIN_USAGE_TOKENS for la in layers for e in range(4)}
        persist_usage(st, hot)
    r = run_json(capsys, *argv)["routing"]
    assert r["slow"]["synthetic"] is False and "learned usage" in r["slow"]["label"]
    assert "'diffuse' dynamics" in r["slow"]["label"] and "'mixed' dynamics" in r["fast"]["label"]
