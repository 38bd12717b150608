"""``plan``'s storage probe on a real file: the backend it reports is the one ``run`` opens the
file with (``runtime.io.auto``'s cached choice), and the CPU its reads took is measured."""

from __future__ import annotations

import os

from expertfs.runtime.io.auto import choose_backend
from expertfs.runtime.plan.storage_probe import probe_storage
from expertfs.runtime.plan.rates import read_cpu_from


def test_the_probe_measures_the_backend_run_uses_and_its_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EXPERTFS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "experts.bin"
    with open(path, "wb") as f:
        for _ in range(32):
            f.write(os.urandom(1 << 20))
    rng, detail = probe_storage(str(path), 2, 1 << 20, total_bytes=8 << 20)
    assert detail["backend"] == choose_backend(str(path)).backend
    assert 0 < rng.slow <= rng.fast
    assert detail["cpu_s_per_gb"] is not None and detail["cpu_s_per_gb"] > 0
    r = read_cpu_from(detail, "probe")        # the dearer fresh point slow, the cheaper fast
    assert r.fast == detail["cpu_s_per_gb"] <= detail["cpu_s_per_gb_slow"] == r.slow


def test_storage_checks_widen_the_cached_drive_rate(tmp_path, monkeypatch) -> None:
    """A probing plan measures the drive once and caches it; each later probing plan runs one
    short check, kept for a day, and the range it reports reaches the day's slowest and
    fastest check; ``--no-probe`` uses the kept checks without a new one."""
    from types import SimpleNamespace

    from expertfs.runtime.plan import boxcache, storage_probe as probe
    from expertfs.runtime.plan.run import _storage
    monkeypatch.setenv("EXPERTFS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    path = tmp_path / "experts.bin"
    with open(path, "wb") as f:
        for _ in range(32):
            f.write(os.urandom(1 << 20))
    g = SimpleNamespace(k=2, slot_bytes=1 << 20)
    req = SimpleNamespace(probe=True, target=str(path))
    first, _ = _storage(req, g, str(path), lambda *_: None)
    drive = boxcache.storage_key(str(path), 1 << 20)
    key = "checks|" + drive
    assert [c[1] for c in boxcache.load()[key]] == [first.slow]
    real = probe.storage_check(str(path), 1 << 20, boxcache.load()[drive]["backend"], 2)
    assert real > 0
    monkeypatch.setattr(probe, "storage_check", lambda *a, **k: first.slow / 3)
    slow, _ = _storage(req, g, str(path), lambda *_: None)
    assert slow.slow == first.slow / 3 and slow.fast == first.fast
    assert "storage checks of the last day" in slow.source
    monkeypatch.setattr(probe, "storage_check", lambda *a, **k: first.fast * 2)
    wide, _ = _storage(req, g, str(path), lambda *_: None)
    assert (wide.slow, wide.fast) == (first.slow / 3, first.fast * 2)
    assert len(boxcache.load()[key]) == 3
    monkeypatch.setattr(probe, "storage_check", lambda *a, **k: 1 / 0)   # not called
    kept, _ = _storage(SimpleNamespace(probe=False, target=str(path)), g, str(path),
                       lambda *_: None)
    assert (kept.slow, kept.fast) == (wide.slow, wide.fast)


def test_storage_spread_keeps_the_day_only() -> None:
    import time

    from expertfs.runtime.plan.boxcache import storage_spread
    from expertfs.runtime.plan.rates import Range
    rng = Range(1.0, 2.0, "probe")
    assert storage_spread(rng, None) is rng
    assert storage_spread(rng, [[time.time(), 1.5]]) is rng                 # inside: unchanged
    old = [[time.time() - 2 * 86400, 0.1]]
    assert storage_spread(rng, old) is rng                                  # too old to count
    w = storage_spread(rng, old + [[time.time(), 0.5], [time.time(), 3.0]])
    assert (w.slow, w.fast) == (0.5, 3.0)
