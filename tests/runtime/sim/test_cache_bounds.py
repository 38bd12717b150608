"""bench/cache_bounds.py: the cache that knows the next W tokens' routes, beside Belady."""

from __future__ import annotations

from support import BENCH
import importlib.util
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from expertfs.runtime.sim.bounds import belady_hits
from expertfs.runtime.sim.replay import Replay
from expertfs.runtime.trace.synth import parse_spec, write_synthetic

_spec = importlib.util.spec_from_file_location(
    "cache_bounds", str(BENCH / "cache_bounds.py"))
cache_bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cache_bounds)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=2, unique=True),
                     min_size=1, max_size=14),
       cap=st.integers(2, 5), per_token=st.integers(1, 3))
def test_a_window_over_the_whole_trace_is_belady(rows, cap, per_token) -> None:
    rp = Replay(None, rows, [i // per_token for i in range(len(rows))], 0)
    assert cache_bounds.window_hits(rp, cap, len(rows)) == belady_hits(rows, cap)
    assert cache_bounds.window_hits(rp, cap, 0) <= belady_hits(rows, cap)


def test_report(tmp_path, capsys, monkeypatch) -> None:
    t = tmp_path / "t.efstrace"
    write_synthetic(t, parse_spec("hot,n_tokens=80,n_layers=3,n_experts=16,k=2,expert_bytes=4096"))
    monkeypatch.setattr("sys.argv", ["cache_bounds.py", str(t), "--capacity", "25%,12",
                                     "--windows", "1,4", "--json"])
    assert cache_bounds.main() == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["slots"] for r in rep] == [12, 12]
    for r in rep:
        assert r["static"] <= r["belady"] and r["wlfu"] <= r["belady"] and r["lru"] <= r["belady"]
        assert all(0 <= h <= r["belady"] for h in r["windows"].values())
