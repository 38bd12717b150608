"""The native kernels' Python face: each call checks that the kernel applies (type, device,
dtype, mode) and returns None otherwise, so callers fall back to their torch paths."""


from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from ...formats.ggml import GGMLType
from .build import load
from .widths import (WIDE_TYPES, WIDE_TYPES_AVX2, WIDE_TYPES_Q8_AVX2,  # noqa: F401
                     _WIDE, max_tokens)

__all__ = ["ACT_QUANT", "TYPES", "available", "matvec", "dequant", "moe", "moe_hidden",
           "moe_down_rows", "moe_combine", "expert_tokens",
           "act_quant_mode", "set_threads", "set_spin_us", "rms_norm", "norm_rope_",
           "attn_decode", "route", "kda_step_", "sinkhorn_", "hc_pre", "hc_post",
           "conv_step_", "kda_token_", "max_tokens", "WIDE_TYPES",
           "WIDE_TYPES_AVX2", "WIDE_TYPES_Q8_AVX2", "without_amx"]

#: Activation-quantization modes: name → kernel mode.
ACT_QUANT = {"off": 0, "q8": 1}

#: ggml types with native kernels (both modes).
TYPES = frozenset({GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q8_0, GGMLType.Q4_0,
                   GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_XS, GGMLType.MXFP4,
                   GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_1, GGMLType.BF16, GGMLType.F16,
                   GGMLType.IQ4_NL, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S,
                   GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ1_S, GGMLType.IQ1_M,
                   GGMLType.TQ1_0, GGMLType.TQ2_0})

#: Types whose q8 mode uses Q8_K activations (rows must be whole 256-element blocks).
_K = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
                GGMLType.IQ4_XS, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S,
                GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ1_S, GGMLType.IQ1_M,
                GGMLType.TQ1_0, GGMLType.TQ2_0})


def act_quant_mode(name: str | None) -> int:
    """Kernel mode of an ``act_quant`` name (None = "off"); ValueError for unknown names."""
    if name is None:
        return 0
    try:
        return ACT_QUANT[name]
    except KeyError:
        raise ValueError(f"unknown activation quantization {name!r}; "
                         f"known: {', '.join(ACT_QUANT)}") from None


def available() -> bool:
    """True when the native kernels are built and loaded (builds them on first call)."""
    return load() is not None


_TYPE_IDS = frozenset(int(t) for t in TYPES)
_K_IDS = frozenset(int(t) for t in _K)


def set_threads(n: int) -> None:
    """Threads of the native kernels' pool (0, the default: ``torch.get_num_threads()``)."""
    mod = load()
    if mod is not None:
        mod.set_threads(int(n))


def set_spin_us(us: int) -> None:
    """How long idle pool workers spin for the next call before sleeping (default 50 µs)."""
    mod = load()
    if mod is not None:
        mod.set_spin_us(int(us))


@contextmanager
def without_amx() -> Iterator[None]:
    """Exact mode's wide products on the float panel inside the block (AMX off where the CPU
    has it, for comparisons), the setting before it restored after."""
    mod = load()
    was = mod.set_amx(False) if mod is not None else False
    try:
        yield
    finally:
        if was:
            mod.set_amx(True)


def _applies(t: int, cols: int, mode: int) -> bool:
    """Native kernels take type id ``t`` for rows of ``cols`` in ``mode`` (ids, not the enum:
    hashing an IntEnum runs Python code and this is on the per-layer path)."""
    return t in _TYPE_IDS and not (mode == 1 and t in _K_IDS and cols % 256)


def matvec(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLType, shape: Sequence[int],
           act_quant: str | None = None) -> torch.Tensor | None:
    """``x [T, in]`` float32 CPU → ``[T, out]`` for W of torch ``shape (out, in)`` as ggml bytes
    ``raw``; None when not applicable or the kernels are unavailable."""
    mode = 0 if act_quant is None or act_quant == "off" else act_quant_mode(act_quant)
    rows, cols = int(shape[0]), int(shape[1])
    t = int(ggml_type)
    if (not x.is_cpu or x.dtype != torch.float32 or x.dim() != 2 or not raw.is_cpu
            or not _applies(t, cols, mode)):
        return None
    mod = load()
    if mod is None:
        return None
    return mod.matvec(x, raw if raw.dim() == 1 else raw.reshape(-1), t, rows, cols, mode)


