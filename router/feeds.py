"""Bus inputs of the router: engine announcements and metrics, device telemetry, diagnoses, KV events.

Each subject is read with an ordered JetStream consumer (no durable state: the router rebuilds
its view on start): engine metrics, announcements and device telemetry from the last message per subject,
diagnoses from the start of their stream, and KV events from the indexer's newest snapshot (the
sequence it covers) or, without one, from the start of the stream. Every message is decoded with its
schema and folded into :class:`router.state.ClusterState` or the embedded KV index; a message
that does not decode goes to the dead-letter subject with the reason, and the feed keeps going.

At start the KV feed has a backlog to read: the stream's messages after the snapshot (or all of
them). Until it has read as far as the stream's last message at that moment, the embedded index
holds a past state of the engines' caches, and the router reports itself not ready
(:meth:`BusFeeds.kv_status`; at most ``kv_catchup_timeout_s``, after which it serves anyway and says
so in the log and on ``infernex_router_kv_feed_behind_messages``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry, Counter, Gauge

from consumers import bus
from consumers.bus import DeadLetters, stream_seq_of
from router.state import ClusterState
from schemas import EngineAnnouncement, EngineMetrics, KvEventBatch, ValidationFailure, decode_event
from schemas import DeviceTelemetry, Diagnosis
from schemas import subjects as S
from schemas.kv_binary import is_group
from streams.topology import build_topology, stream_for_subject

log = logging.getLogger(__name__)

_FOLDS = None  # (fold_group, fold_batch, wire_run) of consumers.index_codec / index_columns, bound once
#: KV folding the feed does back to back before it lets the event loop run the requests waiting: a
#: subscription hands over every message it holds without a pause, and a burst of KV events (engines
#: storing long prompts) held the router's loop 14-48 ms at a time (bench/RESULTS.md, session 28)
KV_YIELD_AFTER_S = 0.002


def _folds() -> tuple[Any, Any, Any]:
    """(fold_group, fold_batch, wire_run), imported once: the codec loads numba, which only a KV
    feed needs."""
    global _FOLDS
    if _FOLDS is None:
        from consumers.index_codec import fold_batch, fold_group
        from consumers.index_columns import wire_run

        _FOLDS = (fold_group, fold_batch, wire_run)
    return _FOLDS


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel the router's KV index and its KV feed's
    readers run, before the router serves: a bridge's group message read into columns and folded,
    the same batches read one by one, on a throwaway index. On a fresh install the group reader
    alone compiles for about 11 s on 2 cores; left to the first KV message, the event loop stalled
    that long with requests waiting (tests/test_cold_start.py, bench/RESULTS.md session 28)."""
    from schemas import kv_binary
    from streams.clock import ManualClock
    from streams.kv_index import KvIndex
    from streams.kv_index import warm_up as index_warm_up

    index_warm_up()
    fold_group, fold_batch, wire_run = _folds()
    # (a store as a bridge sends it: its blocks' token digests instead of the token ids)
    stored = kv_binary.WStored(memoryview((7).to_bytes(8, "little")), memoryview(b""), 16, None, None, None, None,
                               None, None, None, memoryview((9).to_bytes(8, "little")))
    one = kv_binary.encode_wire(kv_binary.WBatch(1, "p", "m", 0, 0, 0, 0.0, [stored]))
    two = kv_binary.encode_wire(kv_binary.WBatch(1, "p", "m", 0, 0, 1, 0.0, [
        kv_binary.WRemoved(memoryview((7).to_bytes(8, "little")), "GPU")]))
    data = kv_binary.group([one, two])
    run = wire_run(data, fold_group)
    idx = KvIndex(ManualClock(1.0))
    if run is not None:
        idx.apply_many((run,))
    KvIndex(ManualClock(1.0)).apply_many(fold_group(data) or [])
    fold_batch(one)


