"""Train a small glm4moe (with its NextN/MTP block) on Python's standard library, from a seed.

    python tools/train_tiny_moe.py OUT_DIR [--preset tiny|small|large] [--seed 0] [--steps N]

Writes into OUT_DIR: ``tokenizer.json`` (byte-level BPE, see ``train_tiny_moe_data``),
``held_out.npy`` (the held-out token stream), ``model.pt`` (preset, state dict, metadata),
``train_log.jsonl`` (one JSON object per logged step and per evaluation) and ``metrics.json``
(final held-out losses and accuracies, routing balance, wall time).

The model (``train_tiny_moe_model``) is transformers' Glm4Moe — first layer dense, sigmoid
routing with a selection bias, one shared expert, GLM-4.5's routed scaling 2.5 — plus a NextN
block trained jointly on next-next-token prediction as in DeepSeek-V3 / GLM-4.5:

    loss = CE(main next token) + mtp_weight · CE(NextN, token p+1 from (Embed(t_p), h_{p-1}))
           + balance_alpha · Σ_layers sequence-wise balance loss

and after each step every MoE layer's selection bias (``e_score_correction_bias``) moves by
``bias_rate`` toward equal load (DeepSeek-V3's auxiliary-loss-free balancing), so experts
specialise but all of them are used. Training is deterministic for a given seed, torch build
and thread count (``--threads``, default 1: on a shared 2-core box two OpenMP threads
spin against other work and ran 2-6x slower); the stopping point is a step count, never a time.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_tiny_moe_data as data  # noqa: E402
from train_tiny_moe_model import (PRESETS, Preset, TinyGlmMoe, preset,  # noqa: E402
                                  recording, save_checkpoint)


def balance_loss(calls: dict, batch: int, n_experts: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, summed over MoE layers."""
    total = torch.zeros(())
    for layer_calls in calls.values():
        for logits, _w, idx in layer_calls:
            s = torch.sigmoid(logits.float()).view(batch, -1, n_experts)
            p = (s / s.sum(-1, keepdim=True)).mean(1)                       # [B, E]
            t = s.shape[1]
            with torch.no_grad():
                off = (torch.arange(batch) * n_experts)[:, None]
                cnt = torch.bincount((idx.view(batch, -1) + off).flatten(),
                                     minlength=batch * n_experts).view(batch, n_experts)
                f = cnt.float() * (n_experts / (k * t))
            total = total + (f * p).sum(-1).mean()
    return total


@torch.no_grad()
def update_bias(model: TinyGlmMoe, calls: dict, rate: float) -> None:
    """Aux-loss-free balancing: bias_e += rate · sign(mean load − load_e), per MoE layer."""
    routers = model.routers()
    for layer, layer_calls in calls.items():
        gate = routers[layer]
        cnt = torch.zeros(gate.num_experts)
        for _l, _w, idx in layer_calls:
            cnt += torch.bincount(idx.flatten(), minlength=gate.num_experts).float()
        gate.e_score_correction_bias += rate * torch.sign(cnt.mean() - cnt)


def forward_losses(model: TinyGlmMoe, ids: torch.Tensor):
    """Main next-token loss, NextN next-next-token loss, and the logits of both."""
    B, T = ids.shape
    h = model.trunk(ids)
    logits = model.logits(h)
    main = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    pos = torch.arange(1, T - 1)[None]                 # NextN input at p: (t_p, h_{p-1})
    z = model.nextn(ids[:, 1:-1], h[:, :-2], pos)
    mlog = model.logits(z)
    mtp = F.cross_entropy(mlog.reshape(-1, mlog.shape[-1]), ids[:, 2:].reshape(-1))
    return main, mtp, logits, mlog


