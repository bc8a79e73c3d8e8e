"""Engines announced on the bus: a fold of ``EngineAnnouncement`` with time-to-live.

An engine is alive while its last announcement is younger than its ``ttl_s`` and its state
is not ``down``. Pure: apply / alive / dump, with an injected clock.
"""

from __future__ import annotations

from schemas.announce import EngineAnnouncement
from streams.clock import Clock, SystemClock


class AnnouncedBackends:
    def __init__(self, clock: Clock | None = None):
        self._clock = clock or SystemClock()
        self._last: dict[str, EngineAnnouncement] = {}

    def apply(self, a: EngineAnnouncement) -> None:
        old = self._last.get(a.pod)
        if old is not None and old.ts > a.ts:
            return
        self._last[a.pod] = a

    def alive(self) -> list[EngineAnnouncement]:
        now = self._clock.now()
        return [a for a in self._last.values() if a.state != "down" and now - a.ts <= a.ttl_s]

    def dump(self) -> list[EngineAnnouncement]:
        return sorted(self._last.values(), key=lambda a: (a.ts, a.pod))
