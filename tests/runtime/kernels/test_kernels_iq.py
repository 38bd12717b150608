"""Native kernels of IQ4_NL, the lattice IQ types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ1_S, IQ1_M) and the ternary TQ1_0 / TQ2_0: exact mode equals F.linear on the reference dequantisation (formats.dequant,
itself tested against gguf-py) per type, ISA and shape; q8 mode equals the product with the
activations as llama.cpp quantizes them (Q8_K, Q8_0 for IQ4_NL; TQ also bit for bit against
a numpy transcription of ``ggml_vec_dot_tq*_q8_K_generic``); the MoE calls equal the
expert loop and, computed in parts, the one call bit for bit; the codebooks come from gguf-py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import GGMLType as T
from expertfs.formats.random_blocks import make_blocks
from expertfs.runtime import kernels
from support.native import (MOD, NEEDS_NATIVE, assert_thread_independent,  # noqa: F401
                            isa, isas, moe_in_parts)                 # (isa: a fixture)

pytestmark = NEEDS_NATIVE

GRID = [T.IQ2_XXS, T.IQ2_S, T.IQ3_XXS, T.IQ2_XS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
TERNARY = [T.TQ1_0, T.TQ2_0]
ALL = [T.IQ4_NL] + GRID + TERNARY


def weight(t: T, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random valid blocks (formats.random_blocks; TQ: random bytes, every code included, and
    a random fp16 d) of a ``rows × cols`` matrix, as bytes."""
    bs = 32 if t == T.IQ4_NL else 256
    rng = np.random.default_rng(seed)
    if t in TERNARY:
        b = rng.integers(0, 256, (rows * cols // bs, 54 if t == T.TQ1_0 else 66), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, b.shape[0]) * cols ** -0.5).astype(np.float16)
        b[:, -2:] = d.view(np.uint8).reshape(-1, 2)
    else:
        b = make_blocks(t, rows * cols // bs, cols ** -0.5, rng)
    return torch.from_numpy(np.ascontiguousarray(b).reshape(-1).copy())


def cols_for(t: T) -> list[int]:
    # IQ4_NL (blocks of 32) stands in where rows are not a multiple of 256: 96, 160, 1408
    return [96, 160, 512, 1408] if t == T.IQ4_NL else [256, 768]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float rounding allowance: a few ulps of sum |x| |w| per output."""
    return 4e-6 * (x.double().abs() @ w.double().abs().T).float() + 1e-30


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_exact_equals_dequant_linear(t, isa):
    for k, cols in enumerate(cols_for(t)):
        rows = 37 + 8 * k
        raw = weight(t, rows, cols, int(t) * 7 + k)
        W = dequantize(raw, t, (rows, cols))
        for nt in (1, 3, 6):            # 6: a chunk of 4 tokens and a remainder
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt + k))
            got = kernels.matvec(x, raw, t, (rows, cols))
            ref = F.linear(x.double(), W.double()).float()
            assert got.shape == (nt, rows)
            assert ((got - ref).abs() <= bound(x, W)).all(), (t.name, isa, cols, nt)


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_q8_equals_llama_numerics(t, isa):
    """The product with the activations llama.cpp's way quantized (``act_dequant``, whose
    Q8_K/Q8_0 bytes test_kernels.py checks against an independent numpy quantizer)."""
    cols, rows = 512, 29
    raw = weight(t, rows, cols, int(t) + 100)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(int(t)))
    x[1, 256:288] = 0.0                               # an all-zero block of 32
    got = kernels.matvec(x, raw, t, (rows, cols), act_quant="q8")
    W = dequantize(raw, t, (rows, cols))
    ref = F.linear(MOD.act_dequant(x, int(t)).double(), W.double()).float()
    assert ((got - ref).abs() <= bound(x, W) + 1e-6 * ref.abs()).all(), (t.name, isa)
    assert not torch.equal(got, kernels.matvec(x, raw, t, (rows, cols)))   # the mode is on


@pytest.mark.skipif("avx512" not in isas(), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("aq", ["off", "q8"])
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_avx512_gives_the_avx2_bits(t, aq):
    """Logits do not depend on the ISA: the AVX-512 kernels (q8: passes of 2 to 8 tokens;
    exact: larger passes, not the IQ2 types; the rest keeps the AVX2 kernels) give the AVX2
    kernels' results bit for bit, per shape (IQ4_NL: rows of 96 and 160, not multiples of 256;
    an odd block at the end) and token count (passes of each size, and AVX-512 passes followed
    by AVX2 ones), and equal the reference dequantisation's product. Exact IQ4_NL is the
    exception: the AVX-512 unit's table lookup (Q4_0's, kern_avx512.cpp) sums in 16 lanes, so
    its last bits are its own; there a token's result is the same in any batch."""
    info = MOD.info()
    assert int(t) in info["avx512_iq_q8_types"]               # the AVX-512 kernels are in use
    assert set(info["avx512_iq_exact_types"]) <= {int(u) for u in ALL}
    if t in (T.IQ1_S, T.TQ2_0):
        assert int(t) in info["avx512_iq_exact_types"]
    own = t == T.IQ4_NL and aq == "off"                # the AVX-512 lookup's own bits
    for k, cols in enumerate(cols_for(t)):
        rows = 29 + 8 * k
        raw = weight(t, rows, cols, int(t) * 3 + k)
        W = dequantize(raw, t, (rows, cols))
        x = torch.randn(17, cols, generator=torch.Generator().manual_seed(k))
        x[1, :32] = 0.0
        alone = torch.cat([kernels.matvec(x[i:i + 1], raw, t, (rows, cols), aq)
                           for i in range(17)]) if own else None
        for nt in (1, 2, 4, 5, 8, 12, 17):
            got = {}
            for name in ("avx2", "avx512"):
                MOD.set_isa(name)
                try:
                    got[name] = kernels.matvec(x[:nt], raw, t, (rows, cols), aq)
                finally:
                    MOD.set_isa("best")
            if own:
                assert torch.equal(got["avx512"], alone[:nt]), (cols, nt)
            else:
                assert torch.equal(got["avx2"], got["avx512"]), (cols, nt)
            xr = x[:nt] if aq == "off" else MOD.act_dequant(x[:nt], int(t))
            ref = F.linear(xr.double(), W.double()).float()
            err = (got["avx512"] - ref).abs()
            assert (err <= bound(x[:nt], W) + 1e-6 * ref.abs()).all(), (cols, nt)


