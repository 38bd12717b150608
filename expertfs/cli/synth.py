"""``expertfs synth``: write a model-shaped GGUF with random weights."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from ..errors import UsageError
from ..units import fmt_bytes
from ._common import print_json, progress_bar, size_arg


def register(sub: argparse._SubParsersAction) -> None:
    from ..synth import ARCHES, PRESETS
    p = sub.add_parser(
        "synth", help="write a GGUF of a real MoE architecture with random weights",
        description="Write a GGUF that llama.cpp loads: a real MoE architecture's tensors, "
                    "metadata and tokenizer with random weights. Without --like: a tiny model "
                    "of a few MB.")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="file to write")
    p.add_argument("--arch", choices=ARCHES, help="architecture of a tiny model (default qwen3moe)")
    p.add_argument("--like", metavar="NAME", help=f"copy a real model's geometry: {', '.join(PRESETS)}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--layers", type=int, metavar="N", help="decoder layers (scales a --like model down)")
    size.add_argument("--size", type=size_arg, metavar="SIZE",
                      help="pick the layer count that makes the file about SIZE (e.g. 4G)")
    p.add_argument("--experts", type=int, metavar="N", help="routed experts per layer")
    p.add_argument("--top-k", type=int, metavar="K", help="experts used per token")
    p.add_argument("--vocab", type=int, metavar="N",
                   help="vocabulary size (smaller shrinks the embedding and output matrices)")
    p.add_argument("--quant", metavar="SPEC",
                   help="types per tensor role, e.g. experts=Q4_K,down=Q6_K,attn=Q8_0,embd=Q6_K,"
                        "output=Q6_K; or a preset (default, q4_k_m, q3_k_m, iq2_m, mxfp4_moe, "
                        "maya-s, mixed) or one type for all")
    p.add_argument("--fuse-gate-up", action="store_true",
                   help="write ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps (deepseek2)")
    p.add_argument("--split-max-size", type=size_arg, metavar="SIZE",
                   help="split into NAME-0000k-of-0000N.gguf shards of at most SIZE of tensors")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite existing output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    """The ``SynthConfig`` the command line asks for."""
    from ..synth import SynthConfig, layers_for_size
    if args.like:
        cfg = SynthConfig.like(args.like)
        if args.arch and args.arch != cfg.arch:
            raise UsageError(f"--like {args.like} is a {cfg.arch} model, not {args.arch}",
                             fix="drop --arch or --like")
    else:
        cfg = SynthConfig.tiny(args.arch or "qwen3moe")
    changes: dict[str, object] = {"seed": args.seed}
    if args.experts is not None:
        changes["n_experts"] = args.experts
    if args.top_k is not None:
        changes["n_expert_used"] = args.top_k
    if args.vocab is not None:
        changes["n_vocab"] = args.vocab
    if args.quant:
        changes["quant"] = f"{cfg.quant},{args.quant}"
    if args.fuse_gate_up:
        changes["fuse_gate_up"] = True
    cfg = cfg.replace(**changes)
    if args.layers is not None:
        cfg = cfg.with_layers(args.layers)
    cfg = cfg.validate()
    if args.size is not None:
        cfg = layers_for_size(cfg, args.size)
    return cfg


def run(args: argparse.Namespace) -> int:
    from ..synth import build_model, synthesize
    cfg = build_config(args)
    model = build_model(cfg)
    t0 = time.perf_counter()
    with progress_bar(f"synth {os.path.basename(args.output)}", enabled=not args.json) as bar:
        paths = synthesize(cfg, args.output, args.split_max_size, bar, overwrite=args.force)
    dt = time.perf_counter() - t0
    total = sum(os.path.getsize(p) for p in paths)
    rate = total / dt / 1e6 if dt > 0 else 0.0
    if args.json:
        print_json({"paths": paths, "bytes": total, "seconds": round(dt, 3),
                    "mb_per_s": round(rate, 1), "tensors": len(model.specs),
                    "expert_bytes": model.expert_bytes, "types": model.type_counts(),
                    "config": dataclasses.asdict(cfg)})
        return 0
    for p in paths:
        print(p)
    print(f"{cfg.arch} '{cfg.name}': {cfg.n_layers} layers"
          f"{f' + {cfg.n_nextn} NextN' if cfg.n_nextn else ''}, {cfg.n_experts} experts (top "
          f"{cfg.n_expert_used}), {len(model.specs)} tensors, {fmt_bytes(total)} in {dt:.2f} s "
          f"({rate:.0f} MB/s)", file=sys.stderr)
    return 0
