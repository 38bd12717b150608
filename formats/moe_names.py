"""Which GGUF tensors are routed experts, for every llama.cpp MoE naming.

A routed-expert tensor is ``blk.N.<base>_exps.weight`` or ``.bias`` whose last ggml dimension
is the layer's expert count: ``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``, the fused
``ffn_gate_up_exps``, gpt-oss's per-expert biases and any other ``*_exps`` llama.cpp adds. The
NextN/MTP block's experts (layer ``block_count - nextn_predict_layers``) match the same names.
Everything else is trunk: attention, norms, embeddings, the router ``ffn_gate_inp``,
``exp_probs_b``, shared experts (``*_shexp``) and dense FFNs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Role", "ExpertName", "parse_expert_name", "is_expert_tensor", "layer_of"]

_EXPERT_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<base>[a-z0-9_]+_exps)\.(?P<kind>weight|bias)$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class Role(IntEnum):
    """A part's role in an expert; the value is its on-disk code (FORMAT.md) and its order."""

    GATE = 1
    UP = 2
    GATE_UP = 3
    DOWN = 4
    GATE_BIAS = 5
    UP_BIAS = 6
    DOWN_BIAS = 7
    OTHER = 15      # an ``*_exps`` tensor llama.cpp may add later; its name is kept


_ROLES = {
    ("ffn_gate_exps", "weight"): Role.GATE,
    ("ffn_up_exps", "weight"): Role.UP,
    ("ffn_gate_up_exps", "weight"): Role.GATE_UP,
    ("ffn_down_exps", "weight"): Role.DOWN,
    ("ffn_gate_exps", "bias"): Role.GATE_BIAS,
    ("ffn_up_exps", "bias"): Role.UP_BIAS,
    ("ffn_down_exps", "bias"): Role.DOWN_BIAS,
}


@dataclass(frozen=True)
class ExpertName:
    layer: int
    base: str          # e.g. "ffn_up_exps"
    kind: str          # "weight" or "bias"
    role: Role


def parse_expert_name(name: str) -> ExpertName | None:
    """``blk.3.ffn_up_exps.weight`` → ``ExpertName(3, "ffn_up_exps", "weight", Role.UP)``."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    role = _ROLES.get((m["base"], m["kind"]), Role.OTHER)
    return ExpertName(int(m["layer"]), m["base"], m["kind"], role)


def is_expert_tensor(name: str, ne: tuple[int, ...], n_experts: int | None) -> bool:
    """True for a routed-expert tensor: an ``*_exps`` name with ``n_experts`` as its last dim."""
    if parse_expert_name(name) is None or len(ne) < 2:
        return False
    return n_experts is None or ne[-1] == n_experts


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None
