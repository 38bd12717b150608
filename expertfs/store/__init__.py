"""The store: a GGUF repacked into one aligned extent per expert, indexed in LMDB (FORMAT.md).

One concept per module, in the order the data flows:

``layout``   the records and their exact bytes;      ``plan``     where every byte goes (pure);
``windows``  the plan cut into aligned write windows; ``writer``   executes them;
``index``    the LMDB index;                           ``repack``   GGUF → store, crash-safe;
``reader``   ``Store``: a store opened for reading;   ``verify``   structure and checksums;
``unpack``   the store back to its GGUF, bit-exact;   ``inspect``  what is inside, as a dict;
``summary``  a model's figures;                       ``fileio``   whole-range reads for tools.
"""

from .reader import Store, is_store

__all__ = ["Store", "is_store"]
