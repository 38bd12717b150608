"""KDA linear attention (glm5-next) against transformers' ``Glm5NextTextLinearAttention``.

A tiny seeded layer; its weights copied in the GGUF converter's layout. Checked in float32 at
rounding level: a whole sequence at once, pieces continued from the state, one token at a time
(against transformers with a cache, which runs its recurrent kernel for single tokens and its
chunked kernel otherwise), the chunked recurrence against the token-by-token one at lengths
that are and are not multiples of the chunk, and the state's byte count.
"""

from __future__ import annotations

import pytest
import torch

from glm5next_ref import D, DCONV, DK, H, kda_gguf, kda_module, tiny_config
from transformers.cache_utils import DynamicCache

from expertfs.runtime.model import kda
from support.native import isa, isas  # noqa: F401  (isa: fixture)
from expertfs.runtime.model.kda import (KDA_TENSORS, KDAConfig, KDAState, KDAWeights,
                                        delta_rule_chunked, delta_rule_step, kda_attention)

TOL = 1e-5            # float32 rounding, relative to the output's magnitude when above 1
LENGTHS = (1, 3, 4, 7, 13, 33, 70)        # our chunks: 4 or 16; transformers': 64


def _setup(seed: int = 0, lower_bound: float | None = -5.0, chunk: int = 4):
    cfg_hf = tiny_config(linear_lower_bound=lower_bound)
    ref = kda_module(cfg_hf, seed)
    w = KDAWeights.from_tensors(kda_gguf(ref, prefix="blk.0."), prefix="blk.0.")
    cfg = KDAConfig(n_head=H, head_dim=DK, d_conv=DCONV, lower_bound=lower_bound,
                    rms_eps=cfg_hf.rms_norm_eps, chunk=chunk)
    return cfg_hf, ref, w, cfg


def _x(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def _ref_pieces(cfg_hf, ref, x: torch.Tensor, pieces: list[int]) -> torch.Tensor:
    cache = DynamicCache(config=cfg_hf)
    outs, p = [], 0
    with torch.no_grad():
        for n in pieces:
            outs.append(ref(x[None, p:p + n], cache=cache)[0])
            p += n
    return torch.cat(outs)


def _ours_pieces(w, cfg, x: torch.Tensor, pieces: list[int], **kw) -> torch.Tensor:
    st = KDAState(cfg, [0])
    outs, p = [], 0
    for n in pieces:
        outs.append(kda_attention(x[p:p + n], w, cfg, st, 0, **kw))
        p += n
    return torch.cat(outs)


def _maxd(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of float32 rounding: over ``max(1, max |b|)``."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def test_tensor_names_are_llama_cpp_s():
    assert set(KDA_TENSORS.values()) == {
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
        "ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight",
        "ssm_f_a.weight", "ssm_f_b.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias",
        "ssm_g_a.weight", "ssm_g_b.weight", "ssm_norm.weight"}
    _, ref, _, _ = _setup()
    t = kda_gguf(ref)
    assert t["ssm_conv1d_q.weight"].shape == (1, H * DK, 1, DCONV)
    assert t["ssm_a"].shape == (H,) and (t["ssm_a"] < 0).all()


@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("T", LENGTHS)
def test_whole_sequence(T, lower_bound, chunk):
    cfg_hf, ref, w, cfg = _setup(lower_bound=lower_bound, chunk=chunk)
    x = _x(T)
    with torch.no_grad():
        want = ref(x[None])[0]
    got = _ours_pieces(w, cfg, x, [T])
    assert got.abs().max() > 0.05
    assert _maxd(got, want) <= TOL


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("pieces", [[5, 3, 1, 7], [1, 1, 9, 2, 13], [4, 4, 4], [33, 1, 6]])
def test_pieces_continue_from_the_state(pieces, lower_bound):
    cfg_hf, ref, w, cfg = _setup(seed=2, lower_bound=lower_bound)
    x = _x(sum(pieces), seed=3)
    want = _ref_pieces(cfg_hf, ref, x, pieces)
    with torch.no_grad():
        whole = ref(x[None])[0]
    got = _ours_pieces(w, cfg, x, pieces)
    assert _maxd(got, want) <= TOL
    assert _maxd(got, whole) <= TOL


@pytest.mark.parametrize("T", [6, 21])
def test_one_token_at_a_time(T):
    cfg_hf, ref, w, cfg = _setup(seed=4)
    x = _x(T, seed=5)
    want = _ref_pieces(cfg_hf, ref, x, [1] * T)
    got = _ours_pieces(w, cfg, x, [1] * T)
    assert _maxd(got, want) <= TOL
    # the whole sequence through the token-by-token recurrence, and chunked
    assert _maxd(_ours_pieces(w, cfg, x, [T], recurrent=True), want) <= TOL
    assert _maxd(_ours_pieces(w, cfg, x, [T], recurrent=False), want) <= TOL


@pytest.mark.parametrize("H,Dk,Dv", [(3, 16, 24), (4, 128, 128)])
def test_native_one_token_step_equals_the_torch_loop(H, Dk, Dv, monkeypatch):
    """The one-token step takes the native fused call (one pass over the state) where the
    kernels are built, and gives the torch loop's output and state within float rounding."""
    from expertfs.runtime import kernels
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.status()['reason']}")
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.nn.functional.normalize(torch.randn(1, H, Dk, generator=gen), dim=-1)
            for _ in range(2))
    g = -torch.rand(1, H, Dk, generator=gen)
    v, beta = torch.randn(1, H, Dv, generator=gen), torch.rand(1, H, generator=gen)
    S = torch.randn(H, Dk, Dv, generator=gen)
    calls = []
    step = kda.native.kda_step_
    monkeypatch.setattr(kda.native, "kda_step_", lambda *a: calls.append(1) or step(*a))
    o1, S1 = delta_rule_step(q, k, v, g, beta, S)
    monkeypatch.setattr(kda.native, "kda_step_", lambda *a: None)
    o2, S2 = delta_rule_step(q, k, v, g, beta, S)
    assert calls and o1.shape == o2.shape == (1, H, Dv)
    assert _maxd(o1, o2) <= TOL and _maxd(S1, S2) <= TOL


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_native_token_of_a_layer_equals_the_torch_ops(isa, lower_bound, monkeypatch):
    """A decode token of a KDA layer after its conv in one native call (kernels.kda_token_:
    the q/k norms, the decay gate with or without its lower bound, beta, the delta rule, the
    gated output norm) gives the torch ops' output and state within float rounding, token
    after token; with ``recurrent=False`` the chunked torch form still runs."""
    from expertfs.runtime import kernels
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.status()['reason']}")
    _, _, w, cfg = _setup(lower_bound=lower_bound)
    x = _x(6, seed=5)
    native, torch_ops = KDAState(cfg, [0]), KDAState(cfg, [0])
    calls = []
    real = kda.native.kda_token_
    monkeypatch.setattr(kda.native, "kda_token_", lambda *a: calls.append(1) or real(*a))
    got = [kda_attention(x[i:i + 1], w, cfg, native, 0) for i in range(6)]
    assert len(calls) == 6
    kda_attention(x[:1], w, cfg, KDAState(cfg, [0]), 0, recurrent=False)
    assert len(calls) == 6
    monkeypatch.setattr(kda.native, "kda_token_", lambda *a: None)
    want = [kda_attention(x[i:i + 1], w, cfg, torch_ops, 0) for i in range(6)]
    for a, b in zip(got, want):
        assert a.shape == b.shape and _maxd(a, b) <= TOL
    assert _maxd(native.ssm[0], torch_ops.ssm[0]) <= TOL
    assert torch.equal(native.conv[0], torch_ops.conv[0])


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("T", [1, 2, 15, 16, 17, 31, 50, 64, 65])
@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_equals_recurrent(T, chunk, factored, monkeypatch):
    if not factored:                  # every chunk through the explicit decays
        monkeypatch.setattr(kda, "_MAX_SPAN", -1.0)
    g = torch.Generator().manual_seed(T * 100 + chunk)
    Dv = 6

    def nrm(x):
        return x / x.norm(dim=-1, keepdim=True)
    q = nrm(torch.randn(T, H, DK, generator=g)) * DK ** -0.5
    k = nrm(torch.randn(T, H, DK, generator=g))
    v = torch.randn(T, H, Dv, generator=g)
    gate = -5.0 * torch.rand(T, H, DK, generator=g)                   # strong decays included
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, DK, Dv, generator=g)
    o1, s1 = delta_rule_step(q, k, v, gate, beta, S0)
    o2, s2 = delta_rule_chunked(q, k, v, gate, beta, S0, chunk)
    assert _maxd(o1, o2) <= TOL and _maxd(s1, s2) <= TOL


