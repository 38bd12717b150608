"""The decode step's native row-wise ops (runtime.kernels: rms_norm, norm_rope_, attn_decode,
route, sinkhorn_) against the torch code they replace (runtime.model.rope's torch path, torch's
own scaled_dot_product_attention, the router's and mHC's torch ops): equal within float
rounding, the caches written as the torch path writes them, and None / False (nothing touched)
where they do not apply."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from expertfs.runtime import kernels
from support.native import isa  # noqa: F401  (fixture: kernels.set_isa for the test, then best)
from expertfs.runtime.model import rope as rope_mod
from expertfs.runtime.model.config import ROPE_NEOX

MOD = kernels.load()
pytestmark = pytest.mark.skipif(MOD is None, reason=f"native kernels unavailable: "
                                f"{kernels.status()['reason']}")


def torch_rms_norm(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


@pytest.mark.parametrize("shape", [(1, 2048), (5, 64), (2, 3, 128), (1, 7)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_torch(shape, weighted):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if weighted else None
    y = kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, torch_rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    assert torch.equal(rope_mod.rms_norm(x, w, 1e-6), y)       # the model's norm uses it


def test_rms_norm_not_applicable():
    x = torch.randn(4, 8)
    assert kernels.rms_norm(x.t(), None, 1e-6) is None                     # not contiguous
    assert kernels.rms_norm(x.double(), None, 1e-6) is None
    assert kernels.rms_norm(x.bfloat16(), None, 1e-6) is None
    # the torch path still serves them
    torch.testing.assert_close(rope_mod.rms_norm(x.t(), None, 1e-6),
                               torch_rms_norm(x.t(), None, 1e-6))


class _Cfg:
    def __init__(self, n_rot, neox, freq_scale=1.0, yarn=False):
        self.n_rot, self.rope = n_rot, (ROPE_NEOX if neox else 0)
        self.rope_base, self.rope_freq_scale, self.rope_yarn = 10000.0, freq_scale, yarn
        self.rope_orig_ctx, self.yarn_beta_fast, self.yarn_beta_slow = 4096, 32.0, 1.0
        self.rope_mscale_in_attention = False


@pytest.mark.parametrize("n_rot,neox", [(64, True), (64, False), (32, True), (32, False)])
@pytest.mark.parametrize("normed", [True, False])
def test_norm_rope_matches_torch_path(n_rot, neox, normed):
    """Full and partial rotation (glm4moe rotates half of each head), both pairings."""
    r = rope_mod.Rope(_Cfg(n_rot, neox), torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    T, H, D = 3, 4, 64
    x = torch.randn(T, H, D, generator=g)
    w = torch.randn(D, generator=g) if normed else None
    cos, sin = r.tables(17, T)
    want = r.apply(torch_rms_norm(x, w, 1e-5) if normed else x, cos, sin)
    got = x.clone()
    assert kernels.norm_rope_(got, w, 1e-5, cos, sin, n_rot, neox, normed)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    if not normed:                              # the same products: bit for bit
        assert torch.equal(got, want)
    torch.testing.assert_close(r.norm_apply(x.clone(), w, 1e-5, cos, sin), want,
                               rtol=2e-6, atol=2e-6)


def test_norm_rope_not_applicable_leaves_x():
    r = rope_mod.Rope(_Cfg(16, True), torch.device("cpu"))
    cos, sin = r.tables(0, 2)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    before = x.clone()
    assert not kernels.norm_rope_(x, None, 1e-6, cos, sin, 16, True, False)
    assert torch.equal(x, before)
    out = r.norm_apply(x, None, 1e-6, cos, sin)                # falls back to torch
    torch.testing.assert_close(out, r.apply(before, cos, sin))


# the CPU's best kernels (AVX2+FMA attention here) and the portable ones
BEST_AND_PORTABLE = pytest.mark.parametrize("isa", ["best", "scalar"], indirect=True)


@BEST_AND_PORTABLE
@pytest.mark.parametrize("H,K,D,Dv", [(32, 4, 128, 128), (8, 8, 64, 64), (6, 2, 16, 24)])
@pytest.mark.parametrize("S", [1, 5, 300])
def test_attn_decode_matches_sdpa(H, K, D, Dv, S, isa):
    g = torch.Generator().manual_seed(3)
    cap = 512
    kc, vc = torch.randn(K, cap, D, generator=g), torch.randn(K, cap, Dv, generator=g)
    q = torch.randn(1, H, D, generator=g)
    k, v = torch.randn(1, K, D, generator=g), torch.randn(1, K, Dv, generator=g)
    scale = 1 / math.sqrt(D)
    kw, vw = kc.clone(), vc.clone()
    kw[:, S - 1], vw[:, S - 1] = k[0], v[0]
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kw[None, :, :S],
                                          vw[None, :, :S], scale=scale, enable_gqa=H != K)
    want = want[0].transpose(0, 1).reshape(1, H * Dv)
    got = kernels.attn_decode(q, k, v, kc, vc, S - 1, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(kc, kw) and torch.equal(vc, vw)          # the token's k, v stored


@BEST_AND_PORTABLE
@pytest.mark.parametrize("sharp", [1.0, 40.0])
def test_attn_decode_softmax_against_float64(sharp, isa):
    """Scores spread over hundreds (sharp=40: most weights underflow) and S not a multiple of
    the kernel's 4 rows or 8 lanes: no further from float64 than torch's float32 sdpa is."""
    g = torch.Generator().manual_seed(5)
    H, K, D, S = 8, 2, 64, 203
    kc, vc = torch.randn(K, 256, D, generator=g), torch.randn(K, 256, D, generator=g)
    q = torch.randn(1, H, D, generator=g) * sharp
    k, v = kc[None, :, S - 1].clone(), vc[None, :, S - 1].clone()
    got = kernels.attn_decode(q, k, v, kc, vc, S - 1, 1 / 8)
    want = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], kc.double()[None, :, :S],
                                          vc.double()[None, :, :S], scale=1 / 8, enable_gqa=True)
    want = want[0].transpose(0, 1).reshape(1, H * D)
    peer = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :S],
                                          vc[None, :, :S], scale=1 / 8, enable_gqa=True)
    peer_err = (peer[0].transpose(0, 1).reshape(1, H * D).double() - want).abs().max()
    assert (got.double() - want).abs().max() <= 4 * peer_err + 1e-6


def test_attn_decode_bad_input():
    kc = vc = torch.zeros(2, 8, 16)
    q, k, v = torch.zeros(1, 4, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
    assert kernels.attn_decode(q.double(), k, v, kc, vc, 0, 1.0) is None
    with pytest.raises(RuntimeError, match="room for position"):
        kernels.attn_decode(q, k, v, kc, vc, 8, 1.0)
    with pytest.raises(RuntimeError, match="head counts"):
        kernels.attn_decode(torch.zeros(1, 3, 16), k, v, kc, vc, 0, 1.0)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("norm_w,w_scale", [(True, 0.0), (False, 2.5)])
@pytest.mark.parametrize("E,D", [(48, 256), (288, 1024)])       # the second: rows in chunks
def test_route_matches_torch_router(gating, biased, norm_w, w_scale, E, D):
    from expertfs.runtime.model.config import GATING_SIGMOID, GATING_SOFTMAX
    from expertfs.runtime.model.router import Router, RouterWeights

    class Cfg:
        n_expert_used, n_group, n_group_used = 6, 1, 1
    Cfg.gating = GATING_SIGMOID if gating == "sigmoid" else GATING_SOFTMAX
    Cfg.norm_w, Cfg.w_scale = norm_w, w_scale
    g = torch.Generator().manual_seed(4)
    rw = RouterWeights(torch.randn(E, D, generator=g) / 8,
                       torch.randn(E, generator=g) / 4 if biased else None)
    r = Router(Cfg())
    assert r.native
    for _ in range(20):
        x = torch.randn(1, D, generator=g)
        ids, wts, probs = r(x, rw)
        assert probs is None                                        # the native call
        r.native = False
        ids_t, wts_t, _ = r(x, rw)
        r.native = True
        assert torch.equal(ids, ids_t)
        torch.testing.assert_close(wts, wts_t, rtol=1e-5, atol=1e-7)
    ids2, _, probs2 = r(torch.randn(3, D, generator=g), rw)        # batches: the torch path
    assert ids2.shape == (3, 6) and probs2 is not None


@pytest.mark.parametrize("E,G,used,k", [(256, 8, 4, 8), (8, 4, 2, 2), (64, 8, 3, 6),
                                         (48, 6, 1, 8)])
def test_grouped_route_matches_torch_router(E, G, used, k):
    """DeepSeek-V3's group-limited choice (sigmoid, selection bias, the best ``used`` of ``G``
    groups by their two best, then top-k) in the native call: the torch path's ids."""
    from expertfs.runtime.model.config import GATING_SIGMOID
    from expertfs.runtime.model.router import Router, RouterWeights

    class Cfg:
        gating, norm_w, w_scale = GATING_SIGMOID, True, 2.5
    Cfg.n_expert_used, Cfg.n_group, Cfg.n_group_used = k, G, used
    g = torch.Generator().manual_seed(E + G)
    rw = RouterWeights(torch.randn(E, 64, generator=g) / 4, torch.randn(E, generator=g) / 8)
    r = Router(Cfg())
    for _ in range(50):
        x = torch.randn(1, 64, generator=g)
        ids, wts, probs = r(x, rw)
        assert probs is None                                        # the native call
        r.native = False
        ids_t, wts_t, _ = r(x, rw)
        top = r.top(x, rw, k)
        r.native = True
        assert torch.equal(ids, ids_t) and torch.equal(r.top(x, rw, k), top)
        torch.testing.assert_close(wts, wts_t, rtol=1e-5, atol=1e-7)


