"""The native paths of the MLA and KDA layers equal their float paths on the same weights.

MLA's per-head ``attn_k_b``/``attn_v_b`` kept as ggml bytes (``mla.HeadMatrices``: one native
call per tensor for a token, a native product per head for small batches, dequantized for big
ones) against the float einsum on the weights gguf-py dequantizes; a KDA layer whose matrices
are Q8_0 bytes (gguf-py quantizes them) through its fused products (f_a|g_a|beta as one
product, f_b and g_b as one native call for a token) against the float layer on the weights
gguf-py dequantizes, token by token and chunked; the chunked recurrence in several chunk groups
against the token-by-token one; the nilpotent-series inverse against torch's triangular solve.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants

from glm5next_ref import kda_gguf, kda_module, tiny_config
from test_model_qmatvec import random_weight

from expertfs.formats.ggml import GGMLType
from expertfs.runtime import kernels as native
from expertfs.runtime.model import kda
from expertfs.runtime.model.kda import (KDA_TENSORS, KDAConfig, KDAState, KDAWeights,
                                        delta_rule_chunked, delta_rule_step, kda_attention)
from expertfs.runtime.model.mla import HEAD_MAX_TOKENS, HeadMatrices
from expertfs.runtime.model.weights import Linear, RawTensor

TOL = 1e-5
needs_native = pytest.mark.skipif(not native.available(),
                                  reason="the native kernels are not built here (no compiler)")


def _maxd(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def _heads_raw(t: GT, H: int, R: int, C: int, seed: int) -> torch.Tensor:
    return random_weight(t, H * R, C, seed)


@needs_native
@pytest.mark.parametrize("T", [1, 3, 40, 200])
@pytest.mark.parametrize("t", [GT.Q8_0, GT.Q6_K, GT.Q4_K])
def test_quantized_head_matrices_equal_the_float_einsum(t, T):
    H, R, C = 4, 48, 256
    raw = _heads_raw(t, H, R, C, 7 + T)
    hm = HeadMatrices.quantized(RawTensor("attn_k_b.weight", raw, GGMLType(int(t)), (H, R, C)))
    assert hm is not None and hm.weight is None
    w = torch.from_numpy(quants.dequantize(raw.numpy(), t).reshape(H, R, C).copy())   # gguf-py
    x = torch.randn(T, H, C, generator=torch.Generator().manual_seed(T))
    want = torch.einsum("thc,hrc->thr", x, w)
    got = hm.apply(x)
    assert got.shape == (T, H, R) and got.dtype == torch.float32
    assert _maxd(got, want) <= TOL
    if T > HEAD_MAX_TOKENS:             # one einsum over the heads dequantized into scratch
        assert torch.equal(got, want) and torch.equal(hm.apply(x), got)
    # a strided input (q's nope part, the attention output transposed) takes the same paths
    wide = torch.randn(T, H, C + 64, generator=torch.Generator().manual_seed(2))
    assert _maxd(hm.apply(wide[..., :C]), torch.einsum("thc,hrc->thr", wide[..., :C], w)) <= TOL


@needs_native
@pytest.mark.parametrize("T", [1, 3])
def test_head_matrices_take_q8_activations_like_the_trunk(T):
    """``--act-quant q8`` reaches MLA's per-head products (llama.cpp quantizes ``q_nope`` and
    the attention's latents as it does every activation): each head as the q8 row kernels
    multiply it."""
    H, R, C = 4, 48, 256
    raw = _heads_raw(GT.Q8_0, H, R, C, 11)
    hm = HeadMatrices.quantized(RawTensor("attn_v_b.weight", raw, GGMLType.Q8_0, (H, R, C)))
    x = torch.randn(T, H, C, generator=torch.Generator().manual_seed(3))
    exact = hm.apply(x)
    hm.act_quant = "q8"
    got = hm.apply(x)
    want = torch.stack([native.matvec(x[:, h].contiguous(), hm.heads[h], GGMLType.Q8_0, (R, C),
                                      "q8") for h in range(H)], dim=1)
    assert torch.equal(got, want) and not torch.equal(got, exact)


@needs_native
def test_the_engine_sets_q8_on_every_layers_head_matrices(tmp_path):
    from expertfs.runtime.engine import Engine
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    synthesize(SynthConfig.tiny("deepseek2").replace(quant="Q8_0"), str(tmp_path / "d.gguf"))
    repack([str(tmp_path / "d.gguf")], str(tmp_path / "d.efs"))
    for mode, want in (("q8", "q8"), ("off", None)):
        with Engine.open(str(tmp_path / "d.efs"), provider="direct", act_quant=mode) as e:
            heads = [b.attn.k_b for b in e.model.trunk.blocks] + [b.attn.v_b
                                                                  for b in e.model.trunk.blocks]
            assert heads and all(h.raw is not None and h.act_quant == want for h in heads)


def test_float_and_unsupported_head_matrices_stay_float():
    w = torch.randn(2, 8, 32)
    hm = HeadMatrices(w)
    x = torch.randn(5, 2, 32)
    assert torch.equal(hm.apply(x), torch.einsum("thc,hrc->thr", x, w))
    f32 = RawTensor("k_b", w.reshape(-1).view(torch.uint8), GGMLType.F32, (2, 8, 32))
    assert HeadMatrices.quantized(f32) is None


def _q8_linear(w: torch.Tensor, name: str) -> tuple[Linear, torch.Tensor]:
    """Q8_0 bytes of ``w`` (gguf-py) as a fused ``Linear``, and gguf-py's dequantization."""
    q = quants.quantize(w.numpy().astype(np.float32), GT.Q8_0)
    deq = torch.from_numpy(quants.dequantize(q, GT.Q8_0).reshape(w.shape).copy())
    raw = torch.from_numpy(q.reshape(-1).copy())
    lin = Linear(None, RawTensor(name, raw, GGMLType.Q8_0, tuple(w.shape)), None, tuple(w.shape))
    lin.fused = True
    return lin, deq