@pytest.mark.parametrize("T,chunk,gate", [(128, 128, -4.9), (48, 16, -5.0), (48, 17, -5.0)])
def test_long_chunks_do_not_overflow(T, chunk, gate):
    # cumulative log-decay at or past float32's exp range within one chunk
    g = torch.Generator().manual_seed(9)
    k = torch.nn.functional.normalize(torch.randn(T, 1, DK, generator=g), dim=-1)
    q, v = k * DK ** -0.5, torch.randn(T, 1, DK, generator=g)
    gate = torch.full((T, 1, DK), gate)
    beta = torch.rand(T, 1, generator=g)
    S0 = torch.randn(1, DK, DK, generator=g)
    o1, s1 = delta_rule_step(q, k, v, gate, beta, S0)
    o2, s2 = delta_rule_chunked(q, k, v, gate, beta, S0, chunk)
    assert torch.isfinite(o2).all() and _maxd(o1, o2) <= TOL and _maxd(s1, s2) <= TOL


def test_state_reset_snapshot_and_bytes():
    cfg_hf, ref, w, cfg = _setup(seed=6)
    x = _x(9, seed=7)
    st = KDAState(cfg, [0, 2])
    first = kda_attention(x, w, cfg, st, 0)
    snap = st.snapshot()
    after = kda_attention(x[:3], w, cfg, st, 0)
    st.restore(snap)
    assert torch.equal(kda_attention(x[:3], w, cfg, st, 0), after)
    st.reset()
    assert torch.equal(kda_attention(x, w, cfg, st, 0), first)
    held = sum(t.numel() * t.element_size() for t in (*st.conv.values(), *st.ssm.values()))
    assert st.nbytes == held == 2 * KDAState.layer_bytes(cfg)
    # llama.cpp's n_embd_r + n_embd_s floats; GLM-5.3-Flash: 64 heads x 128, conv 4
    flash = KDAConfig(n_head=64, head_dim=128, d_conv=4)
    assert KDAState.layer_bytes(flash) == 4 * (3 * 3 * 64 * 128 + 128 * 128 * 64)


def test_config_from_gguf_metadata():
    kv = {"glm5-next.attention.head_count": 64, "glm5-next.kda.head_dim": 128,
          "glm5-next.ssm.conv_kernel": 4, "glm5-next.kda.gate_lower_bound": -5.0,
          "glm5-next.attention.layer_norm_rms_epsilon": 1e-5}
    cfg = KDAConfig.from_gguf(kv)
    assert (cfg.n_head, cfg.head_dim, cfg.d_conv, cfg.lower_bound) == (64, 128, 4, -5.0)
    del kv["glm5-next.kda.gate_lower_bound"]
    assert KDAConfig.from_gguf(kv).lower_bound is None
