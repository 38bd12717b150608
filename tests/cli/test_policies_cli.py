"""``expertfs bench cache``: report shape, capacity arguments, plots and clear errors."""

from __future__ import annotations

import json

import pytest

from expertfs.cli import build_parser, main
from expertfs.runtime.trace.synth import parse_spec, write_synthetic

SPEC = "hot,n_tokens=120,n_layers=4,n_experts=16,k=2,expert_bytes=1048576"


def run_json(capsys, *argv: str) -> dict:
    assert main(["bench", "cache", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_is_shared_with_bench_io() -> None:
    p = build_parser()
    bench = p._subparsers._group_actions[0].choices["bench"]
    sub = bench._expertfs_bench_subparsers.choices
    assert "cache" in sub


def test_json_report(capsys) -> None:
    r = run_json(capsys, "--synthetic", SPEC, "--policies", "lru,wlfu", "--capacity", "8,25%")
    assert r["trace"]["tokens"] == 120 and r["trace"]["accesses"] == 120 * 4 * 2
    assert r["tiers"] == "exclusive" and [p["ram_slots"] for p in r["points"]] == [8, 16]
    for p in r["points"]:
        assert set(p["policies"]) == {"lru", "wlfu"}
        for res in p["policies"].values():
            assert 0 < res["hit_rate"] <= p["belady_hit_rate"]
            assert res["vs_belady"] == pytest.approx(res["hit_rate"] / p["belady_hit_rate"])
            assert res["nvme_bytes_per_token"] == res["misses"] * 1048576 / 120
            assert res["vs_static"] == pytest.approx(res["hit_rate"] / p["static_hit_rate"])
        assert 0 < p["static_hit_rate"] <= p["belady_hit_rate"]


def test_trace_file_with_byte_sizes_and_two_tiers(tmp_path, capsys) -> None:
    t = tmp_path / "t.eftrace"
    write_synthetic(t, parse_spec(SPEC))
    r = run_json(capsys, "--trace", str(t), "--policies", "all", "--ram", "16M,32M", "--vram", "0,8M")
    pts = [(p["vram_slots"], p["ram_slots"]) for p in r["points"]]
    assert pts == [(0, 16), (0, 32), (8, 16), (8, 32)]
    two = r["points"][2]
    assert two["belady_vram_hit_rate"] is not None
    for res in two["policies"].values():
        if res is not None:
            assert res["vram_hit_rate"] <= two["belady_vram_hit_rate"]


def test_text_table_and_plot(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hits.png"
    assert main(["bench", "cache", "--synthetic", SPEC, "--capacity", "8,16,32",
                 "--policies", "lru,wlfu/layer", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "belady (OPT)" in out and "static (freq)" in out and "wlfu" in out
    assert "NVMe MiB/tok" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warm_start_options(tmp_path, capsys) -> None:
    r = run_json(capsys, "--synthetic", SPEC, "--policies", "wlfu", "--capacity", "16",
                 "--warm-tokens", "60")
    assert r["warm"] and r["trace"]["tokens"] == 60
    assert r["points"][0]["policies"]["wlfu"]["bytes_warm"] == 16 * 1048576
    t = tmp_path / "prev.eftrace"
    write_synthetic(t, parse_spec(SPEC + ",seed=5"))
    r = run_json(capsys, "--synthetic", SPEC, "--policies", "lru", "--capacity", "16",
                 "--warm-from", str(t))
    assert r["warm"]


def test_save_trace(tmp_path, capsys) -> None:
    out = tmp_path / "s.eftrace"
    run_json(capsys, "--synthetic", SPEC, "--policies", "lru", "--capacity", "8",
             "--save-trace", str(out))
    assert out.stat().st_size > 0


@pytest.mark.parametrize("argv,msg", [
    (["--capacity", "lots"], "--capacity"),
    (["--ram", "4X"], "--ram"),
    (["--capacity", "1"], "at least 2"),
    (["--policies", "fifo"], "unknown cache policy"),
    (["--warm-tokens", "500"], "nothing to replay"),
])
def test_usage_errors(capsys, argv, msg) -> None:
    assert main(["bench", "cache", "--synthetic", SPEC, *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_damaged_trace_names_the_file(tmp_path, capsys) -> None:
    t = tmp_path / "cut.eftrace"
    write_synthetic(t, parse_spec(SPEC), chunk_rows=64)
    t.write_bytes(t.read_bytes()[:-30])
    assert main(["bench", "cache", "--trace", str(t)]) == 2
    err = capsys.readouterr().err
    assert str(t) in err and "allow-partial" in err
    assert main(["bench", "cache", "--trace", str(t), "--allow-partial", "--capacity", "8",
                 "--policies", "lru", "--json"]) == 0


def test_percent_counts_routed_experts_only_and_zero_belady_prints(tmp_path, capsys) -> None:
    from expertfs.runtime.trace.file import TraceHeader, TraceWriter
    path = tmp_path / "dense_first.efstrace"
    h = TraceHeader(3, 8, 2, (0, 4096, 4096))          # layer 0 dense, like glm4moe
    with TraceWriter(path, h) as w:
        for t in range(20):
            for layer in (1, 2):
                w.add(t, layer, [t % 8, (t + 1) % 8], [0.5, 0.5])
    r = run_json(capsys, "--trace", str(path), "--policies", "lru", "--capacity", "50%")
    assert [p["ram_slots"] for p in r["points"]] == [8]              # 50% of 2 x 8, not of 3 x 8
    assert main(["bench", "cache", "--trace", str(path), "--policies", "lru", "--capacity", "2"]) == 0
    assert "lru" in capsys.readouterr().out
