"""mHC (manifold-constrained hyper-connections) residual streams of glm5-next.

As llama.cpp (``src/models/glm5-next.cpp``: ``build_hc_pre``/``build_hc_sinkhorn``/
``build_hc_post``/``build_hc_mean``) and transformers (``Glm5NextTextHyperConnection``,
``Glm5NextTextHyperHead``) compute it. The residual is ``n`` streams ``[T, n, D]``:

- expand: the token embedding copied into every stream;
- around each block (attention, then FFN, each with its own ``hc_attn_*`` / ``hc_ffn_*``):
  ``m = fn · RMSNorm(flatten(streams))`` (unweighted, ``rms_eps``) → ``(2 + n)·n`` mixes;
  ``pre = sigmoid(m_pre·scale[0] + base_pre) + eps``,
  ``post = 2·sigmoid(m_post·scale[1] + base_post)``,
  ``comb = Sinkhorn(softmax_row(m_comb·scale[2] + base_comb) + eps)`` (one column
  normalisation, then ``iters - 1`` row + column rounds, each sum ``+ eps``);
  block input ``x = Σ_i pre_i · stream_i`` (the block then applies its own RMSNorm);
  new streams ``out_j = post_j · y + Σ_i comb[i, j] · stream_i``;
- collapse: the mean of the streams, before the output norm.

The mixing weights are float32 and the mixing is done in float32 (results in the streams'
dtype). Tensors per block (``blk.{i}.``): ``hc_attn_fn.weight`` ``[(2+n)·n, n·D]``,
``hc_attn_base.weight`` ``[(2+n)·n]``, ``hc_attn_scale.weight`` ``[3]``, likewise ``hc_ffn_*``.

T=tokens, n=streams (``hc_mult``), D=embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from .. import kernels as native
from ..kernels import gemm
from .rope import rms_norm

__all__ = ["HC_TENSORS", "HCConfig", "HCWeights", "HCMix", "hc_expand", "hc_mixes", "sinkhorn",
           "hc_pre", "hc_post", "hc_block", "hc_collapse"]

# block -> (fn, base, scale) GGUF tensor names after ``blk.{i}.``
HC_TENSORS: dict[str, tuple[str, str, str]] = {
    "attn": ("hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight"),
    "ffn": ("hc_ffn_fn.weight", "hc_ffn_base.weight", "hc_ffn_scale.weight"),
}


@dataclass(frozen=True)
class HCConfig:
    n_streams: int          # {arch}.hyper_connection.count (hc_mult)
    sinkhorn_iters: int     # {arch}.hyper_connection.sinkhorn_iterations
    eps: float              # {arch}.hyper_connection.epsilon
    rms_eps: float          # {arch}.attention.layer_norm_rms_epsilon

    @classmethod
    def from_gguf(cls, kv: Mapping[str, object], arch: str = "glm5-next") -> HCConfig:
        return cls(n_streams=int(kv[f"{arch}.hyper_connection.count"]),
                   sinkhorn_iters=int(kv[f"{arch}.hyper_connection.sinkhorn_iterations"]),
                   eps=float(kv[f"{arch}.hyper_connection.epsilon"]),
                   rms_eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]))


@dataclass
class HCWeights:
    """One block's mixing weights, float32."""

    fn: torch.Tensor        # [(2 + n)·n, n·D]
    base: torch.Tensor      # [(2 + n)·n]
    scale: torch.Tensor     # [3]

    def __post_init__(self) -> None:
        self.fn = self.fn.float().contiguous()
        self.base = self.base.float().reshape(-1)
        self.scale = self.scale.float().reshape(-1)
        n = round((1 + self.base.numel()) ** 0.5) - 1              # (2 + n)·n mixes
        self.scales = torch.cat((self.scale[0].expand(n), self.scale[1].expand(n),
                                 self.scale[2].expand(n * n)))       # per mix, [(2 + n)·n]

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor], block: str,
                     prefix: str = "") -> HCWeights:
        """From tensors keyed ``prefix + HC_TENSORS[block][...]`` (e.g. ``prefix="blk.0."``)."""
        fn, base, scale = (t[prefix + name] for name in HC_TENSORS[block])
        return cls(fn, base, scale)


