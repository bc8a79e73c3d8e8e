"""Per-pod load fold for the router: engine metrics in, load snapshots out (health: streams.health).

Pure: ``apply(event)``, queries, ``dump()`` (the state written back as events, so restoring is
replaying). Time comes from an injected clock; a pod whose last metrics are older than
``stale_after_s`` has no load reading (the router then treats it as unknown, i.e. idle).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.metrics import EngineMetrics
from streams.clock import Clock, SystemClock


@dataclass(frozen=True, slots=True)
class PodLoad:
    pod: str
    model: str
    role: str
    ts: float
    waiting: float
    running: float
    kv_usage: float
    block_size: int | None
    num_gpu_blocks: int | None


class LoadState:
    """Latest metrics per (pod, engine); a pod's load sums its data-parallel engines."""

    def __init__(self, clock: Clock | None = None, stale_after_s: float = 30.0):
        self._clock = clock or SystemClock()
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], EngineMetrics] = {}

    def apply(self, m: EngineMetrics) -> bool:
        """Fold one snapshot; an older snapshot than the one held is ignored (returns False)."""
        key = (m.pod, m.engine)
        old = self._latest.get(key)
        if old is not None and old.ts > m.ts:
            return False
        self._latest[key] = m
        return True

    def forget(self, pod: str) -> None:
        for key in [k for k in self._latest if k[0] == pod]:
            del self._latest[key]

    def get(self, pod: str) -> PodLoad | None:
        now = self._clock.now()
        ms = [m for (p, _), m in self._latest.items() if p == pod and now - m.ts <= self.stale_after_s]
        if not ms:
            return None
        n = len(ms)
        return PodLoad(
            pod=pod, model=ms[0].model, role=ms[0].role, ts=max(m.ts for m in ms),
            waiting=sum(m.num_requests_waiting for m in ms), running=sum(m.num_requests_running for m in ms),
            kv_usage=sum(m.kv_cache_usage_perc for m in ms) / n, block_size=ms[0].block_size,
            num_gpu_blocks=sum(m.num_gpu_blocks or 0 for m in ms) or None)

    def all(self) -> dict[str, PodLoad]:
        out = {}
        for pod in {p for p, _ in self._latest}:
            v = self.get(pod)
            if v is not None:
                out[pod] = v
        return out

    def dump(self) -> list[EngineMetrics]:
        return sorted(self._latest.values(), key=lambda m: (m.ts, m.pod, m.engine))
