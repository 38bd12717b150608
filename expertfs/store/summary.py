"""What is inside a model: the figures ``inspect`` shows and the store keeps in its metadata."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from ..formats.gguf_read import GGUFModel
from .layout import KIND_EXPERT
from .plan import RepackPlan

__all__ = ["model_summary"]


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    try:
        return [x.item() if hasattr(x, "item") else x for x in v]
    except TypeError:
        return v.item() if hasattr(v, "item") else str(v)


def model_summary(model: GGUFModel, plan: RepackPlan) -> dict[str, Any]:
    """A JSON-ready description of ``model`` as ``plan`` lays it out."""
    a = model.arch_value
    block_count = a("block_count")
    nextn = int(a("nextn_predict_layers") or 0)
    expert_types: Counter[str] = Counter()
    trunk_types: Counter[str] = Counter()
    for i, t in enumerate(model.tensors):
        (expert_types if plan.kinds[i] == KIND_EXPERT else trunk_types)[t.ggml_type.name] += t.nbytes
    emb = model.by_name.get("token_embd.weight")
    layers = []
    for lp in plan.layers:
        layers.append({
            "layer": lp.layer, "experts": lp.n_experts, "nextn": lp.nextn,
            "expert_bytes": sum(p.nbytes for p in lp.parts), "extent_bytes": lp.extent_len,
            "parts": [{"role": p.role.name.lower(), "type": model.tensors[p.tensor_index].ggml_type.name,
                       "ne": list(p.ne), "bytes": p.nbytes} for p in lp.parts],
        })
    expert_bytes = plan.expert_payload
    trunk_bytes = plan.trunk_payload
    used = _scalar(a("expert_used_count"))
    per_token = None
    if isinstance(used, int) and layers:
        main = [lay for lay in layers if not lay["nextn"]]
        per_token = sum(lay["expert_bytes"] for lay in main) * used
    return {
        "architecture": model.arch,
        "name": _scalar(model.value("general.name")),
        "block_count": _scalar(block_count),
        "nextn_layers": nextn,
        "moe_layers": len([lay for lay in layers if not lay["nextn"]]),
        "expert_count": _scalar(a("expert_count")),
        "expert_used_count": used,
        "expert_shared_count": _scalar(a("expert_shared_count")),
        "leading_dense_blocks": _scalar(a("leading_dense_block_count")),
        "embedding_length": _scalar(a("embedding_length")),
        "vocab_size": int(emb.ne[1]) if emb is not None and len(emb.ne) > 1 else None,
        "tensors": len(model.tensors),
        "expert_bytes": expert_bytes,
        "trunk_bytes": trunk_bytes,
        "expert_fraction": expert_bytes / max(1, expert_bytes + trunk_bytes),
        "expert_bytes_per_token": per_token,
        "expert_types": dict(expert_types.most_common()),
        "trunk_types": dict(trunk_types.most_common()),
        "layers": layers,
        "sources": [{"file": os.path.basename(s.path), "bytes": s.size} for s in model.shards],
        "source_alignment": model.alignment,
        "alignment": plan.alignment,
        "experts_file_bytes": plan.experts_size,
        "trunk_file_bytes": plan.trunk_size,
    }
