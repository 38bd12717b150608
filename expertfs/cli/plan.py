"""``expertfs plan STORE|MODEL.gguf|--like MODEL --ram 32G --vram 24G``: a memory budget, a
predicted decode tokens/s range and first-token time for a box, with what limits them and
what to change."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..units import parse_size

if TYPE_CHECKING:
    from ..runtime.plan.geometry import Geometry

__all__ = ["register", "run", "like_model", "geometry_from_synth", "geometry_from_like"]

_EPILOG = """\
Each placement expert run can execute (gpu: trunk, KV cache and experts on the GPU with a VRAM
tier above a RAM tier; cpu: everything on the CPU) with the trunk float or quantized is
budgeted as expertfs run sizes its default --ram (one function): OS headroom (RAM/8, at least
3 GiB or RAM/4, none under a cap: a cgroup, EXPERTFS_MEMORY_LIMIT, --memory-limit; --headroom),
the runtime, trunk and KV cache,
workspace and staging, then the expert tiers (the RAM tier pinned when it fits the pin budget,
RAM/4 by default). The prediction replays routing through the cache simulator at those tier
sizes and adds the per-token terms: storage (NVMe bytes / measured GB/s), PCIe copies,
dequant+matmul of experts and trunk, attention over the KV cache, dispatch. slow end = their
sum; fast end = reads fully overlapped with compute. The fastest placement is chosen and the
`expertfs run` flags that execute it are printed.

Inputs, each reported with its source: --io-profile (from `expertfs bench io STORE --json`)
or --disk-gbps (the drive of a box not at hand), else a short probe of the store or GGUF
(cached per box; the CPU's cached rates are measured anew when a quarter-second speed check
finds the box faster or slower than when they were taken, and the slowest and fastest checks
of the last day widen their ends), else a stated default; --trace (a recorded routing trace), else the usage a store learned in earlier runs
(which experts, and how its decodes kept and reused them token to token), else synthetic
routing (slow end 'diffuse', fast end 'mixed'), labelled as such. A run's start counts too: the
experts its decode reads after the prompt (--prompt-tokens) and the CPU of the warm start
filling the RAM tier, over -n tokens.
Exit status: 0 it fits, 1 it cannot run at all, 2 bad input.

  expertfs plan --like GLM-4.5-Air --ram 32G --vram 24G
  expertfs plan --like GLM-5.3-Flash --ram 32G --vram 24G --disk-gbps 7   (a box not at hand)
  expertfs plan model.efs --ram 32G --vram 24G --io-profile io.json --trace run.eftrace --json
  expertfs plan model.gguf            (this machine's RAM and GPU)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..runtime.plan.routing import DEFAULT_SYNTHETIC, DEFAULT_TOKENS

    p = subparsers.add_parser("plan", help="memory budget, predicted decode tokens/s and first "
                              "token for a box",
                              description="Plan a model on a box: where everything goes and how "
                                          "fast decode will be.",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", metavar="STORE|MODEL.gguf",
                   help="a store folder or a GGUF (first shard of a split one)")
    p.add_argument("--like", metavar="MODEL", help="plan a known model's geometry instead (e.g. "
                   "GLM-4.5-Air, Qwen3-235B-A22B; see `expertfs synth --help`)")
    p.add_argument("--quant", default="default", help="with --like: the quant mix (synth --quant)")
    p.add_argument("--ram", metavar="SIZE", help="RAM of the box, e.g. 32G (default: this "
                   "machine's, or its memory cap: a cgroup, EXPERTFS_MEMORY_LIMIT)")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="plan under a cap, as expertfs run does in a cgroup or under "
                        "EXPERTFS_MEMORY_LIMIT=SIZE: no OS headroom inside it")
    p.add_argument("--vram", metavar="SIZE", help="VRAM of the GPU, e.g. 24G; 0 for CPU only "
                                                  "(default: this machine's first CUDA device, else 0)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length of the KV cache (4096 as expertfs run, or the model's "
                        "if shorter)")
    p.add_argument("--kv-type", default="auto",
                   help="KV cache element type: auto (the compute dtype: bf16 GPU, f32 CPU), f16, "
                        "bf16, f32, q8_0")
    p.add_argument("--headroom", metavar="SIZE", help="RAM left to the OS (default RAM/8, at least 3G or RAM/4)")
    p.add_argument("--pin-budget", metavar="SIZE",
                   help="pinned-memory limit, as EXPERTFS_PIN_BUDGET (default: RAM/4)")
    p.add_argument("--placement", default="auto", choices=("auto", "gpu", "hybrid", "cpu"),
                   help="where trunk and experts run (auto: the fastest expert run supports)")
    p.add_argument("--trunk", default="auto", choices=("auto", "float", "quant"),
                   help="trunk dequantized at load (float) or per call (quant); auto: the faster")
    p.add_argument("--io-profile", metavar="P.json", help="storage rates from `expertfs bench io --json`")
    p.add_argument("--disk-gbps", metavar="GB/s",
                   help="the drive of the box planned for, instead of measuring this one's: its "
                        "read rate at expert-sized random reads, X (the slow end 0.6 X: a spec "
                        "sheet states the best case) or LO-HI")
    p.add_argument("--trace", metavar="T", help="a routing trace recorded with this model")
    p.add_argument("--synthetic", default=",".join(DEFAULT_SYNTHETIC), metavar="SLOW[,FAST]",
                   help="routing presets without --trace (default: %(default)s): their "
                        "popularity, or the store's learned usage with their dynamics")
    p.add_argument("--policy", default=None, help="cache policy to simulate (default: the runtime's)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help="tokens of synthetic routing to simulate (%(default)s)")
    p.add_argument("-n", "--n-predict", type=int, default=64, metavar="N",
                   help="tokens the run generates, as run's -n (%(default)s): the first reads of "
                        "the experts (the tiers start empty) are spread over them")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="P",
                   help="the run's prompt: the first token's time is predicted for it, and "
                        "the experts it loads are in the tiers before the decode (%(default)s)")
    p.add_argument("--pcie", type=int, default=4, metavar="GEN",
                   help="PCIe generation for the stated H2D rate without CUDA (4)")
    p.add_argument("--gpu-bw", type=float, metavar="GB/s",
                   help="GPU memory bandwidth to assume instead of the stated default")
    p.add_argument("--act-quant", choices=("off", "q8"), default="off",
                   help="plan for run's --act-quant (LOSSY, opt-in): q8 prices the CPU's "
                        "products as the native kernels compute them with 8-bit activations "
                        "(measured so); off = exact (default)")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="measure nothing: stated defaults for storage, CPU and GPU")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _size(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}", fix=f"write {flag} as e.g. 32G") from None


