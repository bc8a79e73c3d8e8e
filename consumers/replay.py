"""Read a window of JetStream history in order, for replay and incident analysis.

Each stream that holds a requested subject is read in stream order by an ephemeral pull
consumer without acks (no durable state; deleted when the read ends, and expiring on its
own if the reader dies), from a start time or stream sequence up to an end time or the
stream's last sequence at the moment the read began. Pulling means a slow fold slows the
read down; nothing is dropped. The per-stream readers
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
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
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
    """Pull the stream with an ephemeral, unacknowledged consumer: flow is driven by our
    fetches, so a slow fold slows the read instead of dropping messages."""
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
    cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60.0, mem_storage=True,
                         max_ack_pending=-1)
    if start_seq is not None:
        cfg.deliver_policy, cfg.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, start_seq
    elif start_time is not None:
        cfg.deliver_policy = DeliverPolicy.BY_START_TIME
        cfg.opt_start_time = datetime.fromtimestamp(start_time, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    else:
        cfg.deliver_policy = DeliverPolicy.ALL
    if len(filters) == 1:
        cfg.filter_subject = filters[0]
    else:
        cfg.filter_subjects = filters
    sub = await js.pull_subscribe(filters[0], durable=None, stream=stream, config=cfg)
    strip = len(prefix) + 1 if prefix else 0
    try:
        info = await sub.consumer_info()
        pending = info.num_pending
        done = pending == 0
        while not done:
            try:
                msgs = await sub.fetch(min(batch_limit, max(pending, 1)), timeout=2.0)
            except asyncio.TimeoutError:
                break  # nothing more within the window (filtered subjects may end early)
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                ts = _ts(msg)
                if end_time is not None and ts > end_time:
                    done = True
                    break
                await out.put(ReplayMsg(ts, stream, seq, msg.subject[strip:], msg.data))
                pending = msg.metadata.num_pending
                if seq >= last or pending == 0:
                    done = True
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