class BusFeeds:
    def __init__(self, nc, state: ClusterState, *, prefix: str | None = None, index: Any = None,
                 registry: CollectorRegistry | None = None, consumer_name: str = "router",
                 kv_snapshot: str | None = None, kv_reorder_window_s: float = 10.0,
                 kv_catchup_timeout_s: float = 60.0, subscribe_wait_s: float = 60.0):
        self.nc = nc
        self.js = nc.jetstream()
        self.subscribe_wait_s = subscribe_wait_s  # how long start() asks JetStream while it does not answer
        self.state = state
        self.index = index
        self.prefix = prefix
        self.topology = build_topology(prefix=prefix)
        self._kv_names = S.KvSubjectNames(prefix)  # a KV batch folds only on its own pod's subject
        self.dead = DeadLetters(self.js, consumer=consumer_name, registry=registry, prefix=prefix)
        self.applied = Counter("infernex_router_feed_messages_total", "Bus messages folded into router state",
                               ["kind"], registry=registry)
        self._subs: list = []
        self._pending: set[asyncio.Task] = set()
        self.kv_snapshot = kv_snapshot
        self.kv_start_seq = 1  # where the KV feed started reading (after the snapshot, if any)
        self.kv_restored_batches = 0
        if index is not None and kv_reorder_window_s and not getattr(index, "reorder_window_s", 0):
            # the KV stream may hold a pod's batches out of order (a bridge's retry after a NATS
            # restart): the embedded index holds a batch back until the earlier ones arrive
            index.reorder_window_s = kv_reorder_window_s
        self._release_task: asyncio.Task | None = None
        self._kv_yielded = 0.0  # perf_counter when the KV feed last let the event loop run other work
        # the KV backlog at start: read up to this stream sequence (0: nothing to read)
        self.kv_catchup_timeout_s = kv_catchup_timeout_s
        self.kv_target_seq = 0
        self.kv_seen_seq = 0
        self.kv_caught_up = True
        self.kv_catchup_s: float | None = None  # how long reading the backlog took
        self._kv_t0 = time.monotonic()
        self._kv_gave_up = False
        self._behind = Gauge("infernex_router_kv_feed_behind_messages",
                             "KV stream messages the embedded index has still to read of the backlog it found at "
                             "start (0 once read)", registry=registry)

    def kv_status(self) -> tuple[bool, str | None]:
        """(ready, why not): not ready while the KV feed reads its start backlog, for at most
        ``kv_catchup_timeout_s``."""
        if self.kv_caught_up or self._kv_gave_up:
            return True, None
        waited = time.monotonic() - self._kv_t0
        if waited >= self.kv_catchup_timeout_s:
            self._kv_gave_up = True
            log.warning("the KV index has not read the KV stream's backlog within %.0f s (%d of %d messages "
                        "behind); serving with it as it is (router.kv_catchup_timeout_s)", self.kv_catchup_timeout_s,
                        max(0, self.kv_target_seq - self.kv_seen_seq), self.kv_target_seq - self.kv_start_seq + 1)
            return True, None
        behind = max(0, self.kv_target_seq - self.kv_seen_seq)
        return False, f"KV index reading the KV stream's backlog: {behind} messages behind after {waited:.1f} s"

    def _kv_progress(self, msg) -> bool:
        """Note how far the KV feed has read; True when ``msg`` is the backlog's last message (or
        the server says nothing is pending after it)."""
        try:
            md = msg.metadata
            seq, pending = md.sequence.stream, md.num_pending
        except Exception:  # noqa: BLE001 - not a JetStream delivery (a test's plain message): no progress to note
            return False
        if seq > self.kv_seen_seq:
            self.kv_seen_seq = seq
        if self.kv_seen_seq >= self.kv_target_seq or pending == 0:
            return True
        self._behind.set(self.kv_target_seq - self.kv_seen_seq)
        return False

    def _kv_done(self) -> None:
        self.kv_caught_up = True
        self._behind.set(0)
        self.kv_catchup_s = time.monotonic() - self._kv_t0
        if self.kv_target_seq:
            log.info("KV index read the KV stream's backlog (to sequence %d) in %.2f s", self.kv_target_seq,
                     self.kv_catchup_s)

    async def _kv_backlog(self, stream: str) -> None:
        """The stream's last sequence now: the backlog the KV feed reads before the router is ready."""
        try:
            info = await self.js.stream_info(stream)
        except Exception as exc:  # noqa: BLE001 - no stream info: nothing to wait for
            log.warning("KV stream %s: no stream info (%s); readiness does not wait for its backlog", stream,
                        type(exc).__name__)
            return
        last = info.state.last_seq
        if info.state.messages and last >= self.kv_start_seq:
            self.kv_target_seq = last
            self.kv_caught_up = False
            self._behind.set(last - max(self.kv_start_seq, info.state.first_seq) + 1)

    async def start(self) -> None:
        feeds = [
            (S.ALL_ENGINE_METRICS, DeliverPolicy.LAST_PER_SUBJECT, EngineMetrics, self.state.apply_metrics),
            (S.ALL_ENGINE_ANNOUNCE, DeliverPolicy.LAST_PER_SUBJECT, EngineAnnouncement,
             self.state.apply_announcement),
            (S.ALL_DIAGNOSIS, DeliverPolicy.ALL, Diagnosis, self.state.apply_diagnosis),
            (S.ALL_DEVICE_TELEMETRY, DeliverPolicy.LAST_PER_SUBJECT, DeviceTelemetry, self.state.apply_device),
        ]
        if self.index is not None:
            feeds.append((S.ALL_KV_EVENTS, DeliverPolicy.ALL, KvEventBatch, self._apply_kv))
        if self.index is not None and self.kv_snapshot:
            self.kv_start_seq = await self._restore_kv(self.kv_snapshot)
        for subject, policy, model, fold in feeds:
            full = S.with_prefix(self.prefix, subject)
            spec = stream_for_subject(self.topology, full)
            cb = self._callback(spec.logical if spec else subject, model, fold)
            if spec is None:
                self._subs.append(await self.nc.subscribe(full, cb=cb))
                continue
            config = ConsumerConfig(deliver_policy=policy)
            if model is KvEventBatch and self.kv_catchup_timeout_s > 0:
                self._kv_t0 = time.monotonic()
                await self._kv_backlog(spec.name)
            if model is KvEventBatch and self.kv_start_seq > 1:
                config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.kv_start_seq)
            # (while JetStream does not answer, e.g. the cluster restarting, ask again rather than fail the
            # router's start. nats-py fills in the config it is given, its deliver subject too: each ask
            # gets a fresh copy, so a consumer created by an ask whose answer was lost delivers to no one
            # and expires, instead of sharing the next one's subject)
            self._subs.append(await bus.while_unanswered(
                lambda full=full, cb=cb, spec=spec, config=config: self.js.subscribe(
                    full, cb=cb, ordered_consumer=True, stream=spec.name, config=dataclasses.replace(config)),
                f"subscribe to {full}", deadline_s=self.subscribe_wait_s))
        if self.index is not None and hasattr(self.index, "release_expired"):
            self._release_task = asyncio.create_task(self._release_waiting(), name="router-kv-release")

    async def _release_waiting(self) -> None:
        """Apply KV batches that waited their reorder window for an earlier one (gap accepted)."""
        while True:
            await asyncio.sleep(0.5)
            if self.index.waiting_count:
                try:
                    self.index.release_expired()
                except Exception:  # noqa: BLE001 - a fold error must not end the feed
                    log.exception("releasing waiting KV batches failed")

    async def _restore_kv(self, where: str) -> int:
        """Load the indexer's newest snapshot into the embedded index; the KV stream sequence to
        read from next (1 when there is no usable snapshot)."""
        from consumers.indexer import read_snapshot, snapshot_bucket_name

        bucket, _, name = where.partition("/")
        bucket = snapshot_bucket_name(self.prefix, bucket)
        try:
            # a bucket whose leader is gone must not hold the router's start: replay instead
            snap = await asyncio.wait_for(read_snapshot(self.js, bucket, name or "kv-indexer"), 15)
        except Exception as exc:  # noqa: BLE001 - a broken snapshot: replay the stream instead
            log.warning("KV snapshot %s/%s unusable (%s); reading the whole KV stream", bucket, name, exc)
            return 1
        if snap is None:
            return 1
        seq, _created, batches = snap
        self.index.apply_many(batches)
        self.kv_restored_batches = len(batches)
        log.info("KV index restored from snapshot %s/%s (%d batches, stream sequence %d)", bucket, name,
                 len(batches), seq)
        return seq + 1

    def _apply_kv(self, batch: KvEventBatch) -> None:
        self.index.apply(batch)

    def _callback(self, stream: str, model, fold):
        kind = model.__name__
        if model is KvEventBatch:
            from consumers.indexer import decode_batch, message_parts  # msgspec fast path, pydantic for bad input

            split, decode = message_parts, decode_batch  # one batch, or a bridge's group of them
        else:
            def split(data: bytes) -> list[bytes]:
                return [data]

            def decode(data: bytes):
                return decode_event(model, data)

        async def cb(msg) -> None:
            if model is KvEventBatch and self._fold_fast(msg):
                return
            try:
                parts = split(msg.data)
            except ValidationFailure as exc:
                await self._dead(stream, msg, str(exc))
                self._lost(model, msg, None)
                return
            for i, part in enumerate(parts):  # each batch of a group on its own: a bad one loses nothing else
                where = f"batch {i} of a group of {len(parts)}: " if len(parts) > 1 else ""
                try:
                    event = decode(part)
                except ValidationFailure as exc:
                    await self._dead(stream, msg, f"{where}{exc}", part)
                    self._lost(model, msg, i)
                    continue
                refused = self._kv_names.refusal(msg.subject, event.pod, event.model) if model is KvEventBatch else None
                if refused is not None:  # (as the indexer refuses it: every view of the pod stays alike)
                    await self._dead(stream, msg, f"{where}{refused}", part)
                    self._lost(model, msg, i)
                    continue
                try:
                    fold(event)
                except (ValueError, KeyError) as exc:  # a fold refusing an event is bad input too
                    await self._dead(stream, msg, f"{where}{kind} rejected: {exc}", part)
                    self._lost(model, msg, i)
                    continue
                self.applied.labels(kind).inc()

        if model is not KvEventBatch:
            return cb

        async def kv_cb(msg) -> None:
            t = time.perf_counter()
            if t - self._kv_yielded >= KV_YIELD_AFTER_S:  # (folding since the loop last ran anything else)
                await asyncio.sleep(0)
                self._kv_yielded = time.perf_counter()
            if self.kv_caught_up:
                await cb(msg)
                return
            last = self._kv_progress(msg)
            try:
                await cb(msg)
            finally:  # a message that fails counts as read too
                if last:
                    self._kv_done()

        return kv_cb

    def _fold_fast(self, msg) -> bool:  # noqa: ANN001 - a nats-py message
        """A message folded the cheap way: a bridge's group of binary batches, or one binary batch,
        as their checked wire structs in one :meth:`streams.kv_index.KvIndex.apply_many` call (no
        schema object per event); a JSON batch decoded with msgspec. False when that cannot decide
        (a bad batch, a group with one in it, a batch for another pod than its subject's, a fold
        that refuses it): then the batches go one by one through the careful decode, and only a bad
        one is dead-lettered with its reason."""
        fold_group, fold_batch, wire_run = _folds()
        data = msg.data
        run = wire_run(data, fold_group)  # a bridge's group in columns (the common case)
        if run is not None and self._kv_names.match(msg.subject, run.pod, run.model):
            try:
                self.index.apply_many((run,))
            except (ValueError, KeyError):
                return False
            self.applied.labels("KvEventBatch").inc(len(run))
            return True
        whole = fold_group(data)
        if whole is None:
            one = None if is_group(data) else fold_batch(data)
            if one is None:
                return False
            whole = [one]
        match, subject = self._kv_names.match, msg.subject
        for w in whole:
            if not match(subject, w.pod, w.model):
                return False
        try:
            self.index.apply_many(whole)
        except (ValueError, KeyError):  # one by one instead: what was applied is stale on the way again
            return False
        self.applied.labels("KvEventBatch").inc(len(whole))
        return True

    def _lost(self, model, msg, part: int | None) -> None:
        """A dead-lettered KV batch (``part`` of the message; None: all of it): from the message's
        headers, when they name the pod and model its subject does, the index is told which position
        it leaves empty (:meth:`streams.kv_index.KvIndex.lost`), so the pod's later batches wait for
        it a short grace, not the whole reorder window."""
        lost = getattr(self.index, "lost", None)
        if model is not KvEventBatch or lost is None:
            return
        from schemas.kv_binary import positions

        at = positions(dict(msg.headers) if msg.headers else None)
        for pod, model_name, epoch, seq in (at if part is None else at[part:part + 1]):
            if self._kv_names.match(msg.subject, pod, model_name):
                lost(pod, epoch, seq)

    async def _dead(self, stream: str, msg, reason: str, data: bytes | None = None) -> None:
        subj = msg.subject[len(self.prefix) + 1:] if self.prefix else msg.subject
        log.warning("dead-lettering a message on %s: %s", subj, reason[:200])
        try:
            await self.dead.send(stream, subj, msg.data if data is None else data, reason,
                                 stream_seq=stream_seq_of(msg))
        except Exception as exc:  # noqa: BLE001 - the feed must keep going
            log.warning("dead letter publish failed: %s", type(exc).__name__)

    async def stop(self) -> None:
        if self._release_task is not None:
            from consumers.bus import cancel_task

            await cancel_task(self._release_task)
            self._release_task = None
        for s in self._subs:
            try:
                await s.unsubscribe()
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self._subs.clear()
