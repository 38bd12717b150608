"""The default VRAM tier and out-of-device-memory errors: ``mem_get_info`` is faked, and OOM is
raised by hand, so both run on the CPU; the ``gpu`` tests check the real calls."""

from __future__ import annotations

import pytest
import torch

from expertfs.runtime.cache.vram import (RESERVE_MIN, DeviceMemoryError, VramPlan,
                                         device_memory, plan_vram)

G = 1 << 30


def _plan(free, total=80 * G, **kw):
    args = dict(trunk=4 * G, kv=2 * G, workspace=1 * G, experts=200 * G, min_tier=64 << 20)
    args.update(kw)
    return plan_vram(mem_get_info=lambda dev: (free, total), device="cpu", **args)


def test_tier_is_free_memory_less_the_rest_and_a_reserve(caplog):
    with caplog.at_level("INFO", logger="expertfs.runtime.cache.vram"):
        p = _plan(60 * G)
    assert p.reserve == max(RESERVE_MIN, 80 * G // 20)
    assert p.tier == 60 * G - 4 * G - 2 * G - 1 * G - p.reserve
    assert "VRAM tier" in caplog.text and "--vram" in caplog.text


def test_tier_capped_at_every_expert_and_zero_below_one_layer():
    assert _plan(60 * G, experts=10 * G).tier == 10 * G
    assert _plan(7 * G, total=16 * G).tier == 0          # the trunk and KV take it all
    p = VramPlan(free=G, total=G, trunk=0, kv=0, workspace=0, reserve=0, experts=G,
                 min_tier=2 * G)
    assert p.tier == 0


def test_out_of_memory_becomes_a_typed_error_naming_what_and_the_fix():
    oom = getattr(torch, "OutOfMemoryError", RuntimeError)
    with pytest.raises(DeviceMemoryError, match=r"the vram tier's slab.*--vram") as e:
        with device_memory("the vram tier's slab", fix="give a smaller --vram", nbytes=3 * G):
            raise oom("CUDA out of memory. Tried to allocate 3.00 GiB")
    assert isinstance(e.value.__cause__, oom) and "3" in str(e.value)
    with pytest.raises(ValueError):                       # other errors pass through
        with device_memory("x", fix="y"):
            raise ValueError("not memory")


def test_device_slab_oom_is_typed(monkeypatch):
    from expertfs.runtime.cache import slots

    def empty(*a, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
    monkeypatch.setattr(slots.torch, "empty", empty)
    with pytest.raises(DeviceMemoryError, match=r"vram tier's slab.*--vram"):
        slots.SlotPool("vram", 4, 4096, device=torch.device("cuda"), host=False)


@pytest.mark.gpu
def test_real_free_memory_gives_a_tier_and_a_past_free_slab_the_typed_error():
    free, total = torch.cuda.mem_get_info()
    p = plan_vram(trunk=0, kv=0, workspace=0, experts=total, min_tier=1, device="cuda")
    assert 0 < p.tier <= free
    from expertfs.runtime.cache.slots import SlotPool
    with pytest.raises(DeviceMemoryError, match="--vram"):
        SlotPool("vram", 2, free, device=torch.device("cuda"), host=False)
