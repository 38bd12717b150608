"""``Engine``: a store opened for inference: config, trunk, expert provider, model, KV cache.

::

    with Engine.open("MODEL.efs", ram_bytes=8 << 30) as eng:
        logits = eng.prefill([1, 2, 3])         # float32 [n_vocab], last position
        logits = eng.decode(42)                 # one more position
        every = eng.logits([1, 2, 3])           # [3, n_vocab], from a fresh context

The provider is any ``ExpertProvider``; ``make_provider`` picks the tiered cache when it is
installed and falls back to the uncached ``DirectProvider`` with a logged warning. Prefill runs
in batches of ``prefill_batch`` tokens, each touched expert fetched once per batch and layer;
``trace(path)`` records every routing decision in the routing-trace format (``runtime.trace``).

The engine knows nothing of speculative decoding: ``runtime.mtp.attach(engine, MTPOptions(...))``
builds it on an open engine through narrow hooks: ``add_observer`` (every forward's tokens and
the trunk's last hidden states, every reset), ``verify`` (a forward of several rows as one
decode window), ``count_decode`` and ``runner.set_router``; ``runtime.generate`` and the server
run its steps. ``decode`` and ``verify`` run with ``runner.decoding`` set (where a router with
hooks, ``runtime.mtp.routing``, may skip experts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ..errors import UsageError
from .experts.protocol import ExpertProvider, WarmStart
from .cache.usage import prompt_coverage
from .cache.vram import KV_FIX, TRUNK_FIX, device_memory
from .memory import memory_limit
from .model import ExpertRunner, Model, ModelConfig, Router, TrunkReader, dequant_cache, load_trunk
from .model.loader import set_act_quant
from .model.qmatvec import use_fused
from .model.trunk_stream import stream_trunk
from .observer import ForwardObserver
from .pool_spin import PoolSpin
from .prefetch.lookahead import MARGIN, LookaheadStats, lookahead_slots
from .prefetch.tuner import LookaheadTuner

__all__ = ["Engine", "EngineOptions", "ForwardObserver", "make_provider", "resolve_dtype"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "bfloat16":
           torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "f16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise UsageError(f"unknown compute dtype {dtype!r}",
                         fix="use auto, float32, bfloat16 or float16") from None


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str | torch.dtype = "auto"     # compute dtype of the matrices (auto: f32 CPU, bf16 CUDA)
    n_ctx: int = 4096                     # KV cache limit in positions
    trunk: str = "auto"                   # "auto" | "float" | "quant" (see model.weights)
    trunk_budget: int | None = None       # float trunk bytes under "auto" (None: a quarter of
                                          # the memory limit, cgroup included)
    dq_cache: int = 0                     # bytes of dequantized experts kept (0: off)
    lookahead: bool = False               # next-layer gate prefetch
    lookahead_margin: int = MARGIN        # experts beyond top-k prefetched per token
    lookahead_tune: bool = False          # tried on and off in decode, the faster kept (tuner)
    prefetch_slots: int | None = None     # RAM slots the lookahead reads into, outside the
                                          # tier (None: k + margin + 1; 0: into the tier)
    prefill_batch: int = 256              # tokens per prefill forward
    prefill_prefetch: bool = False        # a prompt batch prefetches L+1's gate-predicted experts
    load_nextn: bool = True               # build the NextN/MTP block (else left unread)
    fused: str = "auto"                   # compiled decode matvecs: "auto" (CPU), "on", "off"
    act_quant: str = "off"                # "q8": llama.cpp's 8-bit activations in the native
                                          # expert and trunk products (lossy, opt-in, measured)
    trunk_stream: bool = False            # the memory budget cannot hold the trunk: stream the
                                          # share found missing a layer ahead (model.trunk_stream)

    def replace(self, **kw: Any) -> EngineOptions:
        return replace(self, **kw)


def make_provider(store: Any, *, device: str | torch.device = "cpu", ram_bytes: int = 0,
                  vram_bytes: int = 0, kind: str = "auto", **kw: Any) -> ExpertProvider:
    """The tiered cache provider when available (``kind="auto"``/``"tiered"``), else direct."""
    from .experts.direct import DirectProvider
    if kind in ("auto", "tiered"):
        try:
            from .cache.provider import TieredProvider
        except ImportError as e:
            if kind == "tiered":
                raise UsageError("the tiered expert cache is not installed",
                                 fix="use --provider direct") from e
            log.warning("tiered expert cache unavailable (%s); reading every expert from the "
                        "store with the uncached DirectProvider", e)
        else:
            return TieredProvider(store, device=str(device), ram_bytes=ram_bytes,
                                  vram_bytes=vram_bytes, **kw)
    elif kind != "direct":
        raise UsageError(f"unknown provider {kind!r}", fix="use auto, tiered or direct")
    return DirectProvider(store, device)


@dataclass
class StepTimes:
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0


class Engine:
    def __init__(self, store: Any, provider: ExpertProvider,
                 options: EngineOptions = EngineOptions(), *, own_store: bool = False) -> None:
        self.store, self.provider, self.options = store, provider, options
        self._own_store = own_store
        self.device = torch.device(options.device)
        self.dtype = resolve_dtype(options.dtype, self.device)
        self.reader = TrunkReader(store)
        self.kv = kv = store.gguf_kv()
        self.config = c = ModelConfig.from_gguf(kv, self.reader.names(), store.path)
        if not options.load_nextn:              # the NextN blocks: only read to draft
            self.reader.leave_out(range(c.n_layers, c.n_block))
        self.reader.prefetch()
        t0 = time.perf_counter()
        fused = use_fused(options.fused, self.device, self.dtype)
        budget = options.trunk_budget
        if budget is None and self.device.type == "cpu":
            budget = memory_limit() // 4
        # The warm start's reads wait for the first logits: they would share the drive with
        # the trunk's reads and then the prompt's own experts, and delay the first token.
        self._warm = provider if isinstance(provider, WarmStart) else None
        if self._warm is not None:
            provider.hold_warm()
        with device_memory(f"the trunk on {self.device}", fix=TRUNK_FIX):
            self.trunk = load_trunk(self.reader, self.config, dtype=self.dtype,
                                    device=self.device, trunk_mode=options.trunk,
                                    float_budget=budget, nextn=options.load_nextn, fused=fused)
        self.load_seconds = time.perf_counter() - t0
        look = LookaheadStats(options.lookahead_margin) if options.lookahead else None
        dev = self.device.type                  # no native products off the CPU: groups
        self.runner = ExpertRunner(provider, Router(self.config), self.dtype,
                                   dequant_cache(store, options.dq_cache, fused, dev), look,
                                   fused=fused, grouped=dev != "cpu", group_products=dev == "cuda",
                                   group_max=max(1, self.config.n_expert_used))
        self.runner.set_act_quant(options.act_quant)
        set_act_quant(self.trunk, options.act_quant)      # the trunk's products: the same numerics
        t1 = time.perf_counter()
        if fused:
            self._precompile()
        self.compile_seconds = time.perf_counter() - t1 if fused else 0.0
        with device_memory(f"the KV cache on {self.device}", fix=KV_FIX):
            self.model = Model(self.config, self.trunk, self.runner, device=self.device,
                               dtype=self.dtype, n_ctx=options.n_ctx, lookahead=options.lookahead,
                               lookahead_margin=options.lookahead_margin,
                               prefill_prefetch=options.prefill_prefetch)
        self._tuner = LookaheadTuner.of(self.model, options, lambda: provider.stats.stall_seconds)
        self.model.trunk_stream = stream_trunk(self.reader, self.trunk, options.trunk_stream,
                                               lambda: self.provider.stats.bytes_read)
        from . import kernels
        if fused and kernels.available():
            kernels.set_threads(torch.get_num_threads())     # the pool keeps today's count;
            self.model.small_steps_one_thread = True         # small steps' torch ops use one
        self.times, self._spin = StepTimes(), PoolSpin()
        self._trace = None
        self._token_no = 0              # tokens run through the model (trace token index)
        self._observers: list[ForwardObserver] = []

    def _precompile(self) -> None:
        """Compile the fused one-token products this model uses, before the first token."""
        from .model import qmatvec
        from ..formats.moe_names import Role
        from .model.loader import linears
        t = self.trunk
        mats = {(x.q.ggml_type, x.q.shape) for x in linears(t) if x.q is not None and x.fused}
        layers = set()
        for b in t.blocks:
            if b.moe is None:
                continue
            parts = {p.role: p for p in self.store.extent(b.layer, 0).parts}
            if all(r in parts for r in (Role.GATE, Role.UP, Role.DOWN)):
                ps = [parts[r] for r in (Role.GATE, Role.UP, Role.DOWN)]
                layers.add((tuple(p.ggml_type for p in ps),
                            tuple(tuple(reversed(p.ne)) for p in ps), self.config.n_expert_used))
        qmatvec.precompile(mats, layers)

    @classmethod
    def open(cls, path: str, *, provider: ExpertProvider | str = "auto", ram_bytes: int = 0,
             vram_bytes: int = 0, options: EngineOptions | None = None,
             provider_options: dict[str, Any] | None = None, **kw: Any) -> Engine:
        """Open the store at ``path``; ``provider`` is an instance or a kind for ``make_provider``
        (``provider_options`` go to it, e.g. ``{"warm_start": False}``)."""
        from ..store.reader import Store
        options = options or EngineOptions(**kw)
        store = Store.open(path)
        try:
            if isinstance(provider, str):
                popts = dict(provider_options or {})
                if options.lookahead:
                    popts.setdefault("prefetch_slots", lookahead_slots(store, options))
                if provider != "direct":
                    popts.setdefault("warm_held", True)     # resumed at the first logits
                provider = make_provider(store, device=options.device, ram_bytes=ram_bytes,
                                         vram_bytes=vram_bytes, kind=provider, **popts)
            return cls(store, provider, options, own_store=True)
        except BaseException:
            store.close()
            raise

    # --- running -------------------------------------------------------------------------

    def _ids(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):      # a sampled id kept on the device: no copy
            return tokens.to(device=self.device, dtype=torch.long)
        bad = [t for t in tokens if not 0 <= int(t) < self.config.n_vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} outside the vocabulary of "
                             f"{self.config.n_vocab}", fix="pass ids in 0..n_vocab-1")
        return torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)

    def add_observer(self, observer: ForwardObserver) -> None:
        """Tell ``observer`` of every forward from now on (which then keeps the trunk's last
        hidden states) and of every reset."""
        self._observers.append(observer)

    def _run(self, tokens: Sequence[int] | torch.Tensor, logits: str, decoding: bool = False
             ) -> torch.Tensor | None:
        if self._trace is not None:
            self.runner.record = []
        obs = self._observers
        was, self.runner.decoding = self.runner.decoding, decoding
        try:
            with device_memory(f"{len(tokens)} tokens at position {self.model.pos} (KV cache "
                               "growth, activations)", fix=KV_FIX):
                out = self.model.forward(self._ids(tokens), logits=logits, hidden=bool(obs))
        finally:
            self.runner.decoding = was
        for o in obs:     # (a device token's host copy only when someone observes)
            o.observe([int(t) for t in tokens], self.model.hidden)
        if self._trace is not None:
            self._flush_trace(len(tokens))
        self._token_no += len(tokens)
        if logits != "none":
            self.start_warm()
        return out

    def start_warm(self) -> None:
        """Let the provider's warm start read from now on (the engine holds it until the first
        logits, so the trunk's and the prompt's reads come first; a server waiting for its
        first request starts it at once)."""
        if self._warm is not None:
            warm, self._warm = self._warm, None
            warm.resume_warm()

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in batches; float32 logits ``[n_vocab]`` of the last one."""
        if not tokens:
            raise UsageError("nothing to prefill", fix="pass at least one token")
        t0 = time.perf_counter()
        step, out = max(1, self.options.prefill_batch), None
        with prompt_coverage(self.provider, len(tokens)):     # what the store's usage learns
            for a in range(0, len(tokens), step):
                out = self._run(tokens[a:a + step], "last" if a + step >= len(tokens) else "none")
        self.times.prefill_s += time.perf_counter() - t0
        self.times.prefill_tokens += len(tokens)
        return out[0]

    def decode(self, token: int | torch.Tensor) -> torch.Tensor:
        """One position (``token``: an id, or ``Sampler.sample``'s still on the device, then
        copied nowhere); float32 logits ``[n_vocab]``."""
        t0 = time.perf_counter()
        out = self._run(token.reshape(1) if isinstance(token, torch.Tensor) else [token], "last",
                        decoding=True)
        self.count_decode(time.perf_counter() - t0, 1)
        return out[0]

    def verify(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` as one decode window (a speculative verify pass): float32 logits
        ``[len(tokens), n_vocab]`` of every row. Not counted in ``times``: the caller counts its
        whole step with ``count_decode``."""
        return self._run(tokens, "all", decoding=True)

    def count_decode(self, seconds: float, tokens: int) -> None:
        """Count a decode step (``decode``'s or a speculative one's) in ``times`` and the spin."""
        self.times.decode_s += seconds
        self.times.decode_tokens += tokens
        self._spin.step(self.provider)
        if self._tuner is not None:
            self._tuner.step(seconds, tokens)

    def expect_decode(self, tokens: int | None) -> None:
        """Decode tokens the caller means to run from now (None: not known): for the tuner."""
        if self._tuner is not None:
            self._tuner.expect(tokens)

    def logits(self, tokens: Sequence[int], *, reset: bool = True) -> torch.Tensor:
        """Logits of every position of ``tokens``: float32 ``[len(tokens), n_vocab]`` (CPU)."""
        if reset:
            self.reset()
        step = max(1, self.options.prefill_batch)
        parts = [self._run(tokens[a:a + step], "all").cpu()
                 for a in range(0, len(tokens), step)]
        return torch.cat(parts)

    def warm(self, chunk: int = 16) -> None:
        """Fault the whole trunk in and ask for every expert of every layer once (fills the
        provider's tiers as far as they go, and the dequantized-expert cache when it is on); for
        benchmarks of resident runs."""
        self.reader.populate()
        for blk in self.trunk.blocks:
            if blk.moe is None:
                continue
            n = self.store.n_experts(blk.layer)
            for a in range(0, n, chunk):
                try:
                    self.runner._weights(blk.layer, list(range(a, min(n, a + chunk))))
                finally:
                    self.provider.release(blk.layer)

    def can_reset(self, pos: int) -> bool:
        """Can ``reset(pos)`` keep the first ``pos`` positions (else reset to 0 and re-run)?"""
        return self.model.can_reset(pos)

    def reset(self, pos: int = 0) -> None:
        self.model.reset(pos)
        for o in self._observers:
            o.reset(pos)

    @property
    def pos(self) -> int:
        return self.model.pos

    # --- traces and figures --------------------------------------------------------------

    def trace(self, path: str, meta: dict[str, Any] | None = None) -> None:
        """Record every routing decision from now on into the trace file ``path``."""
        from .trace.file import TraceHeader, TraceWriter
        cfg = self.config
        sizes = [int(self.store.layer_info(i)["extent_bytes"])
                 if cfg.is_moe(i) and self.trunk.blocks[i].moe is not None else 0
                 for i in range(cfg.n_layers)]
        m = {"model": str(self.kv.get("general.name").value) if "general.name" in self.kv
             else "", "architecture": cfg.arch, "generator": "expertfs run"}
        m.update(meta or {})
        self._trace = TraceWriter(path, TraceHeader(cfg.n_layers, cfg.n_experts, cfg.n_expert_used,
                                                    tuple(sizes), 0, m))

    def _flush_trace(self, n: int) -> None:
        rec, self.runner.record = self.runner.record or [], None
        for layer, ids, wts in rec:
            ih, wh = ids.cpu().numpy(), wts.float().cpu().numpy()
            for t in range(n):
                self._trace.add(self._token_no + t, layer, ih[t], wh[t])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "provider": type(self.provider).__name__,
            "provider_stats": self.provider.stats.as_dict(),
            "moe": self.runner.stats.as_dict(), "dq_cache": self.runner.dq.stats(),
            "trunk_float_bytes": self.trunk.float_bytes, "trunk_quant_bytes": self.trunk.quant_bytes,
            "kv_cache_bytes": self.model.cache.nbytes, "load_seconds": self.load_seconds,
            "trunk_stream": ts.as_dict() if (ts := self.model.trunk_stream) else None,
            "compile_seconds": self.compile_seconds, "fused": self.runner.fused,
            "prefill_tokens": self.times.prefill_tokens, "prefill_s": self.times.prefill_s,
            "decode_tokens": self.times.decode_tokens, "decode_s": self.times.decode_s,
        }
        if self.runner.lookahead is not None:
            out["lookahead"] = {**self.runner.lookahead.as_dict(),
                                **(self._tuner.as_dict() if self._tuner else {})}
        return out

    def close(self) -> None:
        self._spin.close()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        try:
            self.provider.close()
        finally:
            self.model.close()
            self.reader.close()
            if self._own_store:
                self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
