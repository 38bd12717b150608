"""A group of routed experts dequantized together: its matrices of one type and shape in one call.

Without native products (the CUDA path), an expert's matrix is dequantized by the type's torch
kernel, some 20-30 small device kernels, then multiplied: k experts × 3 matrices a layer is
several hundred kernel launches, most of a decode token's host time at full depth (issue 17
item 7). The experts of one layer share each role's ggml type and shape (one GGUF tensor per
role and layer), so the matrices of a group are dequantized in one call over their bytes
concatenated (one copy kernel, then the type's kernels once, on ``n × out`` rows instead of
``out``; gate and up together where they share a type and shape): about 25 launches for the
whole group's gate and up, and 25 for its down, instead of 75 for each expert.

Each expert of the group comes back as a ``FloatExpert`` whose matrices are its slices of the
group's tensors, so the products are the ones ``expert_ffn`` already takes for a float expert
(one ``gemm.linear`` per matrix). Dequantization is elementwise per block, so an expert's float
weights are the same bits whatever group it came in, and ``expert_ffn`` on them gives the same
bits as on the same expert dequantized alone: a step's logits do not depend on how its reads
landed. The group's float tensors live as long as any of its experts is referenced; ``own``
copies each expert out of them (for the dequantized-expert cache, which frees one expert at a
time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...formats.dequant import dequantize
from ...formats.moe_names import Role
from ..experts.protocol import ExpertWeights
from .dqcache import DequantCache
from .ffn import EXPERT_PARTS, FloatExpert, swiglu, to_float_expert

__all__ = ["groupable", "dequant_group", "as_computed", "group_rows"]


def groupable(ws: Sequence[object]) -> bool:
    """Are ``ws`` quantized experts with the same parts, each part of one type and shape on one
    device (what one layer's experts always are)?"""
    if not ws or not all(isinstance(w, ExpertWeights) for w in ws):
        return False
    first = ws[0].parts
    for w in ws[1:]:
        if w.parts.keys() != first.keys():
            return False
        for role, q in w.parts.items():
            f = first[role]
            if (q.ggml_type, q.shape, q.raw.device) != (f.ggml_type, f.shape, f.raw.device):
                return False
    return True


def dequant_group(ws: Sequence[ExpertWeights], dtype: torch.dtype,
                  own: bool = False) -> list[FloatExpert]:
    """The experts ``ws`` (``groupable``) as float experts in ``dtype``, the roles of one type
    and shape (gate and up, usually) dequantized for the whole group in one call. ``own``: each
    expert's matrices are copied out of the group's tensors, so that keeping one expert does
    not keep the group."""
    n = len(ws)
    parts: list[dict[Role, torch.Tensor]] = [{} for _ in range(n)]
    kinds: dict[tuple, list[Role]] = {}
    for role in EXPERT_PARTS:
        q = ws[0].parts.get(role)
        if q is not None:
            kinds.setdefault((q.ggml_type, q.shape), []).append(role)
    for roles in kinds.values():
        for role, t in zip(roles, _stacked(ws, roles, dtype)):
            for j in range(n):
                parts[j][role] = t[j].clone() if own else t[j]
    return [FloatExpert(p, sum(v.numel() * v.element_size() for v in p.values()))
            for p in parts]


def _stacked(ws: Sequence[ExpertWeights], roles: Sequence[Role],
             dtype: torch.dtype) -> torch.Tensor:
    """``roles`` (present, of one type and shape) of every expert of ``ws`` dequantized in one
    call: ``[len(roles), n, *shape]``."""
    q, n, m = ws[0].parts[roles[0]], len(ws), len(roles)
    raw = torch.cat([w.parts[r].raw.reshape(-1) for r in roles for w in ws]) if n * m > 1 \
        else q.raw
    return dequantize(raw, q.ggml_type, (m * n * q.shape[0], *q.shape[1:]), dtype=dtype).view(
        m, n, *q.shape)


def _role(ws: Sequence[ExpertWeights], role: Role, dtype: torch.dtype) -> torch.Tensor | None:
    """``role``'s part of every expert of ``ws`` dequantized in one call, ``[n, *shape]``."""
    return _stacked(ws, (role,), dtype)[0] if role in ws[0].parts else None


def group_rows(x: torch.Tensor, ws: Sequence[ExpertWeights], limit: float = 0.0,
               alpha: float = 0.0) -> torch.Tensor:
    """One token ``x [1, D]`` through each expert of ``ws`` (``groupable``): ``[n, D]`` float32
    rows, unweighted. Gate and up are dequantized in one call into ``x``'s dtype where they
    share a type and shape (else one call each) and multiplied for the whole group in one
    matrix-vector product; down one call and one batched product; each role's float weights
    freed before the next is made. The rows equal ``expert_ffn``'s to the products' rounding
    (the sums may be ordered otherwise than one expert's own product: not the same bits)."""
    v = x.reshape(-1)
    dt = x.dtype

    def bias(y: torch.Tensor, role: Role) -> torch.Tensor:
        b = _role(ws, role, dt)
        return y if b is None else y + b

    p = ws[0].parts
    if Role.GATE_UP in p:
        g, u = torch.matmul(_role(ws, Role.GATE_UP, dt), v).chunk(2, dim=-1)
    elif (p[Role.GATE].ggml_type, p[Role.GATE].shape) == (p[Role.UP].ggml_type, p[Role.UP].shape):
        g, u = torch.matmul(_stacked(ws, (Role.GATE, Role.UP), dt), v).unbind(0)
        g, u = bias(g, Role.GATE_BIAS), bias(u, Role.UP_BIAS)
    else:
        g = bias(torch.matmul(_role(ws, Role.GATE, dt), v), Role.GATE_BIAS)
        u = bias(torch.matmul(_role(ws, Role.UP, dt), v), Role.UP_BIAS)
    h = swiglu(g, u, limit, alpha)
    y = torch.bmm(_role(ws, Role.DOWN, dt), h.unsqueeze(-1)).squeeze(-1)
    return bias(y, Role.DOWN_BIAS).float()


def as_computed(layer: int, got: dict[int, Any], dtype: torch.dtype, dq: DequantCache,
                grouped: bool, group_max: int) -> dict[int, Any]:
    """``got`` (expert → a provider's weights) as a layer computes them: each put into the
    dequant cache ``dq`` as a float expert when that is on, else as it is; ``grouped``: the
    quantized ones dequantized ``group_max`` at a time (``dequant_group``; into ``dq``
    copied out of the group's tensors, since the cache frees one expert at a time)."""
    if not (grouped and groupable(list(got.values()))):
        if not dq.enabled:
            return dict(got)
        out = {e: to_float_expert(w, dtype) for e, w in got.items()}
        for e, f in out.items():
            dq.put(layer, e, f)
        return out
    out = {}
    es = list(got)
    for a in range(0, len(es), group_max):
        part = es[a:a + group_max]
        for e, f in zip(part, dequant_group([got[e] for e in part], dtype, own=dq.enabled)):
            if dq.enabled:
                dq.put(layer, e, f)
            out[e] = f
    return out
