"""Repack planning (pure): where every byte of a GGUF goes in the store.

``plan_repack(model, alignment)`` decides the layout and nothing else; it reads no tensor
bytes and writes nothing, so it is tested exhaustively without I/O. The writer executes it.

Layout rules (FORMAT.md):
- experts.bin holds one extent per (layer, expert), layer-major then expert order. An extent is
  the expert's parts in role order (gate, up, down or gate_up, down, then any biases), each
  starting on a 4 KiB boundary (``PART_ALIGN``); the extent is padded to ``alignment``.
- trunk.bin holds every other tensor in source order, each starting on ``alignment``.
- Every gap is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FormatError, UnsupportedModelError, UsageError
from ..formats.gguf_read import GGUFModel, TensorInfo
from ..formats.moe_names import Role, is_expert_tensor, parse_expert_name
from .layout import KIND_EXPERT, KIND_TRUNK, PART_ALIGN

__all__ = ["PartPlan", "LayerPlan", "TrunkPlan", "RepackPlan", "plan_repack", "align_up",
           "MAX_ALIGN", "expert_counts"]

MAX_ALIGN = 2 << 20


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class PartPlan:
    role: Role
    tensor_index: int            # into model.tensors
    ne: tuple[int, ...]          # one expert's slice (the source ne without its last dim)
    nbytes: int                  # one expert's bytes of this tensor
    rel_offset: int              # from the extent start


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    n_experts: int
    parts: tuple[PartPlan, ...]
    extent_len: int              # padded
    base: int                    # offset of expert 0's extent in experts.bin
    nextn: bool                  # the NextN/MTP block

    def extent_offset(self, expert: int) -> int:
        return self.base + expert * self.extent_len


@dataclass(frozen=True)
class TrunkPlan:
    tensor_index: int
    offset: int                  # in trunk.bin
    nbytes: int


@dataclass
class RepackPlan:
    model: GGUFModel
    alignment: int
    layers: list[LayerPlan]
    trunk: list[TrunkPlan]
    experts_size: int
    trunk_size: int
    kinds: list[int] = field(default_factory=list)     # KIND_* per model tensor

    @property
    def expert_payload(self) -> int:
        return sum(lp.n_experts * sum(p.nbytes for p in lp.parts) for lp in self.layers)

    @property
    def trunk_payload(self) -> int:
        return sum(t.nbytes for t in self.trunk)

    @property
    def n_extents(self) -> int:
        return sum(lp.n_experts for lp in self.layers)


def expert_counts(model: GGUFModel) -> dict[int, int] | int | None:
    """``{arch}.expert_count``: an int, a per-layer array (as a dict), or None when absent."""
    v = model.arch_value("expert_count")
    if v is None:
        return None
    if hasattr(v, "__len__"):
        return {i: int(x) for i, x in enumerate(v)}
    return int(v)


def _n_expert_for(counts: dict[int, int] | int | None, layer: int) -> int | None:
    if isinstance(counts, dict):
        return counts.get(layer)
    return counts


def plan_repack(model: GGUFModel, alignment: int = 4096) -> RepackPlan:
    """Lay out ``model`` as a store with extents padded to ``alignment`` bytes."""
    if alignment < PART_ALIGN or alignment > MAX_ALIGN or alignment & (alignment - 1):
        raise UsageError(f"alignment {alignment} is not a power of two between {PART_ALIGN} and "
                         f"{MAX_ALIGN}", fix="use --align 4K (default), 64K, 1M or 2M")
    counts = expert_counts(model)
    path0 = model.paths[0]
    by_layer: dict[int, list[tuple[int, TensorInfo]]] = {}
    kinds = []
    for i, t in enumerate(model.tensors):
        name = parse_expert_name(t.name)
        if name is not None and len(t.ne) >= 2:
            n = _n_expert_for(counts, name.layer)
            if n is not None and t.ne[-1] != n:
                raise FormatError(f"expert tensor {t.name!r} has {t.ne[-1]} experts but "
                                  f"{model.arch}.expert_count says {n}", path=path0,
                                  fix="the metadata and tensors disagree; re-convert the model")
        if is_expert_tensor(t.name, t.ne, _n_expert_for(counts, name.layer) if name else None):
            by_layer.setdefault(name.layer, []).append((i, t))
            kinds.append(KIND_EXPERT)
        else:
            kinds.append(KIND_TRUNK)
    if not by_layer:
        raise UnsupportedModelError(
            f"no routed-expert tensors (*_exps) in this {model.arch or 'unknown'} model: it is "
            "dense, and expertfs streams the experts of Mixture-of-Experts models", path=path0,
            fix="run dense models with llama.cpp directly")
    nextn_first = None
    nextn = model.arch_value("nextn_predict_layers")
    if nextn and model.arch_value("block_count") is not None:
        nextn_first = int(model.arch_value("block_count")) - int(nextn)
    layers = []
    offset = 0
    for layer in sorted(by_layer):
        layers.append(_plan_layer(layer, by_layer[layer], alignment, offset, path0,
                                  nextn_first is not None and layer >= nextn_first))
        offset += layers[-1].extent_len * layers[-1].n_experts
    trunk, toff = [], 0
    for i, t in enumerate(model.tensors):
        if kinds[i] == KIND_TRUNK:
            trunk.append(TrunkPlan(i, toff, t.nbytes))
            toff += align_up(max(t.nbytes, 1), alignment)
    return RepackPlan(model, alignment, layers, trunk, offset, toff, kinds)


def _plan_layer(layer: int, tensors: list[tuple[int, TensorInfo]], alignment: int, base: int,
                path: str, nextn: bool) -> LayerPlan:
    n_experts = tensors[0][1].ne[-1]
    roles: dict[Role, tuple[int, TensorInfo]] = {}
    others = []
    for i, t in tensors:
        name = parse_expert_name(t.name)
        if t.ne[-1] != n_experts:
            raise FormatError(f"layer {layer}: {t.name!r} has {t.ne[-1]} experts, "
                              f"{tensors[0][1].name!r} has {n_experts}", path=path,
                              fix="every expert tensor of a layer must have the same expert count")
        if name.role == Role.OTHER:
            others.append((i, t))
        else:
            roles[name.role] = (i, t)
    has_split = Role.GATE in roles or Role.UP in roles
    if Role.DOWN not in roles or not ((Role.GATE in roles and Role.UP in roles) or Role.GATE_UP in roles) \
            or (has_split and Role.GATE_UP in roles):
        found = ", ".join(sorted(t.name for _, t in tensors))
        raise FormatError(f"layer {layer}: incomplete expert set ({found}); an MoE layer needs "
                          "ffn_down_exps with ffn_gate_exps + ffn_up_exps or ffn_gate_up_exps",
                          path=path, fix="the file is damaged or of an architecture expertfs "
                          "does not know; re-convert it")
    ordered = [roles[r] for r in sorted(roles)] + sorted(others, key=lambda x: x[1].name)
    parts, rel = [], 0
    for i, t in ordered:
        per = t.nbytes // n_experts
        if per * n_experts != t.nbytes:
            raise FormatError(f"{t.name!r}: {t.nbytes} bytes do not split into {n_experts} equal "
                              "experts", path=path, fix="re-convert the model")
        parts.append(PartPlan(parse_expert_name(t.name).role, i, tuple(t.ne[:-1]), per, rel))
        rel = align_up(rel + per, PART_ALIGN)
    return LayerPlan(layer, n_experts, tuple(parts), align_up(rel, alignment), base, nextn)
