"""glm5-next's one-token mixing steps in one native call each (runtime.kernels: hc_pre, hc_post,
conv_step_) against the torch code they replace (runtime.model.mhc's and kda.short_conv's torch
paths): equal within float rounding on every ISA tier, the conv window shifted exactly as the
torch path shifts it, and None where they do not apply."""

from __future__ import annotations

import pytest
import torch

from expertfs.runtime import kernels
from expertfs.runtime.model import kda, mhc
from support.native import NEEDS_NATIVE, isa, isas  # noqa: F401  (isa: fixture)

pytestmark = NEEDS_NATIVE
ISAS = pytest.mark.parametrize("isa", isas(), indirect=True)


def _mix(n: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = mhc.HCWeights(torch.randn((2 + n) * n, n * D, generator=g) * 0.05,
                      torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5)
    cfg = mhc.HCConfig(n_streams=n, sinkhorn_iters=20, eps=1e-6, rms_eps=1e-6)
    return w, cfg, torch.randn(1, n, D, generator=g) * 2


@ISAS
@pytest.mark.parametrize("n,D", [(4, 4096), (2, 64), (3, 130), (1, 8)])
def test_hc_pre_and_post_match_the_torch_path(isa, n, D, monkeypatch):
    w, cfg, streams = _mix(n, D, n * D)
    y = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    s0 = streams.clone()
    x, mix = mhc.hc_pre(streams, w, cfg)
    out = mhc.hc_post(y, streams, mix)
    monkeypatch.setattr(kernels, "hc_pre", lambda *a: None)
    monkeypatch.setattr(kernels, "hc_post", lambda *a: None)
    rx, rmix = mhc.hc_pre(streams, w, cfg)
    rout = mhc.hc_post(y, streams, mix)                 # the same mix: hc_post alone
    assert torch.equal(streams, s0)
    assert x.shape == rx.shape and mix.post.shape == rmix.post.shape
    assert mix.comb.shape == rmix.comb.shape and out.shape == rout.shape
    torch.testing.assert_close(mix.post, rmix.post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mix.comb, rmix.comb, rtol=1e-5, atol=1e-6)
    scale = float(streams.abs().max())                  # sums of n terms of this size
    torch.testing.assert_close(x, rx, rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=2e-6 * scale)


@ISAS
@pytest.mark.parametrize("K", [4, 1, 2, 5])
@pytest.mark.parametrize("C", [24, 3 * 512, 13])
def test_conv_step_matches_the_torch_path(isa, K, C, monkeypatch):
    """One token of the short conv: the same outputs within float rounding (very negative
    sums, whose SiLU is about zero, included) and the window shifted bit for bit; then the next
    token continues from it the same way."""
    g = torch.Generator().manual_seed(K * C)
    w = torch.randn(C, K, generator=g)
    win = torch.randn(C, K - 1, generator=g)
    xs = torch.randn(2, 1, C, generator=g) * 3
    xs[0, 0, :4] = -60.0
    ref_win = win.clone()
    got = [kda.short_conv(x, w, win) for x in xs]
    monkeypatch.setattr(kernels, "conv_step_", lambda *a: None)
    ref = [kda.short_conv(x, w, ref_win) for x in xs]
    assert torch.equal(win, ref_win)
    for a, b in zip(got, ref):
        assert a.shape == b.shape == (1, C)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mix_ops_not_applicable_or_refused():
    """Two tokens, bfloat16 or strided inputs: None (the torch paths run); shapes that do not
    fit each other: a RuntimeError naming what is expected."""
    w, cfg, streams = _mix(4, 16, 1)
    assert kernels.hc_pre(streams.expand(2, -1, -1).contiguous(), w.fn, w.base, w.scales, 20,
                          1e-6, 1e-6) is None
    assert kernels.hc_pre(streams.bfloat16(), w.fn, w.base, w.scales, 20, 1e-6, 1e-6) is None
    assert kernels.hc_post(torch.randn(1, 32)[:, ::2], streams, torch.ones(1, 4),
                           torch.ones(1, 4, 4)) is None
    win = torch.zeros(8, 3)
    assert kernels.conv_step_(torch.ones(8, dtype=torch.float64), torch.ones(8, 4), win) is None
    with pytest.raises(RuntimeError, match="fn"):
        kernels.hc_pre(streams, w.fn[:, :-1].contiguous(), w.base, w.scales, 20, 1e-6, 1e-6)
    with pytest.raises(RuntimeError, match="window"):
        kernels.conv_step_(torch.ones(8), torch.ones(8, 4), torch.zeros(8, 2))
