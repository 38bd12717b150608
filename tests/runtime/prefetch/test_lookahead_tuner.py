"""The lookahead's tuner: its trials alternate the arms in ABBAAB epochs, keep the arm it
started from unless the other is faster by more than its margin, hold the choice, check it
again, count a speculative window as one step of several tokens, do not try the lookahead
from off where the decode hardly waits on the drive, and start no trial a decode too short to
repay it; and an engine runs it when its options ask, switching the model's flag, and
``generate`` tells it how long a decode to expect."""

from __future__ import annotations

import pytest

from expertfs.runtime.prefetch.tuner import LookaheadTuner

E = LookaheadTuner.EPOCH


class Box:
    """A decode whose token takes ``cost[arm]`` seconds; records the switches."""

    def __init__(self, cost_on: float, cost_off: float, prior: bool,
                 stall_share: float | None = None, stall_before: float = 0.0) -> None:
        self.cost = {True: cost_on, False: cost_off}
        self.switches: list[bool] = []
        self.share = stall_share              # of each token's time spent waiting on reads
        self.stalled = stall_before           # the provider's counter (the prompt's waits)
        self.t = LookaheadTuner(self.switches.append, prior,
                                None if stall_share is None else lambda: self.stalled)

    def run(self, tokens: int, per_step: int = 1) -> list[bool]:
        arms = []
        for _ in range(tokens // per_step):
            arms.append(self.t.on)
            s = self.cost[self.t.on] * per_step
            self.stalled += s * (self.share or 0.0)
            self.t.step(s, per_step)
        return arms


@pytest.mark.parametrize("prior", [True, False])
def test_a_trial_runs_abbaab_epochs_from_its_prior(prior):
    box = Box(0.1, 0.1, prior)
    arms = box.run(6 * E)
    a, b = prior, not prior
    assert arms == [a] * E + [b] * 2 * E + [a] * 2 * E + [b] * E
    assert box.switches[0] == prior           # the flag set at once, before the first token


@pytest.mark.parametrize("prior", [True, False])
@pytest.mark.parametrize("on,off,kept", [(0.10, 0.15, True), (0.15, 0.10, False)])
def test_the_faster_arm_is_kept(prior, on, off, kept):
    box = Box(on, off, prior)
    box.run(6 * E)
    assert box.t.choice is kept and box.t.on is kept and box.t.trials == 1
    assert box.t.as_dict() == {"tuned": True, "tuned_on": kept, "trials": 1, "skipped": 0,
                               "pending": False,
                               "ms_on": pytest.approx(on * 1e3), "ms_off": pytest.approx(off * 1e3),
                               "trial_ms": [[pytest.approx(on * 1e3), pytest.approx(off * 1e3)]]}
    assert set(box.run(LookaheadTuner.HOLD)) == {kept}      # held


@pytest.mark.parametrize("prior", [True, False])
def test_a_gain_inside_the_margin_keeps_the_prior(prior):
    other = 0.1 * (1 - LookaheadTuner.GAIN / 2)              # faster, but not by the margin
    box = Box(0.1 if prior else other, other if prior else 0.1, prior)
    box.run(6 * E)
    assert box.t.choice is prior


def test_the_choice_is_checked_again_after_the_hold():
    box = Box(0.10, 0.15, False)
    box.run(6 * E)
    assert box.t.choice is True
    box.run(LookaheadTuner.HOLD)
    box.cost = {True: 0.2, False: 0.1}                        # the box changed: now it costs
    arms = box.run(4 * E)
    assert arms == [True] * E + [False] * 2 * E + [True] * E   # ABBA from the choice
    assert box.t.choice is False and box.t.trials == 2 and box.t.on is False


def test_a_speculative_window_is_one_step_of_its_tokens():
    box = Box(0.10, 0.15, False)
    box.run(6 * E, per_step=4)                # windows of 4: the same epochs, per-token times
    assert box.t.trials == 1 and box.t.choice is True
    assert box.t.medians[True] == pytest.approx(0.10)


def test_no_tokens_count_for_nothing():
    box = Box(0.1, 0.2, True)
    box.t.step(5.0, 0)
    assert box.run(E) == [True] * E


class _Opts:
    def __init__(self, lookahead: bool, tune: bool, prior: bool) -> None:
        self.lookahead, self.lookahead_tune, self.lookahead_prior = lookahead, tune, prior


class _Model:
    lookahead = True


@pytest.mark.parametrize("look,tune", [(False, True), (True, False), (False, False)])
def test_no_tuner_unless_asked(look, tune):
    assert LookaheadTuner.of(_Model(), _Opts(look, tune, True)) is None


def test_of_switches_the_models_flag():
    m = _Model()
    t = LookaheadTuner.of(m, _Opts(True, True, False))
    assert m.lookahead is False
    for _ in range(E):
        t.step(0.1, 1)
    assert m.lookahead is True                 # the second epoch: the other arm


def test_no_trial_from_off_where_the_decode_hardly_waits():
    """An epoch off that waited under GAIN of its time: the lookahead cannot save that much, so
    the trial ends there and the choice holds; the prompt's waits, counted before the first
    decode step, do not count for it."""
    box = Box(0.10, 0.15, False, stall_share=LookaheadTuner.GAIN / 3, stall_before=50.0)
    assert set(box.run(E + LookaheadTuner.HOLD)) == {False}
    assert box.t.skipped == 1 and box.t.trials == 0 and box.t.choice is False
    assert box.run(E) == [False] * E and box.t.skipped == 2         # the re-check, the same


@pytest.mark.parametrize("prior,share", [(False, 0.2), (True, 0.0)])
def test_a_trial_runs_where_the_decode_waits_or_from_on(prior, share):
    box = Box(0.10, 0.15, prior, stall_share=share)
    arms = box.run(6 * E)
    assert arms[E:3 * E] == [not prior] * 2 * E
    assert box.t.trials == 1 and box.t.skipped == 0 and box.t.choice is True


def test_a_short_decode_starts_no_trial():
    """Expecting fewer than (1 + PAYBACK) trial lengths: the arm it starts from runs to the end,
    the trial pending; a longer decode expected next begins it at once."""
    trial = 6 * E
    box = Box(0.10, 0.15, False)
    box.t.expect((1 + LookaheadTuner.PAYBACK) * trial - 1)
    assert set(box.run(3 * trial - 1)) == {False}
    assert box.t.trials == 0 and box.t.as_dict()["pending"] is True
    box.t.expect((1 + LookaheadTuner.PAYBACK) * trial)
    arms = box.run(trial)
    assert arms == [False] * E + [True] * 2 * E + [False] * 2 * E + [True] * E
    assert box.t.trials == 1 and box.t.choice is True and box.t.as_dict()["pending"] is False


def test_a_decode_long_enough_or_unknown_runs_the_trial_and_a_recheck_is_gated_too():
    box = Box(0.10, 0.15, False)
    box.t.expect(None)
    assert box.run(6 * E)[E:3 * E] == [True] * 2 * E and box.t.trials == 1
    box.t.expect(LookaheadTuner.HOLD + 10)           # the re-check (ABBA) would not repay
    assert set(box.run(LookaheadTuner.HOLD + 10)) == {True} and box.t.trials == 1
    box.t.expect(None)                               # a server's decode: the pending re-check
    assert box.run(4 * E) == [True] * E + [False] * 2 * E + [True] * E
    assert box.t.trials == 2


def test_generate_tells_the_engine_how_long_a_decode_to_expect():
    from expertfs.runtime.generate import generate
    import torch

    from expertfs.runtime.sampling import Sampler, SamplingParams

    class Eng:
        def __init__(self):
            self.hints = []

        def prefill(self, ids):
            return torch.zeros(4)

        def decode(self, tok):
            self.hints.append("decode")
            return torch.zeros(4)

        def expect_decode(self, n):
            self.hints.append(n)

    eng = Eng()
    steps = list(generate(eng, [1, 2], Sampler(SamplingParams(temperature=0.0)), 3))
    assert len(steps) == 3 and eng.hints == [2, "decode", "decode", None]


def test_the_lookahead_default_is_one_rule_for_run_and_plan() -> None:
    """``auto_lookahead``: off unless the experts stream (a RAM tier short of every expert, no
    VRAM tier, the trunk resident), then on for ``AUTO_ARCHS`` and tuned elsewhere."""
    from expertfs.runtime.prefetch.lookahead import AUTO_ARCHS, auto_lookahead
    arch = AUTO_ARCHS[0]
    assert auto_lookahead(arch, 100, 400, False, True) == "on"
    assert auto_lookahead("qwen3moe", 100, 400, False, True) == "tuned"
    assert auto_lookahead(arch, 400, 400, False, True) == "off"        # every expert held
    assert auto_lookahead(arch, 100, 400, True, True) == "off"         # a VRAM tier
    assert auto_lookahead(arch, 100, 400, False, False) == "off"       # the trunk re-read
