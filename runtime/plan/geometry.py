"""The model as ``expertfs plan`` sees it: every matrix a token reads, expert and trunk, with its
ggml type and bytes, and the KV cache it adds per position (``plan.model`` builds a
``Geometry`` from a store, a GGUF or a ``--like`` preset; ``plan.budget`` budgets it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from ..memory import swa_positions

__all__ = ["KV_TYPES", "DTYPE_BYTES", "FLOAT_TYPE", "Matrix", "Geometry", "kv_bytes_per_token",
           "kv_cache_bytes"]

#: bytes per KV element by cache type (q8_0: 34-byte blocks of 32)
KV_TYPES: dict[str, float] = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32}
DTYPE_BYTES = {"gpu": 2, "cpu": 4}                 # the runtime's compute dtype: bf16 CUDA, f32 CPU
FLOAT_TYPE = {"gpu": "BF16", "cpu": "F32"}


@dataclass(frozen=True)
class Matrix:
    """A weight matrix the forward pass multiplies by: ``rows x cols`` (out x in), ggml bytes."""

    ggml_type: str
    rows: int
    cols: int
    nbytes: int
    count: int = 1                 # how many such matrices (trunk matrices are grouped)
    tied: bool = False             # the output head reading token_embd: its bytes are the embedding's

    @property
    def elements(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Geometry:
    """What the plan needs to know of a model; built by ``plan.model`` from a store, a GGUF or
    a ``--like`` preset."""

    name: str
    arch: str
    source: str                            # "store PATH", "gguf PATH", "--like NAME (quant ...)"
    n_layers: int                          # decoder blocks (NextN blocks not included)
    n_nextn: int
    n_embd: int
    n_head: int
    n_vocab: int
    n_ctx_train: int
    n_experts: int                         # routed experts per MoE layer
    k: int                                 # experts used per token per layer
    moe_layers: tuple[int, ...]            # block index of each decode MoE layer
    expert_bytes: tuple[int, ...]          # payload of one expert, per decode MoE layer
    extent_bytes: tuple[int, ...]          # padded extent (what one read moves), per MoE layer
    expert_parts: tuple[tuple[Matrix, ...], ...]   # one expert's matrices, per MoE layer
    trunk_matrices: tuple[Matrix, ...]     # computed per token (no embedding lookup, no NextN)
    nextn_matrices: tuple[Matrix, ...]     # of the NextN blocks (loaded, not run in decode)
    trunk_bytes: int                       # every tensor that is not a routed expert
    embd_bytes: int
    nextn_trunk_bytes: int
    nextn_expert_bytes: int                # experts of NextN blocks (stored, unused in decode)
    total_expert_bytes: int                # all routed experts, NextN included
    kv_heads: tuple[int, ...]              # KV heads per decoder layer
    key_length: int
    value_length: int
    mla_latent: int = 0                    # >0: MLA, elements cached per token per layer
    indexer_keys: tuple[int, ...] = ()     # DSA indexer key elements cached per token, per layer
    state_bytes: int = 0                   # fixed per-sequence state, any context (KDA layers'
                                           # conv windows + recurrent states, float32)
    hc_streams: int = 1                    # residual streams a token carries (mHC: hc_mult)
    swa: tuple[bool, ...] = ()             # sliding-window layers (empty: none)
    sliding_window: int = 0
    expert_types: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    nextn_loaded: bool = False             # the run loads its NextN blocks (MTP drafts); else
                                           # their trunk tensors are never read or counted

    def __post_init__(self) -> None:
        n = len(self.moe_layers)
        if not (n and len(self.expert_bytes) == n == len(self.extent_bytes) == len(self.expert_parts)):
            raise UsageError(f"{self.name}: no routed-expert layers to plan for",
                             fix="plan a Mixture-of-Experts model")
        if not 1 <= self.k <= self.n_experts:
            raise UsageError(f"{self.name}: top-k {self.k} with {self.n_experts} experts per layer",
                             fix="the model's expert_used_count is wrong")
        if len(self.kv_heads) != self.n_layers:
            raise UsageError(f"{self.name}: {len(self.kv_heads)} KV head counts for "
                             f"{self.n_layers} layers", fix="the model's metadata is inconsistent")

    @property
    def slot_bytes(self) -> int:
        """One tier slot: the largest extent (slots are fixed-size)."""
        return max(self.extent_bytes)

    @property
    def decode_expert_bytes(self) -> int:
        """Extents of every decode MoE layer's experts (what the tiers could hold)."""
        return sum(b * self.n_experts for b in self.extent_bytes)

    @property
    def token_expert_bytes(self) -> int:
        """Extent bytes one token routes to: k per MoE layer (read whole when nothing is cached)."""
        return self.k * sum(self.extent_bytes)

    @property
    def n_decode_experts(self) -> int:
        return self.n_experts * len(self.moe_layers)

    @property
    def trunk_active_bytes(self) -> int:
        return sum(m.nbytes * m.count for m in self.trunk_matrices)

    def trunk_units(self) -> list[int]:
        """Bytes of the trunk's matrices a decoder layer multiplies (the mean), per layer, then
        the output head's: the units ``runtime.model.trunk_stream`` streams a share of."""
        head = sum(m.nbytes * m.count for m in self.trunk_matrices
                   if m.rows == self.n_vocab and not m.tied)
        layer = (self.trunk_active_bytes - head) // max(1, self.n_layers)
        return [layer] * self.n_layers + [head]

    def trunk_resident(self, mode: str, dtype_bytes: int) -> int:
        """Bytes the loaded trunk takes: ggml bytes, with every matrix (NextN's included) in
        the compute dtype when ``mode`` is "float"; the embedding always stays quantized; the
        NextN blocks' only where the run loads them (``nextn_loaded``)."""
        base = self.loaded_trunk_bytes
        if mode == "quant":
            return base
        extra = 0
        for m in (*self.trunk_matrices, *self.loaded_nextn_matrices):
            extra += m.count * (m.elements * dtype_bytes - (0 if m.tied else m.nbytes))
        return base + extra

    @property
    def loaded_trunk_bytes(self) -> int:
        """The trunk's bytes a run loads: a NextN block's only where it drafts."""
        return self.trunk_bytes - (0 if self.nextn_loaded else self.nextn_trunk_bytes)

    @property
    def loaded_nextn_matrices(self) -> tuple[Matrix, ...]:
        return self.nextn_matrices if self.nextn_loaded else ()

    def trunk_compute(self, mode: str, device: str) -> tuple[Matrix, ...]:
        """The trunk matrices one token multiplies by, as the device holds them."""
        if mode == "quant":
            return self.trunk_matrices
        t, b = FLOAT_TYPE[device], DTYPE_BYTES[device]
        return tuple(Matrix(t, m.rows, m.cols, m.elements * b, m.count) for m in self.trunk_matrices)

    @property
    def largest_matrix_elements(self) -> int:
        parts = [m.elements for layer in self.expert_parts for m in layer]
        return max([m.elements for m in self.trunk_matrices] + parts + [0])

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "arch": self.arch, "source": self.source,
            "n_layer": self.n_layers, "n_nextn": self.n_nextn, "moe_layers": len(self.moe_layers),
            "n_expert": self.n_experts, "k": self.k, "n_embd": self.n_embd, "n_head": self.n_head,
            "n_vocab": self.n_vocab, "n_ctx_train": self.n_ctx_train,
            "kv_heads": sorted(set(self.kv_heads)), "key_length": self.key_length,
            "value_length": self.value_length, "mla_latent": self.mla_latent,
            "indexer_keys": sum(self.indexer_keys), "state_bytes": self.state_bytes,
            "swa_layers": sum(self.swa), "sliding_window": self.sliding_window,
            "expert_bytes": max(self.expert_bytes), "slot_bytes": self.slot_bytes,
            "decode_expert_bytes": self.decode_expert_bytes,
            "total_expert_bytes": self.total_expert_bytes,
            "nextn_expert_bytes": self.nextn_expert_bytes,
            "token_expert_bytes": self.token_expert_bytes,
            "trunk_bytes": self.trunk_bytes, "trunk_active_bytes": self.trunk_active_bytes,
            "trunk_float_bytes": {d: self.trunk_resident("float", DTYPE_BYTES[d]) for d in DTYPE_BYTES},
            "embd_bytes": self.embd_bytes, "nextn_trunk_bytes": self.nextn_trunk_bytes,
            "nextn_loaded": self.nextn_loaded,
            "expert_types": dict(self.expert_types), "notes": list(self.notes),
        }


