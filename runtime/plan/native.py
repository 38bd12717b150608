"""The CPU rates of the paths ``expertfs run`` takes, measured on this machine: the native
kernels (``runtime.kernels``: ``matvec`` for trunk products, ``moe`` for a layer's k routed
experts in one call) per ggml type and the ISA they run, and the compiled torch product or
torch dequantization only for a type the kernels lack (``plan.paths``). Each figure is the
time of a call at the model's own shapes (big matrices capped, scaled by bytes), the slow end
its 30th percentile and the fast end its best, so a loaded machine widens the range instead
of moving it. Also the two paths of a prefill's wide products: the panel product
(``probe_panel``: ``kernels.qgemm``, rows dequantized in cache and multiplied by every token)
and, where the kernels have no vector ISA, the native dequantization BLAS's product starts with
(``probe_dequant``); and, where nothing was measured, the kernels' stated rate
(``stated_native``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .coldweights import CAP, rotation
from .geometry import Geometry, Matrix
from .rates import DeviceRates, LinearCost, Range

__all__ = ["kernel_info", "layer_key", "compute_cost", "layer_cost", "probe_trunk_types",
           "probe_expert_layers", "stated_native", "STATED_NATIVE_GWPS", "STATED_NATIVE_CALL_S",
           "probe_dequant", "probe_panel", "PANEL_TOKENS", "wide_limits", "speed_check"]

#: the native kernels' one-token rate when nothing was measured: weights a second per core at
#: the (slow, fast) end, exact numerics on an AVX2-class core, bounded by the memory bandwidth:
#: the fast end what the probe measures on the AVX2 box (bench/README.md), the slow end about
#: half of it, for a busier or older core
STATED_NATIVE_GWPS = (5.0, 11.0)
#: the same where the kernels run AVX-512: the fast end what the probe measures on the Zen 4 box
#: (Q4_K exact, one thread), the slow end about half of it
STATED_NATIVE_GWPS_AVX512 = (10.0, 22.0)
#: and the time of one call beyond its bytes (thread wake-up, activation preparation)
STATED_NATIVE_CALL_S = (20e-6, 10e-6)
#: the runtime's work beside the native products when nothing was measured, seconds a decoder
#: layer and a token at the (slow, fast) end: ``overhead.probe_overhead``'s figures span a
#: qwen3moe layer to a glm5-next one on the boxes of bench/README.md (the per-layer overhead
#: of the model's own architecture); where the native kernels compute the experts this
#: replaces the torch path's stated cost per expert (``assumptions.EXPERT_OVERHEAD_S``)
STATED_NATIVE_LAYER_S = (700e-6, 100e-6)
STATED_NATIVE_TOKEN_S = (100e-6, 20e-6)


def _times(fn: Callable[[], Any], reps: int, budget_s: float) -> list[float]:
    fn()
    out: list[float] = []
    end = time.perf_counter() + budget_s
    while len(out) < reps and (not out or time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _typical(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.3 * len(s)))]


def kernel_info() -> dict[str, Any]:
    """The native kernels' build and ISA here (``available`` False without them)."""
    try:
        from .. import kernels
        from ..kernels import build
        if not kernels.available():
            return {"available": False}
        st = kernels.status()
        return {"available": True, "isa": st.get("isa"), "build": build._build_name(),
                "threads": st.get("threads")}
    except Exception as e:                       # no compiler, a failed build: no native path
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}


def _raw(ggml_type: str, rows: int, cols: int, seed: int = 0):
    from .probe import _weight_bytes
    return _weight_bytes(ggml_type, rows, cols, seed)


def _native_types() -> frozenset[str]:
    try:
        from .. import kernels
        return frozenset(t.name for t in kernels.TYPES) if kernels.available() else frozenset()
    except Exception:
        return frozenset()


