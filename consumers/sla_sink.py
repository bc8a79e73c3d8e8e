"""``infernex sla-sink``: request records, engine metrics, diagnoses and scaling hints from
JetStream into the SLA store.

One durable consumer per input (``router.requests.>``, ``engine.metrics.>``, ``diagnosis.>``,
``autoscale.hints.>``): a durable push consumer (``sla.consume=push``, the default), which nats-py
delivers several times faster, or pull through :func:`consumers.bus.run_durable` (``sla.consume=pull``).
Valid messages are buffered per table and inserted in batches (at
``batch_rows`` rows, or when the oldest buffered row is ``flush_interval_s`` old) while the next
batch fills (one insert in flight per table); messages are acked only after their batch is in
the store and, for request records, the per-minute rollup of the minutes it touched has been
recomputed. A crash before the ack means redelivery, and the store's dedupe keys (see
:mod:`consumers.sla_queries`) make a redelivered row count once.
Malformed messages go to the dead-letter subject with the reason and are acked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import xxhash
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry, Counter, Histogram

from consumers import bus, sla_queries
from consumers.sla_store import SlaConfig, SlaStore
from schemas import Diagnosis, EngineMetrics, RequestRecord, ScalingHint, ValidationFailure
from schemas import subjects as S
from streams.topology import StreamSpec, stream_for_subject

log = logging.getLogger(__name__)


def _msg_id(msg: Msg) -> str:
    hdr = (msg.headers or {}).get("Nats-Msg-Id")
    if hdr:
        return hdr
    return xxhash.xxh3_128_hexdigest(msg.subject.encode() + b"\0" + msg.data)


def record_row(msg: Msg) -> tuple[bytes, float | None]:
    r = RequestRecord.from_json(msg.data)
    return r.model_dump_json().encode(), r.ts


def _hist(h) -> tuple[float, float]:  # noqa: ANN001
    return (h.sum, h.count) if h is not None else (0.0, 0.0)


def metrics_row(msg: Msg) -> tuple[bytes, float | None]:
    m = EngineMetrics.from_json(msg.data)
    row = m.model_dump(exclude={"time_to_first_token_seconds", "inter_token_latency_seconds",
                                "e2e_request_latency_seconds", "request_queue_time_seconds"})
    row["msg_id"] = _msg_id(msg)
    row["ttft_sum"], row["ttft_count"] = _hist(m.time_to_first_token_seconds)
    row["itl_sum"], row["itl_count"] = _hist(m.inter_token_latency_seconds)
    row["e2e_sum"], row["e2e_count"] = _hist(m.e2e_request_latency_seconds)
    row["queue_sum"], row["queue_count"] = _hist(m.request_queue_time_seconds)
    return json.dumps(row).encode(), None


def diagnosis_row(msg: Msg) -> tuple[bytes, float | None]:
    d = Diagnosis.from_json(msg.data)
    row = d.model_dump()
    row["evidence"] = json.dumps(d.evidence, sort_keys=True)
    row["msg_id"] = _msg_id(msg)
    return json.dumps(row).encode(), None


def hint_row(msg: Msg) -> tuple[bytes, float | None]:
    h = ScalingHint.from_json(msg.data)
    row = h.model_dump()
    row["inputs"] = json.dumps(h.inputs, sort_keys=True)
    return json.dumps(row).encode(), None


def minute_runs(minutes: set[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[(first, last), ...]`` of a set of minute numbers."""
    runs: list[tuple[int, int]] = []
    for m in sorted(minutes):
        if runs and m == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], m)
        else:
            runs.append((m, m))
    return runs


@dataclass(frozen=True)
class Route:
    name: str
    table: str
    wildcard: str  # unprefixed subject wildcard
    example: str  # an unprefixed concrete subject, to find the stream
    to_row: Callable[[Msg], tuple[bytes, float | None]]  # row, and event time when rolled up


ROUTES: tuple[Route, ...] = (
    Route("requests", "request_records", S.ALL_ROUTER_REQUESTS, S.router_requests("x"), record_row),
    Route("metrics", "engine_metrics", S.ALL_ENGINE_METRICS, S.engine_metrics("x"), metrics_row),
    Route("diagnoses", "diagnoses", S.ALL_DIAGNOSIS, S.diagnosis("x", "y"), diagnosis_row),
    Route("hints", "scaling_hints", S.ALL_AUTOSCALE_HINTS, S.autoscale_hints("x", "y"), hint_row),
)


