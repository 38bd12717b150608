"""A ``SplitGet`` provider whose reads land in a set order, for the tests of a decode step that
computes its experts as they arrive: what it was asked and what landed when is in ``log``."""

from __future__ import annotations

from expertfs.runtime.experts.protocol import ProviderStats, SplitGet


class LandingProvider(SplitGet):
    """Experts 0..n with fixed weights; ``ready`` resident, the rest land in ``landing`` order,
    one per ``finish(some=True)``."""

    def __init__(self, weights, ready, landing):
        self.w, self.ready, self.landing = weights, set(ready), list(landing)
        self.log: list[str] = []
        self.stats = ProviderStats()

    def get(self, layer, experts):
        return {e: self.w[e] for e in experts}

    def get_begin(self, layer, experts):
        self.log.append("begin")
        late = [e for e in self.landing if e in experts]

        def finish(only=None, *, some=False):
            want = [e for e in late if only is None or e in only]
            got = want[:1] if some else want
            for e in got:
                late.remove(e)
                self.log.append(f"land {e}")
            return {e: self.w[e] for e in got}
        return {e: self.w[e] for e in experts if e in self.ready}, finish

    def release(self, layer):
        self.log.append("release")

    def prefetch(self, layer, experts, source="gate"):
        pass
