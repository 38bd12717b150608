"""The many-token panel product (``kernels.qgemm``, AVX2 and AVX-512F): for every type the
kernels take, on each vector ISA, it equals ``F.linear`` on the reference dequantisation
(formats.dequant, itself tested against gguf-py) for token counts on both sides of its token
groups (8 and 16 tokens a vector) and row counts that end inside a 24-row panel; its result does
not depend on the thread count; it declines (None) under the portable kernels, and
``wide_linear`` then takes the product as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertfs.formats.dequant import dequantize
from expertfs.runtime import kernels
from expertfs.runtime.model.wide import wide_linear
from support.native import MOD, NEEDS_NATIVE, isa, isas  # noqa: F401  (isa: a fixture)

import test_kernels as k_quants
import test_kernels_iq as iq

pytestmark = NEEDS_NATIVE
VECTOR_ISAS = [i for i in isas() if i != "scalar"]

TYPES = k_quants.ALL + iq.ALL


def weight(t, rows: int, cols: int, seed: int) -> torch.Tensor:
    return (iq.weight if t in iq.ALL else k_quants.weight)(t, rows, cols, seed)


def cols_of(t) -> int:
    return (iq.cols_for if t in iq.ALL else k_quants.cols_for)(t)[-1]


@pytest.mark.parametrize("isa", VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_qgemm_equals_dequant_linear(t, isa):
    cols = cols_of(t)
    for rows in (24, 61):                          # one whole panel; a panel of 13 rows at the end
        raw = weight(t, rows, cols, int(t) + rows)
        W = dequantize(raw, t, (rows, cols))
        for nt in (1, 8, 9, 16, 17, 24, 25, 33, 40, 41, 48):  # groups of 8, 16, 32, tails
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt))
            got = kernels.qgemm(x, raw, t, (rows, cols))
            ref = F.linear(x, W)
            assert got.shape == (nt, rows)
            assert ((got - ref).abs() <= k_quants.bound(x, W)).all(), (t.name, isa, rows, nt)


@pytest.mark.parametrize("isa", VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("t", [k_quants.T.Q4_K, k_quants.T.Q6_K], ids=lambda t: t.name)
def test_qgemm_does_not_depend_on_threads(isa, t):
    """On a CPU with AMX the AVX-512 tier takes both of its forms (a multiplier per 32, per
    16 folded in)."""
    rows, cols = 100, 768
    raw = weight(t, rows, cols, 3)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(4))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.qgemm(x, raw, t, (rows, cols))
        torch.set_num_threads(2)
        two = kernels.qgemm(x, raw, t, (rows, cols))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", VECTOR_ISAS, indirect=True)
@pytest.mark.parametrize("t", [k_quants.T.Q4_K, k_quants.T.Q6_K, iq.T.IQ2_XXS],
                         ids=lambda t: t.name)
def test_a_tokens_product_does_not_depend_on_the_batch(isa, t):
    """Each token's sums run over the columns in one order whichever token group (32, 16 or 8
    a step) and column block its batch puts it in: its row of the product is the same bits in
    every batch width (the float panel; AMX, where present, is held off)."""
    rows, cols = 30, cols_of(t)
    raw = weight(t, rows, cols, 7)
    x = torch.randn(48, cols, generator=torch.Generator().manual_seed(8))
    with kernels.without_amx():
        full = kernels.qgemm(x, raw, t, (rows, cols))
        for nt in (1, 7, 8, 9, 16, 17, 20, 24, 25, 33, 40, 41):
            assert torch.equal(kernels.qgemm(x[:nt], raw, t, (rows, cols)), full[:nt]), nt


@pytest.mark.parametrize("isa", ["scalar"], indirect=True)
def test_portable_kernels_decline_and_wide_linear_still_multiplies(isa):
    t, rows, cols = k_quants.T.Q6_K, 50, 512
    raw = weight(t, rows, cols, 5)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(6))
    assert kernels.qgemm(x, raw, t, (rows, cols)) is None
    W = dequantize(raw, t, (rows, cols))
    got = wide_linear(x, raw, t, (rows, cols))
    assert ((got - F.linear(x, W)).abs() <= k_quants.bound(x, W)).all()
