#!/usr/bin/env python3
"""Issue 6's figures: MTP speculative decoding, draft-route prefetch, the route tail skip.

    sudo .venv/bin/python bench/bench_mtp.py --run RUN_DIR --work DIR [--inflate 32] [--json]
    .venv/bin/python bench/bench_mtp.py --run RUN_DIR --work DIR --inflate 64 --gguf-out M.gguf
        (only the inflated model as a GGUF, for ``bench_lowram.py --model M.gguf``)

``RUN_DIR`` is a ``tools/train_tiny_moe.py`` run (model.pt with its trained NextN block,
tokenizer.json, held_out.npy). Every figure is measured in this run:

A. **acceptance** against temperature and top-p: speculative generation (``--depth`` drafts
   per step) from held-out prompts on the trained model's store (F16 export).
B. **route predictors**: coverage and waste of the draft-route predictor and its alternatives
   against the baselines (next-layer lookahead, history) on teacher-forced verify passes over
   held-out text (``runtime.mtp.evaluate.route_predictors``), for each draft depth.
C. **decode speed under a memory cgroup** on a store larger than its RAM budget: the trained
   model with every routed and shared expert zero-padded ``--inflate``× wider (the same
   function, checked here: same greedy tokens; experts as many bytes as a big model's). Cold
   page cache, the whole process (page cache included) capped at ``--cap`` of the store, the
   RAM tier a quarter of the experts, every run from the same learned-usage state;
   configurations run round-robin ``--rounds`` times, the median kept: plain, next-layer
   lookahead (on, and tuned as ``run`` does by default: ``runtime.prefetch.tuner``, whose
   trial takes its first 48 decode tokens), MTP, MTP + draft-route prefetch (with and without
   lookahead), MTP auto + draft prefetch, route tail skip (alone and with MTP), every one
   without the lookahead unless named with it; each also against the disk roofline (the
   drive's random whole-expert bandwidth, measured before and after, over plain's MB read per
   token: its demand misses at the tier's hit rate), as ``bench_lowram.py`` measures it.
D. **route tail skip** quality against exact decoding: teacher-forced next-token distributions
   (top-1 agreement, mean KL) beside C's speed-up.

Needs root (cgroups, drop_caches). Prints tables; ``--json`` the raw figures (also written to
``WORK/bench_mtp.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))

BIN = os.path.dirname(sys.executable)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# --- stores ----------------------------------------------------------------------------------

def export_store(run: str, work: str, name: str = "trained") -> str:
    import export_glm4moe_gguf as ex

    from expertfs.store.repack import repack
    gguf = os.path.join(work, f"{name}.gguf")
    store = os.path.join(work, f"{name}.efs")
    if not os.path.exists(store):
        ex.export(run, gguf, experts="F16", matrices="F16")
        repack([gguf], store, force=True)
        os.remove(gguf)
    return store


def inflate_run(run: str, work: str, factor: int) -> str:
    """A run dir whose model is ``run``'s with routed and shared experts zero-padded to
    ``factor``× their width: silu(0)·0 = 0, so the function is unchanged."""
    import torch
    from train_tiny_moe_model import TinyGlmMoe, load_checkpoint, save_checkpoint
    out = os.path.join(work, f"run-x{factor}")
    if os.path.exists(os.path.join(out, "model.pt")):
        return out
    os.makedirs(out, exist_ok=True)
    model, meta = load_checkpoint(os.path.join(run, "model.pt"))
    p = model.preset
    I = p.moe_ff
    big = TinyGlmMoe(dataclasses.replace(p, moe_ff=I * factor), 0)
    sd, bd = model.state_dict(), big.state_dict()
    with torch.no_grad():
        for k, v in bd.items():
            src = sd[k]
            if src.shape == v.shape:
                v.copy_(src)
                continue
            v.zero_()
            if k.endswith("gate_up_proj"):                      # [E, 2I, H]: gate ; up
                v[:, :I] = src[:, :I]
                v[:, I * factor:I * factor + I] = src[:, I:]
            elif k.endswith("experts.down_proj"):               # [E, H, I]
                v[..., :I] = src
            elif k.endswith(("gate_proj.weight", "up_proj.weight")):   # shared [I_s, H]
                v[:src.shape[0]] = src
            elif k.endswith("down_proj.weight"):                # shared [H, I_s]
                v[:, :src.shape[1]] = src
            else:
                raise SystemExit(f"cannot inflate {k}: {tuple(src.shape)} -> {tuple(v.shape)}")
    save_checkpoint(os.path.join(out, "model.pt"), big, meta)
    for f in ("tokenizer.json", "held_out.npy"):
        shutil.copy(os.path.join(run, f), out)
    return out


# --- A, B, D: in-process on the trained store ---------------------------------------------------

@contextlib.contextmanager
def _engine(store: str, **opts):
    """(engine, ``runtime.mtp.Speculation`` or None) for the engine and MTP options in ``opts``."""
    from expertfs.runtime.engine import Engine, EngineOptions
    from expertfs.runtime.mtp import MTPOptions, attach
    prov = opts.pop("provider", "direct")
    ram = opts.pop("ram_bytes", 0)
    opts.setdefault("fused", "off")
    mtp = MTPOptions(**{k: opts.pop(k) for k in ("mtp", "mtp_max", "draft_prefetch",
                                                 "route_tail_skip") if k in opts})
    with Engine.open(store, provider=prov, ram_bytes=ram,
                     options=mtp.engine_options(EngineOptions(**opts))) as eng:
        yield eng, attach(eng, mtp)


def part_acceptance(store: str, held, a: argparse.Namespace) -> list[dict]:
    from expertfs.runtime.eval.mtp import acceptance
    from expertfs.runtime.sampling import SamplingParams
    prompts = [held[i * 400:i * 400 + 48].tolist() for i in range(a.prompts)]
    grid = [(0.0, 1.0)] + [(t, p) for t in (0.3, 0.6, 1.0) for p in (1.0, 0.9)]
    rows = []
    with _engine(store, mtp=a.depth) as (_, sp):
        for t, p in grid:
            d = acceptance(sp, prompts, SamplingParams(temperature=t, top_p=p, seed=11), a.n_new)
            d.update(temperature=t, top_p=p, depth=a.depth)
            rows.append(d)
            log(f"A  temp {t:.1f} top-p {p:.2f}: acceptance {d['acceptance']:.3f} "
                f"tokens/step {d['tokens_per_step']:.2f}")
    return rows


def part_predictors(store: str, held, a: argparse.Namespace) -> dict:
    from expertfs.runtime.eval.mtp import route_predictors
    out = {}
    for k in a.pred_depths:
        with _engine(store, mtp=k, lookahead=True, lookahead_margin=2) as (_, sp):
            r = route_predictors(sp, held.tolist(), segments=a.segments)
        out[str(k)] = r
        log(f"B  depth {k}: {r['steps']} verify passes in {r['seconds']:.0f} s")
    if a.traces:
        from expertfs.runtime.eval.prefetch import evaluate_predictor
        from expertfs.runtime.prefetch import HistoryPredictor
        from expertfs.runtime.trace.file import TraceReader
        with TraceReader(os.path.join(a.traces, "decode.efstrace")) as r:
            h = r.header
            s = evaluate_predictor(HistoryPredictor(h.n_layers, h.n_experts), h, r.chunks(),
                                   budget=2 * h.k, skip_tokens=256)
        out["history_on_decode_trace"] = {"recall": s.score.recall, "precision": s.score.precision,
                                          "budget": 2 * h.k, "rows": s.rows}
    return out


def part_tailskip_quality(store: str, held, ram: int, ns: list[int],
                          a: argparse.Namespace) -> list[dict]:
    from expertfs.runtime.eval.mtp import tail_skip_quality
    rows = []
    for n in ns:
        with _engine(store, provider="tiered", ram_bytes=ram) as (ex, _), \
                _engine(store, provider="tiered", ram_bytes=ram, route_tail_skip=n) as (lo, _):
            d = tail_skip_quality(ex, lo, held.tolist(), segments=a.segments // 2 or 1)
        d["n"] = n
        rows.append(d)
        log(f"D  N={n}: top-1 agreement {d['top1_agreement']:.3f}, mean KL {d['mean_kl']:.4f}")
    return rows


# --- C: speed under the cap ------------------------------------------------------------------

def _text(run: str, ids) -> str:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(run, "tokenizer.json")).decode(list(map(int, ids)))


def part_speed(store: str, run: str, held, a: argparse.Namespace, k: int) -> dict:
    from lowram import block_device_of, disk_bandwidth, run_capped
    from expertfs.store.reader import Store
    with Store.open(store) as s:
        expert_bytes = sum(s.extent(la, e).length for la in s.layers for e in range(s.n_experts(la)))
    size = sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store)
               if os.path.isfile(os.path.join(store, f)))
    ram = int(expert_bytes * a.ram_frac)
    cap = int(size * a.cap)
    dev = block_device_of(store)
    prompts = [_text(run, held[i * 500 + 100:i * 500 + 100 + 40]) for i in range(a.speed_prompts)]
    d = str(a.speed_depth)
    index = os.path.join(store, "index.lmdb")
    pristine = index + ".pristine"                 # every run starts from the same learned
    if not os.path.exists(pristine):               # usage (runs record theirs on close)
        shutil.copytree(index, pristine)
    half = max(1, k // 2)
    off = ["--no-lookahead"]                       # run's default tunes it (prefetch.tuner)
    configs = {
        "plain": off,
        "lookahead": ["--lookahead"],
        "lookahead tuned (default)": [],
        "lookahead into the cache": ["--lookahead", "--prefetch-slots", "0"],
        f"mtp {d}": ["--mtp", d, *off],
        f"mtp {d} + draft prefetch": ["--mtp", d, "--draft-prefetch", *off],
        f"mtp {d} + draft prefetch + lookahead": ["--mtp", d, "--draft-prefetch", "--lookahead"],
        "mtp auto + draft prefetch": ["--mtp", "auto", "--draft-prefetch", *off],
        f"tail skip {half}": ["--route-tail-skip", str(half), *off],
        f"mtp {d} + draft prefetch + tail skip {half}": ["--mtp", d, "--draft-prefetch",
                                                          "--route-tail-skip", str(half), *off],
    }
    if a.configs:
        want = [c.strip() for c in a.configs.split(",")]
        configs = {n: v for n, v in configs.items() if n in want}
    res: dict[str, list[dict]] = {c: [] for c in configs}
    disk = [disk_bandwidth(store)]                 # before and after: the drive drifts
    for rnd in range(a.rounds):
        for name, extra in configs.items():
            for pi, prompt in enumerate(prompts):
                argv = [os.path.join(BIN, "expertfs"), "run", store, "-p", prompt, "-n",
                        str(a.speed_tokens), "-t", str(a.threads), "--ram", str(ram),
                        "--ignore-eos", "--json", "--fused", "off", "--temp", str(a.temp),
                        "--top-p", "0.95", "--seed", str(pi)] + extra
                shutil.rmtree(index)
                shutil.copytree(pristine, index)
                r = run_capped(argv, cap, dev, timeout=a.timeout)
                if r.returncode != 0:
                    res[name].append({"failed": r.returncode, "stderr": r.stderr[-500:]})
                    log(f"C  {name}: failed {r.returncode}: {r.stderr[-300:]}")
                    continue
                j = json.loads(r.stdout[r.stdout.find("{"):])
                st = j.get("stats", {})
                m = st.get("mtp", {})
                row = {"tok_s": j["decode_tokens_per_s"], "mb_per_token": j["mb_read_per_token"],
                       "stall_s": j["stall_s"], "hit": j["hit_rate"], "peak": r.peak_bytes,
                       "wall_s": r.seconds, "tokens": j["tokens"],
                       "acceptance": m.get("acceptance"),
                       "tokens_per_step": m.get("tokens_per_step"),
                       "draft_prefetch": m.get("draft_prefetch"),
                       "tail_skip": st.get("route_tail_skip"),
                       "prefetch": st.get("provider_stats", {}).get("prefetch_issued"),
                       "lookahead": st.get("lookahead")}
                res[name].append(row)
                la = row["lookahead"] or {}
                log(f"C  round {rnd} {name} prompt {pi}: {row['tok_s']:.2f} tok/s, "
                    f"{row['mb_per_token']:.1f} MB/token, peak {r.peak_bytes / 2**20:.0f} MiB"
                    + (f", lookahead kept {'on' if la['tuned_on'] else 'off'} (trials, ms a "
                       f"token on/off: {la['trial_ms']})" if la.get("tuned") else ""))
    summary = {}
    for name, rows in res.items():
        ok = [r for r in rows if "failed" not in r]
        if not ok:
            summary[name] = {"failed": rows[0] if rows else None}
            continue
        summary[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in ok),
            "mb_per_token": statistics.median(r["mb_per_token"] for r in ok),
            "stall_s": statistics.median(r["stall_s"] for r in ok),
            "peak_mib": max(r["peak"] for r in ok) / 2**20,
            "acceptance": _med([r["acceptance"] for r in ok]),
            "tokens_per_step": _med([r["tokens_per_step"] for r in ok]),
            "draft_coverage": _med([(r["draft_prefetch"] or {}).get("coverage") for r in ok]),
            "draft_waste": _med([(r["draft_prefetch"] or {}).get("waste") for r in ok]),
            "draft_fetched_waste": _med([_fetched_waste(r["draft_prefetch"]) for r in ok]),
            "runs": len(ok)}
    disk.append(disk_bandwidth(store))
    plain_mb = summary.get("plain", {}).get("mb_per_token")
    # the disk roofline: a token's demand misses at the tier's hit rate (plain's MB read per
    # token) read at the measured bandwidth, the lower and the higher measurement
    roof = sorted(bw / (plain_mb * 1e6) for bw in disk) if plain_mb else None
    return {"store_bytes": size, "expert_bytes": expert_bytes, "cap_bytes": cap,
            "disk_bytes_per_s": disk, "roofline_tok_s": roof,
            "ram_tier": ram, "device": dev, "threads": a.threads, "temperature": a.temp,
            "tokens": a.speed_tokens, "prompts": len(prompts), "rounds": a.rounds,
            "summary": summary, "runs": res}


def _fetched_waste(d: dict | None) -> float | None:
    p = (d or {}).get("provider")
    if not p or not p.get("issued_bytes"):
        return None
    return p["wasted_bytes"] / p["issued_bytes"]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def check_inflated(small: str, big: str, held) -> bool:
    """The inflated store decodes the same greedy tokens as the trained one."""
    from expertfs.runtime.generate import generate
    from expertfs.runtime.sampling import Sampler
    outs = []
    for s in (small, big):
        with _engine(s) as (eng, _):
            outs.append([x.token for x in generate(eng, held[:32].tolist(), Sampler(), 24)])
    return outs[0] == outs[1]


# --- report ------------------------------------------------------------------------------------

def report(res: dict) -> None:
    if "acceptance" in res:
        print(f"\nA. MTP draft acceptance on the trained model (depth {res['acceptance'][0]['depth']},"
              f" {res['args']['prompts']} held-out prompts x {res['args']['n_new']} tokens)")
        print(f"{'temp':>5} {'top-p':>6} {'accept':>7} {'tok/step':>9}  by depth (given the previous)")
        for r in res["acceptance"]:
            dep = " ".join(f"{x:.2f}" for x in r["accept_given_previous"])
            print(f"{r['temperature']:5.1f} {r['top_p']:6.2f} {r['acceptance']:7.3f} "
                  f"{r['tokens_per_step']:9.2f}  {dep}")
    if "predictors" in res:
        for k, r in res["predictors"].items():
            if k == "history_on_decode_trace":
                print(f"\nhistory predictor one layer ahead, in-pass (it sees the token's route "
                      f"at the layer before), on the run's decode trace: recall "
                      f"{r['recall']:.3f} precision {r['precision']:.3f} at {r['budget']} per layer")
                continue
            print(f"\nB. verify-pass experts named before the pass (depth {k}, {r['steps']} "
                  "teacher-forced passes; union over the pass's rows, per layer)")
            print(f"{'predictor':62s} {'coverage':>8} {'waste':>6} {'named/needed':>12}")
            for name, v in sorted(r["predictors"].items(), key=lambda kv: -kv[1]["coverage"]):
                print(f"{name:62s} {v['coverage']:8.3f} {v['waste']:6.3f} "
                      f"{v['named_per_needed']:12.2f}")
    if "speed" in res:
        s = res["speed"]
        print(f"\nC. decode under a memory cgroup: store {s['store_bytes'] / 2**20:.0f} MiB "
              f"(experts x{res['args']['inflate']} zero-padded, same tokens: "
              f"{res.get('inflated_same_tokens')}), cap {s['cap_bytes'] / 2**20:.0f} MiB, RAM "
              f"tier {s['ram_tier'] / 2**20:.0f} MiB, {s['threads']} thread(s), temp "
              f"{s['temperature']}, {s['tokens']} tokens x {s['prompts']} prompts x "
              f"{s['rounds']} rounds (median)")
        base = s["summary"].get("plain", {}).get("tok_s")
        look = s["summary"].get("lookahead", {}).get("tok_s")
        roof = s.get("roofline_tok_s")
        if roof:
            print(f"disk {min(s['disk_bytes_per_s']) / 1e9:.2f}-{max(s['disk_bytes_per_s']) / 1e9:.2f} "
                  f"GB/s (before and after); roofline {roof[0]:.2f}-{roof[1]:.2f} tok/s at plain's "
                  "MB read per token; /roof = tok/s over it (the higher roofline first)")
        print(f"{'configuration':44s} {'tok/s':>7} {'/plain':>7} {'/look':>7} {'/roof':>9} "
              f"{'MB/tok':>7} {'accept':>7} {'tok/step':>8} {'draft cov/waste (fetched)':>26}")
        for name, v in s["summary"].items():
            if "failed" in v:
                print(f"{name:44s} failed")
                continue
            cov = ("" if v["draft_coverage"] is None else
                   f"{v['draft_coverage']:.2f}/{v['draft_waste']:.2f} "
                   f"({v['draft_fetched_waste'] if v['draft_fetched_waste'] is None else round(v['draft_fetched_waste'], 2)})")
            rr = (f"{v['tok_s'] / roof[1]:.2f}-{v['tok_s'] / roof[0]:.2f}" if roof else "")
            print(f"{name:44s} {v['tok_s']:7.2f} {v['tok_s'] / base if base else 0:7.2f} "
                  f"{v['tok_s'] / look if look else 0:7.2f} {rr:>9} {v['mb_per_token']:7.1f} "
                  f"{'' if v['acceptance'] is None else round(v['acceptance'], 3)!s:>7} "
                  f"{'' if v['tokens_per_step'] is None else round(v['tokens_per_step'], 2)!s:>8} "
                  f"{cov:>26}")
    if "tailskip" in res:
        print("\nD. route tail skip (lossy, opt-in) against exact decoding: teacher-forced "
              "next-token distributions, and C's speed")
        sp = res.get("speed", {}).get("summary", {})
        base = sp.get("plain", {}).get("tok_s")
        print(f"{'N':>3} {'top-1 agree':>11} {'mean KL':>8} {'experts read':>13} {'speed-up':>9}")
        for r in res["tailskip"]:
            v = sp.get(f"tail skip {r['n']}", {})
            su = v.get("tok_s", 0) / base if base and v.get("tok_s") else None
            print(f"{r['n']:3d} {r['top1_agreement']:11.3f} {r['mean_kl']:8.4f} "
                  f"{r['experts_lossy'] / max(1, r['experts_exact']):13.2f} "
                  f"{'' if su is None else round(su, 2)!s:>9}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a tools/train_tiny_moe.py run directory")
    ap.add_argument("--work", required=True, help="scratch directory for stores and results")
    ap.add_argument("--traces", help="the run's traces directory (history baseline on it)")
    ap.add_argument("--depth", type=int, default=3, help="drafts per step for A (3)")
    ap.add_argument("--speed-depth", type=int, default=2, help="drafts per step for C (2)")
    ap.add_argument("--pred-depths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 3])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--n-new", type=int, default=48)
    ap.add_argument("--segments", type=int, default=8, help="128-token held-out segments (B, D)")
    ap.add_argument("--inflate", type=int, default=32, help="expert width factor for C")
    ap.add_argument("--cap", type=float, default=0.75, help="cgroup cap, fraction of the store")
    ap.add_argument("--ram-frac", type=float, default=0.25, help="RAM tier, fraction of experts")
    ap.add_argument("--speed-prompts", type=int, default=2)
    ap.add_argument("--speed-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--skip", default="", help="parts to skip, e.g. A,B")
    ap.add_argument("--configs", default="", help="C: only these configurations (names, commas)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--gguf-out", metavar="PATH",
                    help="only write the trained model, experts zero-padded --inflate x wide, as a "
                         "GGUF at PATH (for bench_lowram.py: the same model with llama.cpp beside)")
    a = ap.parse_args()
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    os.makedirs(a.work, exist_ok=True)
    if a.gguf_out:
        import export_glm4moe_gguf as ex
        big_run = inflate_run(a.run, a.work, a.inflate)
        ex.export(big_run, a.gguf_out, experts="F16", matrices="F16")
        shutil.rmtree(big_run)                      # the float32 checkpoint is large
        log(f"wrote {a.gguf_out} ({os.path.getsize(a.gguf_out) / 1e9:.2f} GB)")
        return 0
    skip = set(a.skip.upper().split(",")) if a.skip else set()
    held = np.load(os.path.join(a.run, "held_out.npy")).astype(np.int64)
    res: dict = {"args": vars(a)}
    t0 = time.time()
    store = export_store(a.run, a.work)
    from expertfs.store.reader import Store
    with Store.open(store) as s:
        k = int(s.gguf_kv()["glm4moe.expert_used_count"].value)
        expert_bytes = sum(s.extent(la, e).length for la in s.layers
                           for e in range(s.n_experts(la)))
    if "A" not in skip:
        res["acceptance"] = part_acceptance(store, held, a)
    if "B" not in skip:
        res["predictors"] = part_predictors(store, held, a)
    ns = sorted({max(1, k // 2), max(1, 3 * k // 4)})
    if "D" not in skip:
        res["tailskip"] = part_tailskip_quality(store, held, expert_bytes // 4, ns, a)
    if "C" not in skip:
        big = os.path.join(a.work, f"trained-x{a.inflate}.efs")
        if not os.path.exists(big):
            big_run = inflate_run(a.run, a.work, a.inflate)
            export_store(big_run, a.work, f"trained-x{a.inflate}")
            shutil.rmtree(big_run)                  # the float32 checkpoint is large
        res["inflated_same_tokens"] = check_inflated(store, big, held)
        res["speed"] = part_speed(big, a.run, held, a, k)
    res["seconds"] = time.time() - t0
    with open(os.path.join(a.work, "bench_mtp.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    if a.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        report(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
