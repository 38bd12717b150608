"""Decode-step matrix-vector products straight from ggml bytes, fused by ``torch.compile``.

For one token, ``dequant.linear`` writes the whole float weight before multiplying (several
memory passes per weight in eager torch); on CPU that dominates the decode step. Here each
supported type's product is written as one expression over the block fields (no per-element
scale materialised: per sub-block ``scale * Σ q·x``), which inductor compiles into a single
loop that reads every weight byte once. The float32 results equal ``F.linear(x,
dequantize(W))`` up to summation order.

Types: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (the others fall back to ``dequant.linear``). Layouts:

- Q4_0 ``d:f16, qs[16]``: elem i<16 = lo nibble of qs[i], i>=16 = hi nibble of qs[i-16];
  w = d·(q-8).
- Q8_0 ``d:f16, qs:i8[32]``: w = d·q.
- Q4_K ``d, dmin:f16, scales[12], qs[128]``: sub-block s = 2j+h (h: lo/hi nibble of
  qs[32j+i]), 6-bit scale/min pairs (``get_scale_min_k4``); w = d·sc_s·q − dmin·m_s.
- Q5_K as Q4_K with ``qh[32]`` before ``qs``: bit s of qh[i] is the fifth bit of sub-block s.
- Q6_K ``ql[128], qh[64], sc:i8[16], d:f16``: per half h (128 elems), e = 32k + l:
  q = nibble (k >= 2) of ql[64h + 32(k%2) + l] | ((qh[32h + l] >> 2k) & 3) << 4, minus 32;
  scale index 8h + 2k + l//16.

One graph is compiled per (type, rows, cols) the first time it is seen (seconds; inductor's
on-disk cache makes later runs fast). ``available()`` says whether compilation works here; any
compile failure disables the fused path for the process with one logged warning.

When the native kernels (``runtime.kernels``: C++, AVX2) are built, ``fused_matvec`` and
``fused_experts`` use them first (a whole layer's experts in one call, and the opt-in
``act_quant="q8"`` numerics), and ``decode_matvec`` takes every native type and a few tokens at
once; the compiled graphs above are the fallback where no C++ toolchain is present.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from ...errors import UsageError
from ...formats.ggml import GGMLType
from ...formats.moe_names import Role
from .. import kernels as native
from .native_experts import NATIVE_MAX_TOKENS, native_layer

__all__ = ["use_fused", "fused_matvec", "decode_matvec", "fused_experts", "available", "SUPPORTED",
           "disable", "precompile", "NATIVE_MAX_TOKENS"]

log = logging.getLogger(__name__)


def _f16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    h = lo.to(torch.int32) | (hi.to(torch.int32) << 8)
    return h.to(torch.int16).view(torch.float16).float()


def _q4_0(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    R = raw.shape[0]
    b = raw.view(R, -1, 18)
    NB = b.shape[1]
    d = _f16(b[..., 0], b[..., 1])                                    # [R, NB]
    qs = b[..., 2:18].to(torch.int32)                                 # [R, NB, 16]
    xr = x.view(NB, 2, 16)
    dot = ((qs & 15).float() * xr[:, 0]).sum(-1) + ((qs >> 4).float() * xr[:, 1]).sum(-1)
    return (d * (dot - 8.0 * xr.sum((1, 2)))).sum(1)


def _q8_0(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    R = raw.shape[0]
    b = raw.view(R, -1, 34)
    NB = b.shape[1]
    d = _f16(b[..., 0], b[..., 1])
    q = b[..., 2:34].view(torch.int8).float()                         # [R, NB, 32]
    return (d * (q * x.view(NB, 32)).sum(-1)).sum(1)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 scale bytes (int32) → 6-bit scales and mins ``[..., 4, 2]`` (sub-block 2j + h)."""
    s0, s1, s2 = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((s0 & 63, (s2 & 15) | ((s0 >> 2) & 48)), -1).float()
    mn = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 2) & 48)), -1).float()
    shape = s.shape[:-1] + (4, 2)
    return sc.view(shape), mn.view(shape)


