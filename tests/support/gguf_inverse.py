"""The converter's tensor mapping inverted, found by converting a model whose weights are ids.

Every element of the tensors in an ``IdSpace`` gets its own id (a whole float32 below 2**24).
llama.cpp's converter only renames, reshapes, transposes, splits and stacks these tensors, so
the GGUF it writes from the id-valued checkpoint says, element by element, where each GGUF
value came from. ``IdSpace.index_map(gguf)`` reads that back; ``IdSpace.load(map, values)``
puts the values of any other GGUF of the same layout (say a Q8_0 file dequantised by gguf-py)
into the transformers tensors. Elementwise value transforms (``ssm_a = -exp(A_log)``) are the
caller's: they are given id 0 in the id pass and filled by name afterwards.

``requantise(src, out, types, values)`` writes a GGUF with ``src``'s metadata and tensor
layout whose tensors have the types ``types(name, ne)`` asks for: gguf-py quantizes the types
it can (F32, F16, BF16, Q8_0, Q4_0 ...), the K and IQ types get random valid blocks of about
the tensor's own standard deviation (``formats.random_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["IdSpace", "dequantised", "requantise", "types_of", "maya_types",
           "assert_q8_0_holds_the_model"]

_MAX_ID = 1 << 24


class IdSpace:
    """Named groups of tensors (``{"model": state_dict, "nextn": {...}}``) on one id line."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]],
                 skip: Callable[[str], bool] = lambda name: False) -> None:
        self.groups = groups
        self.slots: list[tuple[str, str, int, tuple[int, ...]]] = []
        off = 1                                    # id 0: the skipped tensors
        for g, tensors in groups.items():
            for name, t in tensors.items():
                self.slots.append((g, name, off, tuple(t.shape)))
                off += t.numel()
        if off >= _MAX_ID:
            raise ValueError(f"{off} elements: ids above 2**24 are not exact in float32")
        self.size = off
        self.skip = skip

    def ids(self) -> dict[str, dict[str, torch.Tensor]]:
        """The groups with every element replaced by its id (``skip``-ped tensors by 0)."""
        out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in self.groups}
        for g, name, off, shape in self.slots:
            n = int(np.prod(shape, dtype=np.int64))
            t = torch.zeros(n) if self.skip(name) else torch.arange(off, off + n, dtype=torch.float64)
            out[g][name] = t.float().reshape(shape)
        return out

    def index_map(self, id_gguf: str | Path) -> tuple[dict[str, np.ndarray], list[str]]:
        """GGUF tensor name -> int64 ids (the GGUF's numpy shape), and the names that are not
        a whole-id copy of the checkpoint (transformed by value: the caller maps them)."""
        from gguf import GGUFReader
        from gguf.constants import GGMLQuantizationType as Q
        mapped, other = {}, []
        for t in GGUFReader(str(id_gguf)).tensors:
            if t.tensor_type != Q.F32:
                raise ValueError(f"{t.name}: the id GGUF must be F32 (--outtype f32)")
            v = np.asarray(t.data, dtype=np.float64)
            if v.min() < 1 or v.max() >= self.size or not np.array_equal(v, np.round(v)):
                other.append(t.name)
                continue
            mapped[t.name] = v.astype(np.int64)
        return mapped, other

    def _flat(self) -> np.ndarray:
        return np.concatenate([np.zeros(1)] + [t.detach().double().flatten().numpy() for ts in
                                               self.groups.values() for t in ts.values()])

    def gather(self, index: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The groups' own values in the GGUF's layout (what the converter wrote at F32)."""
        flat = self._flat()
        return {name: flat[ids].astype(np.float32) for name, ids in index.items()}

    def load(self, index: dict[str, np.ndarray], values: dict[str, np.ndarray]
             ) -> dict[str, dict[str, torch.Tensor]]:
        """The groups with the elements ``index`` covers set from ``values`` (same names);
        an element two GGUF tensors hold must get the same value from both."""
        flat = self._flat()
        seen = np.zeros(self.size, dtype=bool)
        for name, ids in index.items():
            v = np.asarray(values[name], dtype=np.float64).reshape(ids.shape)
            again = seen[ids]
            if again.any() and not np.array_equal(flat[ids][again], v[again]):
                raise ValueError(f"{name}: an element already set from another tensor differs")
            flat[ids] = v
            seen[ids] = True
        out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in self.groups}
        for g, name, off, shape in self.slots:
            n = int(np.prod(shape, dtype=np.int64))
            out[g][name] = torch.from_numpy(flat[off:off + n].copy()).float().reshape(shape)
        self.covered = seen
        return out


def dequantised(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF as float32, dequantised by gguf-py (the numpy shape)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    return {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            for t in GGUFReader(str(path)).tensors}


def assert_q8_0_holds_the_model(space: "IdSpace", index, q8_0: str | Path) -> None:
    """The inverted mapping is right: each dequantised Q8_0 tensor is the transformers tensor it
    came from, to within a Q8_0 step (half a step, and the F16 rounding of the scale)."""
    real, deq = space.gather(index), dequantised(q8_0)
    for name, v in real.items():
        step = np.abs(v).max() / 127
        assert np.abs(deq[name].reshape(v.shape) - v).max() <= 0.6 * step + 1e-7, name


def types_of(path: str | Path) -> dict[str, str]:
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def requantise(src: str | Path, out: str | Path, types: Callable[[str, tuple[int, ...]], object],
               values: dict[str, np.ndarray], seed: int = 0) -> dict[str, str]:
    """Write ``out``: ``src``'s metadata and tensors (names, order, shapes) with the type
    ``types(name, ne)`` gives each (a ``GGMLType``), from ``values`` (numpy shape); returns
    name -> type name."""
    from gguf import quants

    from expertfs.formats.ggml import GGMLType
    from expertfs.formats.gguf_read import read_gguf
    from expertfs.formats.gguf_write import TensorSpec, write_gguf
    from expertfs.formats.random_blocks import NATIVE_TYPES, make_blocks

    f = read_gguf(str(src))
    rng = np.random.default_rng(seed)
    specs, data = [], []
    for ti in f.tensors:
        t = GGMLType(types(ti.name, tuple(ti.ne)))
        v = np.ascontiguousarray(values[ti.name], dtype=np.float32)
        if t == GGMLType.F32:
            b = v.view(np.uint8).ravel()
        elif t == GGMLType.F16:
            b = v.astype(np.float16).view(np.uint8).ravel()
        elif t in NATIVE_TYPES:
            b = np.asarray(quants.quantize(v.reshape(-1, ti.ne[0]), t)).view(np.uint8).ravel()
        else:
            from expertfs.formats.ggml import block_size
            n = v.size // block_size(t)
            b = make_blocks(t, n, float(v.std()) or 0.05, rng).ravel()
        specs.append(TensorSpec(ti.name, tuple(ti.ne), t))
        data.append(b)
    kv = [e.raw for e in f.kv.values()]
    write_gguf(str(out), kv, specs, lambda i, spec: [data[i]])
    return {s.name: s.ggml_type.name for s in specs}


_F32_PARTS = ("ffn_gate_inp", "exp_probs_b", ".hc_", "ssm_a", "ssm_dt", "ssm_conv1d",
              "indexer.proj", "indexer_compressor", "sinks")


def maya_types(names: list[str], n_layers: int, spec: str = "maya-s"
               ) -> Callable[[str, tuple[int, ...]], object]:
    """``types(name, ne)`` for ``requantise``: synth's ``--quant`` roles (expertfs.synth.quant)
    read off llama.cpp's tensor names, with llama-quantize's fallbacks for short rows."""
    from expertfs.formats.ggml import GGMLType
    from expertfs.synth.quant import Role, fallback_type, parse_quant, use_more_bits
    q = parse_quant(spec)
    kda = {n.split(".")[1] for n in names if n.endswith(".ssm_a")}

    def role(name: str, ne: tuple[int, ...]) -> Role:
        parts = name.split(".")
        if len(ne) == 1 or any(s in name for s in _F32_PARTS):
            return Role.F32
        if name.startswith("token_embd") or "nextn.embed_tokens" in name:
            return Role.EMBD
        if name.startswith("output.") or "shared_head_head" in name:
            return Role.OUTPUT
        if "_exps" in name:
            if "down" not in name:
                return Role.EXPERTS
            return Role.DOWN_MORE if use_more_bits(int(parts[1]), n_layers) else Role.DOWN
        if "_shexp" in name:
            return Role.SHEXP
        if ".indexer." in name:
            return Role.INDEXER
        if parts[2].startswith("ssm_") or parts[1] in kda:
            return Role.KDA
        if parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            return Role.DENSE
        return Role.ATTN

    def types(name: str, ne: tuple[int, ...]) -> object:
        r = role(name, ne)
        return GGMLType.F32 if r is Role.F32 else fallback_type(q.role_type(r), ne[0])
    return types
