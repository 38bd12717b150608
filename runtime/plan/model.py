"""The model side of a plan: a ``plan.Geometry`` from a store, a GGUF, or a GGUF described in
memory (``formats.gguf_read.GGUFModel``: its metadata and tensor list; the CLI's ``--like``).

All three go through the same path: GGUF metadata (the store keeps its source's whole), the
repack layout (``expertfs.store.plan.plan_repack`` — for a store the layout it was written
with, for a GGUF the one ``repack`` would write) and the tensor list. Reads headers and indexes
only, never tensor bytes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import StoreError, UnsupportedModelError, UsageError
from .geometry import Geometry, Matrix

__all__ = ["TensorDesc", "geometry_from_parts", "geometry_from_store", "geometry_of_store",
           "geometry_from_model", "geometry_from_gguf", "load_geometry"]


@dataclass(frozen=True)
class TensorDesc:
    name: str
    ne: tuple[int, ...]
    ggml_type: str
    nbytes: int
    expert: bool


def _val(kv: Mapping[str, Any], key: str, default: Any = None) -> Any:
    e = kv.get(key)
    if e is None:
        return default
    return getattr(e, "value", e)


def _int(v: Any, default: int = 0) -> int:
    if v is None:
        return default
    if hasattr(v, "__len__") and not isinstance(v, (str, bytes)):
        vals = [int(x) for x in v]
        return max(vals) if vals else default
    return int(v)


def _per_layer(v: Any, n: int, default: int) -> tuple[int, ...]:
    if v is None:
        return (default,) * n
    if hasattr(v, "__len__") and not isinstance(v, (str, bytes)):
        vals = [int(x) for x in v]
        return tuple((vals + [vals[-1] if vals else default] * n)[:n])
    return (int(v),) * n


def _glm5_next_cache(a: Any, n_layers: int, kv_heads: tuple[int, ...],
                     kv_lora: int) -> tuple[int, tuple[int, ...], int]:
    """glm5-next as the runtime holds it: the latent per position on the MLA layers; on each
    full indexer layer key | gate (2·D) plus the k-pool compressed key (D / kpool) per
    position; the KDA layers' fixed state (``KDAState.layer_bytes``)."""
    from ..model.kda import KDAConfig, KDAState
    dim = _int(a("attention.indexer.key_length"))
    kpool = max(1, _int(a("attention.indexer.kpool"), 1))
    types = a("attention.indexer.types")
    full = _per_layer(types, n_layers, 1) if types is not None else (1,) * n_layers
    keys = tuple(2 * dim + dim // kpool if f and h else 0 for f, h in zip(full, kv_heads))
    kcfg = KDAConfig(_int(a("attention.head_count"), 1), _int(a("kda.head_dim")),
                     _int(a("ssm.conv_kernel"), 1))
    return kv_lora, keys, sum(1 for h in kv_heads if not h) * KDAState.layer_bytes(kcfg)


def _layer_of(name: str) -> int | None:
    if name.startswith("blk."):
        head = name.split(".", 2)[1]
        if head.isdigit():
            return int(head)
    return None


def geometry_from_parts(kv: Mapping[str, Any], summary: Mapping[str, Any],
                        tensors: Sequence[TensorDesc], source: str) -> Geometry:
    """A Geometry from GGUF metadata, a ``model_summary``-shaped layout and the tensor list."""
    arch = str(_val(kv, "general.architecture", summary.get("architecture") or ""))

    def a(key: str, default: Any = None) -> Any:
        return _val(kv, f"{arch}.{key}", default)

    block_count = _int(a("block_count"))
    n_nextn = _int(a("nextn_predict_layers"))
    n_layers = block_count - n_nextn
    if n_layers < 1:
        raise UnsupportedModelError(f"{source}: block_count {block_count} with {n_nextn} NextN "
                                    "layers leaves no decoder layer", fix="the metadata is damaged")
    n_embd = _int(a("embedding_length"))
    n_head = _int(a("attention.head_count"), 1)
    kv_heads = _per_layer(a("attention.head_count_kv"), n_layers, n_head)
    head_dim = n_embd // n_head if n_head else 0
    key_len = _int(a("attention.key_length"), head_dim)
    val_len = _int(a("attention.value_length"), head_dim)
    mla = 0
    kv_lora = _int(a("attention.kv_lora_rank"))
    if (arch.startswith("deepseek") or arch == "glm-dsa") and kv_lora:
        mla = kv_lora + _int(a("rope.dimension_count"), 64)
    indexer_keys: tuple[int, ...] = ()
    state_bytes = 0
    if arch == "glm5-next" and kv_lora:   # nope-only MLA layers (head_count_kv 1) + KDA (0)
        mla, indexer_keys, state_bytes = _glm5_next_cache(a, n_layers, kv_heads, kv_lora)
    if arch == "glm-dsa":                 # one key per position on each full indexer layer
        from ..model.archs.glm_dsa import full_indexer_layers
        full = full_indexer_layers(a("attention.indexer.types"), n_layers,
                                   _int(a("context_length")))
        dim = _int(a("attention.indexer.key_length"))
        indexer_keys = tuple(dim if f else 0 for f in full)
    window = _int(a("attention.sliding_window"))
    swa: tuple[bool, ...] = ()
    if arch == "gpt-oss" and window:      # llama.cpp: set_swa_pattern(2), even layers slide
        swa = tuple(i % 2 == 0 for i in range(n_layers))
    k = _int(a("expert_used_count"))
    layers = [lay for lay in summary.get("layers", [])]
    decode = [lay for lay in layers if not lay.get("nextn") and int(lay["layer"]) < n_layers]
    if not decode:
        raise UnsupportedModelError(f"{source}: no routed-expert layers", fix="plan a Mixture-of-"
                                    "Experts model; dense models run with llama.cpp directly")
    n_experts = max(int(lay["experts"]) for lay in decode)

    def parts(lay: Mapping[str, Any]) -> tuple[Matrix, ...]:
        out = []
        for p in lay.get("parts", []):
            ne = tuple(int(x) for x in p["ne"])
            if len(ne) >= 2:
                out.append(Matrix(str(p["type"]), ne[1], ne[0], int(p["bytes"])))
        return tuple(out)

    by_name = {t.name: t for t in tensors}
    embd = by_name.get("token_embd.weight")
    tied = "output.weight" not in by_name
    groups: Counter[tuple[str, int, int, int]] = Counter()
    nextn_groups: Counter[tuple[str, int, int, int]] = Counter()
    nextn_trunk = 0
    for t in tensors:
        if t.expert:
            continue
        layer = _layer_of(t.name)
        is_nextn = layer is not None and layer >= n_layers
        if is_nextn:
            nextn_trunk += t.nbytes
        if len(t.ne) < 2 or t.name == "token_embd.weight":
            continue
        (nextn_groups if is_nextn else groups)[(t.ggml_type, t.ne[1], t.ne[0], t.nbytes)] += 1
    trunk_mats = [Matrix(ty, r, c, b, n) for (ty, r, c, b), n in sorted(groups.items())]
    if tied and embd is not None and len(embd.ne) >= 2:     # the output head reads token_embd
        trunk_mats.append(Matrix(embd.ggml_type, embd.ne[1], embd.ne[0], embd.nbytes, 1, tied=True))
    nextn_mats = tuple(Matrix(ty, r, c, b, n) for (ty, r, c, b), n in sorted(nextn_groups.items()))
    n_vocab = (embd.ne[1] if embd is not None and len(embd.ne) > 1
               else _int(a("vocab_size")) or len(_val(kv, "tokenizer.ggml.tokens", []) or []))
    notes = []
    if n_nextn:
        notes.append(f"{n_nextn} NextN/MTP block(s) stored, loaded only to draft (run --mtp): "
                     "not modelled, their trunk not counted")
    if tied:
        notes.append("output head tied to token_embd")
    nextn_experts = sum(int(lay["expert_bytes"]) * int(lay["experts"]) for lay in layers
                        if lay.get("nextn") or int(lay["layer"]) >= n_layers)
    return Geometry(
        name=str(_val(kv, "general.name", "") or summary.get("name") or arch),
        arch=arch, source=source, n_layers=n_layers, n_nextn=n_nextn, n_embd=n_embd,
        n_head=n_head, n_vocab=int(n_vocab or 0), n_ctx_train=_int(a("context_length")),
        n_experts=n_experts, k=k,
        moe_layers=tuple(int(lay["layer"]) for lay in decode),
        expert_bytes=tuple(int(lay["expert_bytes"]) for lay in decode),
        extent_bytes=tuple(int(lay["extent_bytes"]) for lay in decode),
        expert_parts=tuple(parts(lay) for lay in decode),
        trunk_matrices=tuple(trunk_mats), nextn_matrices=nextn_mats,
        trunk_bytes=int(summary.get("trunk_bytes") or sum(t.nbytes for t in tensors if not t.expert)),
        embd_bytes=embd.nbytes if embd is not None else 0,
        nextn_trunk_bytes=nextn_trunk, nextn_expert_bytes=nextn_experts,
        total_expert_bytes=int(summary.get("expert_bytes") or 0),
        kv_heads=kv_heads, key_length=key_len, value_length=val_len, mla_latent=mla,
        indexer_keys=indexer_keys, state_bytes=state_bytes, swa=swa,
        hc_streams=max(1, _int(a("hyper_connection.count"), 1)),
        sliding_window=window, expert_types=dict(summary.get("expert_types") or {}),
        notes=tuple(notes))


def geometry_from_store(path: str) -> Geometry:
    from ...store.reader import Store

    with Store.open(path) as s:
        return geometry_of_store(s)


def geometry_of_store(s: Any) -> Geometry:
    """The geometry of an open ``Store``."""
    from ...store.layout import KIND_EXPERT
    tensors = [TensorDesc(t.name, tuple(t.ne), t.ggml_type.name, t.nbytes, t.kind == KIND_EXPERT)
               for t in s.tensors()]
    return geometry_from_parts(s.gguf_kv(), s.summary, tensors, f"store {s.path}")


def geometry_from_model(model: Any, source: str) -> Geometry:
    """The geometry of a ``formats.gguf_read.GGUFModel`` (read from a file or described in
    memory), laid out as ``repack`` would store it."""
    from ...store.layout import KIND_EXPERT
    from ...store.plan import plan_repack
    from ...store.summary import model_summary

    rp = plan_repack(model)
    summary = model_summary(model, rp)
    tensors = [TensorDesc(t.name, tuple(t.ne), t.ggml_type.name, t.nbytes, kind == KIND_EXPERT)
               for t, kind in zip(model.tensors, rp.kinds)]
    return geometry_from_parts(model.kv, summary, tensors, source)


def geometry_from_gguf(path: str) -> Geometry:
    from ...formats.gguf_split import read_model

    return geometry_from_model(read_model(path), f"gguf {os.path.abspath(path)}")


def load_geometry(target: str | None, model: Any = None,
                  source: str | None = None) -> tuple[Geometry, str | None]:
    """(geometry, path of the file whose drive holds the experts or None) of a store or GGUF
    at ``target``, or of ``model`` (a ``GGUFModel`` described in memory, called ``source``)."""
    from ...store.reader import is_store

    if model is not None:
        if target:
            raise UsageError("give a store/GGUF or a described model, not both",
                             fix="drop one of them")
        return geometry_from_model(model, source or "a GGUF described in memory"), None
    if not target:
        raise UsageError("nothing to plan", fix="give a store, a .gguf, or --like MODEL")
    if os.path.isdir(target):
        if not is_store(target):
            raise StoreError("not an expertfs store (no index.lmdb inside)", path=target,
                             fix="pass a store made by expertfs repack, or a .gguf")
        g = geometry_from_store(target)
        from ...store.layout import EXPERTS_FILE
        return g, os.path.join(target, EXPERTS_FILE)
    if not os.path.exists(target):
        raise UsageError(f"{target}: no such file or store", fix="check the path, or use --like MODEL")
    return geometry_from_gguf(target), target
