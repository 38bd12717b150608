"""Whether the lookahead pays on this box and model, decided from the decode's own step times.

The lookahead (``prefetch.lookahead``) trades reads for stall: its guesses are read while a
layer computes, so a right guess is a wait saved and a wrong one a read that costs the drive's
time and the CPU's (the system call, the pinning, the completion) on the cores the products
run on. Which side wins depends on how well the next layer's router guesses on this model, how
much of a token the drive is, and how many cores are left over for the reads, so it is measured
here, per run, rather than fixed per architecture:

- a **trial** alternates the lookahead on and off for ``EPOCH`` decode tokens at a time in an
  ``ABBAAB`` order (``A`` the arm it starts from), so a trend over the trial (a warm start
  filling the tier, a cache warming) weighs on both arms alike, then compares the arms' median
  seconds a token;
- the other arm wins only when it is at least ``GAIN`` faster; otherwise the arm it started
  from stays (a trial inside the box's noise changes nothing);
- the choice holds for ``HOLD`` tokens, then a shorter ``ABBA`` trial checks it again (a long
  generation's routing or the box's load may have changed);
- a trial that would try the lookahead from off ends after its first epoch where that epoch
  waited on the drive (``stall()``, the provider's cumulative seconds, from the epoch's second
  step: the first may carry the prompt's waits) for less than ``GAIN`` of its time: the
  lookahead only saves such waits, so it could not win by ``GAIN`` there, and trying it would
  cost its wrong reads for nothing (a decode the RAM tier nearly holds);
- a trial starts only where the decode the caller still expects (``expect``: ``generate``
  knows its ``max_new``) is at least ``1 + PAYBACK`` times the trial's length: up to half a
  trial runs the losing arm, which only the tokens after it can repay, so a short generation
  keeps the arm it starts from, the trial pending until a step finds a longer one expected
  (``expect`` again). Without a hint (a server's requests, the API's own decode loop) the trials
  run as the tokens come, their cost spread over the engine's life.

``set_on(bool)`` switches the lookahead (the model's flag, read at each layer); ``step(s, n)``
counts a decode step of ``n`` tokens (a speculative window is one step) that took ``s`` seconds.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["LookaheadTuner"]

log = logging.getLogger(__name__)


class LookaheadTuner:
    EPOCH = 8            # decode tokens an arm runs before the other takes over
    GAIN = 0.03          # the other arm must be this much faster (median s/token) to switch
    HOLD = 256           # tokens a choice holds before it is tried again
    PAYBACK = 2          # decode expected after a trial, in trial lengths, for it to start

    def __init__(self, set_on: Callable[[bool], None], prior: bool,
                 stall: Callable[[], float] | None = None) -> None:
        self._set_on = set_on
        self._stall = stall
        self.skipped = 0                 # trials ended early: nothing to save
        self._epoch: tuple[float, float] | None = None   # (seconds, stall at its 2nd step)
        self._first = True               # in a trial's first epoch
        self.on = prior                  # the arm the decode runs now
        self.choice = prior              # the arm kept between trials
        self.trials = 0
        self.history: list[tuple[float, float]] = []     # every trial's (on, off) s/token
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._budget: int | None = None  # decode tokens the caller expects (None: unknown)
        self._order: list[bool] = []     # the running trial's epochs (empty: none runs)
        self._pending: list[bool] | None = self._trial(prior, first=True)   # the next trial
        self._left = 0                   # tokens left in this epoch (or in the hold)
        set_on(self.on)

    @classmethod
    def of(cls, model: Any, options: Any, stall: Callable[[], float] | None = None
           ) -> LookaheadTuner | None:
        """The tuner an engine's ``options`` ask for (``lookahead`` and ``lookahead_tune``),
        switching ``model.lookahead``, starting off; else None."""
        if not (options.lookahead and options.lookahead_tune):
            return None
        return cls(lambda on: setattr(model, "lookahead", on), False, stall)

    @property
    def medians(self) -> dict[bool, float]:
        """The last trial's seconds a token per arm (none before the first)."""
        return {True: self.history[-1][0], False: self.history[-1][1]} if self.history else {}

    def expect(self, tokens: int | None) -> None:
        """The decode tokens the caller expects to run from now on (None: not known), weighed
        at the next step: the next trial begins only where they would repay it."""
        self._budget = tokens

    def _repays(self, order: list[bool]) -> bool:
        return self._budget is None or \
            self._budget >= (1 + self.PAYBACK) * len(order) * self.EPOCH

    def _begin(self, order: list[bool]) -> None:
        """Run the trial ``order`` from this step (a trial starts from the choice, the arm this
        step ran)."""
        self._pending, self._order, self._first = None, order, True
        self._switch(order[0], self.EPOCH)

    @staticmethod
    def _trial(a: bool, *, first: bool) -> list[bool]:
        """The arms of a trial's epochs, starting from ``a``: ABBAAB, a re-check ABBA."""
        b = not a
        return [a, b, b, a, a, b] if first else [a, b, b, a]

    def step(self, seconds: float, tokens: int) -> None:
        if tokens <= 0:
            return
        if self._pending is not None and self._repays(self._pending):
            self._begin(self._pending)
        if self._budget is not None:
            self._budget -= tokens
        if self._pending is not None:                # put off: the choice runs meanwhile
            return
        if self._order:                              # in a trial: time this arm
            self._times[self.on] += [seconds / tokens] * tokens
            if self._epoch is None:
                self._epoch = (0.0, self._stall() if self._stall is not None else 0.0)
            else:
                self._epoch = (self._epoch[0] + seconds, self._epoch[1])
        self._left -= tokens
        if self._left > 0:
            return
        if self._order and self._nothing_to_save():
            self._order, self._times = [], {True: [], False: []}
            self.skipped += 1
            self._switch(self.choice, self.HOLD)
        elif self._order:
            self._first = False
            self._order.pop(0)
            if self._order:
                self._switch(self._order[0], self.EPOCH)
                return
            self._decide()
            self._switch(self.choice, self.HOLD)
        else:                                        # the hold is over: check again
            self._pending = self._trial(self.choice, first=False)

    def _nothing_to_save(self) -> bool:
        """The trial's first epoch ran without the lookahead and hardly waited on the drive."""
        if self._stall is None or self.on or not self._first or not self._epoch \
                or self._epoch[0] <= 0:
            return False
        return (self._stall() - self._epoch[1]) < self.GAIN * self._epoch[0]

    def _switch(self, on: bool, tokens: int) -> None:
        self._left, self._epoch = tokens, None
        if on != self.on:
            self.on = on
            self._set_on(on)

    def _decide(self) -> None:
        on, off = (statistics.median(self._times[a]) for a in (True, False))
        self.history.append((on, off))
        self.trials += 1
        kept, other = (on, off) if self.choice else (off, on)
        if other < kept * (1 - self.GAIN):
            self.choice = not self.choice
        self._times = {True: [], False: []}
        log.info("lookahead %s (trial %d: %.1f ms a decode token with it, %.1f without)",
                 "on" if self.choice else "off", self.trials, on * 1e3, off * 1e3)

    def as_dict(self) -> dict[str, Any]:
        return {"tuned": True, "tuned_on": self.choice, "trials": self.trials,
                "skipped": self.skipped, "pending": self._pending is not None,
                "ms_on": self.medians.get(True, 0.0) * 1e3,
                "ms_off": self.medians.get(False, 0.0) * 1e3,
                "trial_ms": [[round(a * 1e3, 2), round(b * 1e3, 2)] for a, b in self.history]}
