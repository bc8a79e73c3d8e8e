"""Admission control from the router's own accounting, not from scraped engine metrics.

Each backend takes at most ``cap(b)`` requests at once: the backend's configured ``max_inflight``,
else the section's ``max_inflight_per_backend``, else the engine's announced ``max_num_seqs``
times ``overcommit``, else ``default_max_inflight``. A backend at its cap is left out of routing
decisions (:attr:`Admission.full`); when every backend that could serve a request is full, the
request waits in a bounded queue for its model until a slot frees or its deadline passes, then is
refused (503 with ``Retry-After``). A full queue refuses at once (503); an API key over its quota
(requests in flight plus queued) is refused at once (429). Waiters of one model are woken one per
freed slot, round-robin across API keys, so one busy key cannot starve the others.

The counts come from ``started``/``finished`` calls made around every upstream request, so the
behaviour is the same with and without the bus. Single-threaded (the event loop); no locks.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from router.types import BackendState


class AdmissionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    max_inflight_per_backend: int | None = Field(
        default=None, gt=0, description="cap for every backend (over max_num_seqs; a backend's own max_inflight wins)")
    default_max_inflight: int = Field(default=256, gt=0,
                                      description="cap when the engine's max_num_seqs is unknown (vLLM's default)")
    overcommit: float = Field(default=1.0, gt=0, description="cap = max_num_seqs x overcommit")
    queue_size: int = Field(default=1024, ge=0, description="requests waiting for a slot, all models")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="longest wait for a slot (then 503)")
    max_inflight_per_key: int | None = Field(default=None, gt=0,
                                             description="per API key: in flight + queued (then 429)")


class Refused(Exception):
    """Not admitted: ``status`` 429 (key quota) or 503 (queue full, waited too long)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True)
class _Waiter:
    key: str
    fut: asyncio.Future


class Admission:
    def __init__(self, cfg: AdmissionConfig | None = None):
        self.cfg = cfg or AdmissionConfig()
        self.full: set[str] = set()  # pods at their cap: left out of decisions
        self.queued = 0
        self._queues: dict[str, OrderedDict[str, deque[_Waiter]]] = {}  # model -> key -> waiters
        self._per_key: dict[str, int] = {}

    # -- caps and accounting ----------------------------------------------------------------------
    def cap(self, b: BackendState) -> int:
        if b.max_inflight:
            return b.max_inflight
        c = self.cfg
        if c.max_inflight_per_backend:
            return c.max_inflight_per_backend
        if b.max_num_seqs:
            return max(1, int(b.max_num_seqs * c.overcommit))
        return c.default_max_inflight

    def started(self, b: BackendState) -> None:
        """After ``b.inflight`` went up (the router sent it a request)."""
        if self.cfg.enabled and b.inflight >= self.cap(b):
            self.full.add(b.pod)

    def finished(self, b: BackendState) -> None:
        """After ``b.inflight`` went down: a slot may have freed; wake a waiter of its model."""
        if b.pod in self.full:
            if b.inflight >= self.cap(b):
                return
            self.full.discard(b.pod)
        if self._queues:  # every freed slot wakes one waiter (a slot freed before is taken already)
            if not self.wake(b.model):
                for a in b.loras:
                    if self.wake(a):
                        break

    def resync(self, backends: list[BackendState]) -> None:
        """Recompute the full set (caps change with discovery) and wake a waiter of every model that
        has a backend with a free slot again (a backend joined, a cap grew)."""
        if not self.cfg.enabled:
            self.full.clear()
            return
        self.full = {b.pod for b in backends if b.inflight >= self.cap(b)}
        if self._queues:
            free = {m for b in backends if b.pod not in self.full for m in (b.model, *b.loras)}
            for model in [m for m in self._queues if m in free]:
                self.wake(model)

    # -- per-key quota ---------------------------------------------------------------------------------
    def enter(self, key: str) -> None:
        """A request of ``key`` arrives; :class:`Refused` (429) when the key is over its quota."""
        q = self.cfg.max_inflight_per_key
        n = self._per_key.get(key, 0)
        if q is not None and n >= q:
            raise Refused(429, "quota_exceeded", f"this API key already has {n} requests in flight (quota {q})")
        self._per_key[key] = n + 1

    def leave(self, key: str) -> None:
        n = self._per_key.get(key, 0) - 1
        if n > 0:
            self._per_key[key] = n
        else:
            self._per_key.pop(key, None)

    # -- the queue --------------------------------------------------------------------------------------
    def waiting(self, model: str) -> bool:
        q = self._queues.get(model)
        return bool(q)

    async def wait(self, model: str, key: str, timeout: float) -> None:
        """Wait for a slot of ``model`` to free (FIFO per key, round-robin across keys).
        :class:`Refused` (503) when the queue is full or ``timeout`` passes first."""
        if self.queued >= self.cfg.queue_size:
            raise Refused(503, "overloaded", f"all backends are at capacity and {self.queued} requests are queued")
        if timeout <= 0:
            raise Refused(503, "queue_timeout", "no backend slot freed within the queue deadline")
        fut = asyncio.get_running_loop().create_future()
        w = _Waiter(key, fut)
        per_model = self._queues.setdefault(model, OrderedDict())
        per_model.setdefault(key, deque()).append(w)
        self.queued += 1
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise Refused(503, "queue_timeout", f"no backend slot freed within {timeout:.1f} s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.wake(model)  # woken as the client left: the slot goes to the next waiter
            raise
        finally:
            if not fut.done() or fut.cancelled():
                self._remove(model, w)
            self.queued -= 1

    def wake(self, model: str) -> bool:
        """Wake the next waiter of ``model`` (round-robin across keys); False when none waits."""
        per_model = self._queues.get(model)
        while per_model:
            key, dq = next(iter(per_model.items()))
            w = dq.popleft()
            if dq:
                per_model.move_to_end(key)  # this key had its turn
            else:
                del per_model[key]
            if not w.fut.done():
                w.fut.set_result(None)
                if not per_model:
                    self._queues.pop(model, None)
                return True
        self._queues.pop(model, None)
        return False

    def _remove(self, model: str, w: _Waiter) -> None:
        per_model = self._queues.get(model)
        if not per_model:
            return
        dq = per_model.get(w.key)
        if dq is None:
            return
        try:
            dq.remove(w)
        except ValueError:
            return
        if not dq:
            del per_model[w.key]
        if not per_model:
            self._queues.pop(model, None)
