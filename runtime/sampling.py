"""Choosing the next token from logits: greedy, or temperature → top-k → top-p sampling.

``temperature <= 0`` is greedy (argmax; ties go to the lowest id). Otherwise the logits are
divided by the temperature, cut to the ``top_k`` largest (0 = all), then to the smallest set
whose probability reaches ``top_p`` (1 = all; the most likely token always survives), and one
token is drawn with a ``torch.Generator`` seeded from ``seed``: the same seed, logits and
parameters give the same tokens. ``Sampler.sample`` chooses on the logits' device and returns
the token there (no host copy of the logits; on a GPU the next decode step takes it without a
host round trip); ``Sampler(logits)`` is the same choice as an int. CPU logits are sampled as
they always were (a CPU generator, the nucleus cut to its tokens); device logits keep the whole
sorted vocabulary with zeros past the nucleus (no data-dependent length, so no sync) and draw
with a generator on that device by the exponential race (``argmax(probs / Exp(1))``, a draw
from ``probs`` without multinomial's checks), so a GPU run's sampled tokens follow the same
distribution but not the CPU run's random stream.

``penalize`` applies OpenAI's presence and frequency penalties before sampling: the logit of
token ``j`` drops by ``c[j] * frequency + (c[j] > 0) * presence``, ``c[j]`` being how many times
``j`` was generated so far. ``bias`` adds OpenAI's ``logit_bias`` (token id → -100..100) to the
logits, and ``allow`` keeps only the tokens a constraint (a grammar's token mask) allows: the
others become ``-inf``, so greedy and sampled choices alike are among the allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import UsageError

__all__ = ["SamplingParams", "Sampler", "nucleus", "nucleus_dense", "penalize", "bias", "allow"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> SamplingParams:
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"sampling: temperature {self.temperature}, top-k {self.top_k}, "
                             f"top-p {self.top_p}",
                             fix="use --temp >= 0, --top-k >= 0 and 0 < --top-p <= 1")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _ranked(lg: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits ``lg`` → the softmax of the top-k (all: sorted) after temperature, most
    likely first, and their ids: what ``nucleus`` and ``nucleus_dense`` then cut at top-p."""
    lg = (lg - lg.max()) / p.temperature
    if p.top_k and p.top_k < lg.numel():
        vals, idx = torch.topk(lg, p.top_k)
    else:
        vals, idx = torch.sort(lg, descending=True)
    return torch.softmax(vals, dim=-1), idx


