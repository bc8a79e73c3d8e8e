"""Read a window of JetStream history in order, for replay and incident analysis.

Each stream that holds a requested subject is read in stream order by its own ephemeral
push consumer without acks (flow control and idle heartbeats on, in memory, deleted when
the read ends and expiring by itself if the reader dies), from a start time or stream
sequence up to an end time or the stream's last sequence at the moment the read began.

Speed: nats-py's pull ``fetch`` costs a timer, a ``Msg`` with parsed metadata and a queue
hand-off per message; here the server pushes into a plain core subscription and the
callback reads sequence, store time and pending count straight from the reply subject
(``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``), so a message
costs a split and a tuple. Readers fill per-stream buffers; the merge hands out runs of
messages (lists), so consumers can fold a run at a time.

Back-pressure: when a stream's buffer is full its callback waits, so flow-control replies
stop and the server stalls delivery; a slow fold slows the read down and nothing is
dropped. Order is checked on the consumer sequence: a gap (messages dropped on the way)
or a consumer that went silent (deleted, or the server restarted) makes the reader
recreate its consumer from the next stream sequence, as nats' ordered consumers do.

The per-stream reads are merged by JetStream store time (ties by stream name and
sequence), so the output is deterministic for the same stored data.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import NamedTuple

from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas import subjects as S
from streams.topology import StreamSpec, subject_matches

log = logging.getLogger(__name__)


class ReplayMsg(NamedTuple):
    """One stored message; tuples order by (store time, stream, sequence)."""

    ts: float  # JetStream store time, seconds since the epoch
    stream: str
    seq: int
    subject: str  # without the deployment prefix
    data: bytes


def streams_for(topology: tuple[StreamSpec, ...], subjects: list[str]) -> dict[str, list[str]]:
    """stream name -> the requested (full) subject filters it holds; ``ValueError`` for a
    filter no stream holds."""
    out: dict[str, list[str]] = {}
    for subj in subjects:
        hit = False
        for spec in topology:
            for pattern in spec.subjects:
                probe = subj.replace(">", "x.x").replace("*", "x")
                if subject_matches(pattern, probe) or subject_matches(subj, pattern.replace(">", "x")):
                    out.setdefault(spec.name, []).append(subj)
                    hit = True
                    break
        if not hit:
            raise ValueError(f"no stream holds subjects {subj!r}")
    return out


class ReplayReadError(RuntimeError):
    """The window could not be read (the consumer kept failing)."""


class _StreamReader:
    """Pushes one stream's window into ``buf`` (a deque of :class:`ReplayMsg`)."""

    def __init__(self, nc: NatsClient, stream: str, filters: list[str], *, start_time: float | None,
                 start_seq: int | None, end_time: float | None, prefix: str | None, limit: int,
                 heartbeat_s: float, max_restarts: int):
        self.nc, self.js = nc, nc.jetstream()
        self.stream, self.filters = stream, filters
        self.start_time, self.start_seq, self.end_time = start_time, start_seq, end_time
        self.strip = len(prefix) + 1 if prefix else 0
        self.limit = max(1, limit)
        self.heartbeat_s = heartbeat_s
        self.max_restarts = max_restarts
        self.buf: deque[ReplayMsg] = deque()
        self.done = False
        self.error: BaseException | None = None
        self.restarts = 0  # in a row, without progress
        self.total_restarts = 0
        self.data = asyncio.Event()  # set when buf is non-empty or the read is over
        self._space = asyncio.Event()
        self._space.set()
        self._wake = asyncio.Event()  # the supervisor: finished, or the consumer must be recreated
        self._last = 0  # stream's last sequence when the read began
        self._next_cseq = 1
        self._last_sseq = 0
        self._activity = 0.0
        self._blocked = False
        self._stale = False
        self._sub = None
        self._consumer: str | None = None

    # ------------------------------------------------------------------ consumer lifecycle
    def _config(self, inbox: str) -> ConsumerConfig:
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_subject=inbox, flow_control=True,
                             idle_heartbeat=self.heartbeat_s, inactive_threshold=max(60.0, 4 * self.heartbeat_s),
                             mem_storage=True, num_replicas=1)
        if self._last_sseq:
            cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self._last_sseq + 1
        elif self.start_seq is not None:
            cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self.start_seq
        elif self.start_time is not None:
            cfg.deliver_policy = DeliverPolicy.BY_START_TIME
            cfg.opt_start_time = (datetime.fromtimestamp(self.start_time, tz=timezone.utc).isoformat()
                                  .replace("+00:00", "Z"))
        else:
            cfg.deliver_policy = DeliverPolicy.ALL
        if len(self.filters) == 1:
            cfg.filter_subject = self.filters[0]
        else:
            cfg.filter_subjects = self.filters
        return cfg

    async def _open(self) -> None:
        inbox = self.nc.new_inbox()
        # unlimited client-side pending: the server's flow control bounds what is in flight
        self._sub = await self.nc.subscribe(inbox, cb=self._on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
        self._next_cseq = 1
        self._stale = False
        self._activity = time.monotonic()
        cfg = self._config(inbox)
        # named before creation: a small window can be delivered, and the read finished and
        # cancelled, before the create call returns; the name is then still known for delete
        cfg.name = self._consumer = f"replay-{inbox.rsplit('.', 1)[-1]}"
        info = await self.js.add_consumer(self.stream, cfg)
        if info.num_pending == 0 and not info.delivered.consumer_seq:
            self._finish()  # nothing (more) matches the filters

    async def _close(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub = self._consumer = None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing; the consumer expires by itself
                pass
        if name is not None:
            for attempt in (1, 2):
                try:
                    await self.js.delete_consumer(self.stream, name)
                    break
                except NotFoundError:
                    break
                except Exception as exc:  # noqa: BLE001 - it also expires by itself (inactive threshold)
                    if attempt == 2 or self.nc.is_closed:
                        log.warning("replay: could not delete consumer %s on %s (%r); it expires by itself",
                                    name, self.stream, exc)
                        break

    def _finish(self) -> None:
        self.done = True
        self.data.set()
        self._wake.set()

    async def run(self) -> None:
        try:
            try:
                info = await self.js.stream_info(self.stream)
            except NotFoundError:
                return
            self._last = info.state.last_seq
            if self._last == 0 or (self.start_seq is not None and self.start_seq > self._last):
                return
            await self._open()
            woke, progress = time.monotonic(), self._last_sseq
            while not self.done:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except asyncio.TimeoutError:
                    pass
                if self.done:
                    break
                now = time.monotonic()
                # silent: no message nor heartbeat for 3 beats while we were free to receive
                # (not waiting for buffer space, and this loop itself was not starved)
                silent = (not self._blocked and now - self._activity > 3 * self.heartbeat_s
                          and now - woke < 2 * self.heartbeat_s)
                woke = now
                if self._stale or silent:
                    if self._last_sseq > progress:
                        self.restarts, progress = 0, self._last_sseq
                    self.restarts += 1
                    self.total_restarts += 1
                    if self.restarts > self.max_restarts:
                        raise ReplayReadError(f"stream {self.stream}: consumer failed {self.restarts} times "
                                              f"(last sequence read {self._last_sseq})")
                    await self._close()
                    await self._open()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done = True
            self.data.set()
            # the merge may cancel us as soon as we report done: delete the consumer anyway
            closing = asyncio.ensure_future(self._close())
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                await closing
                raise

    # ------------------------------------------------------------------ delivery
    async def _on_msg(self, msg) -> None:
        if self.done or self._stale:
            return
        reply = msg.reply or ""
        self._activity = time.monotonic()
        if not reply.startswith("$JS.ACK."):
            if reply:  # flow control request: answered once everything before it is buffered
                await self.nc.publish(reply, b"")
                return
            hdr = msg.headers or {}
            stalled = hdr.get("Nats-Consumer-Stalled")
            if stalled:
                await self.nc.publish(stalled, b"")
            last = hdr.get("Nats-Last-Consumer")
            if last is not None and int(last) >= self._next_cseq:
                self._stale = True  # a heartbeat says we missed messages
                self._wake.set()
            return
        t = reply.split(".")
        o = 0 if len(t) == 9 else 2  # v1, or v2 with domain and account hash
        cseq = int(t[6 + o])
        if cseq != self._next_cseq:
            self._stale = True
            self._wake.set()
            return
        self._next_cseq = cseq + 1
        sseq = int(t[5 + o])
        ts = int(t[7 + o]) / 1e9
        if self.end_time is not None and ts > self.end_time:
            self._finish()
            return
        buf = self.buf
        buf.append(ReplayMsg(ts, self.stream, sseq, msg.subject[self.strip:], msg.data))
        self._last_sseq = sseq
        if len(buf) == 1:
            self.data.set()
        if sseq >= self._last or t[8 + o] == "0":
            self._finish()
        elif len(buf) >= self.limit:
            self._space.clear()
            self._blocked = True
            await self._space.wait()
            self._blocked = False
            self._activity = time.monotonic()

    # ------------------------------------------------------------------ for the merge
    def taken(self) -> None:
        """Called after items were removed from ``buf``."""
        if not self.buf:
            if not self.done:
                self.data.clear()
        if len(self.buf) <= self.limit // 2:
            self._space.set()


async def read_window_batches(
    nc: NatsClient,
    topology: tuple[StreamSpec, ...],
    subjects: list[str],
    *,
    start_time: float | None = None,
    end_time: float | None = None,
    start_seq: int | None = None,
    prefix: str | None = None,
    buffer: int = 8192,
    heartbeat_s: float = 2.0,
    max_restarts: int = 5,
    skip_streams: frozenset[str] = frozenset(),
    stats: dict[str, int] | None = None,
) -> AsyncIterator[list[ReplayMsg]]:
    """Yield the stored messages of ``subjects`` in ``[start, end]`` merged by store time, as
    runs (lists) in order; ``buffer`` bounds each stream's read-ahead. Streams named in
    ``skip_streams`` are left out (another reader covers them). ``stats``, if given, gets
    ``consumer_restarts`` per stream name."""
    full = [S.with_prefix(prefix, s) for s in subjects]
    groups = {k: v for k, v in streams_for(topology, full).items() if k not in skip_streams}
    readers = [_StreamReader(nc, name, filters, start_time=start_time, start_seq=start_seq, end_time=end_time,
                             prefix=prefix, limit=buffer, heartbeat_s=heartbeat_s, max_restarts=max_restarts)
               for name, filters in sorted(groups.items())]
    tasks = [asyncio.create_task(r.run()) for r in readers]
    try:
        active = list(readers)
        while active:
            for r in active:
                while not r.buf and not r.done:
                    await r.data.wait()
                if r.error is not None and not isinstance(r.error, asyncio.CancelledError):
                    raise r.error
            active = [r for r in active if r.buf or not r.done]
            if not active:
                break
            if len(active) == 1:
                r = active[0]
                run = list(r.buf)
                r.buf.clear()
                r.taken()
                yield run
                continue
            first = min(active, key=lambda r: r.buf[0])
            bound = min(r.buf[0] for r in active if r is not first)
            buf = first.buf
            run = []
            take = run.append
            pop = buf.popleft
            while buf and buf[0] < bound:
                take(pop())
            first.taken()
            yield run
        for r in readers:
            if r.error is not None and not isinstance(r.error, asyncio.CancelledError):
                raise r.error
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if stats is not None:
            for r in readers:
                stats[r.stream] = stats.get(r.stream, 0) + r.total_restarts


async def read_window(
    nc: NatsClient,
    topology: tuple[StreamSpec, ...],
    subjects: list[str],
    **kwargs,
) -> AsyncIterator[ReplayMsg]:
    """Like :func:`read_window_batches`, one message at a time."""
    async for run in read_window_batches(nc, topology, subjects, **kwargs):
        for m in run:
            yield m


async def partition_subjects(
    nc: NatsClient,
    topology: tuple[StreamSpec, ...],
    subjects: list[str],
    parts: int,
    *,
    prefix: str | None = None,
) -> tuple[list[list[str]], int]:
    """Split the concrete subjects stored under ``subjects`` into ``parts`` groups of about
    equal message counts (largest first, each to the lightest group), for readers that fold
    independent keys (e.g. one KV-event subject per pod) in parallel.

    Returns the groups (subjects without the prefix; empty groups dropped) and the total
    message count. Counts cover the whole stream, not only a time window.
    """
    js = nc.jetstream()
    full = [S.with_prefix(prefix, s) for s in subjects]
    counts: dict[str, int] = {}
    for stream, filters in streams_for(topology, full).items():
        for f in filters:
            try:
                info = await js.stream_info(stream, subjects_filter=f)
            except NotFoundError:
                continue
            counts.update(info.state.subjects or {})
    strip = len(prefix) + 1 if prefix else 0
    groups: list[list[str]] = [[] for _ in range(max(1, parts))]
    load = [0] * len(groups)
    for subj, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = load.index(min(load))
        groups[i].append(subj[strip:])
        load[i] += n
    return [sorted(g) for g in groups if g], sum(counts.values())