def test_grouped_route_that_cannot_hold_k_takes_the_torch_path():
    from expertfs.runtime.model.config import GATING_SIGMOID
    from expertfs.runtime.model.router import Router, RouterWeights

    class Cfg:
        gating, norm_w, w_scale, n_expert_used, n_group, n_group_used = GATING_SIGMOID, True, 1, 6, 4, 1
    rw = RouterWeights(torch.randn(16, 8), None)
    ids, _, probs = Router(Cfg())(torch.randn(1, 8), rw)          # 6 > 1 group of 4
    assert probs is not None and ids.shape == (1, 6)
    with pytest.raises(RuntimeError, match="groups"):
        kernels.route(torch.randn(1, 8), rw.weight, None, 6, True, True, 1e-5, 1.0, 4, 1)


@pytest.mark.parametrize("shape", [(1, 4, 4), (9, 4, 4), (2, 3, 6, 6), (1, 1, 1)])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_matches_the_torch_path(shape, iters, monkeypatch):
    """mHC's Sinkhorn in one native call equals mhc.sinkhorn's torch ops within float rounding
    (doubly stochastic to eps), and leaves the logits it was given untouched."""
    from expertfs.runtime.model import mhc
    g = torch.Generator().manual_seed(iters)
    x = torch.randn(*shape, generator=g) * 4
    x0 = x.clone()
    got = mhc.sinkhorn(x, iters, 1e-6)
    monkeypatch.setattr(kernels, "sinkhorn_", lambda *a: False)
    ref = mhc.sinkhorn(x, iters, 1e-6)
    assert torch.equal(x, x0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_sinkhorn_not_applicable():
    """float64, non-square, one-dimensional or strided logits: False, nothing touched."""
    for c in (torch.ones(4, 4, dtype=torch.float64), torch.ones(3, 4), torch.ones(4),
              torch.ones(4, 8)[:, ::2]):
        c0 = c.clone()
        assert kernels.sinkhorn_(c, 3, 1e-6) is False
        assert torch.equal(c, c0)
