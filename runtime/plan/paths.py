"""Which compute path each ggml type takes in ``expertfs run``: a native kernel, a compiled
torch one-token product, or torch dequantization (``formats.dequant``: correct, far slower on
the CPU), so a type without a native path is never silently slow. ``expertfs inspect`` (given
``path_table``: the store does not import the runtime), ``expertfs plan`` and ``expertfs run``
report it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["NATIVE", "COMPILED", "DEQUANT", "FLOAT", "compute_paths", "path_table", "paths_for",
           "slow_types", "kept_types", "describe_paths", "q8_prompt_paths", "amx_prompt_types",
           "prompt_paths"]

NATIVE = "native kernel"
COMPILED = "compiled torch"
DEQUANT = "torch dequant"
FLOAT = "float (torch)"
_FLOAT_TYPES = frozenset({"F32", "F64"})


def path_table(device: str = "cpu", fused: bool = True) -> dict[str, str]:
    """Every ggml type's path on ``device`` ("cpu" or "cuda"/"gpu"): on the CPU the native
    kernels' types when they are built (``runtime.kernels``), then the compiled torch products
    (``runtime.model.qmatvec``) when ``fused``, else torch dequantization."""
    from ...formats.ggml import GGMLType
    from .. import kernels
    from ..model.qmatvec import SUPPORTED

    native = {t.name for t in kernels.TYPES} if device == "cpu" and kernels.available() else set()
    compiled = {t.name for t in SUPPORTED} if fused else set()
    out = {}
    for t in GGMLType:
        out[t.name] = (FLOAT if t.name in _FLOAT_TYPES else NATIVE if t.name in native
                       else COMPILED if t.name in compiled else DEQUANT)
    return out


def paths_for(types: Iterable[str], table: Mapping[str, str], trunk: bool = False
              ) -> dict[str, str]:
    """``{type: path}`` for ``types`` (a type the table lacks: torch dequant); trunk F16/BF16
    matrices are used as float."""
    return {t: FLOAT if trunk and t in ("F16", "BF16") else table.get(t, DEQUANT)
            for t in sorted(set(types))}


def slow_types(paths: Mapping[str, str]) -> list[str]:
    """The types of ``paths`` that fall back to torch dequantization."""
    return [t for t, p in paths.items() if p == DEQUANT]


def kept_types(device: str = "cpu", fused: bool = True) -> frozenset[str]:
    """The ggml types ``--trunk auto`` keeps quantized (``runtime.model.loader``'s rule): those
    with a fused one-token product, on the CPU every native kernel's (not F16/BF16)."""
    if not fused:
        return frozenset()
    from .. import kernels
    from ..model.qmatvec import SUPPORTED
    types = {t.name for t in SUPPORTED}
    if device == "cpu" and kernels.available():
        types |= {t.name for t in kernels.TYPES}
    return frozenset(types - {"F16", "BF16"})


def describe_paths(g, device: str = "cpu", fused: bool = True
                   ) -> tuple[str, list[tuple[str, str]]]:
    """(one line naming every expert and trunk type's path, the (type, "experts"|"trunk")
    pairs that fall back to torch dequantization on the CPU) for a ``plan.Geometry``."""
    table = path_table("cpu" if device == "cpu" else "cuda", fused)
    exp = paths_for({m.ggml_type for layer in g.expert_parts for m in layer}, table)
    trunk = paths_for({m.ggml_type for m in g.trunk_matrices}, table, trunk=True)
    line = ("experts " + ", ".join(f"{t} {p}" for t, p in exp.items()) + "; trunk "
            + ", ".join(f"{t} {p}" for t, p in trunk.items()))
    slow = [] if device != "cpu" else (
        [(t, "experts") for t in slow_types(exp)] + [(t, "trunk") for t in slow_types(trunk)])
    return line, slow


def _matrix_types(g) -> set[str]:
    """The ggml type names of a ``plan.Geometry``'s expert and trunk matrices."""
    return {m.ggml_type for layer in g.expert_parts for m in layer} | \
        {m.ggml_type for m in g.trunk_matrices}


def amx_prompt_types(g) -> list[str]:
    """The expert and trunk types of a ``plan.Geometry`` whose exact-mode prompt products run
    on this CPU's AMX tile unit (``kernels.info()["amx_types"]``; none without AMX-BF16)."""
    from ...formats.ggml import GGMLType
    from .. import kernels
    mod = kernels.load()
    amx = set(mod.info().get("amx_types", ())) if mod is not None else set()
    return sorted(t for t in _matrix_types(g)
                  if t in GGMLType.__members__ and int(GGMLType[t]) in amx)


def q8_prompt_paths(g) -> tuple[list[str], list[str]]:
    """With ``--act-quant q8`` on the CPU: (the expert and trunk types whose prompt products go
    through the 8-bit integer panel here, ``kernels.widths.q8_panel``; the natively computed
    ones whose prompts keep the exact float panel: no integer panel for the type, or no VNNI in
    this CPU) for a ``plan.Geometry``."""
    from ...formats.ggml import GGMLType
    from .. import kernels
    mod = kernels.load()
    native = {t.name for t in kernels.TYPES} - {"F16", "BF16"}
    panel, exact = [], []
    for t in sorted(_matrix_types(g) & native):
        (panel if mod is not None and kernels.widths.q8_panel(mod, GGMLType[t]) else exact
         ).append(t)
    return panel, exact


def prompt_paths(g, act_quant: str = "off") -> str | None:
    """What a CPU run's prompt products take beyond the native rows kernels, for a
    ``plan.Geometry`` (``run`` logs it, ``plan`` prints it): with ``--act-quant q8`` which types
    take the 8-bit integer panel and which keep the exact float one; in exact mode which take
    the AMX tile unit, where the CPU has it (else None)."""
    if act_quant == "q8":
        panel, exact = q8_prompt_paths(g)
        return ("--act-quant q8 prompts: 8-bit integer panel for "
                f"{', '.join(panel) or 'no type (this CPU has no VNNI)'}; exact float panel "
                f"for {', '.join(exact) or '-'}")
    amx = amx_prompt_types(g)
    return f"prompts: {', '.join(amx)} products on the AMX tile unit (exact bf16 parts)" \
        if amx else None


def compute_paths(g: Any, act_quant: str) -> dict[str, Any]:
    """Which CPU path each expert and trunk type of ``g`` (a ``plan.Geometry``) takes in
    ``expertfs run`` on this machine, and what its prompt products take in ``act_quant``'s
    numerics (``prompt_paths``): ``plan``'s ``compute_paths``."""
    try:
        table = path_table("cpu")
    except ImportError:                       # no torch: nothing to say
        return {}
    return {"experts": paths_for({m.ggml_type for layer in g.expert_parts for m in layer}, table),
            "trunk": paths_for({m.ggml_type for m in g.trunk_matrices}, table, trunk=True),
            "prompts": prompt_paths(g, act_quant)}
