"""Routing decisions and request records to the bus, never blocking a request.

``submit_*`` puts the event in a bounded queue and returns at once; when the queue is full the
event is dropped and counted (``infernex_router_records_dropped_total``). A background task
publishes to JetStream (``router.decisions.<pool>``, ``router.requests.<pool>``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from schemas import subjects as S
from schemas.base import Event
from schemas.records import RequestRecord, RoutingDecision

log = logging.getLogger(__name__)


class RecordSink:
    """Bounded in-memory buffer; ``drain_to`` consumes it (subclasses publish)."""

    def __init__(self, pool: str, *, buffer: int = 10_000, prefix: str | None = None,
                 registry: CollectorRegistry | None = None):
        self.pool = pool
        self.prefix = prefix
        self.queue: asyncio.Queue[tuple[str, Event, str]] = asyncio.Queue(maxsize=buffer)
        self.dropped = 0
        self.published = 0
        self._dropped = Counter("infernex_router_records_dropped_total",
                                "Records dropped because the publish buffer was full", ["kind"], registry=registry)
        self._published = Counter("infernex_router_records_published_total", "Records published", ["kind"],
                                  registry=registry)
        self._dec_subject = S.with_prefix(prefix, S.router_decisions(pool))
        self._req_subject = S.with_prefix(prefix, S.router_requests(pool))

    def _put(self, kind: str, subject: str, ev, msg_id: str) -> None:
        try:
            self.queue.put_nowait((subject, ev, msg_id))
        except asyncio.QueueFull:
            self.dropped += 1
            self._dropped.labels(kind).inc()

    def submit_decision(self, d: RoutingDecision | Callable[[], RoutingDecision], msg_id: str | None = None) -> None:
        """``d`` may be a zero-argument callable building the event (built by the publisher)."""
        if msg_id is None:
            msg_id = f"dec:{d.request_id}:{d.stage}:{d.ts}"
        self._put("decision", self._dec_subject, d, msg_id)

    def submit_request(self, r: RequestRecord) -> None:
        self._put("request", self._req_subject, r, f"req:{r.request_id}")

    @staticmethod
    def build(ev) -> Event:
        return ev() if callable(ev) else ev


class BusRecordSink(RecordSink):
    def __init__(self, js, pool: str, **kw):
        super().__init__(pool, **kw)
        self._js = js
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        from consumers import bus

        while True:
            subject, ev, msg_id = await self.queue.get()
            try:
                ev = self.build(ev)
                await bus.publish(self._js, subject, ev.to_json(), msg_id=msg_id, retries=2, timeout=2.0)
                self.published += 1
                self._published.labels("decision" if isinstance(ev, RoutingDecision) else "request").inc()
            except Exception as exc:  # noqa: BLE001 - a lost record must not stop the publisher
                self.dropped += 1
                self._dropped.labels("publish_error").inc()
                log.warning("record publish to %s failed: %s", subject, type(exc).__name__)

    async def flush(self, timeout: float = 5.0) -> None:
        end = asyncio.get_running_loop().time() + timeout
        while not self.queue.empty() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        from consumers.bus import cancel_task

        await cancel_task(self._task)
        self._task = None
