"""``expertfs run STORE -p "..."``: generate from a store, experts streamed through the cache tiers.

Text streams to stdout; a live status line (tokens/s, hit rate per tier, MB read per token,
stall time) is drawn on stderr when it is a terminal; a summary follows. ``--json`` prints one
JSON object instead. ``--tokens 1,2,3 --logits-out F.npy`` runs a fixed token sequence and
writes the float32 logits of every position, ``[positions, n_vocab]``, for comparing with any
other implementation. ``--trace OUT`` records every routing decision for ``bench cache``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from ..errors import ExpertfsError, UsageError
from ..units import fmt_bytes
from ._common import mtp_arg, size_arg
from ._prompt import tokenized_prompt
from ._tiers import lookahead_line, ram_and_lookahead

__all__ = ["register", "run"]

log = logging.getLogger(__name__)

_EPILOG = """\
examples:
  expertfs run MODEL.efs -p "The capital of France is" -n 64
  expertfs run MODEL.efs --chat -p "Write a haiku" --temp 0.7 --top-p 0.9 --seed 1
  expertfs run MODEL.efs --ram 8G --vram 12G --device cuda -p "..." --trace run.eftrace
  expertfs run MODEL.efs --tokens 1,2,3 --logits-out logits.npy
  expertfs run MODEL.efs --mtp auto --draft-prefetch --ram 2G -p "..."   (GLM-4.5-class stores)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a store (experts streamed from disk)",
                       description="Generate from a store: the trunk resident, the experts "
                       "streamed NVMe → RAM → VRAM through the cache tiers.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="a store made by expertfs repack")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt text")
    src.add_argument("--tokens", help="run these token ids (comma separated) instead of a prompt")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-text tokens (always generate -n tokens)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: torch's)")
    p.add_argument("--ram", type=size_arg, default=None,
                   help="RAM tier for experts (default: up to 4G, a quarter of RAM, and what "
                   "the memory limit leaves beside the trunk)")
    p.add_argument("--vram", type=size_arg, default=None,
                   help="VRAM tier for experts (default: on CUDA, what free device memory leaves "
                        "beside the trunk, KV cache and workspace; 0: none)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    p.add_argument("--ctx", type=int, default=4096, help="context length limit (4096)")
    p.add_argument("--batch", type=int, default=256, help="prefill batch in tokens (256)")
    p.add_argument("--trunk", choices=("auto", "float", "quant"), default="auto",
                   help="dequantize trunk matrices at load (float) or keep them quantized")
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                   help="compiled one-token products from quantized bytes (auto: on CPU)")
    p.add_argument("--act-quant", choices=("off", "q8"), default="off",
                   help="LOSSY, opt-in: q8 quantizes the activations of the expert and trunk "
                   "products to 8 bits as llama.cpp does (its numerics; faster where arithmetic, "
                   "not memory, bounds the products: a prompt's, on AVX512-VNNI CPUs through "
                   "8-bit integer panels); off = exact (default)")
    p.add_argument("--dq-cache", type=size_arg, default=0, metavar="SIZE",
                   help="keep up to SIZE of experts dequantized (in RAM; on a GPU in VRAM, "
                   "taken from its default tier) (0 = off)")
    p.add_argument("--lookahead", action="store_const", const="on", default="auto",
                   help="prefetch layer L+1's predicted experts while layer L runs (default, where "
                   "experts stream: on for glm5-next, else tried on and off, the faster kept)")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_const", const="off")
    p.add_argument("--prefill-prefetch", action="store_true",
                   help="a prompt batch prefetches the next layer's gate-predicted experts "
                        "behind its own reads (off: it measured slower under a cap)")
    p.add_argument("--lookahead-margin", type=int, default=None, metavar="M",
                   help="experts beyond top-k prefetched per token (2; auto: 0)")
    p.add_argument("--prefetch-slots", type=int, default=None, metavar="N",
                   help="RAM-tier slots the lookahead reads its predictions into, outside the "
                   "cache so wrong ones evict nothing (default k + margin + 1; 0 = read them "
                   "into the cache itself, as --draft-prefetch always does)")
    p.add_argument("--mtp", default="0", metavar="K|auto",
                   help="speculative decoding with the store's NextN/MTP block: K drafts per "
                   "step, or auto (a utility gate picks the depth; none without a block); 0 = "
                   "off (default). Greedy output is unchanged; sampled keeps its distribution")
    p.add_argument("--mtp-max", type=int, default=4, metavar="K",
                   help="deepest draft --mtp auto may choose (4)")
    p.add_argument("--draft-prefetch", action="store_true",
                   help="with --mtp: prefetch every layer's predicted verify experts from the "
                   "drafts, for the whole step")
    p.add_argument("--route-tail-skip", type=int, default=0, metavar="N",
                   help="LOSSY, opt-in: in each decode/verify window skip experts that are not "
                   "resident and rank past N for every token (0 = off, the default)")
    p.add_argument("--provider", choices=("auto", "tiered", "direct"), default="auto",
                   help="expert provider (auto: the tiered cache when installed)")
    p.add_argument("--trace", metavar="OUT", help="write the routing trace to OUT")
    p.add_argument("--no-warm-start", action="store_true",
                   help="start with an empty RAM tier instead of the store's most-used experts")
    p.add_argument("--preload", action="store_true",
                   help="before the prompt, fault the trunk in and read every expert the RAM "
                   "tier holds: a resident run from the first token, as llama.cpp's mmap loads "
                   "its file with MAP_POPULATE (for benchmarks; the time is reported apart, as "
                   "preload_s)")
    p.add_argument("--logits-out", metavar="FILE.npy",
                   help="with --tokens: write float32 logits [positions, n_vocab]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here", fix="use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"unknown --device {name!r}", fix="use cpu, cuda, cuda:N or auto")
    return name


def _parse_tokens(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"--tokens {text!r} is not a list of integers",
                         fix="write e.g. --tokens 1,2,3") from None
    if not ids:
        raise UsageError("--tokens is empty", fix="give at least one token id")
    return ids


def _open(args: argparse.Namespace):
    """(engine, ``runtime.mtp.Speculation`` or None) for the arguments."""
    import torch
    from ..runtime.engine import Engine, EngineOptions
    from ..runtime.mtp import MTPOptions, attach
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.n_predict < 0 or args.ctx < 1 or args.batch < 1:
        raise UsageError("-n, --ctx and --batch must be positive", fix="check the numbers")
    fused = args.fused
    # --tokens runs batches only, nothing to compile for; the q8 products of --act-quant
    # live on the fused path, so they keep it
    if args.tokens and fused == "auto" and args.act_quant == "off":
        fused = "off"
    device = _device(args.device)
    mtp_k = mtp_arg(args.mtp)
    ram, look = ram_and_lookahead(args, device, fused)
    args.ram_tier_bytes = ram
    opts = EngineOptions(device=device, dtype=args.dtype, n_ctx=args.ctx,
                         trunk=args.trunk, dq_cache=args.dq_cache, **look,
                         fused=fused, act_quant=args.act_quant, trunk_stream=args.trunk_short,
                         prefill_batch=args.batch, prefetch_slots=args.prefetch_slots,
                         prefill_prefetch=args.prefill_prefetch,
                         load_nextn=bool(mtp_k))        # the NextN block: only to draft
    mtp = MTPOptions(mtp=mtp_k, mtp_max=args.mtp_max,
                     draft_prefetch=args.draft_prefetch, route_tail_skip=args.route_tail_skip)
    opts = mtp.engine_options(opts)
    extra = {"warm_start": False} if args.no_warm_start and args.provider != "direct" else None
    eng = Engine.open(args.store, provider=args.provider, ram_bytes=ram, vram_bytes=args.vram,
                      options=opts, provider_options=extra)
    try:
        return eng, attach(eng, mtp)
    except BaseException:
        eng.close()
        raise


def _prefill_reads(store: str, nbytes: int, seconds: float) -> dict[str, Any]:
    """The prompt's reads: MB, MB/s over the time to the first token, and the drive's rate at
    one expert per read as ``plan`` measured it on this device (None: never measured)."""
    from ..runtime.plan import boxcache
    from ..runtime.plan.model import load_geometry
    drive = None
    try:
        g, data_path = load_geometry(store)
        if data_path:
            drive = boxcache.drive_rate(data_path, g.slot_bytes)
    except (OSError, ValueError, ExpertfsError):
        drive = None
    return {"prefill_read_mb": nbytes / 1e6,
            "prefill_read_mb_s": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
            "drive_mb_s": drive / 1e6 if drive else None}


def _stats(eng, spec) -> dict[str, Any]:
    """``eng.stats()`` with the speculation's figures (``"mtp"``, ``"route_tail_skip"``)."""
    st = eng.stats()
    if hasattr(eng.provider, "describe"):          # slots, bytes, pinned bytes of the tiers
        st["tiers"] = eng.provider.describe()
    if spec is not None:
        st.update(spec.report())
    return st


def run(args: argparse.Namespace) -> int:
    if args.logits_out and not args.tokens:
        raise UsageError("--logits-out needs --tokens", fix="pass --tokens 1,2,3")
    if args.preload and args.provider == "direct":
        raise UsageError("--preload needs the RAM tier, and --provider direct keeps no expert",
                         fix="drop --provider direct (or --preload)")
    tokens = _parse_tokens(args.tokens) if args.tokens else None
    tok, prompt = (None, tokens) if tokens is not None else tokenized_prompt(args)
    args.prompt_tokens = len(prompt)        # the memory budget's prompt batch (_tiers.ram_and_lookahead)
    eng, spec = _open(args)
    try:
        preload_s = None
        if args.preload:
            t0 = time.perf_counter()
            eng.warm()
            preload_s = time.perf_counter() - t0
        if args.trace:
            eng.trace(args.trace)
        if tokens is not None:
            return _run_tokens(eng, spec, tokens, args)
        return _generate(eng, spec, args, tok, prompt, preload_s)
    finally:
        eng.close()


def _run_tokens(eng, spec, tokens: list[int], args: argparse.Namespace) -> int:
    import numpy as np
    t0 = time.perf_counter()
    logits = eng.logits(tokens).numpy().astype(np.float32)
    secs = time.perf_counter() - t0
    if args.logits_out:
        np.save(args.logits_out, logits)
    top = logits.argmax(-1).tolist()
    if args.json:
        _print_json({"tokens": tokens, "argmax": top, "seconds": secs,
                     "logits_out": args.logits_out, "shape": list(logits.shape),
                     "stats": _stats(eng, spec)})
    else:
        print(" ".join(str(t) for t in top))
        if args.logits_out:
            print(f"wrote {args.logits_out}: float32 {logits.shape[0]} x {logits.shape[1]}",
                  file=sys.stderr)
    return 0


class _Status:
    """The live status line on stderr (only on a terminal).

    When the generated text goes to the same terminal, the line is drawn only while the text
    cursor is at the start of a line (``at_line_start``), in the line the next text will
    take, and cleared before that text is written: streamed text is never overwritten."""

    def __init__(self, eng, enabled: bool) -> None:
        self.eng, self.enabled, self.last = eng, enabled and sys.stderr.isatty(), 0.0
        self.shared = sys.stdout.isatty()
        self.at_line_start = True
        self.shown = False
        st = eng.provider.stats
        self.b0, self.s0 = st.bytes_read, st.stall_seconds

    def text(self, piece: str) -> None:
        """Write generated text to stdout (clearing the status line first when shown)."""
        self.clear()
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.at_line_start = piece.endswith("\n")

    def line(self, n_decoded: int, decode_s: float) -> str:
        st = self.eng.provider.stats
        req = max(1, st.requests)
        tiers = " ".join(f"{k} {100 * v / req:.0f}%" for k, v in sorted(st.hits.items())) or "-"
        tps = n_decoded / decode_s if decode_s > 0 else 0.0
        mb = (st.bytes_read - self.b0) / max(1, n_decoded) / 1e6
        return (f"{tps:6.2f} tok/s | hit {tiers} | {mb:7.1f} MB/token | "
                f"stall {st.stall_seconds - self.s0:6.2f} s")

    def draw(self, n: int, decode_s: float) -> None:
        now = time.perf_counter()
        if (not self.enabled or now - self.last < 0.25
                or (self.shared and not self.at_line_start)):
            return
        self.last = now
        sys.stderr.write("\r\x1b[2K" + self.line(n, decode_s))
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        if self.enabled and self.shown:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
            self.shown = False


def _generate(eng, spec, args: argparse.Namespace, tok, prompt: list[int],
              preload_s: float | None = None) -> int:
    from ..runtime.generate import generate
    from ..runtime.sampling import Sampler, SamplingParams
    sampler = Sampler(SamplingParams(args.temp, args.top_k, args.top_p, args.seed))
    status = _Status(eng, not args.json)
    detok = tok.detokenizer()
    out_ids: list[int] = []
    ttft = 0.0
    t_first = None
    ps = eng.provider.stats
    bytes0, requests0, hits0 = ps.bytes_read, ps.requests, dict(ps.hits)   # after any preload
    stall0 = ps.stall_seconds
    stops = set() if args.ignore_eos else tok.stop_ids
    speculator = spec.speculator if spec is not None else None
    for step in generate(eng, prompt, sampler, args.n_predict, stops, speculator):
        if step.index == 0:
            ttft, t_first = step.seconds, time.perf_counter()
            bytes_prefill, stall_prefill = ps.bytes_read - bytes0, ps.stall_seconds - stall0
        if step.stop:
            break
        out_ids.append(step.token)
        piece = detok.push(step.token)
        if piece and not args.json:
            status.text(piece)
        if t_first is not None:
            status.draw(len(out_ids) - 1, time.perf_counter() - t_first)
    status.clear()
    n_dec = max(0, len(out_ids) - 1)
    dec_s = eng.times.decode_s
    st = _stats(eng, spec)
    dec_bytes = ps.bytes_read - bytes0 - (bytes_prefill if t_first is not None else 0)
    requests = max(1, ps.requests - requests0)
    summary: dict[str, Any] = {
        "prompt_tokens": len(prompt), "generated_tokens": len(out_ids),
        "time_to_first_token_s": ttft,
        "decode_tokens_per_s": n_dec / dec_s if dec_s > 0 and n_dec else 0.0,
        "prefill_tokens_per_s": len(prompt) / st["prefill_s"] if st["prefill_s"] else 0.0,
        "mb_read_per_token": dec_bytes / max(1, n_dec) / 1e6,
        "hit_rate": {k: (v - hits0.get(k, 0)) / requests for k, v in ps.hits.items()},
        "stall_s": ps.stall_seconds - stall0,
        "decode_stall_s": ps.stall_seconds - stall0 - (stall_prefill if t_first is not None else 0),
        "ram_tier_bytes": getattr(args, "ram_tier_bytes", None),
        "vram_tier_bytes": args.vram, "vram_plan": getattr(args, "vram_plan", None),
        "pinned_bytes": st.get("tiers", {}).get("pinned_bytes", 0),
    }
    if t_first is not None:
        summary.update(_prefill_reads(args.store, bytes_prefill, ttft))
    if preload_s is not None:
        summary["preload_s"] = preload_s
    if args.json:
        _print_json({"text": tok.decode(out_ids), "tokens": out_ids, "prompt": prompt,
                     **summary, "stats": st})
        return 0
    sys.stdout.write("\n")
    if summary.get("prefill_read_mb"):
        drive = summary["drive_mb_s"]
        print(f"prefill read {summary['prefill_read_mb']:.0f} MB at "
              f"{summary['prefill_read_mb_s']:.0f} MB/s ("
              + (f"{100 * summary['prefill_read_mb_s'] / drive:.0f}% of the drive's "
                 f"{drive:.0f} MB/s)" if drive else "the drive's rate: run expertfs plan once)"),
              file=sys.stderr)
    hits = " ".join(f"{k} {100 * v:.0f}%" for k, v in summary["hit_rate"].items()) or "-"
    print(f"prompt {len(prompt)} tokens, first token after {ttft:.2f} s; "
          f"{len(out_ids)} generated at {summary['decode_tokens_per_s']:.2f} tok/s; "
          f"hit {hits}; {summary['mb_read_per_token']:.1f} MB read/token; "
          f"stall {summary['stall_s']:.2f} s; trunk {fmt_bytes(eng.trunk.float_bytes)} float",
          file=sys.stderr)
    if "lookahead" in st:
        print(lookahead_line(st["lookahead"]), file=sys.stderr)
    if "mtp" in st:
        m = st["mtp"]
        line = (f"mtp: {m['tokens_per_step']:.2f} tokens/step, acceptance "
                f"{100 * m['acceptance']:.0f}% ({m['accepted']}/{m['drafted']} drafts)")
        dp = m.get("draft_prefetch")
        if dp:
            line += (f"; draft prefetch coverage {100 * dp['coverage']:.0f}%, waste "
                     f"{100 * dp['waste']:.0f}%")
        print(line, file=sys.stderr)
    if "route_tail_skip" in st:
        rs = st["route_tail_skip"]
        print(f"route tail skip (lossy, N={rs['n']}): {rs['skipped_experts']} expert reads "
              f"skipped, {100 * rs['skipped_pair_share']:.1f}% of routed pairs",
              file=sys.stderr)
    return 0


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