def _q4_k(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    R = raw.shape[0]
    b = raw.view(R, -1, 144)
    NB = b.shape[1]
    d, dm = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    sc, mn = _k4_scales(b[..., 4:16].to(torch.int32))                 # [R, NB, 4, 2]
    qs = b[..., 16:144].view(R, NB, 4, 32).to(torch.int32)
    xr = x.view(NB, 4, 2, 32)
    dlo = ((qs & 15).float() * xr[:, :, 0]).sum(-1)                   # [R, NB, 4]
    dhi = ((qs >> 4).float() * xr[:, :, 1]).sum(-1)
    xs = xr.sum(-1)                                                   # [NB, 4, 2]
    y = (d[..., None] * (sc[..., 0] * dlo + sc[..., 1] * dhi)
         - dm[..., None] * (mn[..., 0] * xs[..., 0] + mn[..., 1] * xs[..., 1]))
    return y.sum((1, 2))


def _q5_k(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    R = raw.shape[0]
    b = raw.view(R, -1, 176)
    NB = b.shape[1]
    d, dm = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    sc, mn = _k4_scales(b[..., 4:16].to(torch.int32))
    qh = b[..., 16:48].to(torch.int32).view(R, NB, 1, 32)
    qs = b[..., 48:176].view(R, NB, 4, 32).to(torch.int32)
    xr = x.view(NB, 4, 2, 32)
    dots = []
    for h in range(2):
        sh = torch.arange(4, device=raw.device).view(1, 1, 4, 1) * 2 + h  # sub-block 2j + h
        q = ((qs >> (4 * h)) & 15) | (((qh >> sh) & 1) << 4)
        dots.append((q.float() * xr[:, :, h]).sum(-1))                 # [R, NB, 4]
    xs = xr.sum(-1)
    y = (d[..., None] * (sc[..., 0] * dots[0] + sc[..., 1] * dots[1])
         - dm[..., None] * (mn[..., 0] * xs[..., 0] + mn[..., 1] * xs[..., 1]))
    return y.sum((1, 2))


def _q6_k(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    R = raw.shape[0]
    b = raw.view(R, -1, 210)
    NB = b.shape[1]
    ql = b[..., 0:128].view(R, NB, 2, 2, 32).to(torch.int32)         # [h, k%2, l]
    qh = b[..., 128:192].view(R, NB, 2, 32).to(torch.int32)          # [h, l]
    sc = b[..., 192:208].view(torch.int8).float().view(R, NB, 2, 4, 2)  # [h, k, l//16]
    d = _f16(b[..., 208], b[..., 209])
    xr = x.view(NB, 2, 4, 2, 16)
    y = 0
    for k in range(4):
        q = (((ql[:, :, :, k % 2] >> (4 * (k // 2))) & 15)
             | (((qh >> (2 * k)) & 3) << 4)) - 32                      # [R, NB, 2, 32]
        dot = (q.float().view(R, NB, 2, 2, 16) * xr[:, :, k]).sum(-1)  # [R, NB, 2, 2]
        y = y + (sc[:, :, :, k] * dot).sum((2, 3))
    return (d * y).sum(1)


_KERNELS: dict[GGMLType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q8_0: _q8_0, GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}
SUPPORTED = frozenset(_KERNELS)

_lock = threading.Lock()
_compiled: dict[tuple[GGMLType, int, int], Callable] = {}
_state = {"ok": None}          # None: untested, True: works, False: disabled


def disable(reason: str) -> None:
    if _state["ok"] is not False:
        log.warning("fused quantized matvec disabled (%s); using dequant.linear", reason)
    _state["ok"] = False


def available() -> bool:
    """True unless compilation failed in this process (it is attempted lazily)."""
    return _state["ok"] is not False


def reference(raw: torch.Tensor, t: GGMLType, shape: tuple[int, int],
              x: torch.Tensor) -> torch.Tensor:
    """The uncompiled expression (for tests): ``x [1, cols]`` → ``[1, rows]``."""
    return _KERNELS[t](raw.reshape(shape[0], -1), x.reshape(-1).float()).reshape(1, -1)


def decode_matvec(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, shape: tuple[int, int],
                  act_quant: str | None = None) -> torch.Tensor | None:
    """``x [T, cols]`` float32 on CPU → ``[T, rows]`` through the native kernels (any of their
    types, up to ``kernels.max_tokens`` of the type, ``NATIVE_MAX_TOKENS`` where its table has
    none; ``act_quant`` honoured), else ``fused_matvec``;
    None when neither applies. One token skips the limit's lookup: no table's limit is below
    one token (a test keeps it so)."""
    if x.dim() == 2 and (x.shape[0] == 1
                         or x.shape[0] <= native.max_tokens(t, NATIVE_MAX_TOKENS, act_quant)):
        y = native.matvec(x, raw, t, shape, act_quant)
        if y is not None:
            return y
    return fused_matvec(x, raw, t, shape)


def fused_matvec(x: torch.Tensor, raw: torch.Tensor, t: GGMLType,
                 shape: tuple[int, int]) -> torch.Tensor | None:
    """``x [1, cols]`` float32 on CPU → ``[1, rows]`` for the types in ``SUPPORTED`` (native
    kernels when built, else the compiled graph), or None when not applicable."""
    if t in _KERNELS and x.dim() == 2 and x.shape[0] == 1:
        y = native.matvec(x, raw, t, shape)
        if y is not None:
            return y
    if (_state["ok"] is False or t not in _KERNELS or x.device.type != "cpu"
            or x.dtype != torch.float32 or x.shape[0] != 1):
        return None
    key = (t, shape[0], shape[1])
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch._dynamo as dynamo
                dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
                fn = torch.compile(_KERNELS[t], dynamic=False, fullgraph=True)
                _compiled[key] = fn
    try:
        y = fn(raw.reshape(shape[0], -1), x.reshape(-1))
    except Exception as e:  # noqa: BLE001 - any compiler/toolchain failure: fall back for good
        disable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None
    _state["ok"] = True
    return y.reshape(1, -1)


def _layer_fn(tg: GGMLType, tu: GGMLType, td: GGMLType, n: int) -> Callable:
    """Σ_j w_j · down_j(silu(gate_j x) · up_j x) over n experts, as one graph."""
    G, U, D = _KERNELS[tg], _KERNELS[tu], _KERNELS[td]

    def layer(x: torch.Tensor, w: torch.Tensor, *raws: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(raws[2 * n].shape[0], dtype=torch.float32, device=x.device)
        for j in range(n):
            h = torch.nn.functional.silu(G(raws[j], x)) * U(raws[n + j], x)
            out = out + w[j] * D(raws[2 * n + j], h)
        return out
    return layer


def fused_experts(x: torch.Tensor, w: torch.Tensor, experts: list,
                  act_quant: str | None = None, limit: float = 0.0,
                  alpha: float = 0.0) -> torch.Tensor | None:
    """One decode step through ``experts`` (``ExpertWeights`` with GATE, UP and DOWN parts, or
    GATE_UP and DOWN for the native kernels): ``Σ_j w[j] · expert_j(x)`` as ``[1, n_embd]``
    float32, or None when not applicable. ``act_quant="q8"``: llama.cpp's activation
    quantization (native kernels only). ``limit`` > 0: the swiglu clamp, ``alpha`` > 0
    gpt-oss's ``swiglu_oai``, bias parts (native kernels only)."""
    if experts and x.dim() == 2 and x.shape[0] == 1:
        y = native_layer(x, w, experts, act_quant, limit, alpha)
        if y is not None:
            return y
    if (limit or alpha or _state["ok"] is False or x.device.type != "cpu"
            or x.dtype != torch.float32 or x.shape[0] != 1 or not experts):
        return None
    parts = []
    for role in (Role.GATE, Role.UP, Role.DOWN):
        ws = [e.parts.get(role) for e in experts]
        if any(getattr(q, "ggml_type", None) not in _KERNELS for q in ws):
            return None
        parts.append(ws)
    g, u, d = (p[0] for p in parts)
    if any(q.ggml_type != p[0].ggml_type or q.shape != p[0].shape for p in parts for q in p):
        return None
    n = len(experts)
    key = ("layer", g.ggml_type, u.ggml_type, d.ggml_type, g.shape, u.shape, d.shape, n)
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                import torch._dynamo as dynamo
                dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
                fn = torch.compile(_layer_fn(g.ggml_type, u.ggml_type, d.ggml_type, n),
                                   dynamic=False, fullgraph=True)
                _compiled[key] = fn
    raws = [q.raw.reshape(q.shape[0], -1) for p in parts for q in p]
    try:
        y = fn(x.reshape(-1), w.reshape(-1).float(), *raws)
    except Exception as e:  # noqa: BLE001 - any compiler/toolchain failure: fall back for good
        disable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None
    _state["ok"] = True
    return y.reshape(1, -1)


def precompile(matrices: set[tuple[GGMLType, tuple[int, int]]],
               layers: set[tuple[tuple[GGMLType, ...], tuple[tuple[int, int], ...], int]]) -> None:
    """Compile ahead of time (at model load, not inside the first token): one-token products
    of ``matrices`` ``(type, (rows, cols))`` and expert layers ``((tg, tu, td), shapes, n)``.

    The dummy inputs are ordinary tensors and the calls run under inference mode, as in the
    forward pass, so the compiled graphs' guards match the real calls (no recompiles). With the
    native kernels there is nothing to compile per shape: they are built (or loaded) here."""
    if native.available():
        return
    from ...formats.ggml import row_bytes
    from ...formats.moe_names import Role
    from ..experts.protocol import ExpertWeights, QWeight

    def zeros(t: GGMLType, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros(shape[0] * row_bytes(t, shape[1]), dtype=torch.uint8)

    calls = []                  # weights: ordinary tensors; activations: made in inference mode
    for t, shape in sorted(matrices, key=str):
        if t in _KERNELS:
            raw = zeros(t, shape)
            calls.append(lambda raw=raw, t=t, shape=shape: fused_matvec(
                torch.zeros(1, shape[1]), raw, t, shape))
    for types, shapes, n in sorted(layers, key=str):
        if any(t not in _KERNELS for t in types):
            continue
        parts = {r: QWeight(zeros(t, sh), t, sh)
                 for r, t, sh in zip((Role.GATE, Role.UP, Role.DOWN), types, shapes)}
        experts = [ExpertWeights(0, j, parts) for j in range(n)]
        calls.append(lambda experts=experts, n=n, d=shapes[0][1]: fused_experts(
            torch.zeros(1, d), torch.zeros(n), experts))
    with torch.inference_mode():
        for call in calls:
            if call() is None:
                return


def use_fused(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine takes one-token products through the compiled kernels: ``mode``
    "on", "off", or "auto" (on the CPU in float32 where a C++ compiler builds them)."""
    if mode not in ("auto", "on", "off"):
        raise UsageError(f"unknown fused mode {mode!r}", fix="use auto, on or off")
    if mode == "off" or device.type != "cpu" or dtype != torch.float32:
        return False
    if mode == "on":
        return True
    import shutil
    return shutil.which("c++") is not None or shutil.which("g++") is not None
