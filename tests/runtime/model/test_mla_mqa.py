"""MLA's dense attention core (``mla._mqa``): every head against the one shared latent key,
equal to SDPA with ``enable_gqa`` (what it replaces), whole or in chunks of tokens."""

import pytest
import torch
import torch.nn.functional as F

from expertfs.runtime.model import mla
from expertfs.runtime.model.attention import causal_mask


@pytest.mark.parametrize("T,p0", [(1, 9), (5, 0), (7, 4)])
@pytest.mark.parametrize("chunk", [mla.MQA_CHUNK, 1])
def test_mqa_equals_sdpa_with_gqa(monkeypatch, T, p0, chunk):
    monkeypatch.setattr(mla, "MQA_CHUNK", chunk)        # 1: one token a chunk
    g = torch.Generator().manual_seed(T * 31 + p0)
    H, L, R = 6, 16, 4
    Q = torch.randn(T, H, L + R, generator=g)
    k = torch.randn(p0 + T, L + R, generator=g)
    mask = causal_mask(p0, T, Q.device)
    ref = F.scaled_dot_product_attention(Q.transpose(0, 1)[None], k[None, None],
                                         k[None, None, :, :L], attn_mask=mask, scale=0.3,
                                         enable_gqa=True)[0].transpose(0, 1)
    got = mla._mqa(Q, k, L, mask, 0.3)
    assert got.shape == (T, H, L)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
