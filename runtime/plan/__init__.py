"""``expertfs plan``: what a box will do with a model before it is downloaded.

``geometry`` (every matrix a token reads, and the KV cache), ``model`` (a geometry from a store,
a GGUF or a preset), ``budget`` (the memory budget and the plan's records, pure), ``rates``
(what each device does per second), ``probe`` (short measurements of those rates), ``routing``
(hit rates from a replayed trace), ``predict`` (tokens/s from all of them, pure), ``report``
(the text a user reads), ``run`` (inputs → plan, end to end).
"""
