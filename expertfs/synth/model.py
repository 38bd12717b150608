"""A synthetic model's layout: every tensor's plan, ggml type and size, and the metadata.

``build_model(cfg)`` is pure and cheap (no tensor bytes), so sizes can be estimated and layer
counts searched before anything is written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

from ..formats.ggml import GGMLType
from ..formats.gguf_read import (DEFAULT_ALIGNMENT, GGUFFile, GGUFModel, TensorInfo,
                                 parse_kv_entries)
from ..formats.gguf_write import TensorSpec, header_bytes, pad_to
from .archs import TensorPlan, plan_tensors
from .config import SynthConfig
from .metadata import metadata_kv
from .quant import EXPERT_ROLES, MIXED_TYPES, QuantSpec, Role, fallback_type

__all__ = ["SynthModel", "build_model", "assign_types"]


def assign_types(plans: list[TensorPlan], spec: QuantSpec) -> list[GGMLType]:
    """The ggml type of each tensor: F32 for the fixed roles, the spec's otherwise.

    Under ``mixed``, roles the spec leaves unset rotate through ``MIXED_TYPES``: routed experts
    on one counter, the rest of the quantized tensors on another.
    """
    out: list[GGMLType] = []
    n_exp = n_trunk = 0
    for p in plans:
        if p.role is Role.F32:
            out.append(GGMLType.F32)
            continue
        t = spec.role_type(p.role)
        if t is None:
            if p.role in EXPERT_ROLES:
                t, n_exp = MIXED_TYPES[n_exp % len(MIXED_TYPES)], n_exp + 1
            else:
                t, n_trunk = MIXED_TYPES[n_trunk % len(MIXED_TYPES)], n_trunk + 1
        out.append(fallback_type(t, p.ne[0]))
    return out


@dataclass(frozen=True)
class SynthModel:
    cfg: SynthConfig
    plans: tuple[TensorPlan, ...]
    types: tuple[GGMLType, ...]

    @cached_property
    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(p.name, p.ne, t) for p, t in zip(self.plans, self.types)]

    @cached_property
    def kv(self) -> list[bytes]:
        return metadata_kv(self.cfg)

    @property
    def data_bytes(self) -> int:
        """Bytes of the data section of a single-file GGUF (each tensor padded)."""
        return sum(pad_to(s.nbytes, DEFAULT_ALIGNMENT) for s in self.specs)

    @property
    def file_bytes(self) -> int:
        head, _ = header_bytes(self.kv, self.specs, DEFAULT_ALIGNMENT)
        return len(head) + self.data_bytes

    @property
    def expert_bytes(self) -> int:
        return sum(s.nbytes for s, p in zip(self.specs, self.plans) if p.role in EXPERT_ROLES)

    def gguf_model(self) -> GGUFModel:
        """The single-file GGUF ``synthesize`` writes, as ``formats.gguf_read`` reads one: its
        metadata and tensor list (offsets of the packed, padded data section); nothing is written
        and no tensor bytes are made."""
        label = f"synth:{self.cfg.name}"
        kv = parse_kv_entries(struct.pack("<Q", len(self.kv)) + b"".join(self.kv), label)
        tensors, off = [], 0
        for s in self.specs:
            tensors.append(TensorInfo(s.name, tuple(s.ne), s.ggml_type, off, s.nbytes, 0, off))
            off += pad_to(s.nbytes, DEFAULT_ALIGNMENT)
        f = GGUFFile(label, 3, kv, tensors, DEFAULT_ALIGNMENT, 0, off, 0, True)
        return GGUFModel([f], kv, tensors)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.types:
            counts[t.name] = counts.get(t.name, 0) + 1
        return counts


def build_model(cfg: SynthConfig) -> SynthModel:
    cfg.validate()
    plans = plan_tensors(cfg)
    return SynthModel(cfg, tuple(plans), tuple(assign_types(plans, cfg.quant_spec)))