@dataclass
class HCMix:
    """What ``hc_post`` needs from ``hc_pre``: float32 ``post [T, n]``, ``comb [T, n, n]``
    (``comb[t, i, j]``: weight of input stream ``i`` in output stream ``j``)."""

    post: torch.Tensor
    comb: torch.Tensor


def hc_expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [T, D]`` → streams ``[T, n, D]`` (copies)."""
    return x[:, None, :].expand(-1, n, -1).contiguous()


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` float32: row softmax ``+ eps``, a column normalisation, then
    ``iters - 1`` rounds of row and column normalisation (each sum ``+ eps``); one native call
    on the CPU where the kernels are built."""
    comb = logits.clone(memory_format=torch.contiguous_format)
    if native.sinkhorn_(comb, iters, eps):
        return comb
    comb = torch.softmax(comb, dim=-1).add_(eps)
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb


def hc_mixes(streams: torch.Tensor, w: HCWeights,
             cfg: HCConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [T, n, D]`` → float32 ``(pre [T, n], post [T, n], comb [T, n, n])``."""
    T, n = streams.shape[0], cfg.n_streams
    flat = rms_norm(streams.reshape(T, -1).float().contiguous(), None, cfg.rms_eps)
    m = torch.addcmul(w.base, gemm.linear(flat, w.fn), w.scales)         # [T, (2 + n)·n]
    sg = torch.sigmoid(m[:, :2 * n])
    pre, post = sg[:, :n] + cfg.eps, sg[:, n:] * 2
    return pre, post, sinkhorn(m[:, 2 * n:].view(T, n, n), cfg.sinkhorn_iters, cfg.eps)


def hc_pre(streams: torch.Tensor, w: HCWeights, cfg: HCConfig) -> tuple[torch.Tensor, HCMix]:
    """Block input ``x [T, D]`` (streams' dtype, before the block's norm) and the mix for
    ``hc_post``; one token in one native call where the kernels apply."""
    got = native.hc_pre(streams, w.fn, w.base, w.scales, cfg.sinkhorn_iters, cfg.eps,
                        cfg.rms_eps) if streams.shape[0] == 1 else None
    if got is not None:
        return got[0], HCMix(got[1], got[2])
    pre, post, comb = hc_mixes(streams, w, cfg)
    x = torch.bmm(pre[:, None, :], streams.float())[:, 0]
    return x.to(streams.dtype), HCMix(post, comb)


def hc_post(y: torch.Tensor, residual: torch.Tensor, mix: HCMix) -> torch.Tensor:
    """Block output ``y [T, D]`` and the block's input streams ``[T, n, D]`` → new streams
    (one token in one native call where the kernels apply)."""
    out = native.hc_post(y, residual, mix.post, mix.comb) if y.shape[0] == 1 else None
    if out is not None:
        return out
    out = torch.baddbmm(mix.post[:, :, None] * y.float()[:, None, :], mix.comb.transpose(1, 2),
                        residual.float())
    return out.to(residual.dtype)


def hc_block(streams: torch.Tensor, w: HCWeights, cfg: HCConfig,
             block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``hc_post(block(hc_pre(streams)), streams)``: ``block`` maps ``[T, D] → [T, D]`` and
    includes its own RMSNorm (attn_norm / ffn_norm)."""
    x, mix = hc_pre(streams, w, cfg)
    return hc_post(block(x), streams, mix)


def hc_collapse(streams: torch.Tensor) -> torch.Tensor:
    """``[T, n, D]`` → ``[T, D]``: the unweighted mean (glm5-next's ``hc_head``)."""
    return streams.mean(dim=1)
