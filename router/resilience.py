"""Per-backend circuit breakers and per-key rate limits. Plain state with an injected clock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from streams.clock import Clock, SystemClock


@dataclass(slots=True)
class _Breaker:
    failures: int = 0
    open_until: float = 0.0
    half_open: bool = False


def is_breaker_failure(exc: BaseException | str | None) -> bool:
    """Whether an upstream outcome says the engine is broken (counts toward its breaker) rather
    than merely slow. Broken: connection refused/reset, the answer cut off, an HTTP 5xx. Slow (not
    counted): our read timeout, a connect that timed out (a CPU-starved engine not accepting yet),
    a client that gave up. Accepts an exception or an outcome string (``connect``, ``http_503``,
    ``slow``...)."""
    if exc is None:
        return False
    if isinstance(exc, str):
        return exc != "slow"
    if isinstance(exc, (TimeoutError, asyncio.CancelledError)):
        return False
    kind = getattr(exc, "kind", None)
    if kind == "timeout":
        return False
    return not (kind == "connect" and "timed out" in str(exc))


class CircuitBreakers:
    """``failure_threshold`` consecutive failures open a backend's circuit for ``cooldown_s``;
    then one trial request is let through (half-open): success closes it, failure re-opens it."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 10.0, clock: Clock | None = None):
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock or SystemClock()
        self._b: dict[str, _Breaker] = {}

    @property
    def active(self) -> bool:
        """True when some backend has failures on record (else every circuit is closed)."""
        return bool(self._b)

    def is_open(self, pod: str) -> bool:
        """True while requests must not go to ``pod`` (open, or half-open with its trial under way)."""
        b = self._b.get(pod)
        if b is None or b.open_until == 0.0:
            return False
        if self._clock.now() < b.open_until:
            return True
        return b.half_open

    def attempt(self, pod: str) -> None:
        """A request is being sent to ``pod``; after the cooldown it is the one trial."""
        b = self._b.get(pod)
        if b is not None and b.open_until and self._clock.now() >= b.open_until:
            b.half_open = True

    def open_until(self, pod: str) -> float:
        """When ``pod``'s cooldown ends (0.0: closed); the earliest belongs to the least recently failed."""
        b = self._b.get(pod)
        return b.open_until if b is not None else 0.0

    def success(self, pod: str) -> None:
        self._b.pop(pod, None)

    def failure(self, pod: str) -> bool:
        """Count a failure; returns True when this opened the circuit."""
        b = self._b.setdefault(pod, _Breaker())
        b.failures += 1
        if b.half_open or b.failures >= self.failure_threshold:
            b.open_until = self._clock.now() + self.cooldown_s
            b.half_open = False
            return True
        return False

    def state(self, pod: str) -> str:
        b = self._b.get(pod)
        if b is None or b.open_until == 0.0:
            return "closed"
        if self._clock.now() >= b.open_until and not b.half_open:
            return "half-open"
        return "open"


@dataclass(slots=True)
class _Bucket:
    tokens: float
    ts: float


class RateLimiter:
    """Token bucket per key: ``rate`` requests per second, bursts up to ``burst``."""

    def __init__(self, rate: float, burst: int, clock: Clock | None = None, max_keys: int = 100_000):
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock or SystemClock()
        self._b: dict[str, _Bucket] = {}
        self._max_keys = max_keys

    def allow(self, key: str) -> tuple[bool, float]:
        """(allowed, seconds until the next token when refused)."""
        now = self._clock.now()
        b = self._b.get(key)
        if b is None:
            if len(self._b) >= self._max_keys:
                self._b.clear()
            b = self._b[key] = _Bucket(float(self.burst), now)
        b.tokens = min(self.burst, b.tokens + (now - b.ts) * self.rate)
        b.ts = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return True, 0.0
        return False, (1.0 - b.tokens) / self.rate
