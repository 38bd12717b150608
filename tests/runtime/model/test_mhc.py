"""mHC residual streams (glm5-next) against transformers' ``Glm5NextTextHyperConnection``.

The mixing weights alone (post, comb, the collapsed block input), Sinkhorn's constraint, and
the streams around real blocks: a tiny seeded ``Glm5NextTextDecoderLayer`` (KDA attention and
a dense FFN) and a tiny all-KDA ``Glm5NextTextModel`` (expand, layers, collapse, output norm),
rebuilt from ``mhc`` + ``kda`` with the weights in GGUF layout. The FFN is transformers' own
module (a black box here). Float32, at rounding level: whole sequences, pieces continued from
the state, one token at a time.
"""

from __future__ import annotations

import pytest
import torch

from glm5next_ref import D, DCONV, DK, H, hc_gguf, kda_gguf, seed_, tiny_config
from transformers.cache_utils import DynamicCache
from transformers.models.glm5_next import modeling_glm5_next as M

from expertfs.runtime.model.kda import KDAConfig, KDAState, KDAWeights, kda_attention
from expertfs.runtime.model.mhc import (HC_TENSORS, HCConfig, HCWeights, hc_block, hc_collapse,
                                        hc_expand, hc_mixes, hc_post, hc_pre, sinkhorn)
from expertfs.runtime.model.rope import rms_norm

TOL = 1e-5
N = 4