def _kda_pair():
    H, DK, D = 2, 32, 64
    cfg_hf = tiny_config(hidden_size=D, linear_head_dim=DK, linear_num_heads=H,
                         num_attention_heads=H, num_key_value_heads=H)
    t = kda_gguf(kda_module(cfg_hf, 11))
    deq, qargs = dict(t), {}
    for field, gguf in KDA_TENSORS.items():
        if field in kda._MATRICES:
            qargs[field], deq[gguf] = _q8_linear(t[gguf], gguf)
        else:
            qargs[field] = t[gguf]
    cfg = KDAConfig(n_head=H, head_dim=DK, d_conv=4, lower_bound=-5.0,
                    rms_eps=cfg_hf.rms_norm_eps, chunk=4)
    return KDAWeights(**qargs), KDAWeights.from_tensors(deq), cfg, D


@needs_native
@pytest.mark.parametrize("pieces", [[1] * 6, [9], [5, 1, 1, 6]])
def test_q8_0_kda_layer_through_the_fused_products_equals_the_float_layer(pieces):
    wq, wf, cfg, D = _kda_pair()
    assert wq.w_a is not None and wq.w_a.q is not None and wq.b_rows is not None
    assert wf.qkv is not None and wf.w_a is not None and wf.b_rows is None
    x = torch.randn(sum(pieces), D, generator=torch.Generator().manual_seed(5))
    outs = {}
    for name, w in (("q8", wq), ("float", wf)):
        st, p, o = KDAState(cfg, [0]), 0, []
        for n in pieces:
            o.append(kda_attention(x[p:p + n], w, cfg, st, 0))
            p += n
        outs[name] = (torch.cat(o), st.ssm[0].clone())
    assert outs["float"][0].abs().max() > 0.05
    assert _maxd(outs["q8"][0], outs["float"][0]) <= TOL
    assert _maxd(outs["q8"][1], outs["float"][1]) <= TOL


def test_float_q_k_v_share_one_matrix():
    _, wf, _, _ = _kda_pair()
    W = wf.qkv.weight
    assert all(m.weight.data_ptr() >= W.data_ptr() and m.weight.untyped_storage().data_ptr()
               == W.untyped_storage().data_ptr() for m in (wf.wq, wf.wk, wf.wv))


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("T,chunk", [(37, 4), (64, 16), (9, 1)])
def test_chunk_groups_equal_the_recurrence(T, chunk, factored, monkeypatch):
    monkeypatch.setattr(kda, "CHUNK_GROUP", 2)
    if not factored:
        monkeypatch.setattr(kda, "_MAX_SPAN", -1.0)
    g = torch.Generator().manual_seed(T + chunk)
    H, DK, DV = 3, 16, 5
    q = torch.nn.functional.normalize(torch.randn(T, H, DK, generator=g), dim=-1) * DK ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, DK, generator=g), dim=-1)
    v = torch.randn(T, H, DV, generator=g)
    gate = -5.0 * torch.rand(T, H, DK, generator=g)
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, DK, DV, generator=g)
    o1, s1 = delta_rule_step(q, k, v, gate, beta, S0)
    o2, s2 = delta_rule_chunked(q, k, v, gate, beta, S0, chunk)
    assert _maxd(o1, o2) <= TOL and _maxd(s1, s2) <= TOL


@pytest.mark.parametrize("C", [1, 2, 3, 16, 17, 64])
def test_nilpotent_series_inverse_equals_the_triangular_solve(C):
    g = torch.Generator().manual_seed(C)
    L = (0.3 * torch.randn(5, C, C, generator=g)).tril(-1)
    rhs = torch.randn(5, C, 7, generator=g)
    want = torch.linalg.solve_triangular(L + torch.eye(C), rhs, upper=False, unitriangular=True)
    assert _maxd(kda._unit_lower_inverse(L) @ rhs, want) <= TOL
