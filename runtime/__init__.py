"""The engine: I/O backends, cache tiers, policies, predictors, the MoE forward pass."""

import os as _os

# OpenMP threads that spin-wait between torch ops starve the I/O and prefetch threads this
# runtime depends on, and collapse when any other process wants a core: measured here, a
# 51-token prefill took 112 s with the default (active) wait and 12 s with passive waits, and
# decode ran 11x faster. It only takes effect if set before torch loads OpenMP; the user's
# own setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

