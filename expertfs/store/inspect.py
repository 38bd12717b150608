"""``inspect``: what is inside a store or a GGUF, as one JSON-ready dict."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Iterator

from ..errors import UnsupportedModelError
from ..formats.gguf_split import read_model
from .plan import plan_repack
from .reader import Store, is_store
from .summary import model_summary

__all__ = ["inspect_path", "iter_extents"]


def inspect_path(path: str | list[str], compute_paths: Mapping[str, str] | None = None
                 ) -> dict[str, Any]:
    """Summary of a store folder or a GGUF (its first shard, or every shard). ``compute_paths``
    (ggml type → the compute path the runtime takes, given by the caller: the store does not
    know the runtime) adds ``compute_paths: {"experts": {type: path}, "trunk": {...}}``."""
    info = _inspect(path)
    if compute_paths is not None:
        info["compute_paths"] = {
            "experts": {t: compute_paths.get(t, "torch dequant")
                        for t in sorted(info.get("expert_types") or {})},
            "trunk": {t: ("float (torch)" if t in ("F16", "BF16")
                          else compute_paths.get(t, "torch dequant"))
                      for t in sorted(info.get("trunk_types") or {})}}
    return info


def _inspect(path: str | list[str]) -> dict[str, Any]:
    paths = [path] if isinstance(path, str) else list(path)
    if len(paths) == 1 and os.path.isdir(paths[0]) and is_store(paths[0]):
        with Store.open(paths[0]) as s:
            info = dict(s.summary)
            info.update(kind="store", path=s.path, extents=s.index.counts()["experts"],
                        usage_entries=s.index.counts()["usage"])
            return info
    model = read_model(paths)
    try:
        info = model_summary(model, plan_repack(model))
    except UnsupportedModelError as e:
        info = {"architecture": model.arch, "tensors": len(model.tensors), "layers": [],
                "expert_bytes": 0, "trunk_bytes": sum(t.nbytes for t in model.tensors),
                "note": e.problem}
    info.update(kind="gguf", path=os.path.abspath(paths[0]), gguf_version=model.shards[0].version,
                canonical_layout=all(s.canonical for s in model.shards))
    return info


def iter_extents(path: str | list[str]) -> Iterator[dict[str, int]]:
    """Every extent (layer, expert, offset, length) of a store, or as repack would lay out a GGUF."""
    paths = [path] if isinstance(path, str) else list(path)
    if len(paths) == 1 and os.path.isdir(paths[0]) and is_store(paths[0]):
        with Store.open(paths[0]) as s:
            for e in s.extents():
                yield {"layer": e.layer, "expert": e.expert, "offset": e.offset, "length": e.length}
        return
    plan = plan_repack(read_model(paths))
    for lp in plan.layers:
        for e in range(lp.n_experts):
            yield {"layer": lp.layer, "expert": e, "offset": lp.extent_offset(e), "length": lp.extent_len}