def speed_check(budget_s: float = 0.25) -> float:
    """This box's speed now, in one figure: GB/s of one fixed product, the best of a few
    (``runtime.kernels.matvec`` on a Q4_K 2048 x 4096 matrix, or torch's on float32 where there
    are no native kernels). Cached rates are compared by it with the box they were measured on:
    a shared or throttled machine's speed moves by half or more from one hour to the next."""
    import torch

    rows, cols = 2048, 4096
    if "Q4_K" in _native_types():
        from ...formats.ggml import GGMLType, row_bytes
        from .. import kernels
        raw, x = _raw("Q4_K", rows, cols), torch.randn(1, cols)
        nb = rows * row_bytes(GGMLType.Q4_K, cols)
        ts = _times(lambda: kernels.matvec(x, raw, GGMLType.Q4_K, (rows, cols)), 40, budget_s)
    else:
        w, x = torch.randn(rows, cols), torch.randn(cols)
        nb = w.numel() * w.element_size()
        ts = _times(lambda: torch.mv(w, x), 40, budget_s)
    return nb / min(ts) / 1e9


def stated_native(types: Sequence[str], mem: Range, cores: int | None = None
                  ) -> dict[str, LinearCost]:
    """``{type: LinearCost}`` of the native kernels for the ``types`` this machine computes
    natively, from ``STATED_NATIVE_GWPS`` (``_AVX512`` where the kernels run it) per core over
    ``cores`` (this machine's), never past the memory bandwidth ``mem`` (GB/s)."""
    import os

    from .rates import bytes_per_element

    n = cores or os.cpu_count() or 1
    lo, hi = STATED_NATIVE_GWPS_AVX512 if kernel_info().get("isa") == "avx512" \
        else STATED_NATIVE_GWPS
    src = (f"stated default: the native kernels at {lo:g}-{hi:g} G weights/s per core x {n} "
           f"cores, at most the memory bandwidth (measure: drop --no-probe)")
    over = Range(*STATED_NATIVE_CALL_S, src)
    native = _native_types()
    out = {}
    for t in types:
        if t in native:
            bpe = bytes_per_element(t)
            out[t] = LinearCost(over, Range(min(mem.slow, lo * n * bpe), min(mem.fast, hi * n * bpe),
                                            src))
    return out


def _probe_per_type(types: Sequence[str], budget_s: float, call, work: float, what: str
                    ) -> dict[str, Range]:
    """``work`` / seconds of ``call(ty, raw)`` on a 1024 x 2048 matrix of each of ``types`` the
    kernels take (``call`` None: not applicable to that type), in billions: the slow end its
    typical call, the fast end its best; ``what`` names the call in the figures' source (``{ty}``
    the type)."""
    out: dict[str, Range] = {}
    todo = [t for t in types if t in _native_types()]
    for ty in todo:
        raw = _raw(ty, 1024, 2048)
        try:
            if call(ty, raw) is None:
                continue
            ts = _times(lambda: call(ty, raw), 7, budget_s / max(1, len(todo)))
        except Exception:                             # a type the build refuses: no figure
            continue
        src = f"measured now: runtime.kernels.{what.format(ty=ty)} ({kernel_info().get('isa')})"
        out[ty] = Range(work / _typical(ts) / 1e9, work / min(ts) / 1e9, src)
    return out


def probe_dequant(types: Sequence[str], budget_s: float = 1.0) -> dict[str, Range]:
    """G weights/s of ``runtime.kernels.dequant`` (the wide products' first half where there is
    no panel product: a prefill's batch past a type's native token limit) for each of
    ``types`` it takes, on a 1024 x 2048 matrix: the slow end its typical call, the fast end
    its best."""
    from ...formats.ggml import GGMLType
    from .. import kernels

    return _probe_per_type(types, budget_s,
                           lambda ty, raw: kernels.dequant(raw, GGMLType[ty], (1024, 2048)),
                           1024 * 2048, "dequant {ty} 1024x2048")


#: tokens of the panel product's probe: about a prompt batch's share of a trunk product, where
#: its rate is near its plateau (bench/README.md, the panel product)
PANEL_TOKENS = 128