def _kv_elements(g: Geometry, positions: int, swa_layers: bool = True) -> int:
    total = 0
    for i in range(g.n_layers):
        per = (g.mla_latent if g.kv_heads[i] else 0) if g.mla_latent else \
            g.kv_heads[i] * (g.key_length + g.value_length)      # glm5-next: 0 heads = KDA
        swa = bool(g.swa) and g.swa[i] and g.sliding_window > 0
        if swa and not swa_layers:
            continue
        if g.indexer_keys:
            per += g.indexer_keys[i]
        total += per * (swa_positions(g.sliding_window, positions) if swa else positions)
    return total


def kv_bytes_per_token(g: Geometry, kv_type: str = "f16") -> int:
    """KV-cache bytes one position adds in every full-attention layer (SWA layers stop at their
    ring, ``memory.swa_positions``); the recurrent layers' fixed state is not per position
    (``state_bytes``)."""
    if kv_type not in KV_TYPES:
        raise UsageError(f"KV cache type {kv_type!r} is not known", fix=f"use one of {', '.join(KV_TYPES)}")
    return math.ceil(_kv_elements(g, 1, swa_layers=False) * KV_TYPES[kv_type])


def kv_cache_bytes(g: Geometry, ctx: int, kv_type: str = "f16") -> int:
    """Bytes of the KV cache holding ``ctx`` positions in every decoder layer, plus the fixed
    state of the recurrent layers (``state_bytes``, float32 whatever ``kv_type``)."""
    if kv_type not in KV_TYPES:
        raise UsageError(f"KV cache type {kv_type!r} is not known", fix=f"use one of {', '.join(KV_TYPES)}")
    if ctx < 0:
        raise UsageError(f"context length {ctx} < 0", fix="give --ctx 1 or more")
    return math.ceil(_kv_elements(g, ctx) * KV_TYPES[kv_type]) + g.state_bytes