def windows(stream: np.ndarray, seq: int, n: int) -> torch.Tensor:
    n = min(n, (len(stream) - 1) // seq)
    return torch.from_numpy(stream[: n * seq].astype(np.int64).reshape(n, seq))


@torch.no_grad()
def evaluate(model: TinyGlmMoe, held: torch.Tensor, batch: int) -> dict:
    """Held-out losses and accuracies, and per-layer routing balance."""
    model.eval()
    sums = dict(main=0.0, mtp=0.0, acc=0.0, mtp_acc=0.0, mtp_agree=0.0)
    loads: dict[int, torch.Tensor] = {}
    n_tok = n_mtp = 0
    for a in range(0, len(held), batch):
        ids = held[a:a + batch]
        with recording(model) as rec:
            main, mtp, logits, mlog = forward_losses(model, ids)
        n1, n2 = ids[:, 1:].numel(), ids[:, 2:].numel()
        sums["main"] += main.item() * n1
        sums["mtp"] += mtp.item() * n2
        pred = logits.argmax(-1)
        sums["acc"] += (pred[:, :-1] == ids[:, 1:]).sum().item()
        mpred = mlog.argmax(-1)                                # predicts t_{p+1} at p = 1..T-2
        sums["mtp_acc"] += (mpred == ids[:, 2:]).sum().item()
        sums["mtp_agree"] += (mpred == pred[:, 1:-1]).sum().item()   # = greedy draft accepted
        n_tok, n_mtp = n_tok + n1, n_mtp + n2
        for layer, calls in rec.calls.items():
            for _l, _w, idx in calls:
                c = torch.bincount(idx.flatten(), minlength=model.preset.experts).float()
                loads[layer] = loads.get(layer, 0) + c
    model.train()
    bal = {}
    for layer, c in sorted(loads.items()):
        p = c / c.sum()
        ent = -(p[p > 0] * p[p > 0].log()).sum().item() / math.log(len(p))
        bal[str(layer)] = {"used": int((c > 0).sum()), "max_over_mean": round(float(c.max() / c.mean()), 3),
                           "min_over_mean": round(float(c.min() / c.mean()), 3),
                           "load_entropy": round(ent, 4)}
    return {"held_out_loss": sums["main"] / n_tok, "held_out_mtp_loss": sums["mtp"] / n_mtp,
            "held_out_top1": sums["acc"] / n_tok, "mtp_next_next_top1": sums["mtp_acc"] / n_mtp,
            "mtp_greedy_accept": sums["mtp_agree"] / n_mtp, "balance": bal}


def lr_at(step: int, p: Preset) -> float:
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    t = (step - p.warmup) / max(1, p.steps - p.warmup)
    return p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train(out_dir: str, p: Preset, seed: int, threads: int, experts_impl: str,
          log=print) -> dict:
    torch.set_num_threads(threads)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    tok, corpus = data.build_corpus(p.vocab, p.corpus_chars, p.held_chars, out_dir)
    np.save(os.path.join(out_dir, "held_out.npy"), corpus.held_out)
    t_data = time.time() - t0
    log(f"corpus: {corpus.meta['train_tokens']} train / {corpus.meta['held_out_tokens']} "
        f"held-out tokens, tokenizer {p.vocab} ({t_data:.1f} s)")

    model = TinyGlmMoe(p, seed)
    model.set_experts(experts_impl)
    model.train()
    n_params = sum(x.numel() for x in model.parameters())
    decay = [x for x in model.parameters() if x.dim() >= 2]
    no_decay = [x for x in model.parameters() if x.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=p.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    rng = np.random.default_rng(seed + 1)
    train_stream = corpus.train.astype(np.int64)
    held = windows(corpus.held_out, p.seq, 32)
    log(f"model: {n_params / 1e6:.2f} M params ({p.layers} layers + NextN, {p.experts} experts, "
        f"top-{p.top_k}, hidden {p.hidden}); {p.steps} steps of {p.batch}x{p.seq} tokens")
    logf = open(os.path.join(out_dir, "train_log.jsonl"), "w")
    curve = []
    t_train = time.time()
    ema = None
    for step in range(p.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, p)
        starts = rng.integers(0, len(train_stream) - p.seq - 1, p.batch)
        ids = torch.from_numpy(np.stack([train_stream[s:s + p.seq] for s in starts]))
        with recording(model, detach=False) as rec:
            main, mtp, _, _ = forward_losses(model, ids)
            bal = balance_loss(rec.calls, p.batch, p.experts, p.top_k)
        loss = main + p.mtp_weight * mtp + p.balance_alpha * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_bias(model, rec.calls, p.bias_rate)
        ema = main.item() if ema is None else 0.95 * ema + 0.05 * main.item()
        rec_ = {"step": step + 1, "loss": round(main.item(), 4), "mtp_loss": round(mtp.item(), 4),
                "balance": round(bal.item(), 4), "lr": round(lr_at(step, p), 6),
                "elapsed_s": round(time.time() - t_train, 1)}
        logf.write(json.dumps(rec_) + "\n")
        if step % 10 == 0:
            logf.flush()
        if (step + 1) % p.eval_every == 0 or step + 1 == p.steps or step == 0:
            ev = evaluate(model, held, p.batch)
            point = {"step": step + 1, "train_loss_ema": round(ema, 4),
                     "held_out_loss": round(ev["held_out_loss"], 4),
                     "held_out_mtp_loss": round(ev["held_out_mtp_loss"], 4),
                     "mtp_next_next_top1": round(ev["mtp_next_next_top1"], 4),
                     "elapsed_s": round(time.time() - t_train, 1)}
            curve.append(point)
            logf.write(json.dumps({"eval": point}) + "\n")
            logf.flush()
            log(f"step {step + 1:5d}  train {ema:.3f}  held-out {ev['held_out_loss']:.3f}  "
                f"mtp {ev['held_out_mtp_loss']:.3f}  mtp top-1 {ev['mtp_next_next_top1']:.3f}  "
                f"{time.time() - t_train:6.1f} s")
    logf.close()
    t_train = time.time() - t_train
    final = evaluate(model, held, p.batch)
    metrics = {"preset": p.name, "seed": seed, "threads": threads, "params": n_params,
               "steps": p.steps, "tokens_seen": p.steps * p.batch * p.seq,
               "data_s": round(t_data, 1), "train_s": round(t_train, 1),
               "s_per_step": round(t_train / p.steps, 3),
               "initial_held_out_loss": curve[0]["held_out_loss"],
               "final_train_loss_ema": round(ema, 4), **{k: (round(v, 4) if isinstance(v, float)
                                                              else v) for k, v in final.items()},
               "uniform_loss": round(math.log(p.vocab), 4), "curve": curve, "corpus": corpus.meta}
    save_checkpoint(os.path.join(out_dir, "model.pt"), model,
                    {"seed": seed, "metrics": {k: v for k, v in metrics.items() if k != "curve"}})
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    log(f"done: held-out loss {curve[0]['held_out_loss']:.3f} -> {final['held_out_loss']:.3f} "
        f"(uniform {math.log(p.vocab):.3f}), top-1 {final['held_out_top1']:.3f}; NextN "
        f"next-next top-1 {final['mtp_next_next_top1']:.3f}, greedy draft accepted "
        f"{final['mtp_greedy_accept']:.3f}; {t_train:.0f} s training, {t_data:.0f} s data")
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="override the preset's step count")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is faster and steadier on a shared 2-core box)")
    ap.add_argument("--experts-impl", default="padded_bmm",
                    choices=("padded_bmm", "grouped_mm", "eager"),
                    help="transformers experts implementation used for training")
    a = ap.parse_args(argv)
    p = preset(a.preset, steps=a.steps)
    train(a.out_dir, p, a.seed, a.threads, a.experts_impl,
          log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