def probe_panel(types: Sequence[str], budget_s: float = 1.0, act_quant: str = "off"
                ) -> dict[str, Range]:
    """GFLOP/s of ``runtime.kernels.qgemm`` (the wide products of a prefill's batch past a
    type's native token limit: each panel of rows dequantized in the core's cache and multiplied
    by every token, its dequantization included) for each of ``types`` it takes, on
    [``PANEL_TOKENS``, 2048] x [1024, 2048]ᵀ, in ``act_quant``'s numerics (q8: the 8-bit
    integer panel where the CPU and type have one): the slow end its typical call, the fast end
    its best. Empty where the kernels have no vector ISA (``run`` then dequantizes and calls
    BLAS)."""
    import torch

    from ...formats.ggml import GGMLType
    from .. import kernels

    x = torch.randn(PANEL_TOKENS, 2048)
    return _probe_per_type(types, budget_s,
                           lambda ty, raw: kernels.qgemm(x, raw, GGMLType[ty], (1024, 2048),
                                                         _q8(act_quant)),
                           2.0 * PANEL_TOKENS * 1024 * 2048,
                           f"qgemm {{ty}} {PANEL_TOKENS}x2048 by 1024x2048"
                           + _source_note(act_quant))


def wide_limits(types: Sequence[str], act_quant: str = "off") -> dict[str, int]:
    """The most tokens one native product takes for each of ``types`` in ``act_quant``'s
    numerics (``expertfs run``'s rule, ``model.qmatvec.decode_matvec``): past it a product
    takes the wide path (``model.wide.wide_linear``: the panel product, else dequantization and
    BLAS)."""
    from ...formats.ggml import GGMLType
    from .. import kernels
    from ..model.qmatvec import NATIVE_MAX_TOKENS

    return {t: kernels.max_tokens(GGMLType[t], NATIVE_MAX_TOKENS, act_quant)
            for t in types if t in GGMLType.__members__}


def _source_note(act_quant: str) -> str:
    """What a measured figure's source adds for ``act_quant``'s numerics."""
    return "" if act_quant in (None, "off") else f", --act-quant {act_quant}"


def _q8(act_quant: str | None) -> str | None:
    return None if act_quant in (None, "off") else act_quant


