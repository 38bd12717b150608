"""``plan``'s storage probe on a real file: the backend it reports is the one ``run`` opens the
file with (``runtime.io.auto``'s cached choice), and the CPU its reads took is measured."""

from __future__ import annotations

import os

from expertfs.runtime.io.auto import choose_backend
from expertfs.runtime.plan.probe import probe_storage
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
    assert read_cpu_from(detail, "probe").slow == detail["cpu_s_per_gb"]