def nucleus(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens sampling may choose from ``logits [n_vocab]`` at ``p`` (not greedy): their
    probabilities (float32, summing to 1) and ids after temperature, top-k and top-p, most
    likely first where top-k or top-p cut the vocabulary; with neither, every token in id
    order (nothing to rank: a sort of the whole vocabulary would cost more than the draw).
    Computed in float64 from the logits less their maximum, so a temperature too small for
    float32 (down to the smallest positive double) is greedy, never inf or NaN."""
    lg = logits.detach().double().cpu()
    n = lg.numel()
    cut_k = bool(p.top_k) and p.top_k < n
    if not cut_k and p.top_p >= 1.0:
        probs = torch.softmax((lg - lg.max()) / p.temperature, dim=-1)
        return (probs / probs.sum()).float(), torch.arange(n)
    if cut_k:
        probs, idx = _ranked(lg, p)
    else:
        probs, idx = _head(torch.softmax((lg - lg.max()) / p.temperature, dim=-1), p.top_p)
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        keep = int(torch.searchsorted(cum, torch.tensor([p.top_p])).item()) + 1
        probs, idx = probs[:keep], idx[:keep]
    return (probs / probs.sum()).float(), idx


def _head(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens of ``probs``, most likely first, enough of them to hold ``top_p``
    of the mass: a top-k grown fourfold until it does, not a sort of the whole vocabulary."""
    n, k = probs.numel(), 64
    while True:
        vals, idx = torch.topk(probs, min(k, n))
        if k >= n or float(torch.cumsum(vals, dim=-1)[-1]) >= top_p:
            return vals, idx
        k *= 4


def nucleus_dense(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``nucleus`` without a host sync, on the logits' device: the probabilities of every
    top-k token, most likely first, those past top-p zero (the same tokens ``nucleus`` keeps:
    each whose preceding cumulative probability is below top-p), and their ids."""
    probs, idx = _ranked(logits.detach().double(), p)
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        before = torch.cat((cum.new_zeros(1), cum[:-1]))
        probs = probs * (before < p.top_p)
    return (probs / probs.sum()).float(), idx


def inverse_cdf(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index drawn from CPU ``probs`` (summing to 1): a uniform number against their
    float64 running sum: the distribution of ``torch.multinomial(probs, 1)``, whose setup costs
    milliseconds on a whole vocabulary."""
    cum = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), dtype=torch.float64, generator=gen) * cum[-1]
    return min(int(torch.searchsorted(cum, u, right=True)), probs.numel() - 1)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index drawn from ``probs`` (on their device, no sync): the exponential race."""
    q = torch.empty_like(probs).exponential_(generator=gen)
    return torch.argmax(probs / q)


def penalize(logits: torch.Tensor, counts: Mapping[int, int], presence: float = 0.0,
             frequency: float = 0.0) -> torch.Tensor:
    """``logits [n_vocab]`` as a float32 copy (on their device), less the presence and
    frequency penalties of the tokens in ``counts`` (token id → times generated)."""
    lg = logits.detach().float().clone()
    if counts and (presence or frequency):
        ids = torch.tensor(list(counts), dtype=torch.long, device=lg.device)
        c = torch.tensor([float(counts[i]) for i in counts], device=lg.device)
        lg[ids] -= c * frequency + (c > 0).float() * presence
    return lg


def bias(logits: torch.Tensor, biases: Mapping[int, float]) -> torch.Tensor:
    """``logits [n_vocab]`` as a float32 copy (on their device) plus ``biases`` (token id →
    value; ids beyond the logits are ignored)."""
    lg = logits.detach().float().clone()
    ids = [i for i in biases if 0 <= i < lg.numel()]
    if ids:
        lg[torch.tensor(ids, dtype=torch.long, device=lg.device)] += torch.tensor(
            [float(biases[i]) for i in ids], device=lg.device)
    return lg


def allow(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits [n_vocab]`` as a float32 copy (on their device) with every token ``allowed
    [n]`` (bool) does not allow set to ``-inf`` (tokens past ``n`` too)."""
    lg = logits.detach().float().clone()
    n = min(lg.numel(), allowed.numel())
    keep = torch.zeros(lg.numel(), dtype=torch.bool)
    keep[:n] = allowed[:n]
    keep = keep.to(lg.device)
    return lg.masked_fill_(~keep, float("-inf"))


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams()) -> None:
        self.params = params.validate()
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(int(params.seed))
        self._dev_gen: torch.Generator | None = None

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [n_vocab]`` → the chosen token id, a 0-d long tensor on their device (no
        host sync where that is a GPU)."""
        p = self.params
        lg = logits.detach()
        if lg.device.type == "cpu":
            if p.greedy:
                return torch.argmax(lg.float())
            probs, idx = nucleus(lg, p)
            return idx[inverse_cdf(probs, self.gen)]
        if p.greedy:
            return torch.argmax(lg)
        probs, idx = nucleus_dense(lg, p)
        return idx.index_select(0, draw(probs, self._device_gen(lg.device)).reshape(1))[0]

    def _device_gen(self, device: torch.device) -> torch.Generator:
        g = self._dev_gen
        if g is None or g.device != device:
            g = self._dev_gen = torch.Generator(device=device)
            g.manual_seed(int(self.params.seed))
        return g

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits [n_vocab]`` (any device) → the chosen token id (one host copy)."""
        return int(self.sample(logits))
