"""Placeholder replaced below."""
def linear(*a, **k):
    raise NotImplementedError