@dataclass
class _Buffer:
    rows: list[bytes] = field(default_factory=list)
    msgs: list[Msg] = field(default_factory=list)
    since: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: asyncio.Task | None = None
    minutes: set[int] = field(default_factory=set)  # event minutes (epoch // 60) of rolled-up rows


class SlaSink:
    """Buffers decoded rows per table and inserts them; acks after the insert."""

    def __init__(self, js: JetStreamContext, store: SlaStore, cfg: SlaConfig, *,
                 topology: tuple[StreamSpec, ...], prefix: str | None = None,
                 registry: CollectorRegistry | None = None, monotonic: Callable[[], float] = time.monotonic):
        self.js = js
        self.store = store
        self.cfg = cfg
        self.prefix = prefix
        self.topology = topology
        self._now = monotonic
        self.buffers = {r.table: _Buffer() for r in ROUTES}
        self.dead_letters = bus.DeadLetters(js, consumer="sla-sink", registry=registry, prefix=prefix)
        self.rows_total = Counter("infernex_sla_sink_rows_total", "Rows inserted into the SLA store",
                                  ["table"], registry=registry)
        self.insert_errors = Counter("infernex_sla_sink_insert_errors_total",
                                     "Batches the SLA store refused (redelivered later)", ["table"],
                                     registry=registry)
        self.flush_seconds = Histogram("infernex_sla_sink_flush_seconds", "Time to insert one batch",
                                       ["table"], registry=registry)
        self.inserted = {r.table: 0 for r in ROUTES}

    def stream_of(self, route: Route) -> StreamSpec:
        spec = stream_for_subject(self.topology, S.with_prefix(self.prefix, route.example))
        if spec is None:
            raise RuntimeError(f"no stream in the topology holds {route.wildcard}")
        return spec

    def handler(self, route: Route):
        spec = self.stream_of(route)
        buf = self.buffers[route.table]

        async def handle(msgs: list[Msg]) -> None:
            for msg in msgs:
                try:
                    row, ts = route.to_row(msg)
                except (ValidationFailure, ValueError, TypeError, KeyError) as exc:  # bad input: skip it
                    await self.dead_letters.send(spec.logical, msg.subject, msg.data, str(exc),
                                                 headers=dict(msg.headers or {}),
                                                 stream_seq=bus.stream_seq_of(msg))
                    await msg.ack()
                    continue
                if not buf.rows:
                    buf.since = self._now()
                buf.rows.append(row)
                buf.msgs.append(msg)
                if ts is not None:
                    buf.minutes.add(int(ts // 60))
            if len(buf.rows) >= self.cfg.batch_rows:
                await self._kick(route.table)

        return handle

    async def _kick(self, table: str) -> None:
        """Start inserting the buffered rows of ``table`` in the background, so consuming goes on
        meanwhile; at most one insert per table is in flight (the previous one is awaited first)."""
        buf = self.buffers[table]
        async with buf.lock:
            if buf.inflight is not None:
                await buf.inflight
                buf.inflight = None
            if not buf.rows:
                return
            rows, msgs, minutes = buf.rows, buf.msgs, buf.minutes
            buf.rows, buf.msgs, buf.minutes = [], [], set()
            buf.inflight = asyncio.create_task(self._insert_and_ack(table, rows, msgs, minutes))

    async def flush(self, table: str) -> int:
        """Insert everything buffered for ``table`` and wait for it; returns rows inserted."""
        await self._kick(table)
        buf = self.buffers[table]
        async with buf.lock:
            if buf.inflight is None:
                return 0
            n = await buf.inflight
            buf.inflight = None
            return n

    async def _insert_and_ack(self, table: str, rows: list[bytes], msgs: list[Msg],
                              minutes: set[int] | None = None) -> int:
        """Insert, refresh the per-minute rollup of the minutes the rows touched (request records),
        and only then ack: an acked message is in the table *and* in the rollup, so a crash at any
        point leaves unacked messages that are redelivered, whose rows dedupe and whose minutes are
        refreshed again. On failure nak the batch. Never raises; returns the rows inserted."""
        t0 = self._now()
        try:
            await asyncio.to_thread(self.store.insert_json_each_row, table, rows)
        except Exception as exc:  # noqa: BLE001 - the batch is redelivered, the sink keeps going
            self.insert_errors.labels(table).inc()
            log.error("insert of %d rows into %s failed: %s; they will be redelivered", len(rows), table, exc)
            await self._nak(msgs)
            return 0
        self.flush_seconds.labels(table).observe(self._now() - t0)
        self.rows_total.labels(table).inc(len(rows))
        self.inserted[table] += len(rows)
        if minutes and not await self.refresh_rollup(minutes):
            log.error("the %d rows inserted into %s will be redelivered to refresh their rollup", len(rows), table)
            await self._nak(msgs)
            return len(rows)
        for m in msgs:
            try:
                await m.ack()
            except Exception as exc:  # noqa: BLE001 - unacked rows come back and dedupe
                log.warning("ack after insert into %s failed: %s", table, exc)
                break
        return len(rows)

    @staticmethod
    async def _nak(msgs: list[Msg]) -> None:
        for m in msgs:
            try:
                await m.nak(delay=1.0)
            except Exception:  # noqa: BLE001 - redelivered after ack_wait anyway
                pass

    async def refresh_rollup(self, minutes: set[int]) -> bool:
        """Recompute the rollup of the given minutes, one query per run of consecutive minutes.
        Returns False if a query failed (counted; the caller naks the batch, whose redelivery
        refreshes those minutes again)."""
        ok = True
        for first, last in minute_runs(minutes):
            try:
                await asyncio.to_thread(sla_queries.refresh_minutes, self.store, first * 60.0, last * 60.0,
                                        targets=self.cfg.targets)
            except Exception as exc:  # noqa: BLE001
                self.insert_errors.labels("request_minutes").inc()
                log.error("rollup refresh of minutes %d..%d failed: %s", first, last, exc)
                ok = False
        return ok

    async def flush_all(self) -> None:
        for table in self.buffers:
            await self.flush(table)

    async def _ticker(self, stop: asyncio.Event) -> None:
        period = min(0.25, self.cfg.flush_interval_s / 2)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass
            now = self._now()
            for table, buf in self.buffers.items():
                if buf.rows and now - buf.since >= self.cfg.flush_interval_s:
                    await self._kick(table)

    def durable_name(self, route: Route) -> str:
        suffix = "-push" if self.cfg.consume == "push" else ""
        return f"{self.cfg.durable_prefix}-{route.name}{suffix}"

    async def _run_push(self, route: Route, spec: StreamSpec, stop: asyncio.Event) -> None:
        """A durable push consumer: nats-py hands each message to the callback without the
        per-message timers of ``fetch``. Same guarantees: explicit acks after the insert, at most
        ``3 x batch_rows`` unacked, redelivery after ``ack_wait_s``."""
        handle = self.handler(route)

        async def cb(msg: Msg) -> None:
            await handle([msg])

        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=self.cfg.ack_wait_s,
            max_ack_pending=3 * self.cfg.batch_rows, max_deliver=-1,
        )
        # (the same durable asked for again binds to it; nats-py fills in the config: a fresh copy each time)
        sub = await bus.while_unanswered(lambda: self.js.subscribe(
            S.with_prefix(self.prefix, route.wildcard), stream=spec.name, durable=self.durable_name(route),
            cb=cb, manual_ack=True, config=replace(config),
            pending_msgs_limit=max(65536, 4 * self.cfg.batch_rows),
            pending_bytes_limit=256 * 1024 * 1024,
        ), f"subscribe {self.durable_name(route)}")
        try:
            await stop.wait()
        finally:
            await sub.unsubscribe()

    async def run(self, stop: asyncio.Event, *, fetch_batch: int = 1000) -> None:
        specs = {r.name: self.stream_of(r) for r in ROUTES}
        await bus.apply_topology(self.js, tuple({s.name: s for s in specs.values()}.values()))
        tasks = [asyncio.create_task(self._ticker(stop), name="sla-sink-ticker")]
        for r in ROUTES:
            if self.cfg.consume == "push":
                coro = self._run_push(r, specs[r.name], stop)
            else:
                coro = bus.run_durable(
                    self.js, stream=specs[r.name].name, durable=self.durable_name(r),
                    filter_subject=S.with_prefix(self.prefix, r.wildcard), handle=self.handler(r), stop=stop,
                    batch=min(fetch_batch, self.cfg.batch_rows), ack_wait_s=self.cfg.ack_wait_s,
                )
            tasks.append(asyncio.create_task(coro, name=f"sla-sink-{r.name}"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            stop.set()
            for t in tasks:
                await bus.cancel_task(t)
            try:
                await self.flush_all()
            except Exception as exc:  # noqa: BLE001 - unacked rows are redelivered next start
                log.warning("final flush failed: %s", exc)
