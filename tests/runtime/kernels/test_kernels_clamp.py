"""The native MoE kernels with llama.cpp's SwiGLU clamp (``ggml_swiglu_clamp``, glm5-next's
``swiglu_clamp_exp``): ``silu(min(gate, limit)) · clamp(up, -limit, limit)``. Clamped rows
equal the torch reference (``runtime.model.ffn.swiglu`` on the kernels' own products, and the
whole layer on gguf-py-tested float weights) on every ISA, exact and q8, with the clamp biting;
computed in parts (``moe_hidden`` / ``moe_down_rows`` / ``moe_combine``) they equal one call bit
for bit; ``limit`` 0 is the unclamped product. gpt-oss's ``swiglu_oai`` (``alpha``) with its
experts' bias rows holds to the same rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import GGMLType as T
from expertfs.formats.ggml import block_size
from expertfs.formats.random_blocks import make_blocks
from expertfs.runtime import kernels
from expertfs.runtime.model.ffn import swiglu
from support.native import MOD, NEEDS_NATIVE, isa, isas  # noqa: F401  (isa: a fixture)

pytestmark = NEEDS_NATIVE

LIMIT = 0.5


def weight(t: T, rows: int, cols: int, seed: int) -> torch.Tensor:
    b = make_blocks(t, rows * cols // block_size(t), cols ** -0.5, np.random.default_rng(seed))
    return torch.from_numpy(np.ascontiguousarray(b).reshape(-1).copy())


def experts(types, n, D, ff, fused, seed):
    tg, tu, td = types
    gate = [weight(tg, 2 * ff if fused else ff, D, seed + j) for j in range(n)]
    up = None if fused else [weight(tu, ff, D, seed + 50 + j) for j in range(n)]
    down = [weight(td, D, ff, seed + 100 + j) for j in range(n)]
    return gate, up, down


def gate_up(x, gate, up, types, D, ff, j, aq):
    if up is None:
        return kernels.matvec(x, gate[j], types[0], (2 * ff, D), aq).chunk(2, -1)
    return (kernels.matvec(x, gate[j], types[0], (ff, D), aq),
            kernels.matvec(x, up[j], types[1], (ff, D), aq))


MIXES = [((T.IQ2_XXS, T.IQ2_XXS, T.IQ2_S), False, 256),      # maya-s gate/up, down
         ((T.Q4_K, T.Q4_K, T.Q6_K), False, 256),
         ((T.Q8_0, T.Q8_0, T.IQ4_NL), True, 160),            # fused gate_up, 160-row experts
         ((T.F16, T.F16, T.F16), False, 100)]                # rows not a multiple of 8
MIX_IDS = ["maya", "q4k-q6k", "fused-q8_0", "f16-tail"]


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types,fused,ff", MIXES, ids=MIX_IDS)
def test_clamped_moe_equals_the_torch_reference(types, fused, ff, isa):
    D, n = 512, 4
    gate, up, down = experts(types, n, D, ff, fused, 31)
    x = 3 * torch.randn(1, D, generator=torch.Generator().manual_seed(4))
    w = torch.tensor([0.4, 0.3, 0.2, 0.1])
    for aq in ("off", "q8"):
        h = kernels.moe_hidden(x, gate, up, types[:2], ff, aq, LIMIT)
        ref_h, ref, bites = [], torch.zeros(1, D), 0
        for j in range(n):
            g, u = gate_up(x, gate, up, types, D, ff, j, aq)
            bites += int((g > LIMIT).sum() + (u.abs() > LIMIT).sum())
            ref_h.append(swiglu(g, u, LIMIT))
            ref += w[j] * kernels.matvec(ref_h[-1], down[j], types[2], (D, ff), aq)
        ref_h = torch.cat(ref_h)
        assert bites > n * ff // 2                                   # the clamp bites
        assert torch.allclose(h, ref_h, atol=1e-6 * float(ref_h.abs().max()), rtol=1e-5), aq
        got = kernels.moe(x, w, gate, up, down, types, ff, aq, LIMIT)
        assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0), aq
        free = kernels.moe(x, w, gate, up, down, types, ff, aq)
        assert torch.equal(free, kernels.moe(x, w, gate, up, down, types, ff, aq, 0.0))
        assert not torch.allclose(free, got, atol=1e-2 * float(ref.abs().max()), rtol=0)
    tg, tu, td = types                                               # float weights, exact
    ref = torch.zeros(1, D)
    for j in range(n):
        if fused:
            g, u = F.linear(x, dequantize(gate[j], tg, (2 * ff, D))).chunk(2, -1)
        else:
            g = F.linear(x, dequantize(gate[j], tg, (ff, D)))
            u = F.linear(x, dequantize(up[j], tu, (ff, D)))
        ref += w[j] * F.linear(swiglu(g, u, LIMIT), dequantize(down[j], td, (D, ff)))
    got = kernels.moe(x, w, gate, up, down, types, ff, "off", LIMIT)
    assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("aq", ["off", "q8"])
@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types,fused,ff", MIXES, ids=MIX_IDS)
def test_clamped_moe_in_parts_equals_one_call_bit_for_bit(types, fused, ff, aq, isa):
    D, n = 512, 6
    gate, up, down = experts(types, n, D, ff, fused, 41)
    x = 3 * torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    w = torch.rand(n, generator=torch.Generator().manual_seed(6))
    want = kernels.moe(x, w, gate, up, down, types, ff, aq, LIMIT)
    for first in ([0, 2, 3], [5], [1, 2, 3, 4, 5]):
        parts = (first, [j for j in range(n) if j not in first])
        vs = []
        for part in parts:
            h = kernels.moe_hidden(x, [gate[j] for j in part],
                                   None if up is None else [up[j] for j in part],
                                   types[:2], ff, aq, LIMIT)
            vs.append(kernels.moe_down_rows(h, [down[j] for j in part], types[2], D, aq))
        row = {j: i for i, j in enumerate(parts[0] + parts[1])}
        got = kernels.moe_combine(torch.cat(vs), w, [row[j] for j in range(n)])
        assert torch.equal(got, want), first


# gpt-oss: swiglu_oai (alpha) on the clamped values, and bias rows added after each product.
ALPHA = 1.702


def biases(n, ff, D, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple([torch.randn(m, generator=g) * 0.5 for _ in range(n)] for m in (ff, ff, D))


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types,ff", [((T.MXFP4, T.MXFP4, T.MXFP4), 256),
                                      ((T.Q4_K, T.Q4_K, T.Q6_K), 256),
                                      ((T.F16, T.F16, T.F16), 100)], ids=["mxfp4", "q4k", "f16"])
def test_oai_moe_with_biases_equals_the_torch_reference(types, ff, isa):
    D, n = 512, 4
    gate, up, down = experts(types, n, D, ff, False, 61)
    bg, bu, bd = biases(n, ff, D, 7)
    x = 3 * torch.randn(1, D, generator=torch.Generator().manual_seed(8))
    w = torch.tensor([0.4, 0.3, 0.2, 0.1])
    for aq in ("off", "q8"):
        h = kernels.moe_hidden(x, gate, up, types[:2], ff, aq, LIMIT, ALPHA, (bg, bu))
        ref_h, ref = [], torch.zeros(1, D)
        for j in range(n):
            g, u = gate_up(x, gate, up, types, D, ff, j, aq)
            ref_h.append(swiglu(g + bg[j], u + bu[j], LIMIT, ALPHA))
            ref += w[j] * (kernels.matvec(ref_h[-1], down[j], types[2], (D, ff), aq) + bd[j])
        ref_h = torch.cat(ref_h)
        assert torch.allclose(h, ref_h, atol=1e-6 * float(ref_h.abs().max()), rtol=1e-5), aq
        got = kernels.moe(x, w, gate, up, down, types, ff, aq, LIMIT, ALPHA, (bg, bu, bd))
        assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0), aq
        plain = kernels.moe(x, w, gate, up, down, types, ff, aq, LIMIT)
        assert not torch.allclose(plain, got, atol=1e-2 * float(ref.abs().max()), rtol=0)
    # the parts equal the one call bit for bit (the engine's overlapped decode step)
    want = kernels.moe(x, w, gate, up, down, types, ff, "off", LIMIT, ALPHA, (bg, bu, bd))
    parts = ([2, 0], [1, 3])
    vs = []
    for part in parts:
        hp = kernels.moe_hidden(x, [gate[j] for j in part], [up[j] for j in part], types[:2],
                                ff, "off", LIMIT, ALPHA, ([bg[j] for j in part],
                                                          [bu[j] for j in part]))
        vs.append(kernels.moe_down_rows(hp, [down[j] for j in part], types[2], D, "off",
                                        [bd[j] for j in part]))
    row = {j: i for i, j in enumerate(parts[0] + parts[1])}
    assert torch.equal(kernels.moe_combine(torch.cat(vs), w, [row[j] for j in range(n)]), want)


def test_a_bias_of_the_wrong_length_is_refused():
    D, ff = 512, 256
    types = (T.Q4_K, T.Q4_K, T.Q6_K)
    gate, up, down = experts(types, 1, D, ff, False, 71)
    x = torch.randn(1, D)
    with pytest.raises(RuntimeError, match="bias must be 256"):
        kernels.moe_hidden(x, gate, up, types[:2], ff, "off", 0.0, ALPHA,
                           ([torch.zeros(ff + 1)], []))
    with pytest.raises(RuntimeError, match="one down bias per expert"):
        kernels.moe_down_rows(torch.zeros(1, ff), down, types[2], D, "off",
                              [torch.zeros(D), torch.zeros(D)])
