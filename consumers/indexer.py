"""The cache-indexer service: ``kv.events.>`` -> :class:`streams.kv_index.KvIndex` -> queries.

* A durable JetStream push consumer with a callback (no per-message fetch timer) decodes each
  :class:`schemas.KvEventBatch` (msgspec fast path, pydantic for anything unusual), queues it,
  and folds the queue in one ``apply_many`` when it is full or nothing else is waiting; then
  the last applied message is acked (AckPolicy.ALL), so acks always follow applies.
  Undecodable messages, and messages whose subject disagrees with their pod/model, go to
  ``dlq.kv-events`` (a bounded letter, one per message whichever consumers reject it, see
  :class:`consumers.bus.DeadLetters`) and are skipped; a letter that cannot be published is
  counted and the message skipped all the same, so nothing loops. The fold holds a batch that
  arrives ahead of its pod's predecessor for up to ``reorder_window_s``; for a predecessor that
  was dead-lettered (its position read from the message's headers), only a short grace
  (:meth:`streams.kv_index.KvIndex.lost`). A gap in the delivery
  sequence (a message the client dropped) or a handling error re-reads the stream from the
  last applied sequence.
* Queries: HTTP ``POST /v1/index/query`` (msgspec in and out), ``GET /v1/index/pods``,
  ``/health``, ``/metrics`` (the project's own HTTP server, :mod:`consumers.index_http`), and NATS
  request-reply on ``kv.index.query`` (queue group, same JSON). ``prompt`` / ``messages`` are
  tokenized with an injected tokenizer.
* Recovery: every N batches or T seconds the index is dumped (its own events; packed msgpack,
  see :func:`encode_dump`) to a JetStream object store with the stream sequence it covers;
  only the dump pauses consumption, encoding and writing overlap with it. On start the
  newest snapshot is read (direct gets of its chunks) and applied, and the durable consumer
  is re-pointed at the next sequence, so a SIGKILL loses nothing; batches applied twice are
  dropped by the fold's per-pod ``(epoch, seq)`` check.

:class:`IndexerService` is embeddable (a router can run one in-process): build it with a
config section, the NATS config, optionally an index and a Prometheus registry, then
``await start()`` / ``await stop()``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from collections.abc import Awaitable
from itertools import repeat
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from consumers import bus, index_columns
from consumers.index_api import (  # noqa: F401 - re-exported: the indexer's public API
    IndexQuery,
    QueryError,
    RouteRecord,
    Tokenizer,
    _json_encode,
    pods_body,
    record_route,
    run_query,
    run_query_json,
)
from consumers.index_codec import (  # noqa: F401 - re-exported
    RAW_PARSE_MIN_BYTES,
    SNAPSHOT_FORMAT,
    _fast_batch,
    decode_batch,
    decode_slow,
    decode_snapshot,
    encode_dump,
    encode_snapshot,
    fold_batch,
    fold_group,
    message_parts,
)
from consumers.index_snapshots import (  # noqa: F401 - re-exported
    _forked_encode,
    fetch_snapshot_bytes,
    read_snapshot,
    snapshot_bucket_name,
)
from schemas import KvEventBatch, ValidationFailure
from schemas import kv_binary
from schemas import subjects as S
from schemas.config import NatsConfig
from consumers.indexer_config import IndexerConfig  # noqa: F401 - settings import it without the service
from streams.clock import Clock, SystemClock
from streams.kv_index import KvIndex, warm_up
from streams.kv_spares import PrefaultingSpares
from streams.topology import StreamSpec, build_topology, stream_for_subject

log = logging.getLogger(__name__)

ACK_IDLE_S = 0.05  # while messages trickle in, ack at most this often
FLUSH_DELAY_S = 0.002  # while messages trickle in, fold them in runs at most this much later
SNAPSHOT_CHUNK = 1 << 20  # object-store chunk bytes (nats-py's default, 128 KiB, costs 8x the messages)


class IndexerMetrics:
    def __init__(self, registry: CollectorRegistry | None, service: "IndexerService"):
        self.batches = Counter("infernex_indexer_batches_total", "KV event batches applied", registry=registry)
        self.events = Counter("infernex_indexer_events_total", "KV events applied", registry=registry)
        self.blocks = Counter("infernex_indexer_blocks_total", "Blocks applied, by operation", ["op"],
                              registry=registry)
        self.blocks_stored = self.blocks.labels("stored")
        self.blocks_removed = self.blocks.labels("removed")
        self.resyncs = Counter("infernex_indexer_consumer_resyncs_total",
                               "Times the consumer re-read the stream from the last applied sequence "
                               "(messages dropped or a handling error)", registry=registry)
        self.anomalies = Counter("infernex_indexer_anomalies_total",
                                 "Input handled deliberately (unknown parents, stale batches ...)", ["kind"],
                                 registry=registry)
        self.lag = Histogram("infernex_indexer_apply_lag_seconds", "Engine timestamp to applied",
                             buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                             registry=registry)
        self.query = Histogram("infernex_indexer_query_seconds", "Query latency", ["via"],
                               buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
                               registry=registry)
        self.messages = Counter("infernex_indexer_kv_messages_total",
                                "KV messages taken, by how they were read: columns (a bridge's group, one "
                                "compiled call), decoded (a batch or a group decoded whole), parts (batch by "
                                "batch: a group with a bad batch, JSON, or a message for another subject)",
                                ["path"], registry=registry)
        self.via_columns = self.messages.labels("columns")
        self.via_decoded = self.messages.labels("decoded")
        self.via_parts = self.messages.labels("parts")
        self.snapshots = Counter("infernex_indexer_snapshots_total", "Snapshots written", registry=registry)
        self.snapshot_failures = Counter("infernex_indexer_snapshot_failures_total",
                                         "Snapshots abandoned (bucket unreachable, write timed out); the fold "
                                         "goes on and the next snapshot retries", registry=registry)
        self._service = service
        if registry is not None:
            registry.register(self)

    def describe(self):  # a custom collector: values read at scrape time
        return []

    def collect(self):
        s = self._service
        g = GaugeMetricFamily("infernex_indexer_pod_blocks", "Blocks held per pod and tier", labels=["pod", "tier"])
        for name, p in s.index.pods().items():
            for tier, n in p.blocks.items():
                g.add_metric([name, tier], n)
        yield g
        age = GaugeMetricFamily("infernex_indexer_snapshot_age_seconds", "Seconds since the last snapshot")
        age.add_metric([], (time.time() - s.snapshot_time) if s.snapshot_time else float("nan"))
        yield age
        seq = GaugeMetricFamily("infernex_indexer_applied_stream_seq", "Last stream sequence applied")
        seq.add_metric([], s.applied_seq)
        yield seq
        sp = s.index.spares
        if isinstance(sp, PrefaultingSpares):
            c = CounterMetricFamily("infernex_indexer_spare_tables", "Index tables made ahead of a doubling "
                                    "(streams.kv_spares), by outcome: made, taken by a doubling, dropped unused",
                                    labels=["outcome"])
            for outcome, n in (("made", sp.made), ("taken", sp.taken), ("dropped", sp.dropped)):
                c.add_metric([outcome], n)
            yield c


_ANOMALIES = ("unknown_parent", "unknown_parent_blocks", "unknown_removed", "duplicates", "aliases",
              "stale_batches", "gaps", "epoch_resets", "rejected", "held", "out_of_bounds", "heartbeats")


class IndexerService:
    """Keeps a :class:`KvIndex` up to date from JetStream and answers queries."""

    def __init__(self, config: IndexerConfig, nats_config: NatsConfig, index: KvIndex | None = None,
                 registry: CollectorRegistry | None = None, *, tokenizer: Tokenizer | None = None,
                 topology: tuple[StreamSpec, ...] | None = None, clock: Clock | None = None):
        self.config = config
        self.nats_config = nats_config
        self.clock = clock or SystemClock()
        self.index = index if index is not None else KvIndex(
            self.clock, tier_weights=config.tier_weights or None, predicted_ttl_s=config.predicted_ttl_s,
            predict_on_route_ttl_s=config.predict_on_route_ttl_s, pod_timeout_s=config.pod_timeout_s,
            default_block_size=config.default_block_size, reorder_window_s=config.reorder_window_s,
            reserve_blocks=config.reserve_blocks, spares=PrefaultingSpares())
        self.registry = registry
        self.tokenizer = tokenizer
        prefix = nats_config.subject_prefix
        self.prefix = prefix
        self.subject = S.with_prefix(prefix, S.ALL_KV_EVENTS)
        topo = topology or build_topology(prefix=prefix)
        spec = stream_for_subject(topo, self.subject)
        if spec is None:
            raise ValueError(f"no stream in the topology holds {self.subject}")
        self.stream = spec.name
        self._replicas = spec.replicas  # the snapshot bucket follows the topology's replication
        self._storage = spec.storage
        self.bucket = snapshot_bucket_name(prefix, config.snapshot_bucket)
        self.metrics = IndexerMetrics(registry, self)
        self._query_seconds = {via: self.metrics.query.labels(via) for via in ("api", "http", "nats")}
        self.applied_seq = 0
        self.snapshot_seq = 0
        self.snapshot_time: float | None = None
        self.http_port: int | None = None
        self.restored_batches = 0
        self.restored_seq = 0  # stream sequence covered by the snapshot loaded at start
        self.restore_timings: dict[str, float] = {}
        self._since_snapshot = 0
        self._lock = asyncio.Lock()  # applying and snapshotting exclude each other
        self._buf: list[KvEventBatch | kv_binary.WRun] = []  # (a group in columns: several batches)
        self._buf_seqs: list[int] = []  # the stream sequence of each queued item
        self._buf_batches = 0  # the batches queued (a run counts its own)
        # (pod, epoch, seq) -> stream sequence, for batches the fold may be holding back for an
        # earlier one: a snapshot covers the stream only up to the first of them
        self._wait_seq: dict[tuple[str, int, int], int] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._taken_seq = 0  # last stream sequence decoded (applied, dead-lettered or queued)
        self._next_dseq = 1
        self._last_msg = None
        self._unacked = 0
        self._acked_at = 0.0
        self._halted = False  # set while re-pointing the consumer or stopping
        self._resync_task: asyncio.Task | None = None
        self._names = S.KvSubjectNames(prefix)
        self._chunk = max(1, min(config.fetch_batch, config.max_ack_pending // 4))
        self._ack_every = max(1, config.max_ack_pending // 2)
        self._psub = None
        self._put_task: asyncio.Task | None = None
        self._nc = None
        self._js = None
        self._dlq: bus.DeadLetters | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._server = None  # the HTTP API's consumers.http.Server, once started
        self.snapshot_clock = time.monotonic()
        self._sub = None
        self._obj = None
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(warm_up)  # the fold's kernels: compiled or loaded before the first event
        await asyncio.to_thread(index_columns.warm_up)  # (and the group reader's)
        self._nc = await bus.connect(self.nats_config, name=f"indexer-{self.config.durable}")
        self._js = self._nc.jetstream()
        try:  # (a node that just died may have led the stream: wait out the election)
            await bus.while_unanswered(lambda: self._js.stream_info(self.stream), f"stream info {self.stream}")
        except NotFoundError:
            await self._nc.close()
            raise RuntimeError(f"stream {self.stream} does not exist; run `infernex streams apply` first") from None
        self._dlq = bus.DeadLetters(self._js, consumer=self.config.durable, registry=self.registry,
                                    prefix=self.prefix)
        self._obj = await self._open_bucket()
        start_seq = await self._restore() if self._obj is not None else 1
        if self._obj is None:
            log.warning("snapshot bucket %s unreachable; replaying stream %s from the start", self.bucket,
                        self.stream)
        self._taken_seq = start_seq - 1
        await self._point_consumer(start_seq)
        if self.config.nats_query:
            self._sub = await self._nc.subscribe(S.with_prefix(self.prefix, S.KV_INDEX_QUERY),
                                                 queue="infernex-indexer", cb=self._on_nats_query)
        if self.config.http_port is not None:
            await self._start_http()
        self.snapshot_clock = time.monotonic()
        self._tasks.append(asyncio.create_task(self._ticker(), name="indexer-snapshots"))
        self.ready.set()
        log.info("indexer %s: stream %s from seq %d, %d pods restored", self.config.durable, self.stream,
                 start_seq, len(self.index.pods()))

    async def stop(self) -> None:
        self._stop.set()
        self._halted = True
        await bus.cancel_task(self._resync_task)
        async with self._lock:  # waits for a message being handled; later ones are ignored
            if self._psub is not None:
                try:
                    await self._psub.unsubscribe()
                except Exception:  # noqa: BLE001 - shutting down anyway
                    pass
            self._flush()
            if self._flush_handle is not None:
                self._flush_handle.cancel()
                self._flush_handle = None
            if self._nc is not None and not self._nc.is_closed:
                try:
                    await self._ack()
                except Exception as exc:  # noqa: BLE001 - unacked messages are delivered again
                    log.warning("final ack failed: %s", exc)
        for t in self._tasks:
            try:
                await asyncio.wait_for(t, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
        self._tasks.clear()
        if self._server is not None:
            await self._server.close(grace_s=5.0)
            self._server = None
        if self._put_task is not None and not self._put_task.done():
            await asyncio.wait({self._put_task})
        if self._nc is not None and not self._nc.is_closed:
            if self.config.snapshot_on_stop and self.applied_seq > self.snapshot_seq:
                try:
                    await self.snapshot()
                except Exception as exc:  # noqa: BLE001 - shutting down anyway; say why
                    log.warning("final snapshot failed: %s", exc)
            if self._sub is not None:
                await self._sub.unsubscribe()
            await self._nc.drain()

    async def run_forever(self) -> None:
        await self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    # -------------------------------------------------------------------------- recovery

    async def _restore(self) -> int:
        t0 = time.perf_counter()
        try:
            data = await self._fetch_snapshot()
        except (NotFoundError, Exception) as exc:  # noqa: BLE001 - no snapshot yet
            if "not found" not in str(exc).lower() and not isinstance(exc, NotFoundError):
                log.warning("cannot read snapshot %s/%s: %s", self.bucket, self.config.durable, exc)
            return 1
        if not data:
            return 1
        t1 = time.perf_counter()
        # decoding and applying build millions of long-lived objects and no cycles: without the
        # cyclic GC rescanning them meanwhile, both take about half the time
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            try:
                seq, created, batches = decode_snapshot(data)
            except Exception as exc:  # noqa: BLE001 - a bad snapshot: replay the stream instead
                log.error("snapshot %s/%s unreadable (%s); replaying the whole stream", self.bucket,
                          self.config.durable, exc)
                return 1
            t2 = time.perf_counter()
            self.index.apply_many(batches)
            t3 = time.perf_counter()
        finally:
            if gc_was_on:
                gc.enable()
        self.restore_timings = {"bytes": len(data), "fetch_s": t1 - t0, "decode_s": t2 - t1, "apply_s": t3 - t2}
        log.info("snapshot %s/%s: %d bytes, fetch %.2fs, decode %.2fs, apply %.2fs", self.bucket,
                 self.config.durable, len(data), t1 - t0, t2 - t1, t3 - t2)
        self.restored_batches = len(batches)
        self.restored_seq = seq
        self.applied_seq = self.snapshot_seq = seq
        self.snapshot_time = created
        return seq + 1

    async def _fetch_snapshot(self) -> bytes | None:
        return await asyncio.wait_for(fetch_snapshot_bytes(self._js, self._obj, self.bucket, self.config.durable),
                                      timeout=self.config.snapshot_timeout_s)

    async def _open_bucket(self):  # noqa: ANN202 - nats-py's ObjectStore
        """The snapshot bucket, created or re-replicated to follow the topology; None when the
        object store does not answer within ``snapshot_timeout_s`` (the service then replays
        the stream and retries the bucket at the next snapshot)."""
        try:
            return await asyncio.wait_for(self._bucket(), timeout=self.config.snapshot_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unreachable bucket must not stop the fold
            log.warning("snapshot bucket %s unavailable: %s: %s", self.bucket, type(exc).__name__, exc)
            return None

    async def _bucket(self):  # noqa: ANN202
        from nats.js.api import ObjectStoreConfig, StorageType

        js = self._js
        stream = f"OBJ_{self.bucket}"
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            storage = StorageType.FILE if self._storage == "file" else StorageType.MEMORY
            return await js.create_object_store(self.bucket, config=ObjectStoreConfig(
                bucket=self.bucket, description="KV index snapshots", replicas=self._replicas, storage=storage))
        if info.config.num_replicas != self._replicas:
            log.info("snapshot bucket %s: replicas %s -> %d", self.bucket, info.config.num_replicas, self._replicas)
            cfg = info.config
            cfg.num_replicas = self._replicas
            await js.update_stream(cfg)
        return await js.object_store(self.bucket)

    async def _point_consumer(self, start_seq: int) -> None:
        """(Re)create the durable push consumer so it delivers from ``start_seq``, and subscribe.

        A push consumer with a callback: nats-py hands over each message without the
        per-message timer of a pull ``fetch``. The deliver subject is subscribed before the
        consumer exists, so no first message goes unheard.
        """
        async def delete() -> None:
            try:
                await self._js.delete_consumer(self.stream, self.config.durable)
            except NotFoundError:
                pass

        await bus.while_unanswered(delete, "delete consumer")
        cfg = ConsumerConfig(
            durable_name=self.config.durable, deliver_subject=self._nc.new_inbox(),
            ack_policy=AckPolicy.ALL,  # one ack covers every message before it
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL,
            opt_start_seq=start_seq if start_seq > 1 else None, filter_subject=self.subject,
            ack_wait=self.config.ack_wait_s, max_ack_pending=self.config.max_ack_pending, max_deliver=-1,
            flow_control=True, idle_heartbeat=5.0)
        # the client buffer holds more than the server may have unacked, so nats-py never drops for
        # count; a drop anyway (bytes, reconnect) shows as a delivery-sequence gap -> _resync
        self._psub = await self._js.subscribe_bind(
            self.stream, cfg, self.config.durable, cb=self._on_msg, manual_ack=True,
            pending_msgs_limit=2 * self.config.max_ack_pending + 1024, pending_bytes_limit=1 << 30)
        self._next_dseq = 1
        await bus.while_unanswered(lambda: self._js.add_consumer(self.stream, cfg), "create consumer")

    async def snapshot(self) -> None:
        """Write a snapshot of the current state; returns once it is stored (raises if not)."""
        await (await self._start_snapshot(wait=True))

    async def _start_snapshot(self, wait: bool = False) -> asyncio.Task | None:
        """Capture the index as it is now; encode and store it in a task.

        Callers hold the apply lock. With ``snapshot_fork`` (where ``os.fork`` exists) a
        forked child -- a copy-on-write image of this process -- dumps and encodes the index and
        pipes the bytes back, so consumption pauses only for the fork. Otherwise the dump runs
        in a thread with consumption paused (queries keep being served: they only read); the
        dump's events are new objects, so encoding and writing overlap with consumption again.
        """
        prev = self._put_task
        if prev is not None and not prev.done():
            if not wait:  # one snapshot in flight at a time; the fold never waits for the store
                return None
            await asyncio.wait({prev})
        seq, now = self._covered_seq(), time.time()
        if self.config.snapshot_fork and hasattr(os, "fork"):
            encoded = _forked_encode(self.index, seq, now)
        else:
            dump = await asyncio.to_thread(self.index.dump)
            encoded = asyncio.to_thread(encode_dump, dump, seq, now)
        self._since_snapshot = 0
        self.snapshot_clock = time.monotonic()
        self._put_task = asyncio.create_task(self._store_snapshot(encoded, seq, now), name="indexer-snapshot")
        return self._put_task

    async def _store_snapshot(self, encoded: Awaitable[bytes], seq: int, now: float) -> None:
        data = await encoded
        if self._obj is None:
            self._obj = await self._open_bucket()
            if self._obj is None:
                raise RuntimeError(f"snapshot bucket {self.bucket} unreachable")
        await asyncio.wait_for(
            self._obj.put(self.config.durable, data,
                          meta=ObjectMeta(name=self.config.durable, description=f"stream_seq={seq}",
                                          options=ObjectMetaOptions(max_chunk_size=self._chunk_bytes()))),
            timeout=self.config.snapshot_timeout_s)
        self.snapshot_seq = seq
        self.snapshot_time = now
        self.metrics.snapshots.inc()

    def _covered_seq(self) -> int:
        """The stream sequence a snapshot taken now covers: the last applied one, or just before
        the first batch the fold still holds back (a restart re-reads and re-holds it; batches
        applied since are then dropped as stale)."""
        if not self.index.waiting_count:
            self._wait_seq.clear()
            return self.applied_seq
        live = {k: self._wait_seq[k] for k in map(tuple, self.index.waiting()) if k in self._wait_seq}
        self._wait_seq = live
        return min(self.applied_seq, min(live.values(), default=self.applied_seq + 1) - 1)

    def _chunk_bytes(self) -> int:
        limit = getattr(self._nc, "max_payload", 0) or SNAPSHOT_CHUNK
        return max(64 * 1024, min(SNAPSHOT_CHUNK, limit - 4096))

    # --------------------------------------------------------------------------- consume
    #
    # Per message (the callback): parse the stream/delivery sequences from the reply subject,
    # decode (msgspec fast path), queue the batch. The queue is folded in one ``apply_many``
    # when it is full or when no further message is waiting. Acks (AckPolicy.ALL, on the last
    # applied message) always follow the apply, at most every ACK_IDLE_S while messages trickle
    # in, else every max_ack_pending/2 messages -- so under load both are amortized over
    # hundreds of messages.

    async def _on_msg(self, msg) -> None:
        if self._halted:
            return
        try:
            async with self._lock:
                if not self._halted:
                    await self._take(msg)
        except Exception as exc:  # noqa: BLE001 - re-read from the last applied sequence
            log.exception("indexer: handling stream message failed")
            self._schedule_resync(f"handling a message failed: {exc}")

    async def _take(self, msg) -> None:
        t = msg.reply.split(".")
        off = 0 if len(t) == 9 else 2  # $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<dseq>... (v2: +domain, hash)
        sseq, dseq = int(t[5 + off]), int(t[6 + off])
        if dseq != self._next_dseq:
            self._schedule_resync(f"delivery sequence {dseq}, expected {self._next_dseq} (messages dropped)")
            return
        self._next_dseq = dseq + 1
        if sseq > self._taken_seq:  # else: a redelivery of something already taken
            # a bridge's group read straight into columns (the common case), else decoded in one call
            # when every batch in it is good, else batch by batch
            run = index_columns.wire_run(msg.data, fold_group)
            if run is not None and self._names.match(msg.subject, run.pod, run.model):
                self._buf.append(run)
                self._buf_seqs.append(sseq)
                self._buf_batches += len(run)
                self.metrics.via_columns.inc()
            else:
                whole = fold_group(msg.data)
                if whole is not None and all(self._names_match(msg.subject, b) for b in whole):
                    self._buf.extend(whole)
                    self._buf_seqs.extend(repeat(sseq, len(whole)))
                    self._buf_batches += len(whole)
                    self.metrics.via_decoded.inc()
                else:
                    self.metrics.via_parts.inc()
                    await self._take_parts(msg, sseq)
            self._taken_seq = sseq
        self._last_msg = msg
        self._unacked += 1
        waiting = self._psub.pending_msgs
        if self._buf_batches >= self._chunk:
            self._flush()
        elif not waiting and self._buf and self._flush_handle is None:
            # nothing else queued: fold shortly, so messages trickling in are folded in runs (one
            # kernel call per run, not per message) at the cost of FLUSH_DELAY_S of lag
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self._timed_flush)
        due = self._snapshot_due()
        if due or self._unacked >= self._ack_every or (not waiting and time.monotonic() - self._acked_at >= ACK_IDLE_S):
            # acks cost a socket write each: at most one per ACK_IDLE_S while messages trickle in
            # (the ticker acks what is left when the stream goes quiet)
            await self._ack()
        if due:
            await self._snapshot_guarded()

    async def _take_parts(self, msg, sseq: int) -> None:  # noqa: ANN001 - a nats-py message
        """The message's batches one by one (a group's as if sent apart): a bad one is dead-lettered
        alone, the others queued to fold (or folded carefully, in order)."""
        try:
            parts = message_parts(msg.data)
        except ValidationFailure as exc:  # a group's own frame is broken: the whole message is bad
            self._flush()
            await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, str(exc), headers=dict(msg.headers or {}),
                                 stream_seq=sseq)
            self._lost(msg, None)
            self.applied_seq = sseq
            self._since_snapshot += 1
            return
        for i, part in enumerate(parts):
            batch, careful, reason = self._decode(msg.subject, part)
            if reason is not None or careful:
                self._flush()  # keep the order: everything before it first
                if reason is not None:
                    if len(parts) > 1:
                        reason = f"batch {i} of a group of {len(parts)}: {reason}"
                    await self._dlq.send(S.KV_EVENTS, msg.subject, part, reason,
                                         headers=dict(msg.headers or {}), stream_seq=sseq)
                    self._lost(msg, i)
                else:
                    await self._apply_one(batch, msg, sseq)
                self.applied_seq = sseq
                self._since_snapshot += 1
            else:
                self._buf.append(batch)
                self._buf_seqs.append(sseq)
                self._buf_batches += 1

    def _lost(self, msg, part: int | None) -> None:  # noqa: ANN001 - a nats-py message
        """A dead-lettered batch (``part`` of the message; None: all of it): from the message's
        headers, when they name the pod and model its subject does, the fold is told which position
        it leaves empty (:meth:`streams.kv_index.KvIndex.lost`), so the pod's later batches wait for
        it a short grace, not the whole reorder window."""
        at = kv_binary.positions(dict(msg.headers) if msg.headers else None)
        for pod, model, epoch, seq in (at if part is None else at[part:part + 1]):
            if self._names.match(msg.subject, pod, model):
                self.index.lost(pod, epoch, seq)

    def _decode(self, subject: str, data: bytes) -> tuple[KvEventBatch | None, bool, str | None]:
        """``(batch, careful, reason)``: ``careful`` when the fold may still reject it (slow path)."""
        careful = False
        batch = fold_batch(data)
        if batch is None:
            careful = True
            try:
                batch = decode_slow(data)  # pydantic for JSON; a binary message here is invalid
            except ValidationFailure as exc:
                return None, True, str(exc)
        reason = self._names.refusal(subject, batch.pod, batch.model)
        return (None, True, reason) if reason is not None else (batch, careful, None)

    def _names_match(self, subject: str, batch) -> bool:  # noqa: ANN001 - a batch or its wire struct
        return self._names.match(subject, batch.pod, batch.model)

    def _timed_flush(self) -> None:
        self._flush_handle = None
        if self._halted or not self._buf:
            return
        if self._lock.locked():  # a message, a snapshot or a resync is being handled: shortly again
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self._timed_flush)
            return
        try:
            self._flush()
        except Exception as exc:  # noqa: BLE001 - re-read from the last applied sequence
            log.exception("indexer: folding queued batches failed")
            self._schedule_resync(f"folding queued batches failed: {exc}")

    def _flush(self) -> None:
        """Fold the queued batches in (one ``apply_many``) and count them."""
        buf = self._buf
        if not buf:
            return
        seqs, n = self._buf_seqs, self._buf_batches
        self._buf = []
        self._buf_seqs = []
        self._buf_batches = 0
        st = self.index.apply_many(buf)
        run = kv_binary.WRun
        if st.held:
            for b, sseq in zip(buf, seqs):
                for at in (b.positions() if type(b) is run else ((b.pod, b.epoch, b.seq),)):
                    self._wait_seq.setdefault(at, sseq)
        self.applied_seq = self._taken_seq
        self._since_snapshot += n
        self._count(st)
        if not st.stale_batches:  # replayed (stale) batches would show their age, not our lag
            now = self.clock.now()
            obs = self.metrics.lag.observe
            for b in buf:
                if type(b) is run:
                    for ts in b.ts.tolist():
                        obs(max(0.0, now - ts))
                else:
                    obs(max(0.0, now - b.ts))

    async def _apply_one(self, batch: KvEventBatch, msg, sseq: int | None = None) -> None:
        try:
            st = self.index.apply(batch)
        except ValueError as exc:  # e.g. token ids the index cannot key (>= 2**32)
            log.warning("batch %s rejected by the index: %s", batch.msg_id, exc)
            await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, f"not indexable: {exc}",
                                 headers=dict(msg.headers or {}), reason_class="unindexable",
                                 stream_seq=sseq)
            return
        if st.held and sseq is not None:
            self._wait_seq.setdefault((batch.pod, batch.epoch, batch.seq), sseq)
        self._count(st)
        if not st.stale_batches:
            self.metrics.lag.observe(max(0.0, self.clock.now() - batch.ts))

    def _count(self, st) -> None:
        m = self.metrics
        m.batches.inc(st.batches)
        m.events.inc(st.events)
        if st.blocks_stored:
            m.blocks_stored.inc(st.blocks_stored)
        if st.blocks_removed:
            m.blocks_removed.inc(st.blocks_removed)
        for kind in _ANOMALIES:
            v = getattr(st, kind)
            if v:
                m.anomalies.labels(kind).inc(v)

    async def _ack(self) -> None:
        self._flush()  # the ack covers every message before it: all of them must be folded in
        msg = self._last_msg
        if msg is not None and self._unacked:
            self._unacked = 0
            self._acked_at = time.monotonic()
            await msg.ack()  # AckPolicy.ALL: covers every message before it, all applied by now

    def _snapshot_due(self) -> bool:
        n = self._since_snapshot
        return n > 0 and (n >= self.config.snapshot_every_events
                          or time.monotonic() - self.snapshot_clock >= self.config.snapshot_every_s)

    async def _snapshot_guarded(self) -> None:
        try:
            task = await self._start_snapshot()
        except Exception as exc:  # noqa: BLE001 - keep consuming; the next snapshot retries
            log.warning("snapshot failed: %s", exc)
            self.metrics.snapshot_failures.inc()
            self.snapshot_clock = time.monotonic()
            return
        if task is not None:
            task.add_done_callback(self._snapshot_stored)

    def _snapshot_stored(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # keep consuming; retried after the next event past the period
            log.warning("snapshot failed: %s: %s", type(exc).__name__, exc)
            self.metrics.snapshot_failures.inc()
            self._since_snapshot += 1

    async def _ticker(self) -> None:
        """Acks and snapshots (by time) when the stream is quiet; otherwise messages do both."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(0.25, self.config.snapshot_every_s))
            except asyncio.TimeoutError:
                pass
            if (self._unacked or self._snapshot_due() or self.index.waiting_count) and not self._halted:
                async with self._lock:
                    if not self._halted:
                        self._flush()
                        if self.index.waiting_count:
                            self._count(self.index.release_expired())
                        await self._ack()
                        if self._snapshot_due():
                            await self._snapshot_guarded()

    def _schedule_resync(self, why: str) -> None:
        if self._resync_task is None or self._resync_task.done():
            self._halted = True
            self._resync_task = asyncio.create_task(self._resync(why), name="indexer-resync")

    async def _resync(self, why: str) -> None:
        """Drop what was taken but not applied and re-read from the last applied sequence."""
        delay = 0.5
        while not self._stop.is_set():
            log.warning("indexer: %s; re-reading from stream seq %d", why, self.applied_seq + 1)
            self.metrics.resyncs.inc()
            try:
                async with self._lock:
                    self._buf = []
                    self._buf_seqs = []
                    self._buf_batches = 0
                    self._taken_seq = self.applied_seq
                    self._last_msg = None
                    self._unacked = 0
                    if self._psub is not None:
                        try:
                            await self._psub.unsubscribe()
                        except Exception:  # noqa: BLE001 - the old subscription is abandoned anyway
                            pass
                    self._halted = False
                    await self._point_consumer(self.applied_seq + 1)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. NATS down: retry
                self._halted = True
                why = f"re-pointing the consumer failed ({exc})"
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # ---------------------------------------------------------------------------- query

    def query(self, body: Any, via: str = "api") -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return run_query(self.index, body, self.tokenizer)
        finally:
            self._query_seconds[via].observe(time.perf_counter() - t0)

    def query_json(self, data: bytes, via: str) -> tuple[int, bytes]:
        """``(status, JSON body)`` for a query given as JSON bytes; errors are ``{"error": ...}``."""
        t0 = time.perf_counter()
        try:
            return 200, _json_encode(run_query_json(self.index, data, self.tokenizer))
        except QueryError as exc:
            return exc.status, _json_encode({"error": str(exc)})
        finally:
            self._query_seconds[via].observe(time.perf_counter() - t0)

    async def _on_nats_query(self, msg) -> None:
        try:
            status, out = self.query_json(msg.data, "nats")
            if status != 200:  # the NATS reply carries the status in the body
                out = out[:-1] + b',"status":' + str(status).encode() + b"}"
        except Exception as exc:  # noqa: BLE001 - answer the requester instead of letting it time out
            log.exception("kv index query failed")
            out = json.dumps({"error": f"internal error: {exc}", "status": 500}).encode()
        if msg.reply:
            await msg.respond(out)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "durable": self.config.durable, "stream": self.stream,
                "applied_seq": self.applied_seq, "snapshot_seq": self.snapshot_seq,
                "restored_batches": self.restored_batches, "restored_seq": self.restored_seq,
                "pods": len(self.index.pods()),
                "blocks": len(self.index), "dead_letters": self._dlq.count if self._dlq else 0}

    def _probes(self):
        """``/healthz``: the loop answers; ``/readyz``: NATS connected and the durable's lag small."""
        from consumers.health import Check, Health, lag_check, nats_check

        def nats() -> Check:
            return nats_check(self._nc)() if self._nc is not None else Check(False, {"state": "starting"})

        async def lag() -> Check:
            if self._nc is None:
                return Check(False, {"state": "starting"})
            return await lag_check(self._nc.jetstream(), self.config.durable)()

        return Health(f"indexer {self.config.durable}").add("nats", nats).add("consumer_lag", lag)

    async def _start_http(self) -> None:
        from consumers.index_http import serve

        self._server, self.http_port = await serve(self)
