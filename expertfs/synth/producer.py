"""Generate tensor chunks on a worker thread while the writer writes the previous ones.

numpy's bit generators, ``take`` and the quantizers release the GIL, and so does ``write``, so
generating and writing overlap on two cores. The queue holds at most ``depth`` chunks, so
memory stays bounded (``depth`` × 8 MiB by default).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator, Sequence

__all__ = ["ChunkProducer"]

_END = object()


class ChunkProducer:
    """``with ChunkProducer(n, make) as pf: pf.chunks(i)`` yields ``make(i)``'s chunks, made ahead.

    ``make(i)`` must be asked for in order ``i = 0 .. n-1`` and each fully consumed, which is
    how ``write_gguf`` walks its tensors.
    """

    def __init__(self, items: Sequence[object] | int, make: Callable[[int], Iterable[object]],
                 depth: int = 3) -> None:
        self._n = items if isinstance(items, int) else len(items)
        self._make = make
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="synth-chunks", daemon=True)

    def __enter__(self) -> ChunkProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for i in range(self._n):
                for c in self._make(i):
                    if not self._put((i, c)):
                        return
                if not self._put((i, _END)):
                    return
        except BaseException as e:           # handed to the consumer, raised there
            self._put((-1, e))

    def chunks(self, i: int) -> Iterator[object]:
        while True:
            j, c = self._q.get()
            if j == -1:
                raise c                       # type: ignore[misc]
            if j != i:
                raise RuntimeError(f"chunks out of order: tensor {j} while writing {i}")
            if c is _END:
                return
            yield c