def _maxd(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over ``max(1, max |b|)`` (float32 rounding scales with the values)."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def _hc_cfg(cfg_hf) -> HCConfig:
    return HCConfig(n_streams=cfg_hf.hc_mult, sinkhorn_iters=cfg_hf.hc_sinkhorn_iters,
                    eps=cfg_hf.hc_eps, rms_eps=cfg_hf.rms_norm_eps)


def _kda_cfg(cfg_hf, chunk: int = 4) -> KDAConfig:
    return KDAConfig(n_head=H, head_dim=DK, d_conv=DCONV, lower_bound=cfg_hf.linear_lower_bound,
                     rms_eps=cfg_hf.rms_norm_eps, chunk=chunk)


def _streams(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, N, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_mixing_weights(T, iters):
    cfg_hf = tiny_config(hc_sinkhorn_iters=iters)
    ref = seed_(M.Glm5NextTextHyperConnection(cfg_hf), seed=T + iters, std=0.2)
    w = HCWeights(ref.fn.detach(), ref.base.detach(), ref.scale.detach())
    s = _streams(T, seed=T)
    with torch.no_grad():
        post, comb, collapsed = ref(s[None])
    pre_o, post_o, comb_o = hc_mixes(s, w, _hc_cfg(cfg_hf))
    x, mix = hc_pre(s, w, _hc_cfg(cfg_hf))
    assert _maxd(post_o, post[0]) <= TOL and _maxd(comb_o, comb[0]) <= TOL
    assert _maxd(x, collapsed[0]) <= TOL and _maxd(mix.comb, comb_o) <= TOL   # (one token: native)
    assert pre_o.dtype == post_o.dtype == comb_o.dtype == torch.float32
    assert (post_o >= 0).all() and (post_o <= 2).all() and (pre_o > 0).all()
    # the block output and residual mix, as the decoder layer writes it
    y = torch.randn(T, D)
    want = post[0][..., None] * y[:, None, :] + torch.matmul(comb[0].transpose(-1, -2), s)
    assert _maxd(hc_post(y, s, mix), want) <= TOL


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(7, N, N, generator=torch.Generator().manual_seed(0))
    c = sinkhorn(logits, 20, 1e-6)
    assert (c > 0).all()
    assert (c.sum(-2) - 1).abs().max() < 1e-5 and (c.sum(-1) - 1).abs().max() < 1e-3


def test_expand_and_collapse():
    x = torch.randn(5, D)
    s = hc_expand(x, N)
    assert s.shape == (5, N, D) and torch.equal(s[:, 2], x)
    s = _streams(5, seed=1)
    assert _maxd(hc_collapse(s), M.Glm5NextTextHyperHead()(s[None])[0]) <= TOL


def test_tensor_names():
    assert HC_TENSORS["attn"] == ("hc_attn_fn.weight", "hc_attn_base.weight",
                                  "hc_attn_scale.weight")
    assert HC_TENSORS["ffn"] == ("hc_ffn_fn.weight", "hc_ffn_base.weight", "hc_ffn_scale.weight")
    kv = {"glm5-next.hyper_connection.count": 4,
          "glm5-next.hyper_connection.sinkhorn_iterations": 20,
          "glm5-next.hyper_connection.epsilon": 1e-6,
          "glm5-next.attention.layer_norm_rms_epsilon": 1e-5}
    assert HCConfig.from_gguf(kv) == HCConfig(4, 20, 1e-6, 1e-5)


class _Ours:
    """The layers of a tiny all-KDA glm5-next rebuilt from ``mhc`` + ``kda``."""

    def __init__(self, layers, cfg_hf, chunk: int = 4) -> None:
        self.hc, self.kc = _hc_cfg(cfg_hf), _kda_cfg(cfg_hf, chunk)
        self.blocks = []
        for il, layer in enumerate(layers):
            t = {**kda_gguf(layer.self_attn), **hc_gguf(layer)}
            self.blocks.append((KDAWeights.from_tensors(t), HCWeights.from_tensors(t, "attn"),
                                HCWeights.from_tensors(t, "ffn"),
                                layer.input_layernorm.weight.detach(),
                                layer.post_attention_layernorm.weight.detach(), layer.mlp))
        self.state = KDAState(self.kc, range(len(layers)))

    def layer(self, il: int, s: torch.Tensor) -> torch.Tensor:
        kw, hc_attn, hc_ffn, attn_norm, ffn_norm, mlp = self.blocks[il]
        s = hc_block(s, hc_attn, self.hc, lambda x: kda_attention(
            rms_norm(x, attn_norm, self.kc.rms_eps), kw, self.kc, self.state, il))
        with torch.no_grad():
            return hc_block(s, hc_ffn, self.hc,
                            lambda x: mlp(rms_norm(x, ffn_norm, self.kc.rms_eps)[None])[0])


def _pieces(run, T: int, pieces: list[int]) -> torch.Tensor:
    outs, p = [], 0
    for n in pieces:
        outs.append(run(p, n))
        p += n
    assert p == T
    return torch.cat(outs)


@pytest.mark.parametrize("pieces", [[9], [4, 1, 6], [1] * 7, [13, 1, 1, 2]])
def test_decoder_layer(pieces):
    cfg_hf = tiny_config(n_layers=1)
    ref = seed_(M.Glm5NextTextDecoderLayer(cfg_hf, 0), seed=3)
    ours = _Ours([ref], cfg_hf)
    T = sum(pieces)
    s = _streams(T, seed=4)
    cache = DynamicCache(config=cfg_hf)

    def run_ref(p, n):
        with torch.no_grad():
            return ref(s[None, p:p + n], cache=cache)[0][0]
    want = _pieces(run_ref, T, pieces)
    got = _pieces(lambda p, n: ours.layer(0, s[p:p + n]), T, pieces)
    with torch.no_grad():
        whole = ref(s[None])[0][0]
    assert got.abs().max() > 0.1
    assert _maxd(got, want) <= TOL and _maxd(got, whole) <= TOL


@pytest.mark.parametrize("pieces", [[11], [5, 1, 7], [1] * 6, [3, 3, 3, 3]])
def test_tiny_model(pieces):
    cfg_hf = tiny_config(n_layers=3)
    model = seed_(M.Glm5NextTextModel(cfg_hf), seed=5, std=0.2)
    ours = _Ours(model.layers, cfg_hf)
    emb, norm = model.embed_tokens.weight.detach(), model.norm.weight.detach()
    T = sum(pieces)
    ids = torch.randint(1, cfg_hf.vocab_size, (T,), generator=torch.Generator().manual_seed(6))
    cache = DynamicCache(config=cfg_hf)

    def run_ref(p, n):
        # Glm5NextTextModel.forward's loop (its own forward asks an all-KDA cache for a
        # sequence length it cannot give); the whole-sequence check below runs the forward
        with torch.no_grad():
            h = model.embed_tokens(ids[None, p:p + n])
            h = h.unsqueeze(2).expand(-1, -1, cfg_hf.hc_mult, -1).contiguous()
            for layer in model.layers:
                h = layer(h, cache=cache)[0]
            return model.norm(model.hc_head(h))[0]

    def run_ours(p, n):
        s = hc_expand(emb[ids[p:p + n]], N)
        for il in range(len(ours.blocks)):
            s = ours.layer(il, s)
        return rms_norm(hc_collapse(s), norm, cfg_hf.rms_norm_eps)

    want = _pieces(run_ref, T, pieces)
    got = _pieces(run_ours, T, pieces)
    with torch.no_grad():
        whole = model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    assert _maxd(got, want) <= TOL and _maxd(got, whole) <= TOL
