"""A layer's routed experts through the native kernels' MoE calls, from the experts' ggml bytes:
the one-call decode step (``native_layer``), its two phases and their combine (a layer whose
resident experts compute while the others load: ``native_hidden``, ``native_down_rows``,
``native_combine``), and a prompt's expert in one call (``native_expert_tokens``). Each returns
None (or False) where an expert is not plain ggml bytes the kernels take, and the caller keeps
its own path."""

from __future__ import annotations

from typing import Any

import torch

from ...formats.ggml import GGMLType
from ...formats.moe_names import Role
from .. import kernels as native
from ..experts.protocol import QWeight as _QWeight

__all__ = ["NATIVE_MAX_TOKENS", "native_layer", "native_hidden", "native_down_rows",
           "native_combine", "native_expert_tokens"]

_R_GATE, _R_UP, _R_GATE_UP, _R_DOWN = Role.GATE, Role.UP, Role.GATE_UP, Role.DOWN
_BIAS_SLOT = {Role.GATE_BIAS: 0, Role.UP_BIAS: 1, Role.DOWN_BIAS: 2}
_F32 = GGMLType.F32

#: Most tokens a native product takes (more: ``wide.wide_linear``) for a type the ISA's table
#: (``kernels.max_tokens``) does not list: up to 32 tokens the native products measured faster
#: than dequant.linear (one matrix about even), beyond it not consistently (bench/README.md).
NATIVE_MAX_TOKENS = 32


def _native_parts(experts: list, D: int) -> tuple | None:
    """``experts``' ggml bytes for the native kernels: (gate list, up list or None when fused
    gate_up, down list, (tg, tu, td), n_ff, (gate, up, down bias lists)), or None when an
    expert is not plain ggml bytes (one served dequantized by the dequant cache) or has other
    parts. Bias parts (gpt-oss) must be F32, as llama.cpp writes them; a bias list is empty
    when the experts have none. Parts are matched by identity while iterating (Enum hashing
    costs microseconds here); the experts of a layer come from one GGUF tensor per role, so the
    first expert's types and shapes are the layer's (the kernels check every expert's byte
    count and bias length)."""
    G: list = []
    U: list = []
    Dn: list = []
    B: tuple[list, list, list] = ([], [], [])
    for e in experts:
        for r, q in e.parts.items():
            if type(q) is not _QWeight:
                return None
            if r is _R_GATE or r is _R_GATE_UP:
                G.append(q.raw)
            elif r is _R_UP:
                U.append(q.raw)
            elif r is _R_DOWN:
                Dn.append(q.raw)
            elif r in _BIAS_SLOT and q.ggml_type is _F32:
                B[_BIAS_SLOT[r]].append(q.raw.view(torch.float32))
            else:
                return None
    p0 = experts[0].parts
    n = len(experts)
    fused = not U
    g = p0.get(_R_GATE_UP) if fused else p0.get(_R_GATE)
    u = g if fused else p0.get(_R_UP)
    d = p0.get(_R_DOWN)
    if (g is None or len(G) != n or len(Dn) != n or len(U) not in (0, n)
            or any(len(b) not in (0, n) for b in B) or (fused and (B[0] or B[1]))):
        return None
    n_ff = g.shape[0] // 2 if fused else g.shape[0]
    if d.shape != (D, n_ff) or g.shape[1] != D or u.shape[1] != D:
        return None
    return G, (None if fused else U), Dn, (g.ggml_type, u.ggml_type, d.ggml_type), n_ff, B


def native_layer(x: torch.Tensor, w: torch.Tensor, experts: list, act_quant: str | None,
                 limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor | None:
    """One native call for the layer, or None when not applicable."""
    p = _native_parts(experts, x.shape[1])
    if p is None:
        return None
    G, U, Dn, types, n_ff, B = p
    return native.moe(x, w, G, U, Dn, types, n_ff, act_quant, limit, alpha, B)


def native_hidden(x: torch.Tensor, experts: list, act_quant: str | None = None,
                  limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor | None:
    """The first phase of the native layer call for some of its experts: ``[n, n_ff]`` rows
    ``silu(gate_j x) · up_j x`` (each row the same whatever else shares the call; ``limit``:
    the swiglu clamp; ``alpha``: gpt-oss's ``swiglu_oai``; gate/up biases added), or None."""
    p = None if not experts or x.dim() != 2 or x.shape[0] != 1 else _native_parts(experts,
                                                                                 x.shape[1])
    if p is None:
        return None
    G, U, _, types, n_ff, B = p
    return native.moe_hidden(x, G, U, types[:2], n_ff, act_quant, limit, alpha, B[:2])


def native_down_rows(h: torch.Tensor, experts: list, n_embd: int,
                     act_quant: str | None = None) -> torch.Tensor | None:
    """The second phase's first step for some experts: ``[n, n_embd]`` unscaled rows
    ``down_j h[j]`` (+ the down bias; ``h``: ``native_hidden``'s rows for the same experts), or
    None."""
    p = _native_parts(experts, n_embd) if experts else None
    if p is None:
        return None
    _, _, Dn, types, _, B = p
    return native.moe_down_rows(h, Dn, types[2], n_embd, act_quant, B[2])


def native_expert_tokens(x: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                         expert: Any, act_quant: str | None = None, limit: float = 0.0,
                         alpha: float = 0.0) -> bool:
    """A prompt's pairs routed to ``expert`` in one native call: ``out[i] = w[i] ·
    expert_ffn(x[tok[i]])`` bit for bit (``expert_ffn`` with the native kernels, ``fused``),
    or False (nothing written) when the expert is not plain ggml bytes the kernels take."""
    p = _native_parts([expert], x.shape[1])
    if p is None:
        return False
    G, U, Dn, types, n_ff, B = p
    return native.expert_tokens(x, tok, w, out, G[0], U[0] if U else None, Dn[0], types, n_ff,
                                NATIVE_MAX_TOKENS, act_quant, limit, alpha,
                                tuple(b[:1] for b in B))


def native_combine(v: torch.Tensor, w: torch.Tensor, order: list[int]) -> torch.Tensor | None:
    """``Σ_j w[j] · v[order[j]]`` in routing order j, ``[1, n_embd]``: with ``order[j]`` the
    row of ``native_down_rows``' output holding the j-th routed expert, the one-call product
    bit for bit."""
    return native.moe_combine(v, w, order)
