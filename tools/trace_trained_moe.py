"""Realistic routing traces from a model trained by ``train_tiny_moe.py``, in expertfs's format.

    python tools/trace_trained_moe.py RUN_DIR OUT_DIR (--gguf M.gguf | --store M.efs)
                                      [--tokens 8192] [--segment 256] [--drafts 2]

The model reads the run's held-out text (stdlib files it never trained on) in segments of
``--segment`` tokens, each a fresh context, teacher-forced: the token stream is the text, as a
decode over that text would see it. With ``--generate N`` the last N tokens of each segment are
instead sampled by the model itself after the held-out prompt (``--temperature``, seeded), so
the stream is a real decode and "the next token" is the model's own. Two traces are written
(``expertfs.runtime.trace.file``):

``decode.efstrace``
    ``n_layers`` = the trunk's layers; per token, one row per MoE layer (dense layers have
    ``expert_bytes`` 0 and no rows), token-major: what a plain decode reads.

``mtp.efstrace``
    ``n_layers`` = trunk + the NextN block (layer ``L = n_layers``), ``n_draft = --drafts``. Per
    token p, in execution order of MTP speculative decoding (llama.cpp ``draft-mtp``):

    * layer L (p >= 1): the NextN block's own routes while drafting from (Embed(t_p), h_{p-1}),
      draft step 0 as the row's route, chained steps 1..D-1 (input: the previous draft and the
      block's own normed output, as llama.cpp chains ``t_h_nextn``) as its draft routes;
    * each trunk MoE layer l: t_p's route, and as draft routes the routes the D drafted tokens
      d_{p+1..p+D} take at layer l in the verify batch [t_p, d_{p+1}, ..., d_{p+D}] over the
      context t_0..t_{p-1} (a tree-masked batched forward gives exactly those). Drafts are
      greedy (top-1), as llama.cpp drafts. Token 0 has no draft (there is no h_{-1}).

    With ``expertfs bench cache --drafts`` a row's route and its draft routes are needed at once
    (the verify batch), which is what a cache sees under MTP decoding.

Weights are the router's top-k weights renormalised to sum to 1 (the model multiplies them by
``routed_scaling_factor``, recorded in the header meta), experts in descending weight order.
``expert_bytes`` per layer is the store's extent size (``--store``, what the runtime reads per
expert) or the GGUF's bytes of one expert's gate+up+down (``--gguf``). ``--sync`` (default on
with ``--gguf``) loads the GGUF's dequantized weights into the torch model first, so the routes
are those of the file's weights. ``trace_stats.json`` holds the MTP acceptance, the overlap of
draft routes with the next token's real routes, temporal reuse and per-layer load balance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_tiny_moe_model import TinyGlmMoe, load_checkpoint, recording  # noqa: E402


def expert_bytes_from_gguf(path: str, n_layers: int) -> list[int]:
    from expertfs.formats.gguf_split import read_model
    m = read_model(path)
    out = [0] * n_layers
    for i in range(n_layers):
        names = [f"blk.{i}.ffn_{x}_exps.weight" for x in ("gate", "up", "down")]
        if all(n in m.by_name for n in names):
            out[i] = sum(m.by_name[n].nbytes // m.by_name[n].ne[-1] for n in names)
    return out


def expert_bytes_from_store(path: str, n_layers: int) -> list[int]:
    from expertfs.store.reader import Store
    with Store.open(path) as s:
        have = set(s.layers)
        return [int(s.layer_info(i)["extent_bytes"]) if i in have else 0 for i in range(n_layers)]


def _routes(calls, rows: slice | None = None):
    """(ids [N, k], weights [N, k]) of one router call, sorted by weight, weights summing to 1."""
    _logits, w, idx = calls
    if rows is not None:
        w, idx = w[rows], idx[rows]
    w = w / w.sum(-1, keepdim=True)
    order = torch.argsort(w, dim=-1, descending=True)
    return idx.gather(-1, order).numpy().astype(np.uint16), w.gather(-1, order).numpy()


def draft_mask(S: int, D: int, ctx_of: np.ndarray) -> torch.Tensor:
    """Bool ``[1, 1, N, N]`` for a base of S causal entries followed by D chains of S entries:
    chain j's entry p sees base entries ``<= ctx_of[p]`` and chain entries ``i <= j`` of p."""
    N = S * (1 + D)
    m = torch.zeros(N, N, dtype=torch.bool)
    m[:S, :S] = torch.tril(torch.ones(S, S, dtype=torch.bool))
    base = torch.arange(S)[None, :] <= torch.from_numpy(ctx_of)[:, None]        # [S, S]
    eye = torch.eye(S, dtype=torch.bool)
    for j in range(D):
        r = slice(S * (1 + j), S * (2 + j))
        m[r, :S] = base
        for i in range(j + 1):
            m[r, S * (1 + i):S * (2 + i)] = eye
    return m[None, None]