def _experts(types, n, D, ff, fused, seed):
    tg, tu, td = types
    gate = [weight(tg, 2 * ff if fused else ff, D, seed + j) for j in range(n)]
    up = None if fused else [weight(tu, ff, D, seed + 50 + j) for j in range(n)]
    down = [weight(td, D, ff, seed + 100 + j) for j in range(n)]
    return gate, up, down


MIXES = [((T.IQ2_XXS, T.IQ2_XXS, T.IQ2_S), False, 256),      # Maya-style gate/up, down
         ((T.IQ3_XXS, T.IQ3_XXS, T.IQ2_S), False, 256),
         ((T.IQ2_XXS, T.IQ2_XXS, T.IQ4_NL), False, 160),     # IQ4_NL down: ff % 256 != 0
         ((T.IQ1_M, T.IQ1_M, T.IQ1_S), True, 256),
         ((T.IQ2_XS, T.IQ3_S, T.IQ4_NL), False, 256),
         ((T.TQ1_0, T.TQ1_0, T.TQ2_0), False, 256)]
MIX_IDS = ["maya", "iq3xxs-iq2s", "iq4nl-down", "iq1-fused", "mixed", "ternary"]


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types,fused,ff", MIXES, ids=MIX_IDS)
def test_moe_equals_expert_loop_and_float_weights(types, fused, ff, isa):
    D, n = 512, 4
    tg, tu, td = types
    gate, up, down = _experts(types, n, D, ff, fused, 11)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(4))
    w = torch.tensor([0.4, 0.3, 0.2, 0.1])
    for aq in ("off", "q8"):
        got = kernels.moe(x, w, gate, up, down, types, ff, aq)
        ref = torch.zeros(1, D)
        for j in range(n):
            if fused:
                g, u = kernels.matvec(x, gate[j], tg, (2 * ff, D), aq).chunk(2, -1)
            else:
                g = kernels.matvec(x, gate[j], tg, (ff, D), aq)
                u = kernels.matvec(x, up[j], tu, (ff, D), aq)
            ref += w[j] * kernels.matvec(F.silu(g) * u, down[j], td, (D, ff), aq)
        assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0), aq
    ref = torch.zeros(1, D)                     # exact mode against float weights
    for j in range(n):
        if fused:
            g, u = F.linear(x, dequantize(gate[j], tg, (2 * ff, D))).chunk(2, -1)
        else:
            g = F.linear(x, dequantize(gate[j], tg, (ff, D)))
            u = F.linear(x, dequantize(up[j], tu, (ff, D)))
        ref += w[j] * F.linear(F.silu(g) * u, dequantize(down[j], td, (D, ff)))
    got = kernels.moe(x, w, gate, up, down, types, ff)
    assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("aq", ["off", "q8"])
@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types,fused,ff", MIXES[:4] + MIXES[5:], ids=MIX_IDS[:4] + MIX_IDS[5:])
def test_moe_in_parts_equals_one_call_bit_for_bit(types, fused, ff, isa, aq):
    D, n = 512, 5
    gate, up, down = _experts(types, n, D, ff, fused, 21)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    w = torch.rand(n, generator=torch.Generator().manual_seed(6))
    want = kernels.moe(x, w, gate, up, down, types, ff, aq)
    for first in ([0, 2], [4], [1, 2, 3, 4]):
        parts, vs, got = moe_in_parts(x, w, (gate, up, down), types, ff, aq, first)
        assert torch.equal(got, want), first


