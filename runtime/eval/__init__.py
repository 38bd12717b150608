"""Offline evaluation of predictors and speculative decoding, for benchmarks and reports:
``prefetch`` (a predictor's recall and precision on a trace), ``mtp`` (draft acceptance,
route predictors, route tail-skip quality)."""
