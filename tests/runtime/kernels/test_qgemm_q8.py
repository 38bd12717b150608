"""q8 mode's integer panel product (``kernels.qgemm`` with ``act_quant="q8"``, AVX512-VNNI):
for every type it takes, its results are the q8 row kernels' (themselves checked against
llama.cpp's numerics in test_kernels.py) up to float summation order, for token counts around
its tile of 6 and rows around its panel of 32, the blocks-of-32 types in rows of any multiple
of 32 weights; the same bits on one thread and two, and in its
AVX-VNNI form (256-bit) as in its AVX-512 one; and where the CPU or the ISA in use has no VNNI,
q8's wide products keep the exact panel product."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import GGMLType as T
from expertfs.formats.ggml import block_size
from expertfs.formats.random_blocks import make_blocks
from expertfs.runtime import kernels
from support.native import MOD, NEEDS_NATIVE

PANEL = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
         T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4, T.Q5_0, T.Q4_1,
         T.Q5_1]
#: blocks of 32: Q8_0 activations, Q8_1 for Q4_1 and Q5_1 (their mins times the blocks' s)
BLOCKS32 = (T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4, T.Q5_0, T.Q4_1, T.Q5_1)

pytestmark = [NEEDS_NATIVE, pytest.mark.skipif(
    MOD is None or not MOD.info().get("avx512_vnni"), reason="this CPU has no AVX512-VNNI")]


def weight(t: T, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid random blocks (TQ: random bytes, every code, and a random fp16 d) as bytes."""
    rng = np.random.default_rng(seed)
    if t in (T.TQ1_0, T.TQ2_0):
        b = rng.integers(0, 256, (rows * cols // 256, 54 if t == T.TQ1_0 else 66), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, b.shape[0]) * cols ** -0.5).astype(np.float16)
        b[:, -2:] = d.view(np.uint8).reshape(-1, 2)
    else:
        b = make_blocks(t, rows * cols // block_size(t), cols ** -0.5, rng)
    return torch.from_numpy(np.ascontiguousarray(b).reshape(-1).copy())


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float rounding allowance: a few ulps of sum |x| |w| per output."""
    return 4e-6 * (x.double().abs() @ w.double().abs().T).float() + 1e-30


@pytest.mark.parametrize("t", PANEL, ids=lambda t: t.name)
def test_equals_the_q8_row_kernels(t):
    for k, (rows, cols) in enumerate(((37, 256), (64, 768), (5, 512), (70, 1024))):
        raw = weight(t, rows, cols, int(t) * 11 + k)
        W = dequantize(raw, t, (rows, cols))
        for nt in (1, 5, 6, 7, 13, 40):
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt + 7 * k))
            if cols > 256:
                x[0, :256] = 0.0                              # an all-zero block
            got = kernels.qgemm(x, raw, t, (rows, cols), "q8")
            rows_q8 = kernels.matvec(x, raw, t, (rows, cols), act_quant="q8")
            assert got.shape == (nt, rows)
            assert ((got - rows_q8).abs() <= bound(x, W)).all(), (t.name, rows, cols, nt)
            exact = kernels.qgemm(x, raw, t, (rows, cols))
            assert not torch.equal(got, exact)               # q8 numerics, not the exact ones


def test_thread_split_keeps_the_bits():
    raw = weight(T.Q4_K, 200, 512, 1)
    x = torch.randn(23, 512, generator=torch.Generator().manual_seed(3))
    old = torch.get_num_threads()
    out = []
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            kernels.set_threads(th)
            out.append(kernels.qgemm(x, raw, T.Q4_K, (200, 512), "q8"))
    finally:
        torch.set_num_threads(old)
        kernels.set_threads(0)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K, T.IQ2_XXS, T.IQ1_M, T.TQ2_0],
                         ids=lambda t: t.name)
def test_the_avx_vnni_form_gives_the_same_bits(t):
    """At the AVX2 tier the product runs in 256-bit vectors where the CPU has AVX-VNNI (the
    same integer sums and, lane by lane, the same float steps: the same bits), and is the exact
    panel product where it has not; ``max_tokens`` follows."""
    raw = weight(t, 70, 512, 2)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(4))
    wide = kernels.qgemm(x, raw, t, (70, 512), "q8")
    MOD.set_isa("avx2")
    try:
        if MOD.info()["avx_vnni"]:
            assert kernels.widths.q8_panel(MOD, t)
            for nt in (1, 2, 3, 4, 7, 20):      # tiles of 3 and what is left
                assert torch.equal(kernels.qgemm(x[:nt], raw, t, (70, 512), "q8"), wide[:nt])
        else:
            assert not kernels.widths.q8_panel(MOD, t)
            assert torch.equal(kernels.qgemm(x, raw, t, (70, 512), "q8"),
                               kernels.qgemm(x, raw, t, (70, 512)))
    finally:
        MOD.set_isa("best")


@pytest.mark.parametrize("t", BLOCKS32, ids=lambda t: t.name)
def test_blocks_of_32_in_rows_not_whole_panels(t):
    """Rows of cols % 256 weights (llama.cpp's fallback types on GLM-4.5-Air's 1408-wide
    ffn_down): the last panel's blocks only, the q8 row kernels' results as above."""
    for rows, cols in ((40, 288), (33, 1408)):
        raw = weight(t, rows, cols, 6)
        W = dequantize(raw, t, (rows, cols))
        for nt in (1, 6, 13):
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt))
            got = kernels.qgemm(x, raw, t, (rows, cols), "q8")
            rows_q8 = kernels.matvec(x, raw, t, (rows, cols), act_quant="q8")
            assert ((got - rows_q8).abs() <= bound(x, W)).all(), (t.name, cols, nt)
            assert not torch.equal(got, kernels.qgemm(x, raw, t, (rows, cols)))


def test_other_types_keep_the_exact_panel_product():
    """Every quantized type the kernels take has the integer panel; a type without it (the
    float ones) keeps the exact panel product; q8's own results are near the exact ones (its
    rounding, not garbage)."""
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(7))
    from test_qgemm import weight as any_weight
    panel = set(MOD.info()["q8_panel_types"])
    quantized = {t for t in kernels.TYPES if t not in (T.F16, T.BF16, T.F32)}
    assert {int(t) for t in quantized} <= panel
    for t in set(kernels.TYPES) - quantized:
        w = any_weight(t, 40, 512, 8)
        if kernels.qgemm(x, w, t, (40, 512)) is not None:
            assert torch.equal(kernels.qgemm(x, w, t, (40, 512), "q8"),
                               kernels.qgemm(x, w, t, (40, 512)))
    raw = weight(T.Q4_K, 40, 512, 5)
    W = dequantize(raw, T.Q4_K, (40, 512))
    assert ((kernels.qgemm(x, raw, T.Q4_K, (40, 512), "q8") - x @ W.T).abs()
            <= 0.05 * (x @ W.T).abs().max()).all()
