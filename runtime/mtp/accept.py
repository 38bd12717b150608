"""Accepting drafted tokens: greedy exact match, or speculative sampling that keeps the output
distribution exactly the sampler's.

``target_probs(logits, params)`` is the distribution ``runtime.sampling.Sampler`` draws from
(temperature, then top-k, then top-p with the same cut, renormalised), as a full-vocabulary
float32 vector. Drafts are drawn from the draft head's logits under the same parameters
(``draft``). Verification (Leviathan et al. 2023, Chen et al. 2023): draft ``d_i`` with
draft probability ``q_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
first rejection the next token is drawn from ``norm(max(0, p_i - q_i))``; when every draft is
accepted the next token is drawn from ``p_k`` (the bonus token). Each emitted token then has
exactly the target's distribution given the tokens before it. Greedy (temperature 0): accept
while the target's argmax equals the draft; the next token is the target's argmax.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, nucleus

__all__ = ["target_probs", "draft", "accept_greedy", "accept_sampled"]


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``logits [V]`` → the sampler's distribution over the vocabulary, float32 ``[V]`` (CPU)."""
    lg = logits.detach().float().cpu()
    out = torch.zeros_like(lg)
    if p.greedy:
        out[int(torch.argmax(lg))] = 1.0
        return out
    probs, idx = nucleus(logits, p)
    out[idx] = probs
    return out


def draft(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator
          ) -> tuple[int, torch.Tensor | None, float]:
    """A draft token from the draft head's ``logits [V]``: (token, its distribution q or None
    when greedy, q(token) — the draft's confidence)."""
    if p.greedy:
        lg = logits.detach().float().cpu()
        t = int(torch.argmax(lg))
        return t, None, float(torch.softmax(lg, -1)[t])
    q = target_probs(logits, p)
    t = int(torch.multinomial(q, 1, generator=gen))
    return t, q, float(q[t])


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """``target_logits [k+1, V]`` (row i predicts the token after draft i-1) → (drafts
    accepted, next token)."""
    top = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and top[n] == drafts[n]:
        n += 1
    return n, int(top[n])


def accept_sampled(target_logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor],
                   p: SamplingParams, gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling over ``k`` drafts with draft distributions ``qs`` → (drafts
    accepted, next token), drawn with ``gen``."""
    lg = target_logits.detach().float().cpu()
    for i, (d, q) in enumerate(zip(drafts, qs)):
        pi = target_probs(lg[i], p)
        u = float(torch.rand((), generator=gen))
        if u * float(q[d]) < float(pi[d]):                   # u < p/q without dividing
            continue
        r = (pi - q).clamp_min(0.0)
        s = float(r.sum())
        r = pi if s <= 0.0 else r / s
        return i, int(torch.multinomial(r, 1, generator=gen))
    last = target_probs(lg[len(drafts)], p)
    return len(drafts), int(torch.multinomial(last, 1, generator=gen))