@torch.no_grad()
def trace_segment(model: TinyGlmMoe, ids: torch.Tensor, D: int) -> dict:
    """All routes of one segment (see the module docstring)."""
    S, L = len(ids), model.n_layers
    moe = sorted(k for k in model.routers() if k < L)
    with recording(model) as rec:                           # 1. the trunk over the text
        h = model.trunk(ids[None])[0]                       # [S, H], after the final norm
    main_pred = model.logits(h).argmax(-1)                  # predicts t_{p+1}
    plain = {l: _routes(rec.last(l)) for l in moe}

    # 2. NextN drafting: base entries p = 1..S-1 take (t_p, h_{p-1}) at position p; chain step
    #    j >= 1 takes (d_{p+j}, its own previous normed output) at position p + j.
    P = S - 1
    ctx_of = np.arange(P)                                   # base entry q-1 is position q
    tok_in = [ids[1:]]
    h_in = [h[:-1]]
    pos = [torch.arange(1, S)]
    drafts, mtp_routes = [], []
    for j in range(D):
        n = len(tok_in)
        mask = None if n == 1 else draft_mask(P, n - 1, ctx_of)
        with recording(model) as rec:
            z = model.nextn(torch.cat(tok_in)[None], torch.cat(h_in)[None],
                            torch.cat(pos)[None], mask)[0]
        zj = z[(n - 1) * P:]
        d = model.logits(zj).argmax(-1)                     # draft for position p + j + 1
        drafts.append(d)
        mtp_routes.append(_routes(rec.last(L), slice((n - 1) * P, n * P)))
        tok_in.append(d)
        h_in.append(zj)
        pos.append(torch.arange(1, S) + j + 1)

    # 3. the verify batch: text + D chains of drafts, each seeing t_0..t_p and its own chain
    vt = torch.cat([ids] + [torch.cat([d.new_zeros(1), d]) for d in drafts])
    vpos = torch.cat([torch.arange(S)] + [torch.arange(S) + j + 1 for j in range(D)])
    with recording(model) as rec:
        model.trunk(vt[None], vpos[None], draft_mask(S, D, np.arange(S)))
    verify = {l: _routes(rec.last(l)) for l in moe}
    mismatch = sum(int((np.sort(verify[l][0][:S], 1) != np.sort(plain[l][0], 1)).any(1).sum())
                   for l in moe)
    return {"moe": moe, "plain": plain, "verify": verify, "drafts": drafts,
            "mtp_routes": mtp_routes, "main_pred": main_pred, "mismatch": mismatch}


def _rows(h, tokens, layers, ex, w, n_valid=None, dex=None, dw=None):
    from expertfs.runtime.trace.file import TraceChunk
    n = len(tokens)
    if n_valid is None:
        n_valid = np.zeros(n, np.uint8)
    return TraceChunk(np.asarray(tokens, np.uint32), np.asarray(layers, np.uint16),
                      np.asarray(n_valid, np.uint8), ex.astype(np.uint16), w.astype(np.float16),
                      None if dex is None else dex.astype(np.uint16),
                      None if dw is None else dw.astype(np.float16))


