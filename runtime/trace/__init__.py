"""Routing traces: which experts each token used at each layer.

``format`` (the records and the rules a chunk obeys), ``file`` (``TraceWriter``/``TraceReader``),
``async_writer`` (a writer for an asyncio runtime), ``synth`` (synthetic traces with set skew,
locality and cross-layer correlation).
"""
