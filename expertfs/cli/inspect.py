"""``expertfs inspect STORE|MODEL.gguf [--json] [--extents]``"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from ..store.inspect import inspect_path, iter_extents
from ..units import fmt_bytes
from ._common import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="what is inside a store or a GGUF",
                       description="Architecture, layers, experts per layer and per token, quant "
                       "types, trunk versus expert bytes, bytes per expert; --extents lists every "
                       "extent (for a GGUF: as repack would lay it out).")
    p.add_argument("path", nargs="+", help="a store folder or a .gguf (split: first shard or all)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--extents", action="store_true", help="list every (layer, expert, offset, length)")
    p.set_defaults(func=run)


def _path_table() -> dict[str, str] | None:
    """The runtime's compute path per ggml type on this machine's CPU (None without torch)."""
    try:
        from ..runtime.plan.paths import path_table
        return path_table("cpu")
    except ImportError:
        return None


def run(args: argparse.Namespace) -> int:
    target = args.path[0] if len(args.path) == 1 else args.path
    info = inspect_path(target, compute_paths=_path_table())
    if args.extents:
        info["extent_list"] = list(iter_extents(target))
    if args.json:
        print_json(info)
        return 0
    for line in describe(info):
        print(line)
    for e in info.get("extent_list", []):
        print(f"  extent layer={e['layer']:<4} expert={e['expert']:<5} offset={e['offset']:<14} "
              f"length={e['length']}")
    return 0


def _types(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items()) or "-"


def describe(info: dict[str, Any]) -> list[str]:
    kind = "store" if info["kind"] == "store" else f"GGUF v{info.get('gguf_version')}"
    name = f" \"{info['name']}\"" if info.get("name") else ""
    lines = [f"{info['path']}: {kind}, {info['architecture']}{name}, {info['tensors']} tensors"]
    if info.get("note"):
        lines.append(f"  {info['note']}")
        lines.append(f"  trunk: {fmt_bytes(info['trunk_bytes'])}")
        return lines
    nextn = f" (incl. {info['nextn_layers']} NextN)" if info.get("nextn_layers") else ""
    n_nextn_moe = sum(1 for lay in info["layers"] if lay["nextn"])
    moe_nextn = f" (+{n_nextn_moe} NextN)" if n_nextn_moe else ""
    lines.append(f"  blocks: {info['block_count']}{nextn}; MoE layers: {info['moe_layers']}{moe_nextn}; "
                 f"experts per layer: {info['expert_count']}; used per token: "
                 f"{info['expert_used_count']}; shared: {info.get('expert_shared_count') or 0}; "
                 f"leading dense: {info.get('leading_dense_blocks') or 0}")
    total = info["expert_bytes"] + info["trunk_bytes"]
    lines.append(f"  experts: {fmt_bytes(info['expert_bytes'])} "
                 f"({100 * info['expert_bytes'] / max(total, 1):.1f}%), trunk: "
                 f"{fmt_bytes(info['trunk_bytes'])}, embedding {info.get('embedding_length')}, "
                 f"vocab {info.get('vocab_size')}")
    shapes = Counter((lay["expert_bytes"], tuple((p["role"], p["type"], tuple(p["ne"]))
                                                 for p in lay["parts"])) for lay in info["layers"])
    for (nbytes, parts), count in shapes.most_common():
        desc = ", ".join(f"{r} {t} {'x'.join(map(str, ne))}" for r, t, ne in parts)
        lines.append(f"  {count} layer(s): {fmt_bytes(nbytes)} per expert ({desc})")
    if info.get("expert_bytes_per_token"):
        lines.append(f"  routed expert bytes per token (nothing cached): "
                     f"{fmt_bytes(info['expert_bytes_per_token'])}")
    lines.append(f"  expert types: {_types(info['expert_types'])}")
    lines.append(f"  trunk types: {_types(info['trunk_types'])}")
    cp = info.get("compute_paths")
    if cp:
        for role in ("experts", "trunk"):
            lines.append(f"  {role} compute (CPU): "
                         + (", ".join(f"{t} {p}" for t, p in cp[role].items()) or "-"))
        slow = [t for t, p in cp["experts"].items() if p == "torch dequant"]
        if slow:
            lines.append(f"  warning: expert type(s) {', '.join(slow)} have no native kernel "
                         "here: every expert product dequantizes through torch (far slower)")
    if info["kind"] == "store":
        lines.append(f"  extents: {info['extents']}, alignment {fmt_bytes(info['alignment'])}, "
                     f"experts.bin {fmt_bytes(info['experts_file_bytes'])}, trunk.bin "
                     f"{fmt_bytes(info['trunk_file_bytes'])}")
        made = info.get("in_place")
        if made:
            lines.append(f"  made in place (repack --consume-source) from "
                         f"{', '.join(made['sources'])}, {fmt_bytes(made['released_bytes'])} "
                         "released as it went")
    return lines
