"""Exact mode's panel product on AMX (``kernels.qgemm`` where the CPU has AMX-BF16): for every
type it takes (the Q8_K types: a multiplier per 32 weights, or per 16 folded into the weights;
the blocks-of-32 types in rows of any multiple of 32 weights), its results equal ``F.linear`` on
the reference dequantization (formats.dequant, itself tested against gguf-py) within the float
panel's rounding bound, and closer to the float64 product than the float panel, for token
counts around its token tiles (16, in pairs) and rows around its panel of 32; the types it does
not take keep the float panel's bits; ``kernels.without_amx()`` restores the float panel. (That
its results do not depend on the thread count is test_qgemm.py's test, which takes it on such a
CPU.) Skipped where the CPU (or the OS) has no AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import GGMLType as T
from expertfs.runtime import kernels
from support.native import MOD, NEEDS_NATIVE

import test_kernels as k_quants
from test_qgemm import weight as any_weight
from test_qgemm_q8 import weight

AMX = [T.Q4_K, T.Q5_K, T.IQ4_XS, T.IQ2_XXS, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.TQ1_0, T.TQ2_0,
       T.Q2_K, T.Q3_K,                                  # multipliers per 16, one part
       T.Q6_K, T.IQ2_XS, T.IQ2_S, T.IQ1_M,              # multipliers per 16, two parts
       T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4, T.Q5_0, T.Q4_1, T.Q5_1]   # blocks of 32
FLOAT_PANEL = [T.BF16, T.F16]                             # kept on the float panel

pytestmark = [NEEDS_NATIVE, pytest.mark.skipif(
    MOD is None or not MOD.info().get("amx"), reason="this CPU has no AMX-BF16")]


def float_panel(f):
    """f() with AMX off: the float panel's product."""
    with kernels.without_amx():
        return f()


def test_the_types_it_takes():
    assert sorted(MOD.info()["amx_types"]) == sorted(int(t) for t in AMX)


@pytest.mark.parametrize("t", AMX, ids=lambda t: t.name)
def test_equals_dequant_linear_and_beats_the_float_panel(t):
    for rows, cols in ((32, 256), (70, 512)):       # a whole panel; a panel of 6 rows at the end
        raw = weight(t, rows, cols, int(t) + rows)
        W = dequantize(raw, t, (rows, cols))
        err_amx = err_float = 0.0
        for nt in (1, 15, 16, 17, 32, 33, 40):       # token tiles of 16, in pairs, and tails
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt))
            got = kernels.qgemm(x, raw, t, (rows, cols))
            flt = float_panel(lambda: kernels.qgemm(x, raw, t, (rows, cols)))
            ref = F.linear(x.double(), W.double())
            bound = k_quants.bound(x, W)
            assert got.shape == (nt, rows)
            assert ((got - ref).abs() <= bound).all(), (t.name, rows, nt)
            assert not torch.equal(got, flt) or nt == 1
            err_amx += float((got - ref).abs().sum())
            err_float += float((flt - ref).abs().sum())
        # exact products, short float32 sums: closer to the float64 product than the FMAs' chain
        assert err_amx < err_float, (t.name, err_amx, err_float)


@pytest.mark.parametrize("t", FLOAT_PANEL, ids=lambda t: t.name)
def test_other_types_keep_the_float_panel(t):
    raw = any_weight(t, 40, 512, 7)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernels.qgemm(x, raw, t, (40, 512)),
                       float_panel(lambda: kernels.qgemm(x, raw, t, (40, 512))))


def test_off_at_the_avx2_tier():
    MOD.set_isa("avx2")
    try:
        assert MOD.info()["amx_types"] == []
    finally:
        MOD.set_isa("best")


def test_max_tokens_takes_the_amx_limits_while_it_is_on():
    from expertfs.runtime.kernels import widths
    t = T.IQ2_XXS
    assert kernels.max_tokens(t, 32) == widths.WIDE_TYPES_AMX[t]
    with kernels.without_amx():
        assert kernels.max_tokens(t, 32) == widths._WIDE[("avx512", widths.splits_512(), 0)][t]
    assert kernels.max_tokens(t, 32) == widths.WIDE_TYPES_AMX[t]      # on again after


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4, T.Q5_0, T.Q4_1, T.Q5_1],
                         ids=lambda t: t.name)
def test_blocks_of_32_in_rows_not_whole_panels(t):
    """Rows of cols % 256 weights (llama.cpp's fallback types on GLM-4.5-Air's 1408-wide
    ffn_down, say): the last block's steps only, the same bound and the float64 product
    closer than the float panel's."""
    for rows, cols in ((40, 288), (33, 1408)):       # nine blocks of 32; 5.5 panels
        raw = weight(t, rows, cols, 5)
        W = dequantize(raw, t, (rows, cols))
        x = torch.randn(21, cols, generator=torch.Generator().manual_seed(3))
        got = kernels.qgemm(x, raw, t, (rows, cols))
        flt = float_panel(lambda: kernels.qgemm(x, raw, t, (rows, cols)))
        ref = F.linear(x.double(), W.double())
        assert ((got - ref).abs() <= k_quants.bound(x, W)).all(), (t.name, cols)
        assert float((got - ref).abs().sum()) < float((flt - ref).abs().sum()), (t.name, cols)
