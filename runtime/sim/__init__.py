"""Offline cache simulation on routing traces: ``replay`` (a trace against two tiers),
``sweep`` (policies × capacities, the data of ``bench cache``), ``bounds`` (Belady and the
static-frequency cache, the references a policy is judged against)."""