def qgemm(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLType,
          shape: Sequence[int], act_quant: str | None = None) -> torch.Tensor | None:
    """``x [T, in]`` float32 CPU → ``[T, out]`` for many tokens (prefill): each panel of rows of
    W decoded once, into the core's cache, and multiplied by every token. Exact mode's numerics
    (dequantized floats, float32 sums), or with ``act_quant="q8"`` where the CPU has AVX512-VNNI
    or AVX-VNNI and the type an integer panel (``widths.q8_panel``) q8 mode's: the q8 row
    kernels' activations and 8-bit integer products, their results up to float summation order;
    q8 for another type, CPU or row length keeps the exact panel product. None when not applicable (the portable kernels only,
    another device or dtype, a type the kernels do not take)."""
    rows, cols = int(shape[0]), int(shape[1])
    t = int(ggml_type)
    if (not x.is_cpu or x.dtype != torch.float32 or x.dim() != 2 or not raw.is_cpu
            or not _applies(t, cols, 0)):
        return None
    mod = load()
    if mod is None or not hasattr(mod, "qgemm"):
        return None
    return mod.qgemm(x, raw.reshape(-1), t, rows, cols, _moe_mode(act_quant))


def dequant(raw: torch.Tensor, ggml_type: GGMLType, shape: Sequence[int],
            out: torch.Tensor | None = None) -> torch.Tensor | None:
    """W of torch ``shape (out, in)`` as float32 ``[out, in]`` from ggml bytes ``raw`` (CPU,
    contiguous rows), each weight as the exact kernels use it; None when not applicable.
    ``out``: written into the first ``out * in`` floats of this contiguous float32 buffer (a
    view of it is returned), not into a new tensor."""
    rows, cols = int(shape[0]), int(shape[1])
    t = int(ggml_type)
    if not raw.is_cpu or not _applies(t, cols, 0):
        return None
    mod = load()
    if mod is None or not hasattr(mod, "dequant"):
        return None
    if out is not None:
        return mod.dequant_into(raw.reshape(-1), t, rows, cols, out)
    return mod.dequant(raw.reshape(-1), t, rows, cols)


def moe(x: torch.Tensor, w: torch.Tensor, gate: Sequence[torch.Tensor],
        up: Sequence[torch.Tensor] | None, down: Sequence[torch.Tensor],
        types: tuple[GGMLType, GGMLType, GGMLType], n_ff: int,
        act_quant: str | None = None, limit: float = 0.0, alpha: float = 0.0,
        biases: Sequence[Sequence[torch.Tensor]] = ((), (), ())) -> torch.Tensor | None:
    """One token through n experts: ``Σ_j w[j] · down_j(silu(gate_j x) · up_j x)``.

    ``x [1, n_embd]`` float32 CPU; ``w [n]``; ``gate``/``up``/``down`` the experts' ggml bytes
    (``up`` None or empty: each ``gate`` is a fused gate_up, gate rows first); ``types`` the
    (gate, up, down) ggml types. ``limit`` > 0: llama.cpp's ``swiglu_clamp``,
    ``silu(min(gate, limit)) · clamp(up, -limit, limit)``; ``alpha`` > 0: gpt-oss's
    ``swiglu_oai`` on the same clamped values, ``g / (1 + exp(-alpha g)) · (u + 1)``;
    ``biases``: the (gate, up, down) float32 bias rows per expert, each list empty or one per
    expert, added after their product. Returns ``[1, n_embd]`` float32, or None when not
    applicable.
    """
    mode = _moe_mode(act_quant)
    D = int(x.shape[-1])
    tg, tu, td = int(types[0]), int(types[1]), int(types[2])
    if (not x.is_cpu or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] != 1
            or not gate or not _applies(tg, D, mode) or not _applies(tu, D, mode)
            or not _applies(td, n_ff, mode)):
        return None
    mod = load()
    if mod is None:
        return None
    bg, bu, bd = (list(b) for b in biases)
    return mod.moe(x, w, list(gate), list(up or ()), list(down), tg, tu, td, int(n_ff), mode,
                   float(limit), float(alpha), bg, bu, bd)


def _moe_mode(act_quant: str | None) -> int:
    return 0 if act_quant is None or act_quant == "off" else act_quant_mode(act_quant)


def moe_hidden(x: torch.Tensor, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor] | None,
               types: tuple[GGMLType, GGMLType], n_ff: int,
               act_quant: str | None = None, limit: float = 0.0, alpha: float = 0.0,
               biases: Sequence[Sequence[torch.Tensor]] = ((), ())) -> torch.Tensor | None:
    """``moe``'s first phase: ``silu(gate_j x) · up_j x`` per expert (``limit``, ``alpha`` and
    the (gate, up) ``biases`` as ``moe``'s), ``[n, n_ff]`` float32 (each row independent of
    the others in the call); None when not applicable."""
    mode = _moe_mode(act_quant)
    D = int(x.shape[-1])
    tg, tu = int(types[0]), int(types[1])
    if (not x.is_cpu or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] != 1
            or not gate or not _applies(tg, D, mode) or not _applies(tu, D, mode)):
        return None
    mod = load()
    if mod is None:
        return None
    return mod.moe_hidden(x, list(gate), list(up or ()), tg, tu, int(n_ff), mode, float(limit),
                          float(alpha), list(biases[0]), list(biases[1]))


