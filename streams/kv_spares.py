"""Tables made ready before the KV index needs them, so a table that doubles does not stall the fold.

When one of the index's tables (:mod:`streams.kv_core`) would pass its load factor, it is doubled:
a new table allocated and every row rehashed into it. The rehash is one streaming pass (about
12 ms for a million pair rows), but the new table's memory is faulted in by the kernel as the
rehash first touches it, and numpy asks for huge pages, which the kernel may compact and zero
synchronously: 6 to 165 ms for 50 MB on the 2-core bench machine (bench/RESULTS.md, session 26),
all of it inside the fold, so every batch and query behind it waits (the ingest lag's p99 was 88 ms
at 1000 frames/s with one such doubling, 6 ms with the tables sized ahead).

The index asks its :class:`Spares` for the next size of a table early (:data:`EARLY` of the way to
its load factor) and takes it when the doubling comes. :class:`Spares` itself keeps nothing (the
index allocates as before: deterministic, for tests and one-shot tools); :class:`PrefaultingSpares`
allocates and touches the table on a background thread (numpy releases the GIL while it writes),
so the fold only rehashes. Services that run for long (the indexer, the router's embedded index)
use it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

#: ask for a table's next size when it holds this share of the rows its load factor allows
EARLY = 0.75


class Spares:
    """The synchronous default: nothing made ahead, :meth:`take` always misses."""

    def want(self, rows: int, cols: int) -> None:
        """A zeroed ``uint64`` table of this shape will probably be needed soon."""

    def take(self, rows: int, cols: int) -> np.ndarray | None:
        """A zeroed table of this shape made ahead, or None (then the caller allocates)."""
        return None


class PrefaultingSpares(Spares):
    """Zeroed tables allocated and faulted in on a daemon thread (started on the first :meth:`want`).

    At most one table per shape is kept (any table of that shape may take it: tables of one shape
    are interchangeable); taking one drops those of its columns with fewer rows (outgrown). A table
    the engines' caches stop short of needing (the index levels off between :data:`EARLY` and the
    load factor) is dropped after ``ttl_s`` unused, and that shape is not made again: at most one
    such table's memory for ``ttl_s``, and past that the table doubles as without spares."""

    def __init__(self, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._ready: dict[tuple[int, int], np.ndarray] = {}
        self._made_at: dict[tuple[int, int], float] = {}
        self._unused: set[tuple[int, int]] = set()  # shapes dropped unused: not made again
        self._asked: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.made = 0  # tables made ahead
        self.taken = 0  # of them taken by a doubling
        self.dropped = 0  # of them dropped unused after ttl_s

    def want(self, rows: int, cols: int) -> None:
        key = (rows, cols)
        with self._lock:
            if self._made_at:
                self._expire()
            if key in self._ready or key in self._asked or key in self._unused:
                return
            self._asked.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-index-spares", daemon=True)
                self._thread.start()
        self._queue.put(key)

    def take(self, rows: int, cols: int) -> np.ndarray | None:
        with self._lock:
            out = self._ready.pop((rows, cols), None)
            self._made_at.pop((rows, cols), None)
            for key in [k for k in self._ready if k[1] == cols and k[0] < rows]:
                del self._ready[key]
                del self._made_at[key]
            if out is not None:
                self.taken += 1
            return out

    def _expire(self) -> None:
        old = self._clock() - self.ttl_s
        for key in [k for k, t in self._made_at.items() if t <= old]:
            del self._ready[key]
            del self._made_at[key]
            self._unused.add(key)
            self.dropped += 1

    def ready(self) -> list[tuple[int, int]]:
        """The shapes made and not yet taken."""
        with self._lock:
            return sorted(self._ready)

    def _run(self) -> None:
        # the lowest CPU priority: on a busy machine the fold and the engines' own work go first, and a
        # spare not ready in time only means a doubling as without spares
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # (not Linux, or not allowed)
            pass
        while True:
            key = self._queue.get()
            table = np.empty(key, dtype=np.uint64)
            table[...] = 0  # every page faulted in here, off the fold (the GIL released meanwhile)
            with self._lock:
                self._asked.discard(key)
                self._ready[key] = table
                self._made_at[key] = self._clock()
                self.made += 1
