"""The cache-indexer service: ``kv.events.>`` -> :class:`streams.kv_index.KvIndex` -> queries.

* A durable JetStream consumer (:func:`consumers.bus.run_durable`) decodes each
  :class:`schemas.KvEventBatch`, applies it and then acks. Undecodable messages, and
  messages whose subject disagrees with their pod/model, go to ``dlq.kv-events`` with the
  reason (counted); the consumer keeps going.
* Queries: HTTP ``POST /v1/index/query``, ``GET /v1/index/pods``, ``/health``, ``/metrics``
  (starlette + uvicorn), and NATS request-reply on ``kv.index.query`` (queue group, same
  JSON). ``prompt`` / ``messages`` are tokenized with an injected tokenizer.
* Recovery: every N batches or T seconds the index is dumped (its own events, msgpack) to a
  JetStream object store with the stream sequence it covers. On start the newest snapshot is
  loaded and the durable consumer is re-pointed at the next sequence, so a SIGKILL loses
  nothing; batches applied twice are dropped by the fold's per-pod ``(epoch, seq)`` check.

:class:`IndexerService` is embeddable (a router can run one in-process): build it with a
config section, the NATS config, optionally an index and a Prometheus registry, then
``await start()`` / ``await stop()``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import msgpack
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from consumers import bus
from schemas import KvEventBatch, ValidationFailure, decode_event
from schemas.kv import BlockStored, PodGone
from schemas import subjects as S
from schemas.config import NatsConfig
from streams.clock import Clock, SystemClock
from streams.kv_index import KvIndex, block_keys
from streams.topology import StreamSpec, build_topology, stream_for_subject

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 2


class IndexerConfig(BaseModel):
    """The ``indexer`` settings section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durable: str = Field(default="kv-indexer", pattern=r"^[A-Za-z0-9_-]+$",
                         description="durable consumer name; one per indexer instance")
    http_host: str = "127.0.0.1"
    http_port: int | None = Field(default=8090, ge=0, le=65535, description="0 = a free port; null = no HTTP")
    nats_query: bool = Field(default=True, description="answer kv.index.query requests")
    snapshot_bucket: str = Field(default="kv-index-snapshots", pattern=r"^[A-Za-z0-9_-]+$")
    snapshot_every_events: int = Field(default=20_000, ge=1)
    snapshot_every_s: float = Field(default=30.0, gt=0)
    snapshot_on_stop: bool = True
    pod_timeout_s: float | None = Field(default=None, gt=0)
    predicted_ttl_s: float = Field(default=120.0, gt=0)
    predict_on_route_ttl_s: float = Field(default=2.0, gt=0)
    tier_weights: dict[str, float] = Field(default_factory=dict)
    default_block_size: int | None = Field(default=None, gt=0,
                                           description="block size for models without KV events (approximate mode)")
    tokenizer: str | None = Field(default=None, description="tokenizer spec for prompt/messages queries")
    fetch_batch: int = Field(default=512, ge=1)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class QueryError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class IndexQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    block_hashes: list[int] | None = None
    pods: list[str] | None = None
    lora: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "IndexQuery":
        given = [n for n in ("token_ids", "prompt", "messages", "block_hashes") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of token_ids, prompt, messages, block_hashes"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


def _messages_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(messages)
    parts = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            raise QueryError(400, "message content must be a string")
        parts.append(f"{m.get('role', 'user')}: {content}\n")
    return "".join(parts)


def run_query(index: KvIndex, body: Any, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Answer one query body (already parsed JSON); raise :class:`QueryError` on bad input."""
    if not isinstance(body, dict):
        raise QueryError(400, "the query must be a JSON object")
    try:
        q = IndexQuery.model_validate(body)
    except ValidationError as exc:
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise QueryError(400, msg) from None
    if q.block_hashes is not None:
        if any(h < 0 or h >= 1 << 64 for h in q.block_hashes):
            raise QueryError(400, "block_hashes must be unsigned 64-bit integers")
        matches = index.match_keys(q.model, q.block_hashes, q.pods)
    else:
        if q.token_ids is not None:
            ids: Sequence[int] = q.token_ids
        else:
            if tokenizer is None:
                raise QueryError(400, "this indexer has no tokenizer configured; send token_ids")
            try:
                text = q.prompt if q.prompt is not None else _messages_text(tokenizer, q.messages or [])
                ids = tokenizer.encode(text)
            except QueryError:
                raise
            except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input problem
                raise QueryError(400, f"cannot tokenize: {exc}") from None
        try:
            matches = index.match_tokens(q.model, ids, q.pods, lora=q.lora)
        except ValueError as exc:
            raise QueryError(400, str(exc)) from None
    return {
        "block_size": index.block_size(q.model),
        "pods": {
            pod: {"matched_blocks": m.matched_blocks, "tiers": m.tiers, "score": round(m.score, 6),
                  "predicted_blocks": m.predicted_blocks}
            for pod, m in matches.items()
        },
    }


class RouteRecord(BaseModel):
    """``POST /v1/index/route``: a router's decision, recorded as predicted blocks."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    pod: str = Field(min_length=1)
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    ttl_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_input(self) -> "RouteRecord":
        if (self.token_ids is None) == (self.block_hashes is None):
            raise ValueError("give exactly one of token_ids, block_hashes")
        return self


def record_route(index: KvIndex, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise QueryError(400, "the body must be a JSON object")
    try:
        r = RouteRecord.model_validate(body)
        index.record_route(r.model, r.pod, token_ids=r.token_ids, keys=r.block_hashes, ttl_s=r.ttl_s)
    except ValidationError as exc:
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise QueryError(400, msg) from None
    except ValueError as exc:
        raise QueryError(400, str(exc)) from None
    return {"recorded": True, "block_size": index.block_size(r.model)}


def pods_body(index: KvIndex) -> dict[str, Any]:
    return {"pods": {name: {"model": p.model, "blocks": p.blocks, "total_blocks": sum(p.blocks.values()),
                            "predicted_blocks": p.predicted_blocks, "epoch": p.epoch, "seq": p.seq,
                            "last_event_ts": p.last_event_ts, "last_seen": p.last_seen, "live": p.live}
                     for name, p in index.pods().items()}}


def encode_snapshot(index: KvIndex, stream_seq: int, created: float) -> bytes:
    """The index's :meth:`~streams.kv_index.KvIndex.dump` as compact msgpack rows.

    A batch is ``[pod, model, epoch, seq, ts, events]``; a stored event is
    ``["s", hashes, parent_key, keys, block_size, medium, lora_id, lora_name]`` whose tokens are
    in a per-snapshot table ``key -> uint32-LE token bytes`` (a block many pods hold is written
    once); a gone pod is ``["g"]``.
    """
    rows = []
    table: dict[int, bytes] = {}
    for b in index.dump():
        events = []
        for e in b.events:
            if isinstance(e, BlockStored):
                lora = e.lora_id if e.lora_id is not None else e.lora_name
                data = array("I", e.token_ids)
                if sys.byteorder != "little":
                    data.byteswap()
                raw = data.tobytes()
                keys = block_keys(e.token_ids, e.block_size, e.parent_key, lora=lora)
                w = e.block_size * 4
                for i, k in enumerate(keys):
                    if k not in table:
                        table[k] = raw[i * w:(i + 1) * w]
                events.append(["s", e.block_hashes, e.parent_key, keys, e.block_size, e.medium, e.lora_id,
                               e.lora_name])
            elif isinstance(e, PodGone):
                events.append(["g"])
            else:  # dump() only writes the two kinds above
                raise ValueError(f"unexpected event in a dump: {e.type}")
        rows.append([b.pod, b.model, b.epoch, b.seq, b.ts, events])
    return msgpack.packb({"format": SNAPSHOT_FORMAT, "stream_seq": stream_seq, "created": created,
                          "tokens": table, "batches": rows})


def decode_snapshot(data: bytes) -> tuple[int, float, list[KvEventBatch]]:
    """Inverse of :func:`encode_snapshot` (the snapshot is our own output: built without re-validation)."""
    doc = msgpack.unpackb(data, strict_map_key=False)
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        raise ValueError("not an indexer snapshot of a known format")
    table = doc["tokens"]
    batches = []
    for pod, model, epoch, seq, ts, rows in doc["batches"]:
        events: list = []
        for r in rows:
            if r[0] == "s":
                toks = array("I")
                toks.frombytes(b"".join(map(table.__getitem__, r[3])))
                if sys.byteorder != "little":
                    toks.byteswap()
                events.append(BlockStored.model_construct(
                    type="stored", block_hashes=r[1], parent_block_hash=None, token_ids=toks.tolist(),
                    block_size=r[4], medium=r[5], lora_id=r[6], lora_name=r[7], parent_key=r[2]))
            elif r[0] == "g":
                events.append(PodGone())
            else:
                raise ValueError(f"unknown snapshot row {r[0]!r}")
        batches.append(KvEventBatch.model_construct(schema_version=1, pod=pod, model=model, dp_rank=0, epoch=epoch,
                                                    seq=seq, ts=ts, events=events))
    return int(doc["stream_seq"]), float(doc["created"]), batches


# --------------------------------------------------------------------------- fast decoding
#
# Validating a batch with pydantic costs about twice what applying it does, so the consumer
# first decodes with msgspec into mirror structs, checks the same constraints cheaply, and builds
# the schema objects with ``model_construct``. Anything the fast path does not accept exactly
# (hashes given as bytes or hex, a failed check, an unknown field) goes through
# :func:`schemas.decode_event`, which accepts it or names the offending field.

import msgspec  # noqa: E402

from schemas.base import SCHEMA_VERSION  # noqa: E402
from schemas.kv import U64, AllBlocksCleared, BlockRemoved, PodReset  # noqa: E402

_MEDIA = frozenset({None, "GPU", "CPU", "DISK", "LOCAL_FILE", "REMOTE"})


class _FStored(msgspec.Struct, tag="stored", tag_field="type", forbid_unknown_fields=True):
    block_hashes: list[int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    parent_key: int | None = None


class _FRemoved(msgspec.Struct, tag="removed", tag_field="type", forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None = None


class _FCleared(msgspec.Struct, tag="cleared", tag_field="type", forbid_unknown_fields=True):
    medium: str | None = None


class _FReset(msgspec.Struct, tag="reset", tag_field="type", forbid_unknown_fields=True):
    reason: str = "engine restart"


class _FGone(msgspec.Struct, tag="gone", tag_field="type", forbid_unknown_fields=True):
    reason: str = "pod deleted"


class _FBatch(msgspec.Struct, forbid_unknown_fields=True):
    pod: str
    model: str
    seq: int
    ts: float
    events: list[_FStored | _FRemoved | _FCleared | _FReset | _FGone]
    schema_version: int = SCHEMA_VERSION
    dp_rank: int = 0
    epoch: int = 0


_fast_decoder = msgspec.json.Decoder(_FBatch)


def _hashes_ok(hs: list[int]) -> bool:
    return bool(hs) and min(hs) >= 0 and max(hs) <= U64


def _fast_batch(data: bytes) -> KvEventBatch | None:
    """The batch, or None when only the full pydantic validation can decide."""
    try:
        b = _fast_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not (b.pod and b.model and b.seq >= 0 and b.epoch >= 0 and b.dp_rank >= 0 and b.ts >= 0
            and 0 < b.schema_version <= SCHEMA_VERSION):
        return None
    events: list = []
    for e in b.events:
        if type(e) is _FStored:
            if not (_hashes_ok(e.block_hashes) and e.block_size > 0 and e.medium in _MEDIA
                    and len(e.token_ids) == len(e.block_hashes) * e.block_size
                    and (e.parent_block_hash is None or 0 <= e.parent_block_hash <= U64)
                    and (e.parent_key is None or 0 <= e.parent_key <= U64)
                    and (not e.token_ids or min(e.token_ids) >= 0)):
                return None
            events.append(BlockStored.model_construct(
                type="stored", block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                token_ids=e.token_ids, block_size=e.block_size, lora_id=e.lora_id, lora_name=e.lora_name,
                medium=e.medium, parent_key=e.parent_key))
        elif type(e) is _FRemoved:
            if not (_hashes_ok(e.block_hashes) and e.medium in _MEDIA):
                return None
            events.append(BlockRemoved.model_construct(type="removed", block_hashes=e.block_hashes, medium=e.medium))
        elif type(e) is _FCleared:
            if e.medium not in _MEDIA:
                return None
            events.append(AllBlocksCleared.model_construct(type="cleared", medium=e.medium))
        elif type(e) is _FReset:
            events.append(PodReset.model_construct(type="reset", reason=e.reason))
        else:
            events.append(PodGone.model_construct(type="gone", reason=e.reason))
    return KvEventBatch.model_construct(schema_version=b.schema_version, pod=b.pod, model=b.model,
                                        dp_rank=b.dp_rank, epoch=b.epoch, seq=b.seq, ts=b.ts, events=events)


def decode_batch(data: bytes) -> KvEventBatch:
    """Decode one ``kv.events`` message; raise :class:`schemas.ValidationFailure` when invalid."""
    batch = _fast_batch(data)
    return batch if batch is not None else decode_event(KvEventBatch, data)


class IndexerMetrics:
    def __init__(self, registry: CollectorRegistry | None, service: "IndexerService"):
        self.batches = Counter("infernex_indexer_batches_total", "KV event batches applied", registry=registry)
        self.events = Counter("infernex_indexer_events_total", "KV events applied", registry=registry)
        self.blocks = Counter("infernex_indexer_blocks_total", "Blocks applied, by operation", ["op"],
                              registry=registry)
        self.anomalies = Counter("infernex_indexer_anomalies_total",
                                 "Input handled deliberately (unknown parents, stale batches ...)", ["kind"],
                                 registry=registry)
        self.lag = Histogram("infernex_indexer_apply_lag_seconds", "Engine timestamp to applied",
                             buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                             registry=registry)
        self.query = Histogram("infernex_indexer_query_seconds", "Query latency", ["via"],
                               buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
                               registry=registry)
        self.snapshots = Counter("infernex_indexer_snapshots_total", "Snapshots written", registry=registry)
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


_ANOMALIES = ("unknown_parent", "unknown_removed", "duplicates", "aliases", "stale_batches", "gaps",
              "epoch_resets", "rejected")


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
            default_block_size=config.default_block_size)
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
        self.bucket = (f"{prefix.replace('.', '_')}_{config.snapshot_bucket}" if prefix else config.snapshot_bucket)
        self.metrics = IndexerMetrics(registry, self)
        self.applied_seq = 0
        self.snapshot_seq = 0
        self.snapshot_time: float | None = None
        self.http_port: int | None = None
        self.restored_batches = 0
        self.restored_seq = 0  # stream sequence covered by the snapshot loaded at start
        self.restore_timings: dict[str, float] = {}
        self._since_snapshot = 0
        self._nc = None
        self._js = None
        self._dlq: bus.DeadLetters | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._server = None
        self._http_task: asyncio.Task | None = None
        self.snapshot_clock = time.monotonic()
        self._sub = None
        self._obj = None
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._nc = await bus.connect(self.nats_config, name=f"indexer-{self.config.durable}")
        self._js = self._nc.jetstream()
        try:
            await self._js.stream_info(self.stream)
        except NotFoundError:
            await self._nc.close()
            raise RuntimeError(f"stream {self.stream} does not exist; run `infernex streams apply` first") from None
        self._dlq = bus.DeadLetters(self._js, consumer=self.config.durable, registry=self.registry,
                                    prefix=self.prefix)
        try:
            self._obj = await self._js.object_store(self.bucket)
        except (NotFoundError, Exception):  # noqa: BLE001 - missing bucket: create it
            self._obj = await self._js.create_object_store(self.bucket)
        start_seq = await self._restore()
        await self._point_consumer(start_seq)
        if self.config.nats_query:
            self._sub = await self._nc.subscribe(S.with_prefix(self.prefix, S.KV_INDEX_QUERY),
                                                 queue="infernex-indexer", cb=self._on_nats_query)
        if self.config.http_port is not None:
            await self._start_http()
        self.snapshot_clock = time.monotonic()
        self._tasks.append(asyncio.create_task(self._consume(), name="indexer-consume"))
        self.ready.set()
        log.info("indexer %s: stream %s from seq %d, %d pods restored", self.config.durable, self.stream,
                 start_seq, len(self.index.pods()))

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            try:
                await asyncio.wait_for(t, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
        self._tasks.clear()
        if self._server is not None:
            self._server.should_exit = True
            if self._http_task is not None:
                try:
                    await asyncio.wait_for(self._http_task, timeout=5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    self._http_task.cancel()
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
            res = await self._obj.get(self.config.durable)
        except (NotFoundError, Exception) as exc:  # noqa: BLE001 - no snapshot yet
            if "not found" not in str(exc).lower() and not isinstance(exc, NotFoundError):
                log.warning("cannot read snapshot %s/%s: %s", self.bucket, self.config.durable, exc)
            return 1
        if res.info.deleted or not res.data:
            return 1
        t1 = time.perf_counter()
        try:
            seq, created, batches = decode_snapshot(res.data)
        except Exception as exc:  # noqa: BLE001 - a bad snapshot: replay the stream instead
            log.error("snapshot %s/%s unreadable (%s); replaying the whole stream", self.bucket,
                      self.config.durable, exc)
            return 1
        t2 = time.perf_counter()
        self.index.apply_many(batches)
        t3 = time.perf_counter()
        self.restore_timings = {"bytes": len(res.data), "fetch_s": t1 - t0, "decode_s": t2 - t1, "apply_s": t3 - t2}
        log.info("snapshot %s/%s: %d bytes, fetch %.2fs, decode %.2fs, apply %.2fs", self.bucket,
                 self.config.durable, len(res.data), t1 - t0, t2 - t1, t3 - t2)
        self.restored_batches = len(batches)
        self.restored_seq = seq
        self.applied_seq = self.snapshot_seq = seq
        self.snapshot_time = created
        return seq + 1

    async def _point_consumer(self, start_seq: int) -> None:
        """(Re)create the durable consumer so it delivers from ``start_seq``."""
        try:
            await self._js.delete_consumer(self.stream, self.config.durable)
        except NotFoundError:
            pass
        cfg = ConsumerConfig(
            durable_name=self.config.durable, ack_policy=AckPolicy.ALL,  # one ack per fetched batch
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq > 1 else DeliverPolicy.ALL,
            opt_start_seq=start_seq if start_seq > 1 else None, filter_subject=self.subject,
            ack_wait=30.0, max_ack_pending=20000, max_deliver=-1)
        await self._js.add_consumer(self.stream, cfg)

    async def snapshot(self) -> None:
        seq = self.applied_seq
        now = time.time()
        # the consumer is paused meanwhile; queries keep being served (they only read exact state)
        data = await asyncio.to_thread(encode_snapshot, self.index, seq, now)
        await self._obj.put(self.config.durable, data,
                            meta=ObjectMeta(name=self.config.durable, description=f"stream_seq={seq}"))
        self.snapshot_seq = seq
        self.snapshot_time = now
        self._since_snapshot = 0
        self.snapshot_clock = time.monotonic()
        self.metrics.snapshots.inc()

    # --------------------------------------------------------------------------- consume

    async def _consume(self) -> None:
        """Pull from the durable consumer :meth:`_point_consumer` created.

        Like :func:`consumers.bus.run_durable`, but without re-declaring the consumer:
        ``run_durable`` declares it with ``DeliverPolicy.ALL``, which JetStream refuses for a
        consumer re-pointed at a snapshot's sequence.
        """
        from nats.errors import ConnectionClosedError
        from nats.errors import TimeoutError as NatsTimeoutError

        sub = await self._js.pull_subscribe_bind(durable=self.config.durable, stream=self.stream)
        try:
            while not self._stop.is_set():
                try:
                    msgs = await sub.fetch(self.config.fetch_batch, timeout=0.25)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    continue
                except ConnectionClosedError:
                    break
                if msgs:
                    await self._handle(msgs)
        except Exception:
            log.exception("indexer consumer stopped")
            raise
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass

    async def _handle(self, msgs) -> None:
        m = self.metrics
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            reason = None
            try:
                batch = decode_batch(msg.data)
                reason = self._subject_mismatch(msg.subject, batch)
            except ValidationFailure as exc:
                reason = str(exc)
            if reason is not None:
                await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, reason,
                                     headers=dict(msg.headers or {}))
            else:
                try:
                    st = self.index.apply(batch)
                except ValueError as exc:  # e.g. token ids the index cannot key (>= 2**32)
                    log.warning("batch %s rejected by the index: %s", batch.msg_id, exc)
                    await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, f"not indexable: {exc}",
                                         headers=dict(msg.headers or {}), reason_class="unindexable")
                    self.applied_seq = seq
                    continue
                m.batches.inc()
                m.events.inc(st.events)
                if st.blocks_stored:
                    m.blocks.labels("stored").inc(st.blocks_stored)
                if st.blocks_removed:
                    m.blocks.labels("removed").inc(st.blocks_removed)
                for kind in _ANOMALIES:
                    v = getattr(st, kind)
                    if v:
                        m.anomalies.labels(kind).inc(v)
                if not st.stale_batches:
                    m.lag.observe(max(0.0, self.clock.now() - batch.ts))
            self.applied_seq = seq
            self._since_snapshot += 1
        if msgs:
            await msgs[-1].ack()  # AckPolicy.ALL: acks every message before it too, after applying
        if (self._since_snapshot >= self.config.snapshot_every_events
                or (self._since_snapshot and time.monotonic() - self.snapshot_clock >= self.config.snapshot_every_s)):
            try:
                await self.snapshot()
            except Exception as exc:  # noqa: BLE001 - keep consuming; the next snapshot retries
                log.warning("snapshot failed: %s", exc)

    def _subject_mismatch(self, subject: str, batch: KvEventBatch) -> str | None:
        rest = subject[len(self.prefix) + 1:] if self.prefix else subject
        try:
            parts = S.parse(rest)
        except ValueError as exc:
            return str(exc)
        if parts.get("pod") != batch.pod or parts.get("model") != batch.model:
            return (f"subject {subject} names pod {parts.get('pod')!r} model {parts.get('model')!r} but the "
                    f"batch is for pod {batch.pod!r} model {batch.model!r}")
        return None

    # ---------------------------------------------------------------------------- query

    def query(self, body: Any, via: str = "api") -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return run_query(self.index, body, self.tokenizer)
        finally:
            self.metrics.query.labels(via).observe(time.perf_counter() - t0)

    async def _on_nats_query(self, msg) -> None:
        try:
            body = json.loads(msg.data)
            out = self.query(body, "nats")
        except json.JSONDecodeError as exc:
            out = {"error": f"invalid JSON: {exc}", "status": 400}
        except QueryError as exc:
            out = {"error": str(exc), "status": exc.status}
        except Exception as exc:  # noqa: BLE001 - answer the requester instead of letting it time out
            log.exception("kv index query failed")
            out = {"error": f"internal error: {exc}", "status": 500}
        if msg.reply:
            await msg.respond(json.dumps(out).encode())

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "durable": self.config.durable, "stream": self.stream,
                "applied_seq": self.applied_seq, "snapshot_seq": self.snapshot_seq,
                "restored_batches": self.restored_batches, "restored_seq": self.restored_seq,
                "pods": len(self.index.pods()),
                "blocks": len(self.index), "dead_letters": self._dlq.count if self._dlq else 0}

    def http_app(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        async def query(request: Request):
            try:
                body = json.loads(await request.body())
            except json.JSONDecodeError as exc:
                return JSONResponse({"error": f"invalid JSON: {exc}"}, status_code=400)
            try:
                return JSONResponse(self.query(body, "http"))
            except QueryError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)

        async def route(request: Request):
            try:
                return JSONResponse(record_route(self.index, json.loads(await request.body())))
            except json.JSONDecodeError as exc:
                return JSONResponse({"error": f"invalid JSON: {exc}"}, status_code=400)
            except QueryError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)

        async def pods(request: Request):
            return JSONResponse(pods_body(self.index))

        async def health(request: Request):
            return JSONResponse(self.health())

        async def state(request: Request):
            return JSONResponse({"fingerprint": self.index.fingerprint(), "applied_seq": self.applied_seq})

        async def metrics(request: Request):
            if self.registry is None:
                return JSONResponse({"error": "no metrics registry"}, status_code=404)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[
            Route("/v1/index/query", query, methods=["POST"]),
            Route("/v1/index/route", route, methods=["POST"]),
            Route("/v1/index/pods", pods, methods=["GET"]),
            Route("/v1/index/state", state, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ])

    async def _start_http(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: small responses must not wait for a delayed ACK
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.config.http_host, self.config.http_port or 0))
        self.http_port = sock.getsockname()[1]
        cfg = uvicorn.Config(self.http_app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._server.install_signal_handlers = lambda: None  # the owner handles signals
        self._http_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="indexer-http")
        for _ in range(200):
            if self._server.started:
                return
            if self._http_task.done():
                self._http_task.result()
            await asyncio.sleep(0.02)
        raise RuntimeError("the HTTP server did not start")
