"""Train → export → store → realistic routing traces (→ cache benchmark), in one command.

    python tools/make_realistic_traces.py OUT_DIR [--preset small] [--seed 0] [--bench]
                                          [--check-llama] [--llama-quantize Q4_K_M]

Stages, each into OUT_DIR (nothing is cached between runs; a fixed seed gives the same model):

1. ``tools/train_tiny_moe.py``       → OUT/run/ (tokenizer.json, model.pt, metrics.json, logs)
2. ``tools/export_glm4moe_gguf.py``  → OUT/model-<experts>.gguf (NextN included); with
   ``--check-llama`` llama.cpp against torch on the same weights: greedy top-1 of the trunk, and
   the NextN block's draft logits through llama.cpp's MTP graph
3. ``expertfs repack`` + ``expertfs verify --source`` → OUT/model-<experts>.efs
4. ``tools/trace_trained_moe.py``    → OUT/traces/{decode,mtp}.efstrace, trace_stats.json
   (bytes per expert from the store's extents)
5. with ``--bench``: ``expertfs bench cache --policies all`` on both traces at 12.5/25/50% of
   the trace's MoE experts (given as slot counts: the CLI's N% counts dense layers too; never
   below two routes), the mtp trace with ``--drafts`` → OUT/bench_{decode,mtp}.json and .md
   (hit rate / ×Belady per policy, ``trace_bench_table.py``)

``OUT/summary.json`` records every stage's wall time and headline numbers. ``--reuse`` keeps a
finished ``OUT/run`` of the same preset, seed and steps instead of training again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _expertfs() -> list[str]:
    return [sys.executable, "-m", "expertfs"]


def _run(cmd: list[str], log, capture: bool = False) -> str:
    log("$ " + " ".join(cmd))
    r = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE if capture else None)
    return r.stdout if capture else ""


def _reusable(run_dir: str, p, seed: int) -> dict | None:
    """The metrics of a finished training run of exactly this preset and seed, else None."""
    import dataclasses

    import torch
    path = os.path.join(run_dir, "model.pt")
    if not os.path.exists(os.path.join(run_dir, "metrics.json")) or not os.path.exists(path):
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck.get("preset") != dataclasses.asdict(p) or ck.get("meta", {}).get("seed") != seed:
        return None
    with open(os.path.join(run_dir, "metrics.json")) as f:
        return json.load(f)


def pipeline(out: str, *, preset: str = "small", seed: int = 0, steps: int | None = None,
             experts: str = "F16", matrices: str = "F16", tokens: int | None = None,
             segment: int | None = None, drafts: int = 2, threads: int = 1,
             check_llama: bool = False, llama_quantize: str | None = None, bench: bool = False,
             capacities: tuple[float, ...] = (0.125, 0.25, 0.5), reuse: bool = False,
             log=print) -> dict:
    import export_glm4moe_gguf as ex
    import trace_bench_table as bench_table
    import trace_trained_moe as tr
    import train_tiny_moe as train
    from train_tiny_moe_model import preset as get_preset
    os.makedirs(out, exist_ok=True)
    p = get_preset(preset, steps=steps)
    times: dict[str, float] = {}
    summary: dict = {"preset": p.name, "seed": seed, "steps": p.steps, "threads": threads}
    run_dir = os.path.join(out, "run")

    t = time.time()
    m = _reusable(run_dir, p, seed) if reuse else None
    if m is None:
        m = train.train(run_dir, p, seed, threads, "padded_bmm", log=log)
        times["train_total_s"] = round(time.time() - t, 1)
    else:
        log(f"reusing the trained model in {run_dir} (trained in {m['train_s']} s)")
        summary["reused_run"] = True
    summary["train"] = {k: m[k] for k in ("params", "tokens_seen", "initial_held_out_loss",
                                          "final_train_loss_ema", "held_out_loss", "held_out_top1",
                                          "held_out_mtp_loss", "mtp_next_next_top1",
                                          "mtp_greedy_accept", "uniform_loss", "s_per_step")}

    t = time.time()
    gguf = os.path.join(out, f"model-{experts.upper()}.gguf")
    summary["gguf"] = ex.export(run_dir, gguf, experts=experts, matrices=matrices)
    times["export_s"] = round(time.time() - t, 1)
    if llama_quantize:
        t = time.time()
        q = ex.llama_quantize(gguf, gguf[:-5] + f"-{llama_quantize.upper()}.gguf", llama_quantize,
                              threads)
        summary["gguf_llama_quantized"] = {"path": q, "bytes": os.path.getsize(q)}
        times["llama_quantize_s"] = round(time.time() - t, 1)
    if check_llama:
        t = time.time()
        summary["llama_check"] = ex.check_llama(run_dir, gguf, threads=threads)
        summary["llama_nextn_check"] = ex.check_llama_mtp(run_dir, gguf, threads=threads)
        if llama_quantize:
            summary["llama_check_quantized"] = ex.check_llama(run_dir, q, threads=threads)
            summary["llama_nextn_check_quantized"] = ex.check_llama_mtp(run_dir, q,
                                                                        threads=threads)
        times["llama_check_s"] = round(time.time() - t, 1)
        log(f"llama.cpp vs torch: {json.dumps(summary['llama_check'])}; NextN "
            f"{json.dumps(summary['llama_nextn_check'])}")

    t = time.time()
    store = gguf[:-5] + ".efs"
    _run(_expertfs() + ["repack", gguf, "-o", store, "--force"], log)
    _run(_expertfs() + ["verify", store, "--source", gguf], log)
    times["repack_verify_s"] = round(time.time() - t, 1)
    summary["store"] = store

    t = time.time()
    st = tr.write_traces(run_dir, os.path.join(out, "traces"), gguf=gguf, store=store,
                         tokens=tokens or (2048 if p.name == "tiny" else 8192),
                         segment=segment or min(256, p.seq * 4), drafts=drafts, threads=threads,
                         log=log)
    times["traces_s"] = round(time.time() - t, 1)
    summary["traces"] = {k: st[k] for k in ("tokens", "decode_trace", "mtp_trace",
                                            "draft_top1_vs_text", "draft0_equals_main_greedy",
                                            "draft_chain_accepted_vs_text")}

    if bench:
        t = time.time()
        from expertfs.runtime.trace.file import TraceReader
        summary["bench"] = {}
        for name, extra in (("decode", []), ("mtp", ["--drafts"])):
            trace = os.path.join(out, "traces", f"{name}.efstrace")
            with TraceReader(trace) as r:
                h = r.header
            n_moe = sum(1 for b in h.expert_bytes if b) * h.n_experts
            # at least two routes' worth (a capacity of one route has a Belady bound of 0)
            floor = 2 * h.k * (1 + (h.n_draft if extra else 0))
            caps = ",".join(str(max(floor, round(c * n_moe))) for c in capacities)
            summary["bench"][name] = {"capacity_slots": caps, "moe_experts": n_moe}
            cmd = _expertfs() + ["bench", "cache", "--trace", trace, "--policies", "all",
                                 "--capacity", caps] + extra
            js = _run(cmd + ["--json"], log, capture=True)
            with open(os.path.join(out, f"bench_{name}.json"), "w") as f:
                f.write(js)
            table = "\n".join(bench_table.rows(name, json.loads(js)))
            with open(os.path.join(out, f"bench_{name}.md"), "w") as f:
                f.write(bench_table.HEADER + table + "\n")
            log(bench_table.HEADER + table)
        times["bench_s"] = round(time.time() - t, 1)
    summary["times"] = times
    summary["total_s"] = round(sum(times.values()), 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--experts", default="F16")
    ap.add_argument("--matrices", default="F16")
    ap.add_argument("--tokens", type=int, help="traced tokens (default 8192; tiny 2048)")
    ap.add_argument("--segment", type=int)
    ap.add_argument("--drafts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-llama", action="store_true")
    ap.add_argument("--llama-quantize", metavar="FTYPE")
    ap.add_argument("--bench", action="store_true", help="run expertfs bench cache on the traces")
    ap.add_argument("--reuse", action="store_true",
                    help="keep OUT/run if it holds a finished run of this preset and seed")
    a = ap.parse_args(argv)
    s = pipeline(a.out_dir, preset=a.preset, seed=a.seed, steps=a.steps, experts=a.experts,
                 matrices=a.matrices, tokens=a.tokens, segment=a.segment, drafts=a.drafts,
                 threads=a.threads, check_llama=a.check_llama, llama_quantize=a.llama_quantize,
                 bench=a.bench, reuse=a.reuse, log=lambda x: print(x, flush=True))
    print(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
