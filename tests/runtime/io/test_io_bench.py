"""``expertfs bench io`` and its data: points per backend and queue depth, the sequential
ceiling, verification, JSON, the plot, and typed errors for bad arguments. Small and warm
(``--no-cold``): numbers are not asserted, only their shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertfs.cli import main
from expertfs.runtime.io.bench import format_report, run_bench, target_from_file
from expertfs.runtime.io.pagecache import make_cold


@pytest.fixture
def f8m(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(9).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    return path


def test_run_bench_shape(f8m):
    t = target_from_file(f8m, 1 << 20)
    r = run_bench(t, backends=["buffered", "direct", "mmap", "kvikio"], qds=[1, 4],
                  total_bytes=4 << 20, cold=False, seq_bytes=8 << 20, with_auto=False)
    got = {(p.backend, p.qd) for p in r.points}
    assert {("buffered", 1), ("direct", 4), ("mmap", 4)} <= got
    for p in r.points:
        assert p.reads == 4 and p.bytes == 4 << 20 and p.gbps > 0 and p.iops > 0
        assert p.lat_us["p50"] <= p.lat_us["p99"] <= p.lat_us["max"]
        assert p.verified == min(p.qd, 4) and p.ratio_to_seq > 0
    assert r.seq.bytes == 8 << 20 and r.seq.gbps > 0
    if ("kvikio", 1) not in got:
        assert "kvikio" in r.skipped
    text = format_report(r)
    assert "seq-read (ceiling)" in text and "read: IOPS=" in text and "lat (usec): p50=" in text


def test_cli_json_store_and_plot(tmp_path, capsys):
    from support.gguf_builders import moe_gguf
    from expertfs.store.repack import repack
    src = moe_gguf(tmp_path / "m.gguf", layers=2, experts=4)[0]
    repack(str(src), str(tmp_path / "m.efs"))
    args = ["bench", "io", str(tmp_path / "m.efs"), "--backend", "buffered,direct", "--qd", "1,2",
            "--no-cold", "--seq", "1M", "--json"]
    plot = tmp_path / "q.png"
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["label"] == "8 expert extents" and len(rep["points"]) == 4
    assert all(p["verified"] >= 1 for p in rep["points"])
    assert rep["auto"]["backend"] in ("buffered", "direct", "kvikio")
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_text_and_bad_arguments(f8m, capsys):
    assert main(["bench", "io", str(f8m), "--size", "1M", "--qd", "2", "--total", "2M",
                 "--seq", "2M", "--no-cold", "--no-auto", "--backend", "direct"]) == 0
    out = capsys.readouterr().out
    assert "direct: (qd=2) read: IOPS=" in out and "best: direct qd=2" in out
    for bad, msg in ((["--qd", "x"], "--qd"), (["--backend", "floppy"], "not known"),
                     (["--size", "3000"], "multiple of 4096"), (["--size", "1G"], "exceeds the file"),
                     (["--total", "lots"], "--total")):
        assert main(["bench", "io", str(f8m), "--no-cold", *bad]) == 2
        assert msg in capsys.readouterr().err
    assert main(["bench", "io", str(f8m.parent / "nope.bin")]) == 2
    assert main(["bench"]) == 2


def test_make_cold_says_how(f8m):
    assert "dropped" in make_cold(f8m, system=False)
