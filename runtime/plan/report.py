"""``expertfs plan``'s text report: the budget table, the prediction's arithmetic, plain advice."""

from __future__ import annotations

from .assumptions import GiB, MiB
from .budget import Pool
from .geometry import kv_bytes_per_token
from .predict import Plan
from .rates import FLOAT_TYPES

__all__ = ["format_plan"]


def _g(n: float) -> str:
    return f"{n / GiB:6.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:9.1f} ms"


def _pool_lines(p: Pool, slot: int) -> list[str]:
    out = [f"  {p.name.upper()} {p.total / GiB:.2f} GiB"]
    for i in p.items:
        out.append(f"    {i.name:<13}{_g(i.nbytes)}  {i.note}")
    tier = f"= {p.tier_slots} experts of {slot / MiB:.2f} MiB" if p.tier_slots else "(no tier)"
    out.append(f"    {'expert tier':<13}{_g(p.tier_bytes)}  {tier}")
    if p.unused > 0:
        out.append(f"    {'unused':<13}{_g(p.unused)}  {p.tier_note or 'less than one slot'}")
    return out


def format_plan(p: Plan) -> str:
    g, box, m = p.geometry, p.box, p.memory
    lines = [f"plan: {g.name} ({g.arch}) from {g.source}",
             f"box: RAM {box.ram / GiB:.2f} GiB, VRAM {box.vram / GiB:.2f} GiB ({box.label}), "
             f"ctx {box.ctx}, KV {m.kv_type}"]
    extra = f" + {g.n_nextn} NextN" if g.n_nextn else ""
    lines.append(f"model: {g.n_layers} layers{extra}, {len(g.moe_layers)} MoE x "
                 f"{g.n_experts} experts, top-{g.k}; expert extent {g.slot_bytes / MiB:.2f} MiB; experts "
                 f"{g.total_expert_bytes / GiB:.1f} GiB, trunk {g.trunk_bytes / GiB:.2f} GiB")
    lines.append(f"       one token routes to {g.k} x {len(g.moe_layers)} x "
                 f"{g.slot_bytes / MiB:.2f} MiB = {g.token_expert_bytes / GiB:.2f} GiB of experts; "
                 f"KV cache {kv_bytes_per_token(g, m.kv_type) / 1024:.0f} KiB per position")
    for n in g.notes:
        lines.append(f"       ({n})")
    pl = m.placement
    lines.append("")
    lines.append(f"placement {pl.name}: trunk ({pl.trunk_mode}) + KV cache ({m.kv_type}) on the "
                 f"{pl.trunk.upper()}, experts computed on the {pl.experts.upper()}"
                 + ((", RAM tier pinned" if m.pinned else ", RAM tier pageable") if pl.gpu else "")
                 + ("" if pl.supported else "  [not supported by expertfs run yet]"))
    lines.append("memory budget:")
    lines += _pool_lines(m.ram, g.slot_bytes)
    if m.vram is not None:
        lines += _pool_lines(m.vram, g.slot_bytes)
    held = m.ram.tier_slots + (m.vram.tier_slots if m.vram else 0)
    lines.append(f"  tiers hold {held} of {g.n_decode_experts} experts "
                 f"({held / max(1, g.n_decode_experts):.1%})")

    if p.prediction is not None and p.routing is not None and p.rates is not None:
        pr, rt = p.prediction, p.routing
        lines.append("")
        same = rt.slow.label == rt.fast.label
        lines.append(f"routing: {rt.slow.label if same else rt.slow.label + ' (slow end), ' + rt.fast.label + ' (fast end)'}"
                     f"; policy {rt.slow.policy}; {rt.slow.tokens} tokens replayed from a warm cache"
                     + ("  [SYNTHETIC, not this model's routing]" if rt.slow.synthetic else ""))
        ends = [("slow", rt.slow)] if same else [("slow", rt.slow), ("fast", rt.fast)]
        for name, r in ends:
            lines.append(f"  {name + ':' if not same else ''}{'' if same else ' '}hit VRAM "
                         f"{r.vram_hit_rate:.1%}, RAM {r.ram_hit_rate:.1%}, miss {r.miss_rate:.1%}; "
                         f"per token NVMe {r.nvme_bytes_per_token / MiB:.0f} MiB, H2D "
                         f"{r.h2d_bytes_per_token / MiB:.0f} MiB, D2H {r.d2h_bytes_per_token / MiB:.0f} MiB")
        lines.append("rates:")
        lines.append(f"  storage {p.rates.storage.slow:.2f}-{p.rates.storage.fast:.2f} GB/s  "
                     f"[{p.rates.storage.source}]")
        if pl.experts == "gpu":
            lines.append(f"  PCIe {p.rates.pcie.slow:.1f}-{p.rates.pcie.fast:.1f} GB/s  "
                         f"[{p.rates.pcie.source}]")
        for dev in sorted({pl.trunk, pl.experts}):
            r = p.rates.gpu if dev == "gpu" else p.rates.cpu
            used = {m_.ggml_type for layer in g.expert_parts for m_ in layer} if dev == pl.experts else set()
            used |= {m_.ggml_type for m_ in g.trunk_matrices} if dev == pl.trunk else set()
            def cost(t: str):              # what predict prices: the quantized path where it is
                return r.cost(t) if t in FLOAT_TYPES else r.quant_cost(t)

            costs = ", ".join(f"{t} {cost(t).gbps.slow:.2f}-{cost(t).gbps.fast:.2f} GB/s "
                              f"+{cost(t).overhead_s.fast * 1e6:.0f}-"
                              f"{cost(t).overhead_s.slow * 1e6:.0f} us/call" for t in sorted(used))
            main = max(used, key=lambda t: sum(m_.nbytes * m_.count for layer in g.expert_parts
                                                for m_ in layer if m_.ggml_type == t)) if used else ""
            src = cost(main).gbps.source if used else ""
            lines.append(f"  {dev.upper()} products: {costs}  [{src}]")
            cp = p.probes.get("compute_paths") if dev == "cpu" else None
            if cp:
                lines.append("  CPU compute paths: experts " + ", ".join(
                    f"{t} {x}" for t, x in cp["experts"].items()) + "; trunk " + ", ".join(
                    f"{t} {x}" for t, x in cp["trunk"].items()))
                if cp.get("prompts"):
                    lines.append(f"  CPU {cp['prompts']}")
            lines.append(f"  {dev.upper()} memory {r.mem_gbps.slow:.0f}-{r.mem_gbps.fast:.0f} GB/s, "
                         f"{r.op_s.fast * 1e6:.1f}-{r.op_s.slow * 1e6:.1f} us per small op  "
                         f"[{r.mem_gbps.source}]")
        lines.append("")
        lines.append(f"per token{'':<14}{'slow end':>12}{'fast end':>12}  share(slow)")
        for t in pr.terms:
            lines.append(f"  {t.name:<21}{_ms(t.slow_s):>12}{_ms(t.fast_s):>12}  "
                         f"{t.slow_s / pr.slow_s:6.1%}  {t.detail}")
        lines.append(f"  {'total':<21}{_ms(pr.slow_s):>12}{_ms(pr.fast_s):>12}  "
                     "slow = sum at slow rates; fast = sum at fast rates (the lookahead "
                     "on: max(storage, pcie, compute))")
        lines.append("")
        lines.append(f"predicted decode: {pr.tok_s_low:.2f} - {pr.tok_s_high:.2f} tokens/s "
                     f"(dominant: {pr.dominant_slow} at the slow end, {pr.dominant_fast} at the "
                     "fast end)" + ("; hit rates from SYNTHETIC routing" if rt.slow.synthetic else ""))
        ft = p.first_token
        if ft is not None:
            lines.append(f"predicted first token ({ft.prompt_tokens}-token prompt): "
                         f"{ft.s_fast:.1f} - {ft.s_slow:.1f} s (compute {ft.compute_s[1]:.1f}-"
                         f"{ft.compute_s[0]:.1f} s at {ft.gemm_gflops.slow:.0f}-"
                         f"{ft.gemm_gflops.fast:.0f} GFLOP/s; {ft.read_bytes[1] / 2**30:.2f}-"
                         f"{ft.read_bytes[0] / 2**30:.2f} GiB of experts read "
                         + ("into the cold tiers" if ft.drive >= 1.0 else
                            f"from the drive: the RAM tier is the experts file mapped, "
                            f"{p.box.page_cache:.0%} of it in the page cache now")
                         + (f"; {ft.fresh_s[1]:.1f}-{ft.fresh_s[0]:.1f} s of CPU faulting in "
                            "the tiers' fresh pages" if ft.fresh_s[0] >= 0.05 else "")
                         + (f"; {ft.verify_s[1]:.1f}-{ft.verify_s[0]:.1f} s checksumming them"
                            if ft.verify_s[0] >= 0.05 else "")
                         + (f"; {ft.cover}" if ft.cover else "") + ")")
    else:
        lines.append("")
        lines.append("predicted decode: none (the model cannot run on this box)")
    run = p.run_args()
    if run:
        lines.append(f"run it: {run}")
    alts = [o for o in p.alternatives]
    if alts:
        lines.append("other placements: " + "; ".join(
            f"{o.memory.placement.name} "
            + (f"{o.prediction.tok_s_low:.2f}-{o.prediction.tok_s_high:.2f} tok/s" if o.prediction
               else f"at most {o.bound:.2f} tok/s (not simulated)" if o.bound is not None
               else "does not fit")
            + ("" if o.memory.placement.supported else " (not in expertfs run)") for o in alts))
    cp = p.probes.get("compute_paths") or {}
    slow = [t for t, x in (cp.get("experts") or {}).items() if x == "torch dequant"]
    if slow and "cpu" == p.memory.placement.experts:
        lines.append(f"warning: expert type(s) {', '.join(slow)} have no native kernel here: "
                     "torch dequantization, far slower than the rates of native types")
    if p.notes:
        lines.append("")
        for n in p.notes:
            tag = {"error": "CANNOT RUN", "warning": "warning", "info": "note"}.get(n.level, n.level)
            lines.append(f"{tag}: {n.text}")
    return "\n".join(lines)