def moe_down_rows(h: torch.Tensor, down: Sequence[torch.Tensor], ggml_type: GGMLType,
                  n_embd: int, act_quant: str | None = None,
                  bias: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
    """The first step of ``moe``'s second phase: each expert's unscaled ``down_j h[j]`` (+ its
    ``bias`` row when given), ``[n, n_embd]`` float32 (each row independent of the others in
    the call); None when not applicable."""
    mode = _moe_mode(act_quant)
    td = int(ggml_type)
    if (not h.is_cpu or h.dtype != torch.float32 or h.dim() != 2 or not down
            or not _applies(td, int(h.shape[1]), mode)):
        return None
    mod = load()
    if mod is None:
        return None
    return mod.moe_down_rows(h, list(down), td, int(n_embd), mode, list(bias))


def moe_combine(v: torch.Tensor, w: torch.Tensor,
                order: Sequence[int] = ()) -> torch.Tensor | None:
    """The second step: ``Σ_j w[j] · v[order[j]]`` added in that order (``order`` empty: v's
    rows in turn), ``[1, n_embd]``, with the same rounding as ``moe``; None when the kernels
    are unavailable."""
    mod = load() if _f32_cpu(v) and v.dim() == 2 else None
    return None if mod is None else mod.moe_combine(v, w, list(order))


def expert_tokens(x: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  gate: torch.Tensor, up: torch.Tensor | None, down: torch.Tensor,
                  types: tuple[GGMLType, GGMLType, GGMLType], n_ff: int, default_limit: int,
                  act_quant: str | None = None, limit: float = 0.0, alpha: float = 0.0,
                  biases: Sequence[Sequence[torch.Tensor]] = ((), (), ())) -> bool:
    """A prompt's expert in one call: ``out[i] = w[i] · expert_ffn(x[tok[i]])`` bit for bit
    (biases, ``limit``/``alpha`` as ``moe``'s; ``up`` None: a fused gate_up; each product native
    up to ``max_tokens`` of its type, else ``qgemm``); False (nothing written) if not applicable."""
    mode = _moe_mode(act_quant)
    D = int(x.shape[-1])
    tg, tu, td = int(types[0]), int(types[1]), int(types[2])
    if (not _f32_cpu(x) or x.dim() != 2 or not _f32_cpu(out) or not _applies(tg, D, mode)
            or not _applies(tu, D, mode) or not _applies(td, n_ff, mode)):
        return False
    mod = load()
    if mod is None or not hasattr(mod, "expert_tokens"):
        return False
    lims = [max_tokens(t, default_limit, act_quant) for t in types]
    bg, bu, bd = (list(b) for b in biases)
    return mod.expert_tokens(x, tok, w, out, gate, [] if up is None else [up], down, tg, tu, td,
                             int(n_ff), mode, float(limit), float(alpha), *lims, bg, bu, bd)


def _f32_cpu(t: torch.Tensor | None) -> bool:
    return t is None or (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous())


def kda_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, S: torch.Tensor) -> torch.Tensor | None:
    """One token of the gated delta rule in one call, ``S [H, Dk, Dv]`` updated in place:
    ``o [H, Dv]`` for ``q, k, g [H, Dk]``, ``v [H, Dv]``, ``beta [H]`` (float32 CPU,
    contiguous); None when not applicable or the kernels are unavailable."""
    if not all(_f32_cpu(t) and t.is_contiguous() for t in (q, k, v, g, beta, S)) or S.dim() != 3:
        return None
    mod = load()
    return None if mod is None else mod.kda_step_(q, k, v, g, beta, S)


