"""The per-layer overhead probe (``plan.overhead``) runs the planned model's architecture: a tiny
store of its layer kinds, decoded for real; its figures are cached per architecture, and a
plan without a writer of tiny GGUFs prices the built-in tiny qwen3moe's and says so. No timing
assertions beyond "measured and positive"."""

from __future__ import annotations

from expertfs.cli.plan import geometry_from_like, geometry_from_synth, tiny_gguf
from expertfs.runtime.plan import boxcache
from expertfs.runtime.plan.overhead import overhead_kind, probe_overhead
from expertfs.synth import SynthConfig


def test_kind_follows_the_layer_kinds() -> None:
    assert overhead_kind(geometry_from_like("GLM-5.3-Flash")) == ("glm5-next", 4)
    assert overhead_kind(geometry_from_like("DeepSeek-V3")) == ("deepseek2", 1)
    assert overhead_kind(geometry_from_like("Qwen3-30B-A3B")) == ("qwen3moe", 1)


def test_probe_decodes_a_tiny_store_of_the_architecture() -> None:
    lay, tok, d = probe_overhead(k=2, tokens=4, arch="glm5-next", period=4, writer=tiny_gguf)
    assert (d["arch"], d["period"]) == ("glm5-next", 4)
    assert len(d["decode_s_4_layers"]) == len(d["decode_s_12_layers"]) == 4
    assert lay.slow >= lay.fast > 0 and tok.slow >= tok.fast >= 0
    assert lay.source.startswith("measured now: decode of a tiny glm5-next store at 4 and 12 "
                                 "layers, an MLA layer every 4")


def test_cpu_rates_cache_the_overhead_per_architecture(tmp_path, monkeypatch) -> None:
    from expertfs.runtime.plan import native, overhead

    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    monkeypatch.setattr(native, "speed_check", lambda *_: 10.0)
    asked: list[tuple[str, int, bool]] = []

    def fake(k, arch="qwen3moe", period=1, writer=None, tokens=24):
        asked.append((arch, period, writer is not None))
        return real(k, tokens=2, arch=arch, period=period, writer=writer)

    real = overhead.probe_overhead
    monkeypatch.setattr(overhead, "probe_overhead", fake)
    g = geometry_from_synth(SynthConfig.tiny("deepseek2"))
    rates, _ = boxcache.cpu_rates(g, [], probe=True)              # no writer: the tiny qwen3moe
    assert asked == [("deepseek2", 1, False)]
    assert "tiny qwen3moe store" in rates.layer_s.source
    rates, _ = boxcache.cpu_rates(g, [], probe=True, tiny=tiny_gguf)   # its own, measured once
    assert asked[1:] == [("deepseek2", 1, True)]
    assert "tiny deepseek2 store" in rates.layer_s.source
    entry = boxcache.load()[boxcache.cpu_key()]
    assert set(entry["overhead"]) == {"qwen3moe/1", "deepseek2/1"}
    offline, d = boxcache.cpu_rates(g, [], probe=False)            # --no-probe: the cached one
    assert "tiny deepseek2 store" in offline.layer_s.source and len(asked) == 2


def test_an_architecture_the_writer_lacks_falls_back_to_the_tiny_qwen3moe() -> None:
    from expertfs.errors import UsageError

    def writer(path, arch, n_layers, k, period):
        raise UsageError(f"unknown architecture {arch!r}", fix="t")

    lay, _, d = probe_overhead(k=2, tokens=2, arch="qwen9moe", writer=writer)
    assert d["arch"] == "qwen3moe" and "tiny qwen3moe store" in lay.source
