"""The engine: I/O backends, cache tiers, policies, predictors, the MoE forward pass.

Importing it changes nothing: the OpenMP wait policy the runtime is tuned for is set by
``expertfs.runtime.openmp.configure()``, which the CLI calls before torch loads.
"""