def test_results_do_not_depend_on_threads():
    D, ff, types = 512, 256, (T.IQ2_XXS, T.IQ2_XXS, T.IQ2_S)
    assert_thread_independent(_experts(types, 3, D, ff, False, 3), types, ff,
                              weight(T.IQ3_XXS, 300, D, 9), T.IQ3_XXS, (300, D))


def test_tables_come_from_gguf_py_and_are_checked():
    from gguf import quants

    from expertfs.runtime.kernels import iq_tables
    info = MOD.info()
    assert info["iq_tables"]
    assert all(int(t) in info["types"] for t in ALL)
    with pytest.raises(RuntimeError, match="wrong size"):
        MOD.set_iq_table("iq2xxs", torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="unknown table"):
        MOD.set_iq_table("iq9", torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="differs"):
        MOD.set_iq_table("kvalues_iq4nl", torch.zeros(16, dtype=torch.uint8))
    iq_tables.install(MOD)                              # reinstalling is harmless
    quants.IQ2_XXS.init_grid()
    assert len(iq_tables.TABLES) == 6 and MOD.info()["iq_tables"]


def test_types_are_routed_and_others_fall_back():
    assert set(ALL) <= kernels.TYPES
    x = torch.randn(1, 256)
    raw = torch.zeros(8 * 292, dtype=torch.uint8)           # Q8_K: no native kernel
    assert kernels.matvec(x, raw, T.Q8_K, (8, 256)) is None
    raw = weight(T.IQ4_NL, 8, 96, 1)                         # IQ4_NL q8 on 96 columns: Q8_0
    assert kernels.matvec(torch.randn(1, 96), raw, T.IQ4_NL, (8, 96), act_quant="q8") is not None



def _tq_ints(raw: np.ndarray, t: T) -> tuple[np.ndarray, np.ndarray]:
    """(n, 256) integer weights t - 1 and (n,) float32 d of TQ blocks, in element order."""
    if t == T.TQ2_0:
        q = raw[:, :64].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (q & 3).reshape(-1, 256).astype(np.int64) - 1
        return q, raw[:, 64:66].copy().view(np.float16).astype(np.float32).ravel()
    pow3 = np.array([1, 3, 9, 27, 81], np.uint8).reshape(5, 1)
    parts = [raw[:, None, :32] * pow3, raw[:, None, 32:48] * pow3, raw[:, None, 48:52] * pow3[:4]]
    q = np.concatenate([p.reshape(raw.shape[0], -1) for p in parts], axis=1)
    q = ((q.astype(np.int64) * 3) >> 8) - 1
    return q, raw[:, 52:54].copy().view(np.float16).astype(np.float32).ravel()


def _q8k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_K_ref: qs and d per 256 elements."""
    xb = x.astype(np.float32).reshape(-1, 256)
    mx = xb[np.arange(len(xb)), np.abs(xb).argmax(1)]
    iscale = (np.float32(-127.0) / mx).astype(np.float32)          # test data: no zero block
    q = np.minimum(127, np.rint((iscale[:, None] * xb).astype(np.float32))).astype(np.int64)
    return q, (np.float32(1.0) / iscale).astype(np.float32)


@pytest.mark.parametrize("isa", ["scalar"], indirect=True)
@pytest.mark.parametrize("t", TERNARY, ids=lambda t: t.name)
def test_tq_q8_is_llama_vec_dot_bit_for_bit(t, isa):
    """Scalar q8 is ggml_vec_dot_tq*_q8_K_generic: sumf += (float)isum * (d * dy) per block."""
    cols, rows = 768, 9
    nb = cols // 256
    raw = weight(t, rows, cols, int(t) + 5)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3))
    got = kernels.matvec(x, raw, t, (rows, cols), act_quant="q8").numpy().ravel()
    q, d = _tq_ints(raw.numpy().reshape(rows * nb, -1), t)
    qy, dy = _q8k(x.numpy())
    ref = np.zeros(rows, np.float32)
    for r in range(rows):
        s = np.float32(0)
        for i in range(nb):
            isum = np.float32(int((q[r * nb + i] * qy[i]).sum()))
            s = np.float32(s + isum * np.float32(d[r * nb + i] * dy[i]))
        ref[r] = s
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_fused_trunk_keeps_every_native_quantized_type():
    """trunk_mode=auto with fused products: natively handled types stay quantized on the CPU
    (the compiled set elsewhere), and the planner's probe times them through the native path."""
    from expertfs.runtime.model import loader, qmatvec
    from expertfs.runtime.plan.probe import _fused_kernel
    keep = loader._kept_quantized(torch.device("cpu"))
    assert qmatvec.SUPPORTED | {T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ2_XXS, T.IQ1_M, T.TQ1_0} <= keep
    assert T.F16 not in keep and T.BF16 not in keep
    assert loader._kept_quantized(torch.device("meta")) == qmatvec.SUPPORTED
    assert _fused_kernel(T.IQ2_S) is qmatvec.decode_matvec