def probe_trunk_types(mats: Sequence[Matrix], budget_s: float, act_quant: str = "off"
                      ) -> tuple[dict[str, LinearCost], list]:
    """``{type: LinearCost}`` of ``runtime.kernels.matvec`` for each natively computed type of
    ``mats`` (its largest matrix, capped, and a small one: overhead + bytes / rate), in
    ``act_quant``'s numerics."""
    import torch

    from ...formats.ggml import GGMLType, row_bytes
    from .. import kernels

    native = _native_types()
    big: dict[str, Matrix] = {}
    for m in mats:
        if m.ggml_type in native and (m.ggml_type not in big or m.elements > big[m.ggml_type].elements):
            big[m.ggml_type] = m
    out: dict[str, LinearCost] = {}
    detail = []
    isa = kernel_info().get("isa")
    per = budget_s / max(1, len(big))
    for ty, m in big.items():
        t = GGMLType[ty]
        rb = row_bytes(t, m.cols)
        rows = max(1, min(m.rows, CAP // max(1, rb)))
        small_rows = min(rows, 16)
        try:
            # copies past the last-level cache, each call the next: from memory, as a decode reads
            raws = [r for (r,) in rotation([(_raw(ty, rows, m.cols, seed=i),)
                                             for i in range(max(1, min(16, CAP // (rows * rb))))])]
            raw, x, at, aq = raws[0], torch.randn(1, m.cols), [0], _q8(act_quant)
            if kernels.matvec(x, raw, t, (rows, m.cols), aq) is None:
                continue

            def big():
                at[0] = (at[0] + 1) % len(raws)
                return kernels.matvec(x, raws[at[0]], t, (rows, m.cols), aq)
            tb = _times(big, 9, per * 0.7)
            rs = raw[: small_rows * rb]
            ts = _times(lambda: kernels.matvec(x, rs, t, (small_rows, m.cols), aq), 15,
                        per * 0.3)
        except Exception:                         # a type the build refuses: no native figure
            continue
        nb, ns = rows * rb, small_rows * rb
        src = (f"measured now: runtime.kernels.matvec {ty} {rows}x{m.cols} "
               f"({isa}{_source_note(act_quant)})")

        def fit(b: float, s: float) -> tuple[float, float]:
            rate = (nb - ns) / (b - s) if b > s and nb > ns else nb / b
            return max(0.0, s - ns / rate), rate

        o_slow, r_slow = fit(_typical(tb), _typical(ts))
        o_fast, r_fast = fit(min(tb), min(ts))
        out[ty] = LinearCost(Range(max(o_slow, o_fast), min(o_slow, o_fast), src),
                             Range(min(r_slow, r_fast) / 1e9, max(r_slow, r_fast) / 1e9, src))
        detail.append({"type": ty, "shape": [rows, m.cols], "kernel": "runtime.kernels.matvec",
                       "isa": isa, "act_quant": act_quant, "big_s": tb, "small_s": ts})
    return out, detail


def compute_cost(rates: DeviceRates, mats: Sequence[Matrix], end: str, quantized: bool = False
                 ) -> float:
    """Seconds of ``mats``' products at ``end`` (``quantized``: the fused/native cost)."""
    cost = rates.quant_cost if quantized else rates.cost
    return sum(cost(m.ggml_type).seconds(m.nbytes, end, m.count) for m in mats)


def layer_cost(rates: DeviceRates, parts: Sequence[Matrix], k: int, end: str) -> float:
    """One routed-expert layer's k experts: the measured native layer call when there is one,
    else k times each matrix's product."""
    c = rates.layers.get(layer_key(parts, k))
    if c is not None:
        return c.seconds(k * sum(m.nbytes for m in parts), end)
    return k * compute_cost(rates, parts, end, quantized=True)


def layer_key(parts: Sequence[Matrix], k: int) -> str:
    """What a routed-expert layer's cost depends on: the parts' types and shapes, and k."""
    return "+".join(f"{m.ggml_type}:{m.rows}x{m.cols}" for m in parts) + f"@k{k}"


def probe_expert_layers(g: Geometry, budget_s: float, known: Sequence[str] = (),
                        act_quant: str = "off") -> tuple[dict[str, LinearCost], list]:
    """``{layer_key: LinearCost}`` of one decode step through k experts with
    ``runtime.kernels.moe`` (gate, up, SiLU, down, weighted sum in one call) in ``act_quant``'s
    numerics, for each distinct layer of ``g`` whose types the kernels take (``known`` keys are
    skipped: cached)."""
    import torch

    from ...formats.ggml import GGMLType
    from .. import kernels

    native = _native_types()
    todo: dict[str, tuple[Matrix, ...]] = {}
    for parts in g.expert_parts:
        key = layer_key(parts, g.k)
        if key not in known and len(parts) in (2, 3) and all(m.ggml_type in native for m in parts):
            todo.setdefault(key, parts)
    out: dict[str, LinearCost] = {}
    detail = []
    isa = kernel_info().get("isa")
    per = budget_s / max(1, len(todo))
    for key, parts in todo.items():
        down = parts[-1]
        fused_gu = len(parts) == 2
        n_ff = down.cols
        layer_bytes = sum(m.nbytes for m in parts)
        # distinct experts repeated past the last-level cache, each call the next k of them
        # (wrapping around), so their weights come from memory as a decode's do
        n_dist = max(1, min(4 * g.k, CAP // max(1, layer_bytes)))
        try:
            ws = rotation([[_raw(m.ggml_type, m.rows, m.cols, seed=i) for m in parts]
                            for i in range(n_dist)])
            n_dist = len(ws)
            x = torch.randn(1, down.rows)
            w = torch.full((g.k,), 1.0 / g.k)
            types = tuple(GGMLType[m.ggml_type] for m in (parts[0], parts[0] if fused_gu else parts[1],
                                                           down))
            at = [0]

            def call():
                pick = [ws[(at[0] + i) % n_dist] for i in range(g.k)]
                at[0] = (at[0] + g.k) % n_dist
                return kernels.moe(x, w, [p[0] for p in pick], None if fused_gu else [p[1] for p in pick],
                                   [p[-1] for p in pick], types, n_ff, _q8(act_quant))
            if call() is None:
                continue
            ts = _times(call, 9, per)
        except Exception:
            continue
        nb = g.k * layer_bytes
        src = (f"measured now: runtime.kernels.moe {key.split('@')[0]} x {g.k} experts "
               f"({isa}{_source_note(act_quant)})")
        out[key] = LinearCost(Range(0.0, 0.0, src), Range(nb / _typical(ts) / 1e9, nb / min(ts) / 1e9, src))
        detail.append({"layer": key, "kernel": "runtime.kernels.moe", "isa": isa,
                       "act_quant": act_quant,
                       "distinct_experts": n_dist, "times_s": ts})
    return out, detail