def sinkhorn_(c: torch.Tensor, iters: int, eps: float) -> bool:
    """mHC's Sinkhorn in place on logits ``c [..., n, n]`` (float32 CPU, contiguous): False
    (``c`` untouched) when not applicable or the kernels are unavailable."""
    if not (_f32_cpu(c) and c.is_contiguous()) or c.dim() < 2 or c.shape[-1] != c.shape[-2]:
        return False
    mod = load()
    if mod is None:
        return False
    mod.sinkhorn_(c, int(iters), float(eps))
    return True


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scales: torch.Tensor,
           iters: int, eps: float, rms_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mHC's pre mix of one token in one call (``runtime.model.mhc.hc_pre``): ``streams [1, n,
    D]`` → ``(x [1, D], post [1, n], comb [1, n, n])``; None when not applicable (float32 CPU,
    contiguous, one token) or the kernels are unavailable."""
    if (not all(_f32_cpu(t) for t in (streams, fn, base, scales)) or streams.dim() != 3
            or streams.shape[0] != 1):
        return None
    mod = load()
    return None if mod is None else mod.hc_pre(streams, fn, base, scales, int(iters),
                                               float(eps), float(rms_eps))


def hc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor | None:
    """mHC's post mix of one token in one call (``runtime.model.mhc.hc_post``): the new
    streams ``[1, n, D]``; None when not applicable or the kernels are unavailable."""
    if not all(_f32_cpu(t) for t in (y, streams, post, comb)) or streams.dim() != 3:
        return None
    mod = load()
    return None if mod is None else mod.hc_post(y, streams, post, comb)


def kda_token_(qkv: torch.Tensor, f: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor,
               dt_bias: torch.Tensor, a: torch.Tensor, lower_bound: float | None,
               o_norm: torch.Tensor, rms_eps: float, l2_eps: float,
               S: torch.Tensor) -> torch.Tensor | None:
    """One token of a KDA layer after its short conv (``runtime.model.kda.kda_attention``), the
    state ``S [H, Dk, Dk]`` advanced in place → the gated, normed output ``[1, H·Dk]``; None
    when not applicable (float32 CPU, contiguous) or the kernels are unavailable."""
    if not all(_f32_cpu(t) for t in (qkv, f, gate, beta, dt_bias, a, o_norm, S)) or S.dim() != 3:
        return None
    mod = load()
    return None if mod is None else mod.kda_token_(
        qkv, f, gate, beta, dt_bias, a, lower_bound is not None, float(lower_bound or 0.0),
        o_norm, float(rms_eps), float(l2_eps), S)


def conv_step_(x: torch.Tensor, w: torch.Tensor, window: torch.Tensor) -> torch.Tensor | None:
    """One token of KDA's short conv + SiLU (``runtime.model.kda.short_conv``): ``x`` of C
    values, ``w [C, K]``, ``window [C, K - 1]`` shifted in place → ``[1, C]``; None when not
    applicable or the kernels are unavailable."""
    if not all(_f32_cpu(t) for t in (x, w, window)) or w.dim() != 2:
        return None
    mod = load()
    return None if mod is None else mod.conv_step_(x, w, window)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """``x · rsqrt(mean(x²) + eps) · w`` over the last dim in one call (float32 CPU,
    contiguous); None when not applicable or the kernels are unavailable."""
    if not (_f32_cpu(x) and _f32_cpu(w)) or x.dim() == 0:
        return None
    mod = load()
    return None if mod is None else mod.rms_norm(x, w, float(eps))


def norm_rope_(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
               sin: torch.Tensor, n_rot: int, neox: bool, norm: bool) -> bool:
    """In place on ``x [T, H, D]``: RMSNorm each head by ``w`` when ``norm``, then RoPE of the
    first ``n_rot`` dims (``cos``/``sin`` ``[T, 1, n_rot/2]``). False (``x`` untouched) when
    not applicable or the kernels are unavailable."""
    if not (_f32_cpu(x) and _f32_cpu(w)) or x.dim() != 3 or cos.dtype != torch.float32:
        return False
    mod = load()
    if mod is None:
        return False
    mod.norm_rope_(x, w, float(eps), bool(norm), cos, sin, int(n_rot), bool(neox))
    return True


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                vc: torch.Tensor, p0: int, scale: float) -> torch.Tensor | None:
    """One token's attention: stores ``k [1, K, D]``, ``v [1, K, Dv]`` at position ``p0`` of
    the caches ``kc [K, cap, D]``, ``vc [K, cap, Dv]`` and returns ``softmax(q kᵀ·scale) v``
    over positions ``0..p0`` for every head of ``q [1, H, D]`` as ``[1, H·Dv]``, the key and
    value heads shared by ``H / K`` query heads each. None (nothing written) when not
    applicable or the kernels are unavailable."""
    if not (_f32_cpu(q) and _f32_cpu(k) and _f32_cpu(v) and _f32_cpu(kc) and _f32_cpu(vc)):
        return None
    mod = load()
    return None if mod is None else mod.attn_decode(q, k, v, kc, vc, int(p0), float(scale))


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
          sigmoid: bool, norm_w: bool, w_min: float, w_scale: float, n_group: int = 1,
          n_group_used: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token's expert choice (``x [1, D]``, router ``weight [E, D]``): softmax or sigmoid
    probabilities, the top ``k`` of probs (+ ``bias``, for the choice only) best first, with
    ``n_group > 1`` only among the ``n_group_used`` groups whose two best score highest,
    their probs as weights, normalised (sum clamped at ``w_min``) when ``norm_w``, times
    ``w_scale``. ``(ids [1, k] int64, weights [1, k] float32)``; None when not applicable."""
    if not (_f32_cpu(x) and _f32_cpu(weight) and _f32_cpu(bias)) or x.shape[0] != 1:
        return None
    mod = load()
    return None if mod is None else mod.route(x, weight, bias, int(k), bool(sigmoid),
                                              bool(norm_w), float(w_min), float(w_scale),
                                              int(n_group), int(n_group_used))
