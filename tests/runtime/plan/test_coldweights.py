"""The kernel probes' weights past the last-level cache (``plan.coldweights``)."""

from __future__ import annotations

import torch

from expertfs.runtime.plan import coldweights as cw


def test_llc_is_the_largest_cache_of_the_highest_level(tmp_path) -> None:
    for i, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "491520K"), (2, "1M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert cw.llc_bytes(str(tmp_path)) == 491520 << 10
    assert cw.llc_bytes(str(tmp_path / "none")) == 0          # no description: no figure


def test_cold_bytes_pass_the_cache_within_bounds(monkeypatch) -> None:
    monkeypatch.setattr(cw, "llc_bytes", lambda: 480 << 20)
    assert cw.cold_bytes() == 960 << 20                          # a server: twice its cache
    monkeypatch.setattr(cw, "llc_bytes", lambda: 32 << 20)
    assert cw.cold_bytes() == cw.CAP                             # a desktop: at least CAP
    monkeypatch.setattr(cw, "llc_bytes", lambda: 4 << 30)
    assert cw.cold_bytes() == 1 << 30                            # at most 1 GiB


def test_rotation_repeats_each_group_as_aligned_copies(monkeypatch) -> None:
    monkeypatch.setattr(cw, "cold_bytes", lambda: 1 << 20)
    groups = [(torch.full((1000,), i, dtype=torch.uint8), torch.full((300,), 10 + i,
                                                                     dtype=torch.uint8))
              for i in range(3)]
    try:
        out = cw.rotation(groups)
        assert len(out) == (1 << 20) // (1024 + 320)              # past the cold size
        for j, views in enumerate(out):
            for v, g in zip(views, groups[j % 3]):
                assert torch.equal(v, g) and v.data_ptr() % 64 == 0
        assert len({v.data_ptr() for views in out for v in views}) == 2 * len(out)
    finally:
        cw.release_pool()
    assert not cw._POOL
