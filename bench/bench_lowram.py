#!/usr/bin/env python3
"""expertfs against llama.cpp on a box with less RAM than the model (issue 5's headline target).

One run, same GGUF, same threads, same prompt and token count, caches dropped before each:

- llama.cpp (llama-cpp-python, mmap, ``use_extra_bufts=False``) under a memory cgroup that caps
  the whole process, page cache included, at ``--cap`` of the model's size; with the device's
  default readahead and with readahead lowered to 128 KB (its best setting here);
- ``expertfs run`` on the repacked store under the same cap, its RAM tier sized by ``run`` itself
  (no ``--ram``: what a user gets under that limit); it and
  llama.cpp at 128 KB alternate ``--rounds`` times (this disk drifts), medians reported;
- a disk roofline: the disk's random-read bandwidth at the expert size (``expertfs bench io``
  in the same run) ÷ the expert bytes expertfs missed per token;
- optionally (``--resident``) both without a cap: llama.cpp with the model in the page cache,
  expertfs with its trunk faulted in and every expert read into its RAM tier before the prompt
  (``--preload``; that time reported apart, as ``preload_s``), so both decode from memory from
  the first token.

llama.cpp runs with its own OpenMP defaults (``peer_environ``: without the wait policy
``expertfs.runtime`` puts in this process's environment). Prints a table and ratios;
``--json`` the raw figures. Needs root (cgroups, drop_caches, readahead) and llama-cpp-python.

    sudo .venv/bin/python bench/bench_lowram.py --model /work/scratch/low.gguf --size 6G --cap 0.33
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lowram import block_device_of, disk_bandwidth, readahead, run_capped  # noqa: E402

from expertfs.runtime.openmp import configure, peer_environ  # noqa: E402

configure()

from expertfs.store.reader import Store  # noqa: E402
from expertfs.units import fmt_bytes  # noqa: E402

BIN = os.path.dirname(sys.executable)
DEFAULT_QUANT = "experts=Q4_0,down=Q4_0"
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun"
#: a prompt as users write them: few words repeat, so its tokens route to as many experts as
#: a real request's do (``PROMPT`` repeated touches a fraction of them)
PROSE = ("Summarise the main arguments of the attached report on regional water policy. The "
         "authors compare three river basins over two decades, measuring rainfall, irrigation "
         "demand, groundwater depletion and the cost of desalination plants built since 2009. "
         "They argue that pricing reforms reduced agricultural waste faster than new dams did, "
         "although farmers in the southern valleys objected loudly to quotas. Please list each "
         "recommendation, note which evidence supports it, flag any statistical weaknesses you "
         "notice, and suggest two follow-up questions a journalist might ask the ministry. Keep "
         "the tone neutral, cite page numbers where possible, and write for readers without "
         "technical training in hydrology, economics or engineering. Finally, translate the "
         "executive summary into plain Spanish and German, estimate how long implementation "
         "would take, and explain what could go wrong during a severe drought next summer.")


def last_json(text: str) -> dict:
    return json.loads(text[text.index("{"):])


def prompt_args(a: argparse.Namespace, peer: str) -> list[str]:
    """The same prompt text for both (``PROMPT``, or ``--prompt-tokens``' longer one)."""
    text = a.prompt_text or PROMPT
    return ["--prompt", text] if peer == "llama" else ["-p", text]


def long_prompt(store: str, n: int, text: str = PROMPT) -> str:
    """``text``'s words (repeated where needed) until the model's tokenizer makes at least
    ``n`` tokens of them (the peers' prompt_n are reported: their tokenizers may differ by a
    token)."""
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    with Store.open(store) as st:
        tok = GGUFTokenizer(st.gguf_kv(), store)
    words, out = text.split(), ""
    i = 0
    while len(tok.encode(out)) < n:
        out += (" " if out else "") + words[i % len(words)]
        i += 1
    return out


def prompt_tokens(store: str, text: str) -> int:
    """``text``'s length as ``run`` will count it (the model's tokenizer, its BOS)."""
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    with Store.open(store) as st:
        return len(GGUFTokenizer(st.gguf_kv(), store).encode(text))


def prefill_tok_s(r: dict) -> float:
    """Prompt tokens per second of either peer's figures."""
    if "prefill_tokens_per_s" in r:
        return float(r["prefill_tokens_per_s"])
    return r.get("prompt_n", 0) / r["ttft_s"] if r.get("ttft_s") else 0.0


def synth(a: argparse.Namespace) -> None:
    """``--like`` cut to ``--layers`` or ``--size``; ``--experts``/``--vocab`` 0 and no
    ``--nextn`` keep the preset's."""
    from expertfs.synth import SynthConfig, layers_for_size, synthesize
    from expertfs.synth.presets import like_fields
    from expertfs.units import parse_size
    over: dict = {"quant": a.quant or like_fields(a.like).get("quant") or DEFAULT_QUANT}
    for key, v in (("n_experts", a.experts), ("n_vocab", a.vocab)):
        if v:
            over[key] = v
    if a.nextn is not None:
        over["n_nextn"] = a.nextn
    if a.dense_lead is not None:
        over["n_dense_lead"] = a.dense_lead
    cfg = SynthConfig.like(a.like, layers=a.layers or None, **over)
    synthesize(cfg if a.layers else layers_for_size(cfg, parse_size(a.size)), a.model)


def llama(model: str, cap: int | None, dev: str, ra: int | None, a: argparse.Namespace,
          warm: bool = False) -> dict:
    with readahead(dev, ra) as kb:
        r = run_capped([sys.executable, os.path.join(os.path.dirname(__file__), "llama_decode.py"),
                        model, *prompt_args(a, "llama"), "-n", str(a.n), "-t", str(a.threads),
                        "--temp", str(a.temp), "--seed", str(a.seed), "--ctx", str(a.ctx)],
                       cap, dev, timeout=a.timeout, env=peer_environ(),
                       warm=(model,) if warm else ())
    if r.returncode != 0:
        return {"peer": "llama.cpp", "failed": r.returncode, "stderr": r.stderr[-400:],
                "readahead_kb": kb, "peak": r.peak_bytes}
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d.update(readahead_kb=kb, wall_s=r.seconds, peak=r.peak_bytes, disk_read=r.disk_read,
             mb_read_per_token=d["decode_read_bytes_per_token"] / 1e6)
    return d


def expertfs_run(store: str, cap: int | None, dev: str, ram: int | None, a: argparse.Namespace,
                 trace: str | None = None, preload: bool = False) -> dict:
    argv = [os.path.join(BIN, "expertfs"), "run", store, *prompt_args(a, "expertfs"), "-n", str(a.n),
            "-t", str(a.threads), *(["--ram", str(ram)] if ram is not None else []),
            "--ctx", str(a.ctx), "--ignore-eos",
            "--temp", str(a.temp), "--seed", str(a.seed), "--json"]
    argv += ["--preload"] if preload else ["--no-warm-start"]
    argv += (["--trace", trace] if trace else []) + a.expertfs_args.split()
    r = run_capped(argv, cap, dev, timeout=a.timeout)
    if r.returncode != 0:
        return {"peer": "expertfs", "failed": r.returncode, "stderr": r.stderr[-600:], "peak": r.peak_bytes}
    d = last_json(r.stdout)
    d["bytes_read_total"] = d.get("stats", {}).get("provider_stats", {}).get("bytes_read")
    d.pop("stats", None)
    d.update(peer="expertfs", ram_tier=d.get("ram_tier_bytes", ram), wall_s=r.seconds, peak=r.peak_bytes, disk_read=r.disk_read)
    return d


def simulated_bytes(trace: str, ram: int) -> dict:
    """What ``bench cache`` predicts for the same trace and RAM budget (default policy)."""
    r = subprocess.run([os.path.join(BIN, "expertfs"), "bench", "cache", "--trace", trace,
                        "--ram", str(ram), "--policies", "default", "--json"],
                       capture_output=True, text=True)
    if r.returncode != 0:       # keep the measured runs: report, do not lose them
        return {"failed": r.returncode, "stderr": r.stderr[-600:]}
    pol = next(iter(json.loads(r.stdout)["points"][0]["policies"].values()))
    return {"bytes_nvme": pol["bytes_nvme"], "hit_rate": pol["hit_rate"], "tokens": pol["tokens"]}


def capped(res: dict, store: str, cap: int, dev: str, a: argparse.Namespace) -> None:
    """llama.cpp at the default readahead (unless ``--no-default``), then it at 128 KB and
    expertfs alternating."""
    if not a.no_default:
        res["llama_default"] = llama(a.model, cap, dev, None, a)
    # the two close peers alternate, --rounds times, the order swapped every round: this disk
    # drifts by more than the gap being measured; each keeps its median run
    rounds: list[dict] = []
    for rnd in range(a.rounds):
        row = {}
        for peer in (("llama_ra128", "expertfs") if rnd % 2 == 0 else ("expertfs", "llama_ra128")):
            if peer == "expertfs":
                trace = f"{store}.run{rnd}.efstrace"
                row[peer] = expertfs_run(store, cap, dev, None, a, trace)
                row[peer]["trace"] = trace
            else:
                row[peer] = llama(a.model, cap, dev, 128, a)
        rounds.append(row)
    res["rounds"] = rounds
    for peer, key in (("llama_ra128", "decode_tok_s"), ("expertfs", "decode_tokens_per_s")):
        ok = sorted((r[peer] for r in rounds if "failed" not in r[peer]), key=lambda d: d[key])
        res[peer] = ok[(len(ok) - 1) // 2] if ok else rounds[0][peer]
    if "failed" not in res["expertfs"]:
        res["ram_tier"] = res["expertfs"]["ram_tier"]
        res["simulated"] = simulated_bytes(res["expertfs"]["trace"], res["ram_tier"])
    bw = disk_bandwidth(store)
    res["disk_bytes_per_s"] = bw
    e = res["expertfs"]
    if "failed" not in e and e.get("mb_read_per_token"):
        res["roofline_tok_s"] = bw / (e["mb_read_per_token"] * 1e6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF path (synthesised if missing)")
    ap.add_argument("--size", default="6G", help="size to synthesise (default 6G)")
    ap.add_argument("--like", default="Qwen3-30B-A3B")
    ap.add_argument("--layers", type=int, default=0,
                    help="synthesise this many decoder layers instead of --size")
    ap.add_argument("--experts", type=int, default=64, help="routed experts (0: the preset's)")
    ap.add_argument("--nextn", type=int, default=None,
                    help="NextN blocks to synthesise (default: the preset's)")
    ap.add_argument("--dense-lead", type=int, default=None,
                    help="leading dense blocks of the cut (default: the preset's, at most all but "
                         "one; DeepSeek-V3's 3 would leave a 6 GB cut one MoE layer)")
    ap.add_argument("--quant", default=None,
                    help="synth --quant spec or preset (e.g. maya-s, q4_k_m; default: the "
                         "--like preset's own mix where it has one, gpt-oss's mxfp4_moe, "
                         f"else {DEFAULT_QUANT})")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="synthesised vocabulary, 0: the preset's (the presets' 150k one makes a "
                         "1 GB trunk)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="a prompt of about N tokens for both (the default text's words "
                         "repeated; prefill length)")
    ap.add_argument("--cap", type=float, default=1 / 3,
                    help="cgroup cap as a fraction of the model (0: no capped runs)")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temp", type=float, default=1.0,
                    help="sampling temperature for both (default 1.0: greedy decoding of random "
                         "weights repeats one token, the same experts every step, which "
                         "flatters every cache)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512, help="context limit for both peers (512)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating runs of llama.cpp at 128 KB readahead and expertfs; the "
                         "median of each is reported (3)")
    ap.add_argument("--resident", action="store_true", help="also compare with no cap, warm")
    ap.add_argument("--no-default", action="store_true",
                    help="skip llama.cpp at the default readahead under the cap (minutes a "
                    "token at full depth)")
    ap.add_argument("--resident-rounds", type=int, default=1,
                    help="alternating resident runs of each, median reported (1)")
    ap.add_argument("--expertfs-args", default="", help="extra flags for expertfs run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not os.path.exists(a.model):
        synth(a)
    store = a.model[:-5] + ".efs" if a.model.endswith(".gguf") else a.model + ".efs"
    if not os.path.exists(store):
        subprocess.run([os.path.join(BIN, "expertfs"), "repack", a.model, "-o", store], check=True,
                       stdout=subprocess.DEVNULL)
    a.prompt_text = long_prompt(store, a.prompt_tokens) if a.prompt_tokens else None
    from expertfs.runtime import kernels
    kernels.load()          # built here, uncapped: a compiler under the cap is OOM-killed
    size = os.path.getsize(a.model)
    cap = int(size * a.cap)
    dev = block_device_of(a.model)
    info = json.loads(subprocess.run([os.path.join(BIN, "expertfs"), "inspect", store, "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    res: dict = {"model_bytes": size, "cap_bytes": cap, "ram_tier": 0, "device": dev,
                 "expert_bytes_per_token": info.get("expert_bytes_per_token")}
    if a.cap:
        capped(res, store, cap, dev, a)
    if a.resident:
        # both peers alternate too, the model in memory for each: llama.cpp with the GGUF read
        # back into the page cache after the drop, expertfs with --preload; the median kept
        rr: list[dict] = []
        for rnd in range(a.resident_rounds):
            row = {}
            for peer in (("llama", "expertfs") if rnd % 2 == 0 else ("expertfs", "llama")):
                row[peer] = (llama(a.model, None, dev, None, a, warm=True) if peer == "llama"
                             else expertfs_run(store, None, dev, 2 * size, a, preload=True))
            rr.append(row)
        res["resident_rounds"] = rr
        for peer, key in (("llama", "decode_tok_s"), ("expertfs", "decode_tokens_per_s")):
            ok = sorted((r[peer] for r in rr if "failed" not in r[peer]), key=lambda d: d[key])
            res[peer + "_resident"] = ok[(len(ok) - 1) // 2] if ok else rr[0][peer]
    if a.json:
        print(json.dumps(res, indent=2, default=str))
        return 0
    print(f"model {fmt_bytes(size)}, cap {fmt_bytes(cap)} ({a.cap:.2f}), expertfs RAM tier "
          f"{fmt_bytes(res['ram_tier'] or 0)}, disk {res.get('disk_bytes_per_s', 0) / 1e9:.2f} GB/s (random "
          f"expert reads, QD8); load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':<18} {'decode tok/s':>12} {'TTFT s':>8} {'prefill tok/s':>13} {'prompt':>6} "
          f"{'MB/token':>9} {'peak':>10}")
    for k in ("llama_default", "llama_ra128", "expertfs", "llama_resident", "expertfs_resident"):
        r = res.get(k)
        if not r:
            continue
        if "failed" in r:
            print(f"{k:<18} failed ({r['failed']}): {r.get('stderr', '')[-120:]!r}")
            continue
        tps = r.get("decode_tok_s", r.get("decode_tokens_per_s", 0))
        ttft = r.get("ttft_s", r.get("time_to_first_token_s", 0))
        print(f"{k:<18} {tps:12.3f} {ttft:8.2f} {prefill_tok_s(r):13.2f} "
              f"{r.get('prompt_n', r.get('prompt_tokens', 0)):>6} "
              f"{r.get('mb_read_per_token', 0):9.1f} {fmt_bytes(r.get('peak', 0)):>10}")
    e, l0, l1 = res.get("expertfs"), res.get("llama_default"), res.get("llama_ra128")
    if a.cap and all(x and "failed" not in x for x in (e, l1)):
        et = e["decode_tokens_per_s"]
        if l0 and "failed" not in l0:
            print(f"expertfs / llama.cpp default readahead: {et / l0['decode_tok_s']:.2f}x")
        print(f"first token, expertfs / llama.cpp 128 KB: "
              f"{e['time_to_first_token_s'] / l1['ttft_s']:.2f}x the time")
        print(f"expertfs / llama.cpp readahead 128 KB:  {et / l1['decode_tok_s']:.2f}x (medians "
              f"of {a.rounds} alternating runs; per round: " + ", ".join(
                  f"{r['expertfs']['decode_tokens_per_s'] / r['llama_ra128']['decode_tok_s']:.2f}x"
                  for r in res["rounds"] if all("failed" not in r[p] for p in r)) + ")")
        sim = res.get("simulated")
        if sim and "failed" not in sim and e.get("bytes_read_total"):
            print(f"bytes read / bench cache prediction (same trace, same RAM tier): "
                  f"{e['bytes_read_total'] / sim['bytes_nvme']:.3f} "
                  f"(hit rate {e['hit_rate'].get('ram', 0):.3f} vs {sim['hit_rate']:.3f})")
        if res.get("roofline_tok_s"):
            print(f"expertfs / disk roofline ({res['roofline_tok_s']:.2f} tok/s): "
                  f"{et / res['roofline_tok_s']:.2f}")
    if a.resident and "failed" not in res["llama_resident"] and "failed" not in res["expertfs_resident"]:
        er, lr = res["expertfs_resident"], res["llama_resident"]
        ok = [r for r in res["resident_rounds"] if all("failed" not in r[p] for p in r)]
        pre = {p: statistics.median(prefill_tok_s(r[p]) for r in ok) for p in ("expertfs", "llama")}
        print(f"resident: expertfs / llama.cpp: decode "
              f"{er['decode_tokens_per_s'] / lr['decode_tok_s']:.2f}x, prefill "
              f"{pre['expertfs']:.2f} / {pre['llama']:.2f} tok/s = "
              f"{pre['expertfs'] / max(pre['llama'], 1e-9):.2f}x (medians of "
              f"{a.resident_rounds} alternating runs; per round, decode: " + ", ".join(
                  f"{r['expertfs']['decode_tokens_per_s'] / r['llama']['decode_tok_s']:.2f}x"
                  for r in ok) + "; prefill: " + ", ".join(
                  f"{prefill_tok_s(r['expertfs']) / max(prefill_tok_s(r['llama']), 1e-9):.2f}x"
                  for r in ok) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