class Stats:
    """Acceptance, draft-route overlap, temporal reuse and load, accumulated over segments."""

    def __init__(self, n_layers: int, n_experts: int, k: int, D: int) -> None:
        self.k, self.D, self.E = k, D, n_experts
        self.acc_text = np.zeros(D)
        self.chain_ok = np.zeros(D)
        self.n_text = np.zeros(D)
        self.acc_main = 0
        self.n_draft = 0
        self.overlap = {}              # layer -> [sum overlap(accepted), n, sum(rejected), n]
        self.reuse = {}                # layer -> [sum |r_p ∩ r_{p-1}|, n]
        self.load = {}
        self.mismatch = 0

    def add(self, ids: np.ndarray, seg: dict) -> None:
        S, D, k = len(ids), self.D, self.k
        d = np.stack([x.numpy() for x in seg["drafts"]])          # [D, S-1], d[j, p-1]
        P = S - 1
        ok = np.ones(P, bool)
        for j in range(D):
            tgt = np.full(P, -1)
            m = np.arange(1, S) + j + 1 < S
            tgt[m] = ids[np.arange(1, S)[m] + j + 1]
            hit = d[j] == tgt
            self.acc_text[j] += hit[m].sum()
            ok &= hit
            self.chain_ok[j] += ok[m].sum()
            self.n_text[j] += m.sum()
        self.acc_main += int((d[0][:-1] == seg["main_pred"].numpy()[1:-1]).sum())
        self.n_draft += P - 1
        acc = d[0][:-1] == ids[2:]                                 # draft for p+1 is right
        for l in seg["moe"]:
            ex = seg["verify"][l][0]
            main, dr = ex[:S], ex[S:2 * S]                            # d_{p+1} routes at row p
            inter = np.array([len(set(dr[p]) & set(main[p + 1])) for p in range(1, S - 1)]) / k
            o = self.overlap.setdefault(l, [0.0, 0, 0.0, 0])
            o[0] += inter[acc].sum()
            o[1] += acc.sum()
            o[2] += inter[~acc].sum()
            o[3] += (~acc).sum()
            reuse = np.array([len(set(main[p]) & set(main[p - 1])) for p in range(1, S)]) / k
            r = self.reuse.setdefault(l, [0.0, 0])
            r[0] += reuse.sum()
            r[1] += len(reuse)
            self.load[l] = self.load.get(l, 0) + np.bincount(main.ravel(), minlength=self.E)
        self.mismatch += seg["mismatch"]

    def as_dict(self) -> dict:
        n, nt = max(1, self.n_draft), np.maximum(1, self.n_text)
        out = {"drafts_per_token": self.D,
               "draft_top1_vs_text": [round(float(x), 4) for x in self.acc_text / nt],
               "draft_chain_accepted_vs_text": [round(float(x), 4) for x in self.chain_ok / nt],
               "draft0_equals_main_greedy": round(self.acc_main / n, 4),
               "verify_vs_plain_route_mismatch_rows": int(self.mismatch), "layers": {}}
        for l in sorted(self.overlap):
            o, r, c = self.overlap[l], self.reuse[l], self.load[l].astype(float)
            p = c / c.sum()
            out["layers"][str(l)] = {
                "draft_route_overlap_next_if_accepted": round(o[0] / max(1, o[1]), 4),
                "draft_route_overlap_next_if_rejected": round(o[2] / max(1, o[3]), 4),
                "reuse_prev_token": round(r[0] / max(1, r[1]), 4),
                "load_entropy": round(float(-(p[p > 0] * np.log(p[p > 0])).sum() / math.log(self.E)), 4),
                "load_max_over_mean": round(float(c.max() / c.mean()), 3),
                "experts_used": int((c > 0).sum())}
        return out


