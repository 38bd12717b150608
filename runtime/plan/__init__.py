"""``expertfs plan``: what a box will do with a model before it is downloaded.

``assumptions`` (what the plan models, and its stated constants), ``geometry`` (every matrix a
token reads, and the KV cache), ``model`` (a geometry from a store, a GGUF, or a GGUF described
in memory), ``budget`` (the memory budget and its records, pure), ``rates``
(what each device does per second), ``probe`` (short measurements of those rates), ``routing``
(hit rates from a replayed trace), ``predict`` (tokens/s from all of them, pure), ``report``
(the text a user reads), ``run`` (inputs → plan, end to end).
"""
