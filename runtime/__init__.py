"""The engine: I/O backends, cache tiers, policies, predictors, the MoE forward pass."""