@torch.no_grad()
def sample(model: TinyGlmMoe, prompt: np.ndarray, n: int, temperature: float,
           seed: int) -> np.ndarray:
    """``prompt`` followed by ``n`` tokens the model samples (greedy at temperature 0)."""
    torch.manual_seed(seed)
    out = model.lm.generate(input_ids=torch.from_numpy(prompt)[None], max_new_tokens=n,
                            min_new_tokens=n, do_sample=temperature > 0,
                            temperature=temperature if temperature > 0 else None, top_k=0,
                            top_p=1.0, pad_token_id=0, eos_token_id=None)
    return out[0].numpy().astype(np.int64)


def write_traces(run_dir: str, out_dir: str, *, gguf: str | None = None, store: str | None = None,
                 tokens: int = 8192, segment: int = 256, drafts: int = 2, sync: bool = True,
                 threads: int = 1, generate: int = 0, temperature: float = 0.8, seed: int = 0,
                 log=print) -> dict:
    from expertfs.runtime.trace.file import TraceHeader, TraceWriter
    torch.set_num_threads(threads)
    model, meta = load_checkpoint(os.path.join(run_dir, "model.pt"))
    model.set_experts("padded_bmm")
    if gguf and sync:
        from export_glm4moe_gguf import load_gguf_weights
        load_gguf_weights(model, gguf)
    L, E, k = model.n_layers, model.preset.experts, model.preset.top_k
    if store:
        eb = expert_bytes_from_store(store, L + 1)
    elif gguf:
        eb = expert_bytes_from_gguf(gguf, L + 1)
    else:
        raise SystemExit("give --gguf or --store (the geometry's bytes per expert)")
    held = np.load(os.path.join(run_dir, "held_out.npy")).astype(np.int64)
    n_seg = min(tokens // segment, len(held) // segment)
    if n_seg < 1:
        raise SystemExit(f"held-out text has {len(held)} tokens, fewer than one segment")
    if not 0 <= generate < segment:
        raise SystemExit(f"--generate {generate} must be below --segment {segment}")
    text = "python stdlib held-out files, teacher-forced"
    if generate:
        text = (f"a {segment - generate}-token held-out prompt, then {generate} tokens sampled by "
                f"the model (temperature {temperature}, seed {seed} + segment)")
    os.makedirs(out_dir, exist_ok=True)
    base_meta = {"model": f"expertfs tiny glm4moe {model.preset.name}",
                 "architecture": "glm4moe", "generator": "tools/trace_trained_moe.py",
                 "seed": meta.get("seed"), "text": text, "generated_tokens": generate,
                 "segment_tokens": segment, "routed_scaling_factor": model.config.routed_scaling_factor,
                 "weights": "top-k router weights renormalised to sum 1, descending",
                 "expert_bytes_source": "store extent" if store else "gguf gate+up+down"}
    n_moe = sum(1 for b in eb[:L] if b)
    dec_h = TraceHeader(L, E, k, tuple(eb[:L]), 0,
                        dict(base_meta, mode="decode", n_moe_layers=n_moe))
    mtp_h = TraceHeader(L + 1, E, k, tuple(eb), drafts,
                        dict(base_meta, mode="mtp", mtp_layer=L, n_moe_layers=n_moe + 1,
                             draft="greedy NextN chain",
                             rows="layer L: NextN drafting (draft step 0; chained steps as "
                                  "drafts); trunk layers: token route + the drafts' verify routes"))
    dec_p, mtp_p = os.path.join(out_dir, "decode.efstrace"), os.path.join(out_dir, "mtp.efstrace")
    st = Stats(L, E, k, drafts)
    t0 = time.time()
    with TraceWriter(dec_p, dec_h) as wd, TraceWriter(mtp_p, mtp_h) as wm:
        for s in range(n_seg):
            ids = held[s * segment:(s + 1) * segment]
            if generate:
                ids = sample(model, ids[:segment - generate], generate, temperature, seed + s)
            seg = trace_segment(model, torch.from_numpy(ids), drafts)
            st.add(ids, seg)
            t_base = s * segment
            moe = seg["moe"]
            S = segment
            # decode: token-major, layers ascending
            ex = np.stack([seg["verify"][l][0][:S] for l in moe], 1)        # [S, nl, k]
            w = np.stack([seg["verify"][l][1][:S] for l in moe], 1)
            tok = np.repeat(np.arange(t_base, t_base + S), len(moe))
            lay = np.tile(np.array(moe), S)
            wd.add_chunk(_rows(dec_h, tok, lay, ex.reshape(-1, k), w.reshape(-1, k)))
            # mtp: per token, the NextN row (p >= 1) then the trunk rows with draft routes
            dex = np.stack([np.stack([seg["verify"][l][0][S * (1 + j):S * (2 + j)]
                                      for j in range(drafts)], 1) for l in moe], 1)  # [S,nl,D,k]
            dw = np.stack([np.stack([seg["verify"][l][1][S * (1 + j):S * (2 + j)]
                                     for j in range(drafts)], 1) for l in moe], 1)
            nv = np.full((S, len(moe)), drafts, np.uint8)
            nv[0] = 0
            dex[0], dw[0] = 0, 0
            mex = np.zeros((S, k), np.uint16)
            mw = np.zeros((S, k), np.float32)
            mdex = np.zeros((S, drafts, k), np.uint16)
            mdw = np.zeros((S, drafts, k), np.float32)
            mex[1:], mw[1:] = seg["mtp_routes"][0]
            for j in range(1, drafts):
                mdex[1:, j - 1], mdw[1:, j - 1] = seg["mtp_routes"][j]
            per = 1 + len(moe)
            T_ = np.repeat(np.arange(t_base, t_base + S), per)
            Ly = np.tile(np.array([L] + moe), S)
            EX = np.concatenate([mex[:, None], ex], 1).reshape(-1, k)
            W = np.concatenate([mw[:, None], w], 1).reshape(-1, k)
            DEX = np.concatenate([mdex[:, None], dex], 1).reshape(-1, drafts, k)
            DW = np.concatenate([mdw[:, None], dw], 1).reshape(-1, drafts, k)
            NV = np.concatenate([np.full((S, 1), drafts - 1, np.uint8), nv], 1)
            NV[0, 0] = 0
            keep = np.ones(S * per, bool)
            keep[0] = False                                  # token 0 has no NextN row
            wm.add_chunk(_rows(mtp_h, T_[keep], Ly[keep], EX[keep], W[keep], NV.reshape(-1)[keep],
                               DEX[keep], DW[keep]))
            if (s + 1) % 8 == 0 or s + 1 == n_seg:
                log(f"segment {s + 1}/{n_seg}  {time.time() - t0:.1f} s")
    stats = st.as_dict()
    stats.update({"tokens": n_seg * segment, "segments": n_seg, "trace_s": round(time.time() - t0, 1),
                  "decode_trace": {"path": dec_p, "bytes": os.path.getsize(dec_p),
                                   "rows": n_seg * segment * len(moe)},
                  "mtp_trace": {"path": mtp_p, "bytes": os.path.getsize(mtp_p)},
                  "expert_bytes": eb, "moe_layers": moe})
    with open(os.path.join(out_dir, "trace_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--gguf", help="the exported GGUF (weights and bytes per expert)")
    ap.add_argument("--store", help="the repacked store (bytes per expert = its extent size)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--segment", type=int, default=256)
    ap.add_argument("--drafts", type=int, default=2, help="NextN draft depth (chain length)")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="trace a decode: per segment, the model samples the last N tokens "
                         "after a held-out prompt (default 0: all held-out text)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sync", action="store_true",
                    help="route with the checkpoint's float weights, not the GGUF's")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    st = write_traces(a.run_dir, a.out_dir, gguf=a.gguf, store=a.store, tokens=a.tokens,
                      segment=a.segment, drafts=a.drafts, sync=not a.no_sync, threads=a.threads,
                      generate=a.generate, temperature=a.temperature, seed=a.seed,
                      log=lambda s: print(s, flush=True))
    print(json.dumps({k: v for k, v in st.items() if k != "layers"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