def _gbps(text: str | None, flag: str) -> tuple[float, ...] | None:
    """``X`` or ``LO-HI`` as numbers (GB/s; the planner checks and widens them)."""
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split("-"))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a rate in GB/s",
                         fix=f"write {flag} as one positive figure (e.g. 7) or a range LO-HI "
                             "(e.g. 3.5-6)") from None


def like_model(name: str, quant: str = "default") -> tuple[Any, str]:
    """The GGUF ``expertfs synth --like NAME --quant QUANT`` would write, described in memory
    (a ``formats.gguf_read.GGUFModel``; nothing written), and what the plan calls it."""
    from ..synth import SynthConfig, build_model

    cfg = SynthConfig.like(name, quant=quant)
    return (build_model(cfg).gguf_model(),
            f"--like {cfg.name} (quant {quant}, as expertfs synth writes it)")


def geometry_from_synth(cfg: Any, source: str | None = None) -> Geometry:
    """The plan's ``Geometry`` of the GGUF ``expertfs synth`` would write for ``cfg`` (a
    ``SynthConfig``), laid out as ``repack`` would store it; nothing is written."""
    from ..runtime.plan.model import geometry_from_model
    from ..synth import build_model

    return geometry_from_model(build_model(cfg).gguf_model(),
                               source or f"synth {cfg.name} (quant {cfg.quant})")


def geometry_from_like(name: str, quant: str = "default") -> Geometry:
    """The plan's ``Geometry`` of ``expertfs synth --like NAME --quant QUANT``'s GGUF."""
    from ..runtime.plan.model import geometry_from_model

    return geometry_from_model(*like_model(name, quant))


def tiny_gguf(path: str, arch: str, n_layers: int, k: int, period: int) -> None:
    """``plan.overhead.TinyWriter`` by ``expertfs synth``: the tiny model of ``arch`` at
    ``n_layers`` with ``k`` experts used (of its 8); glm5-next's KDA layers between MLA
    layers ``period`` apart, each MLA layer with its full indexer (GLM-5.3-Flash's kinds)."""
    from ..synth import SynthConfig, synthesize

    over: dict[str, Any] = {"n_layers": n_layers, "n_expert_used": k}
    if arch == "glm5-next":
        over.update(kda_interval=max(2, period), indexer_freq=1)
    synthesize(SynthConfig.tiny(arch, **over), path, overwrite=True)


def run(args: argparse.Namespace) -> int:
    from ..runtime.plan.predict import plan_to_dict
    from ..runtime.plan.report import format_plan
    from ..runtime.plan.run import PlanRequest, run_plan
    from ..runtime.policies.registry import DEFAULT_POLICY, parse_policies

    policy = args.policy or DEFAULT_POLICY
    if len(parse_policies(policy)) != 1:
        raise UsageError(f"--policy {policy!r}: give one policy", fix="e.g. --policy wlfu")
    synthetic = tuple(s.strip() for s in args.synthetic.split(",") if s.strip())
    if any("=" in s for s in synthetic):
        raise UsageError("--synthetic takes preset names", fix="e.g. --synthetic diffuse,mixed")
    req = PlanRequest(target=args.target,
                      ram=_size(args.ram, "--ram"), vram=_size(args.vram, "--vram"), ctx=args.ctx,
                      memory_limit=_size(args.memory_limit, "--memory-limit"),
                      kv_type=args.kv_type, headroom=_size(args.headroom, "--headroom"),
                      pin_budget=_size(args.pin_budget, "--pin-budget"), placement=args.placement,
                      trunk=args.trunk, io_profile=args.io_profile, trace=args.trace,
                      synthetic=synthetic, policy=policy, tokens=args.tokens, probe=args.probe,
                      n_predict=args.n_predict, prompt_tokens=args.prompt_tokens,
                      pcie_gen=args.pcie, gpu_gbps=args.gpu_bw, act_quant=args.act_quant,
                      disk_gbps=_gbps(args.disk_gbps, "--disk-gbps"), tiny_store=tiny_gguf)
    if args.like:                  # the preset's model, described in memory: the runtime plans it
        if args.target:
            raise UsageError("give a store/GGUF or --like, not both", fix="drop one of them")
        model, source = like_model(args.like, args.quant)
        req = dataclasses.replace(req, model=model, source=source)
    elif args.target and args.quant != "default":
        raise UsageError("--quant applies to --like only", fix="drop --quant")

    def progress(msg: str) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"\r\033[K{msg}...", end="", file=sys.stderr, flush=True)

    plan = run_plan(req, progress)
    if not args.json and sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(plan_to_dict(plan), indent=1, default=str))
    else:
        print(format_plan(plan))
    return plan.exit_code
