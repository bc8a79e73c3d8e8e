"""Publishing to JetStream in order, pipelined: the KV bridge's sender (no domain logic).

:class:`OrderedPublisher` keeps up to ``max_inflight`` publishes unacknowledged, retires them in
queue order, and re-sends a whole window one by one with the same ``Nats-Msg-Id`` when an ack
fails or times out (so JetStream drops the copies it already stored). ``metrics`` is any object
with the counters it updates (:class:`consumers.kv_bridge.BridgeMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Item:
    subject: str
    data: bytes
    msg_id: str
    t0: float
    stored: int = 0
    removed: int = 0
    sent_at: float = 0.0
    state: int = 0  # 0 in flight, 1 acknowledged, 2 failed
    error: str | None = None
    headers: dict[str, str] | None = None  # besides Nats-Msg-Id (content type, pod, model, epoch, seq)
    batches: int = 1  # a group message holds several


class _Pipe:
    """A bounded FIFO between one producer and one consumer task (lighter than asyncio.Queue)."""

    def __init__(self, maxsize: int):
        self._d: deque = deque()
        self._max = maxsize
        self._items = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()

    async def put(self, item) -> None:
        while len(self._d) >= self._max:
            self._space.clear()
            await self._space.wait()
        self._d.append(item)
        self._items.set()

    async def get(self):
        while not self._d:
            self._items.clear()
            await self._items.wait()
        item = self._d.popleft()
        self._space.set()
        return item

    def empty(self) -> bool:
        return not self._d

    def qsize(self) -> int:
        return len(self._d)


class OrderedPublisher:
    """Publishes queued items to JetStream in order with up to ``max_inflight`` unacknowledged.

    Each message is a plain NATS publish whose reply subject is a token under one inbox
    subscription, so JetStream's ack comes back there (cheaper than a request per message).
    Items are retired in queue order. A failed ack, or one missing after ``ack_timeout``
    (e.g. NATS restarted), makes the whole window be re-sent one by one with the same
    ``Nats-Msg-Id`` (copies the server already stored are dropped as duplicates), then
    pipelining resumes. ``on_ack`` is called in queue order.
    """

    def __init__(self, nc, metrics: Any, *, max_inflight: int = 256, queue_size: int = 4096,
                 ack_timeout: float = 5.0, on_ack: Callable[[Item], None] | None = None):
        self._nc = nc
        self._m = metrics
        self.queue = _Pipe(queue_size)
        self._max_inflight = max_inflight
        self._ack_timeout = ack_timeout
        self._on_ack = on_ack
        self._inflight: dict[str, Item] = {}
        self._wake = asyncio.Event()
        self._token = 0
        self._inbox: str | None = None
        self._sub = None
        self.acked = 0

    async def put(self, item: Item) -> None:
        await self.queue.put(item)
        self._wake.set()

    async def _on_reply(self, msg) -> None:
        token = msg.subject[len(self._inbox) + 1:]
        item = self._inflight.pop(token, None)
        if item is None:
            return  # an ack for a window that was already re-sent
        hdrs = msg.headers
        if hdrs and hdrs.get("Status") == "503":
            item.state, item.error = 2, "no JetStream stream answers this subject (503)"
        elif b'"error"' in msg.data:
            item.state, item.error = 2, msg.data.decode(errors="replace")[:300]
        else:
            item.state = 1
        self._wake.set()

    async def _send(self, item: Item) -> None:
        self._token += 1
        token = str(self._token)
        item.state, item.error, item.sent_at = 0, None, time.monotonic()
        self._inflight[token] = item
        hdrs = {"Nats-Msg-Id": item.msg_id}
        if item.headers:
            hdrs.update(item.headers)
        try:
            await self._nc.publish(item.subject, item.data, reply=f"{self._inbox}.{token}", headers=hdrs)
        except Exception:
            self._inflight.pop(token, None)
            raise

    def _done(self, item: Item) -> None:
        self.acked += 1
        m = self._m
        m.published += item.batches
        m.messages += 1
        if m.messages % m.LATENCY_SAMPLE == 0:
            m.lat.observe(time.monotonic() - item.t0)
        m.stored += item.stored
        m.removed += item.removed
        if self._on_ack is not None:
            self._on_ack(item)

    async def _resend_serially(self, items: list[Item]) -> None:
        delay = 0.05
        for item in items:
            while True:
                try:
                    await self._send(item)
                    deadline = time.monotonic() + self._ack_timeout
                    while item.state == 0 and time.monotonic() < deadline:
                        self._wake.clear()
                        try:
                            await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
                        except asyncio.TimeoutError:
                            break
                    if item.state == 1:
                        break
                    reason = item.error or "no ack"
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - connection trouble: wait and retry, same id
                    reason = f"{type(exc).__name__}: {exc}"
                self._m.retry.inc()
                log.warning("publish %s failed (%s); retrying", item.msg_id, reason)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            delay = 0.05
            self._done(item)

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply,
                                             pending_msgs_limit=1_000_000, pending_bytes_limit=256 * 1024 * 1024)

    async def run(self) -> None:
        """Publish until a ``None`` item arrives (everything before it is acknowledged)."""
        if self._inbox is None:
            await self.start()
        window: deque[Item] = deque()
        q = self.queue
        finished = False
        try:
            while not finished or window:
                failed = False
                # send what is queued while the window has room
                while not finished and len(window) < self._max_inflight and (not window or not q.empty()):
                    item = await q.get()
                    if item is None:
                        finished = True
                        break
                    window.append(item)
                    try:
                        await self._send(item)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - resend serially below
                        item.state, item.error = 2, f"{type(exc).__name__}: {exc}"
                        failed = True
                        break
                self._m.queue_depth = q.qsize()
                # retire acknowledged items from the head, in order
                while window and window[0].state == 1:
                    self._done(window.popleft())
                if window and not failed:
                    head = window[0]
                    if head.state == 2 or time.monotonic() - head.sent_at > self._ack_timeout:
                        failed = True
                if failed:
                    items = list(window)
                    window.clear()
                    self._inflight.clear()
                    self._m.retry.inc()
                    log.warning("JetStream publish of %s failed (%s); re-sending %d batches in order",
                                items[0].msg_id, items[0].error or "ack timeout", len(items))
                    await self._resend_serially(items)
                    continue
                if window and (len(window) >= self._max_inflight or q.empty()):
                    # wait for an ack (or a new item when there is room)
                    self._wake.clear()
                    if window[0].state == 0 and (len(window) >= self._max_inflight or q.empty()):
                        left = self._ack_timeout - (time.monotonic() - window[0].sent_at)
                        try:
                            await asyncio.wait_for(self._wake.wait(), max(0.001, left))
                        except asyncio.TimeoutError:
                            pass
        finally:
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except Exception:  # noqa: BLE001 - connection may be closed already
                    pass
