"""RMSNorm and rotary position embeddings, with llama.cpp's numerics.

RMSNorm: ``x * rsqrt(mean(x²) + eps) * w``, computed in float32 and returned in ``x.dtype``.

RoPE follows ggml's ``rope_ext``: ``theta_i = p * base^(-2i / n_rot)`` for ``i < n_rot / 2``,
applied to the first ``n_rot`` dims of each head (the rest pass through, glm4moe's partial
rotary). NEOX pairs dim ``i`` with ``i + n_rot/2`` (HF ``rotate_half``); NORM pairs ``2i`` with
``2i+1`` (GPT-J style; the llama converter permutes q/k so that this equals HF's rotation).
Linear scaling multiplies ``theta`` by ``freq_scale``; YaRN blends interpolated and extrapolated
``theta`` per dim with ggml's ramp and scales cos/sin by ``1 + 0.1 ln(1/freq_scale)``; the
ramp's correction range is floored/ceiled as ggml does unless ``yarn_truncate`` is off (gpt-oss,
as transformers and the model's reference compute it). The
angles are computed in float64 and rounded once, which keeps both peers within float32 rounding.
"""

from __future__ import annotations

import math

import torch

from .. import kernels as native
from .config import ROPE_NEOX, ModelConfig

__all__ = ["rms_norm", "Rope"]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = native.rms_norm(x, w, eps)      # one call instead of seven ops (float32 on the CPU)
    if y is not None:
        return y
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    return y.to(x.dtype)


def _yarn_corr_dim(n_rot: int, n_ctx_orig: int, beta: float, base: float) -> float:
    return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))


class Rope:
    """Cos/sin tables grown on demand; ``apply(x, pos)`` rotates ``x [T, H, D]`` in place-free."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.n_rot, self.neox, self.device = cfg.n_rot, cfg.rope == ROPE_NEOX, device
        half = self.n_rot // 2
        i = torch.arange(half, dtype=torch.float64)
        theta = cfg.rope_base ** (-2.0 * i / self.n_rot)              # per-dim frequency
        fs = cfg.rope_freq_scale
        self.mscale = 1.0
        if cfg.rope_yarn and fs != 1.0:
            lo = _yarn_corr_dim(self.n_rot, cfg.rope_orig_ctx, cfg.yarn_beta_fast, cfg.rope_base)
            hi = _yarn_corr_dim(self.n_rot, cfg.rope_orig_ctx, cfg.yarn_beta_slow, cfg.rope_base)
            if cfg.yarn_truncate:                                      # ggml always rounds
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(0.0, lo), min(self.n_rot - 1.0, hi)
            y = (i - lo) / max(0.001, hi - lo)                         # ggml: i0/2 == i
            ramp = 1.0 - y.clamp(0.0, 1.0)                             # ext_factor = 1
            self.freq = theta * fs * (1.0 - ramp) + theta * ramp
            if not cfg.rope_mscale_in_attention:
                self.mscale = 1.0 + 0.1 * math.log(1.0 / fs)
        else:
            self.freq = theta * fs
        self._cos = self._sin = torch.empty(0, half, device=device)
        self._dtype: torch.dtype | None = None

    def _ensure(self, n: int, dtype: torch.dtype) -> None:
        if self._cos.shape[0] >= n and self._dtype == dtype:
            return
        size = max(n, 2 * self._cos.shape[0], 256)
        ang = torch.arange(size, dtype=torch.float64)[:, None] * self.freq[None, :]
        self._cos = (ang.cos() * self.mscale).to(torch.float32).to(self.device)
        self._sin = (ang.sin() * self.mscale).to(torch.float32).to(self.device)
        self._dtype = dtype

    def tables(self, pos0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, 1, n_rot/2]`` for positions ``pos0 .. pos0+n-1`` (float32)."""
        self._ensure(pos0 + n, torch.float32)
        return self._cos[pos0:pos0 + n, None, :], self._sin[pos0:pos0 + n, None, :]

    def norm_apply(self, x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """``apply(rms_norm(x, w, eps))`` per head of ``x [T, H, D]`` (no norm when ``w`` is
        None); in one native call, in place on ``x``, where the kernels take it."""
        if native.norm_rope_(x, w, eps, cos, sin, self.n_rot, self.neox, w is not None):
            return x
        return self.apply(x if w is None else rms_norm(x, w, eps), cos, sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` → rotated copy (float32 math, result in ``x.dtype``)."""
        r = self.n_rot
        xr = x[..., :r].float()
        if self.neox:
            a, b = xr[..., :r // 2], xr[..., r // 2:]
            out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if r == x.shape[-1]:
            return out
        return torch.cat((out, x[..., r:]), dim=-1)
