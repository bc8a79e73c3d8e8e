"""Read a window of JetStream history in order, for replay and incident analysis.

Each stream that holds a requested subject is read with an ephemeral *ordered* consumer
(nats-py's ordered push consumer: no acks, no durable state, recreated by the client on
gaps, deleted with the subscription), from a start time or stream sequence up to an end
time or the stream's last sequence at the moment the read began. The per-stream readers
are merged by JetStream timestamp (ties by stream name and sequence), so the output is
deterministic for the same stored data.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone

from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from schemas import subjects as S
from streams.topology import StreamSpec, subject_matches


@dataclass(frozen=True, order=True)
class ReplayMsg:
    ts: float  # JetStream store time, seconds since the epoch
    stream: str
    seq: int
    subject: str  # without the deployment prefix
    data: bytes


def _streams_for(topology: tuple[StreamSpec, ...], subjects: list[str]) -> dict[str, list[str]]:
    """stream name -> the requested subject filters it holds."""
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


def _ts(msg) -> float:
    t = msg.metadata.timestamp
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


async def _read_stream(nc: NatsClient, stream: str, filters: list[str], *, start_time: float | None,
                       start_seq: int | None, end_time: float | None, prefix: str | None,
                       out: asyncio.Queue, batch_limit: int) -> None:
    js = nc.jetstream()
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await out.put(None)
        return
    last = info.state.last_seq
    if last == 0 or (start_seq is not None and start_seq > last):
        await out.put(None)
        return
    if start_seq is not None:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
    elif start_time is not None:
        iso = datetime.fromtimestamp(start_time, tz=timezone.utc).isoformat().replace("+00:00", "Z")
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=iso)
    else:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    if len(filters) == 1:
        cfg.filter_subject = filters[0]
    else:
        cfg.filter_subjects = filters
    queue: asyncio.Queue = asyncio.Queue(maxsize=batch_limit)
    sub = await js.subscribe(filters[0], stream=stream, ordered_consumer=True, config=cfg,
                             cb=queue.put, pending_msgs_limit=batch_limit * 4)
    strip = len(prefix) + 1 if prefix else 0
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and queue.empty():
            return
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), timeout=2.0)
            except asyncio.TimeoutError:
                # nothing more arrives: filtered subjects may end before the stream does
                break
            seq = msg.metadata.sequence.stream
            ts = _ts(msg)
            if end_time is not None and ts > end_time:
                break
            await out.put(ReplayMsg(ts, stream, seq, msg.subject[strip:], msg.data))
            if seq >= last or msg.metadata.num_pending == 0:
                break
    finally:
        name = None
        try:
            name = (await sub.consumer_info()).name
        except Exception:  # noqa: BLE001 - consumer may already be gone
            pass
        await sub.unsubscribe()
        if name:
            try:
                await js.delete_consumer(stream, name)
            except Exception:  # noqa: BLE001 - ephemeral consumers also expire by themselves
                pass
        await out.put(None)


async def read_window(
    nc: NatsClient,
    topology: tuple[StreamSpec, ...],
    subjects: list[str],
    *,
    start_time: float | None = None,
    end_time: float | None = None,
    start_seq: int | None = None,
    prefix: str | None = None,
    buffer: int = 4096,
) -> AsyncIterator[ReplayMsg]:
    """Yield the stored messages of ``subjects`` in ``[start, end]`` merged by store time."""
    full = [S.with_prefix(prefix, s) for s in subjects]
    groups = _streams_for(topology, full)
    queues = {name: asyncio.Queue(maxsize=buffer) for name in groups}
    tasks = [
        asyncio.create_task(_read_stream(nc, name, filters, start_time=start_time, start_seq=start_seq,
                                         end_time=end_time, prefix=prefix, out=queues[name],
                                         batch_limit=buffer))
        for name, filters in groups.items()
    ]
    heap: list[tuple[ReplayMsg, str]] = []
    try:
        for name, q in queues.items():
            item = await q.get()
            if item is not None:
                heapq.heappush(heap, (item, name))
        while heap:
            item, name = heapq.heappop(heap)
            yield item
            nxt = await queues[name].get()
            if nxt is not None:
                heapq.heappush(heap, (nxt, name))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
