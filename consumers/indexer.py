"""The cache-indexer service: ``kv.events.>`` -> :class:`streams.kv_index.KvIndex` -> queries.

* A durable JetStream push consumer with a callback (no per-message fetch timer) decodes each
  :class:`schemas.KvEventBatch` (msgspec fast path, pydantic for anything unusual), queues it,
  and folds the queue in one ``apply_many`` when it is full or nothing else is waiting; then
  the last applied message is acked (AckPolicy.ALL), so acks always follow applies.
  Undecodable messages, and messages whose subject disagrees with their pod/model, go to
  ``dlq.kv-events`` with the reason (counted); the consumer keeps going. A gap in the delivery
  sequence (a message the client dropped) or a handling error re-reads the stream from the
  last applied sequence.
* Queries: HTTP ``POST /v1/index/query`` (plain ASGI, msgspec in and out), ``GET /v1/index/pods``,
  ``/health``, ``/metrics`` (starlette + uvicorn), and NATS request-reply on ``kv.index.query``
  (queue group, same JSON). ``prompt`` / ``messages`` are tokenized with an injected tokenizer.
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
import base64
import gc
import hashlib
import io
import json
import logging
import os
import signal
import socket
import sys
import time
from array import array
from collections.abc import Awaitable, Sequence
from typing import Annotated, Any, Literal, Protocol

import msgpack
import msgspec
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from consumers import bus
from schemas import KvEventBatch, ValidationFailure, decode_event
from schemas.kv import U64, BlockStored, PodGone
from streams.kv_core import parse_uint_arrays
from schemas import subjects as S
from schemas.config import NatsConfig
from consumers.indexer_config import IndexerConfig  # noqa: F401 - settings import it without the service
from streams.clock import Clock, SystemClock
from streams.kv_index import KvIndex, warm_up
from streams.topology import StreamSpec, build_topology, stream_for_subject

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 4
_LITTLE = sys.byteorder == "little"
ACK_IDLE_S = 0.05  # while messages trickle in, ack at most this often
FLUSH_DELAY_S = 0.002  # while messages trickle in, fold them in runs at most this much later
SNAPSHOT_CHUNK = 1 << 20  # object-store chunk bytes (nats-py's default, 128 KiB, costs 8x the messages)


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
    ids: Sequence[int] | None = q.token_ids
    if q.block_hashes is None and ids is None:
        if tokenizer is None:
            raise QueryError(400, "this indexer has no tokenizer configured; send token_ids")
        try:
            text = q.prompt if q.prompt is not None else _messages_text(tokenizer, q.messages or [])
            ids = tokenizer.encode(text)
        except QueryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input problem
            raise QueryError(400, f"cannot tokenize: {exc}") from None
    return _answer(index, q.model, ids, q.block_hashes, q.pods, q.lora)


class _FastQuery(msgspec.Struct, forbid_unknown_fields=True):
    """The common query shapes (token ids or block hashes), decoded without pydantic."""

    model: str
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    pods: list[str] | None = None
    lora: str | None = None


_query_decoder = msgspec.json.Decoder(_FastQuery)
_json_encode = msgspec.json.Encoder().encode


def run_query_json(index: KvIndex, data: bytes, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Answer one query given as JSON bytes (HTTP and NATS). ``token_ids`` / ``block_hashes``
    queries are decoded with msgspec; anything else, and every malformed query, goes through
    :func:`run_query` (pydantic), which names what is wrong."""
    try:
        q = _query_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        q = None
    if q is None or not q.model or (q.token_ids is None) == (q.block_hashes is None):
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QueryError(400, f"invalid JSON: {exc}") from None
        return run_query(index, body, tokenizer)
    return _answer(index, q.model, q.token_ids, q.block_hashes, q.pods, q.lora)


def _answer(index: KvIndex, model: str, ids: Sequence[int] | None, hashes: list[int] | None,
            pods: list[str] | None, lora: str | None) -> dict[str, Any]:
    if hashes is not None:
        if hashes and (min(hashes) < 0 or max(hashes) > U64):
            raise QueryError(400, "block_hashes must be unsigned 64-bit integers")
        matches = index.match_keys(model, hashes, pods)
    else:
        try:
            matches = index.match_tokens(model, ids, pods, lora=lora)
        except ValueError as exc:
            raise QueryError(400, str(exc)) from None
    return {
        "block_size": index.block_size(model),
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


def _le_bytes(values, typecode: str) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def encode_snapshot(index: KvIndex, stream_seq: int, created: float) -> bytes:
    """The index's :meth:`~streams.kv_index.KvIndex.dump` as a snapshot (see :func:`encode_dump`)."""
    return encode_dump(index.dump(), stream_seq, created)


def encode_dump(dump: list[KvEventBatch], stream_seq: int, created: float) -> bytes:
    """A :meth:`~streams.kv_index.KvIndex.dump` as compact msgpack (format 4).

    A batch is ``[pod, model, epoch, seq, ts, events]``; a stored event is
    ``["k", hashes, keys, block_size, medium]`` with ``hashes`` (the engine's) and ``keys``
    (ours, see ``BlockStored.block_keys``) packed uint64-LE; a gone pod is ``["g"]``. Packed
    arrays keep both the snapshot and its decoding small (no Python object per block).
    """
    rows = []
    for b in dump:
        events = []
        for e in b.events:
            if isinstance(e, BlockStored) and e.block_keys is not None:
                events.append(["k", _le_bytes(e.block_hashes, "Q"), _le_bytes(e.block_keys, "Q"), e.block_size,
                               e.medium])
            elif isinstance(e, PodGone):
                events.append(["g"])
            else:  # dump() only writes the two kinds above
                raise ValueError(f"unexpected event in a dump: {e.type}")
        rows.append([b.pod, b.model, b.epoch, b.seq, b.ts, events])
    return msgpack.packb({"format": SNAPSHOT_FORMAT, "stream_seq": stream_seq, "created": created, "batches": rows})


def _le_array(blob: bytes) -> array:
    a = array("Q")
    a.frombytes(blob)
    if not _LITTLE:
        a.byteswap()
    return a


def decode_snapshot(data: bytes) -> tuple[int, float, list[KvEventBatch]]:
    """Inverse of :func:`encode_snapshot` (the snapshot is our own output: built without
    re-validation). Hashes and keys come back as ``array('Q')``, which the fold reads as it
    reads a list, without a Python int per block. Formats 2 and 3 keyed blocks with another
    hash: they are refused (ValueError), and the service replays the stream instead."""
    doc = msgpack.unpackb(data, strict_map_key=False)
    if not isinstance(doc, dict) or "format" not in doc:
        raise ValueError("not an indexer snapshot")
    if doc["format"] != SNAPSHOT_FORMAT:
        raise ValueError(f"snapshot format {doc['format']!r} is not {SNAPSHOT_FORMAT} (older snapshots keyed "
                         "blocks with another hash)")
    batches = []
    for pod, model, epoch, seq, ts, rows in doc["batches"]:
        events: list = []
        for r in rows:
            if r[0] == "k":
                events.append(_mk_stored(
                    type="stored", block_hashes=_le_array(r[1]), parent_block_hash=None, token_ids=[],
                    block_size=r[3], lora_id=None, lora_name=None, medium=r[4], parent_key=None,
                    block_keys=_le_array(r[2]), block_salts=None))
            elif r[0] == "g":
                events.append(PodGone())
            else:
                raise ValueError(f"unknown snapshot row {r[0]!r}")
        batches.append(_mk_batch(schema_version=1, pod=pod, model=model, dp_rank=0, epoch=epoch, seq=seq, ts=ts,
                                 events=events))
    return int(doc["stream_seq"]), float(doc["created"]), batches


def _forked_encode(index: KvIndex, seq: int, created: float) -> Awaitable[bytes]:
    """Fork now; the child encodes ``index`` (as of the fork) and writes it to a pipe. Returns
    an awaitable of the bytes (raises if the child fails). The child runs only the pure dump
    and encoding -- no event loop, locks, sockets or logging -- and always ends in ``os._exit``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            try:  # a signal here must not reach the parent's event loop (shared wakeup fd)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
            except ValueError:  # forked from a thread other than the main one: nothing was set
                pass
            os.close(r)
            data = encode_snapshot(index, seq, created)
            with os.fdopen(w, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)

    def collect() -> bytes:
        with os.fdopen(r, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            raise RuntimeError(f"the snapshot child process failed (wait status {status})")
        return data

    return asyncio.to_thread(collect)


# --------------------------------------------------------------------------- fast decoding
#
# Validating a batch with pydantic costs about twice what applying it does, so the consumer
# first decodes with msgspec into mirror structs, checks the same constraints cheaply, and builds
# the schema objects with ``model_construct``. Anything the fast path does not accept exactly
# (hashes given as bytes or hex, a failed check, an unknown field) goes through
# :func:`schemas.decode_event`, which accepts it or names the offending field.

from schemas.base import SCHEMA_VERSION  # noqa: E402
from schemas.kv import AllBlocksCleared, BlockRemoved, PodReset  # noqa: E402



# Scalar range checks are msgspec constraints, checked in C while decoding (but for hashes' upper
# bound: msgspec takes no bound past int64). Token ids must be uint32 (what the fold can key), a
# stricter rule than the schema's: a batch with larger ones takes the pydantic path and the
# consumer applies it on its own (the fold rejects it there).
#
# Two mirrors of the schema: for small messages msgspec builds the hash and token lists itself
# (cheapest below a few KB); for large ones the arrays stay raw JSON and are parsed natively in
# one call into uint64 / uint32 numpy arrays (no Python int per token: several times cheaper
# per value, but with a fixed cost per message).
_Hash = Annotated[int, msgspec.Meta(ge=0)]
_Hashes = Annotated[list[_Hash], msgspec.Meta(min_length=1)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
_Medium = Annotated[str, msgspec.Meta(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Name = Annotated[str, msgspec.Meta(min_length=1)]
RAW_PARSE_MIN_BYTES = 2048  # messages at least this long take the native array parse


class _FCleared(msgspec.Struct, tag="cleared", tag_field="type", forbid_unknown_fields=True):
    medium: _Medium | None = None


class _FReset(msgspec.Struct, tag="reset", tag_field="type", forbid_unknown_fields=True):
    reason: str = "engine restart"


class _FGone(msgspec.Struct, tag="gone", tag_field="type", forbid_unknown_fields=True):
    reason: str = "pod deleted"


def _mirror(name: str, hashes: Any, tokens: Any) -> tuple[type, type, msgspec.json.Decoder]:
    """(stored struct, removed struct, batch decoder) with the given array field types."""
    opts = {"forbid_unknown_fields": True, "tag_field": "type"}
    stored = msgspec.defstruct(f"_{name}Stored", [
        ("block_hashes", hashes), ("token_ids", tokens), ("block_size", Annotated[int, msgspec.Meta(gt=0)]),
        ("parent_block_hash", _Hash | None, None), ("lora_id", int | None, None), ("lora_name", str | None, None),
        ("medium", _Medium | None, None), ("parent_key", _Hash | None, None),
        ("block_keys", list[_Hash] | None, None), ("block_salts", list[_Hash] | None, None)],
        tag="stored", **opts)
    removed = msgspec.defstruct(f"_{name}Removed", [("block_hashes", hashes), ("medium", _Medium | None, None)],
                                tag="removed", **opts)
    batch = msgspec.defstruct(f"_{name}Batch", [
        ("pod", _Name), ("model", _Name), ("seq", _NonNeg), ("ts", Annotated[float, msgspec.Meta(ge=0)]),
        ("events", list[stored | removed | _FCleared | _FReset | _FGone]),
        ("schema_version", Annotated[int, msgspec.Meta(gt=0, le=SCHEMA_VERSION)], SCHEMA_VERSION),
        ("dp_rank", _NonNeg, 0), ("epoch", _NonNeg, 0)], forbid_unknown_fields=True)
    return stored, removed, msgspec.json.Decoder(batch)


_LStored, _LRemoved, _list_decoder = _mirror("List", _Hashes, list[_Token])
_RStored, _RRemoved, _raw_decoder = _mirror("Raw", msgspec.Raw, msgspec.Raw)




def _constructor(cls):
    """``make(**every_field)`` -> a ``cls`` instance without validation, like ``model_construct``
    given every field, but without its per-field default and alias handling (a third of
    the decode time). It sets exactly the attributes ``model_construct`` sets; checked
    against it once here, falling back to ``model_construct`` for models it does not fit."""
    names = tuple(cls.model_fields)
    if cls.__pydantic_post_init__ or cls.__pydantic_root_model__ or cls.model_config.get("extra") == "allow":
        return cls.model_construct
    new = object.__new__
    put = object.__setattr__

    def make(**values):
        m = new(cls)
        put(m, "__dict__", values)
        put(m, "__pydantic_fields_set__", set(values))
        put(m, "__pydantic_extra__", None)
        put(m, "__pydantic_private__", None)
        return m

    probe = {n: f.get_default(call_default_factory=True) if not f.is_required() else None
             for n, f in cls.model_fields.items()}
    a, b = make(**probe), cls.model_construct(**probe)
    same = (a.__dict__ == b.__dict__ and list(a.__dict__) == list(names) and a.model_fields_set == b.model_fields_set
            and a.__pydantic_extra__ == b.__pydantic_extra__ and a.__pydantic_private__ == b.__pydantic_private__)
    return make if same else cls.model_construct


_mk_stored = _constructor(BlockStored)
_mk_removed = _constructor(BlockRemoved)
_mk_batch = _constructor(KvEventBatch)


def _fast_batch(data: bytes) -> KvEventBatch | None:
    """The batch, or None when only the full pydantic validation can decide."""
    raw = len(data) >= RAW_PARSE_MIN_BYTES
    try:
        b = (_raw_decoder if raw else _list_decoder).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    stored_t, removed_t = (_RStored, _RRemoved) if raw else (_LStored, _LRemoved)
    if raw:
        raws: list = []
        to32 = bytearray()
        for e in b.events:
            t = type(e)
            if t is stored_t:
                raws.append(e.block_hashes)
                raws.append(e.token_ids)
                to32 += b"\x00\x01"
            elif t is removed_t:
                raws.append(e.block_hashes)
                to32 += b"\x00"
        if raws:
            bad, v64, v32, counts = parse_uint_arrays(np.frombuffer(b"".join(raws), dtype=np.uint8),
                                                      np.frombuffer(bytes(to32), dtype=np.uint8))
            if bad >= 0:
                return None
            counts = counts.tolist()
    i = o64 = o32 = 0
    events: list = []
    for e in b.events:
        t = type(e)
        if t is stored_t:
            if raw:
                nh, nt = counts[i], counts[i + 1]
                i += 2
                hashes = v64[o64:o64 + nh]
                toks = v32[o32:o32 + nt]
                o64 += nh
                o32 += nt
                if not nh:
                    return None
            else:
                hashes, toks = e.block_hashes, e.token_ids
                nh, nt = len(hashes), len(toks)
                if max(hashes) > U64:
                    return None
            if e.block_keys is not None:
                if (len(e.block_keys) != nh or nt or min(e.block_keys) == 0 or max(e.block_keys) > U64):
                    return None
            elif nt != nh * e.block_size:
                return None
            if (e.parent_block_hash or 0) > U64 or (e.parent_key or 0) > U64:
                return None
            salts = e.block_salts
            if salts is not None and (len(salts) != nh or max(salts) > U64):
                return None
            events.append(_mk_stored(
                type="stored", block_hashes=hashes, parent_block_hash=e.parent_block_hash,
                token_ids=toks, block_size=e.block_size, lora_id=e.lora_id, lora_name=e.lora_name,
                medium=e.medium, parent_key=e.parent_key, block_keys=e.block_keys,
                block_salts=salts))
        elif t is removed_t:
            if raw:
                nh = counts[i]
                i += 1
                if not nh:
                    return None
                hashes = v64[o64:o64 + nh]
                o64 += nh
            else:
                hashes = e.block_hashes
                if max(hashes) > U64:
                    return None
            events.append(_mk_removed(type="removed", block_hashes=hashes, medium=e.medium))
        elif t is _FCleared:
            events.append(AllBlocksCleared.model_construct(type="cleared", medium=e.medium))
        elif t is _FReset:
            events.append(PodReset.model_construct(type="reset", reason=e.reason))
        else:
            events.append(PodGone.model_construct(type="gone", reason=e.reason))
    return _mk_batch(schema_version=b.schema_version, pod=b.pod, model=b.model, dp_rank=b.dp_rank, epoch=b.epoch,
                     seq=b.seq, ts=b.ts, events=events)


def decode_batch(data: bytes) -> KvEventBatch:
    """Decode one ``kv.events`` message; raise :class:`schemas.ValidationFailure` when invalid."""
    batch = _fast_batch(data)
    return batch if batch is not None else decode_event(KvEventBatch, data)


def snapshot_bucket_name(prefix: str | None, bucket: str) -> str:
    """The object-store bucket of index snapshots under a subject prefix (bucket names have no dots)."""
    return f"{prefix.replace('.', '_')}_{bucket}" if prefix else bucket


async def fetch_snapshot_bytes(js, obj, bucket: str, name: str) -> bytes | None:  # noqa: ANN001
    """A snapshot object's bytes (None when deleted or empty), digest-checked.

    Chunks are read with direct gets, one request each: nats-py's ``ObjectStore.get`` reads
    through an ordered push consumer whose flow-control replies wait for a 0.25 s poll
    (about 1 s for 30 MB) and, without ``writeinto``, grows one bytes object chunk by chunk.
    Buckets without direct gets fall back to ``get(writeinto=...)``.
    """
    info = await obj.get_info(name)
    if info.deleted or not info.size:
        return None
    try:
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
        parts = []
        seq = 0
        for _ in range(info.chunks or 0):
            raw = await js.get_msg(stream, seq=seq + 1, subject=subject, direct=True, next=True)
            parts.append(raw.data or b"")
            seq = raw.seq
        data = b"".join(parts)
    except Exception as exc:  # noqa: BLE001 - e.g. a bucket made without allow_direct
        log.info("direct reads of the snapshot failed (%s); reading it through the object store", exc)
        buf = io.BytesIO()
        await obj.get(name, writeinto=buf)
        return buf.getvalue()
    want = info.digest or ""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if len(data) != info.size or want.split("=", 1)[-1].rstrip("=") != digest.rstrip("="):
        raise ValueError(f"snapshot {bucket}/{name} is incomplete or corrupt "
                         f"({len(data)} of {info.size} bytes, digest mismatch)")
    return data


async def read_snapshot(js, bucket: str, name: str) -> tuple[int, float, list[KvEventBatch]] | None:  # noqa: ANN001
    """The newest index snapshot an indexer wrote, as ``(stream sequence, created, batches)``;
    None when there is none. Other services (router replicas) start from it instead of
    replaying the whole KV stream: apply the batches, then read from ``sequence + 1``."""
    try:
        obj = await js.object_store(bucket)
        data = await fetch_snapshot_bytes(js, obj, bucket, name)
    except NotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - the object store says "not found" in several ways
        if "not found" in str(exc).lower():
            return None
        raise
    if not data:
        return None
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return decode_snapshot(data)
    finally:
        if gc_was_on:
            gc.enable()


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
        self._buf: list[KvEventBatch] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._taken_seq = 0  # last stream sequence decoded (applied, dead-lettered or queued)
        self._next_dseq = 1
        self._last_msg = None
        self._unacked = 0
        self._acked_at = 0.0
        self._halted = False  # set while re-pointing the consumer or stopping
        self._resync_task: asyncio.Task | None = None
        self._subjects: dict[str, tuple[str | None, str | None] | str] = {}
        self._chunk = max(1, min(config.fetch_batch, config.max_ack_pending // 4))
        self._ack_every = max(1, config.max_ack_pending // 2)
        self._psub = None
        self._put_task: asyncio.Task | None = None
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
        await asyncio.to_thread(warm_up)  # the fold's kernels: compiled or loaded before the first event
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
            self._server.should_exit = True
            if self._http_task is not None:
                try:
                    await asyncio.wait_for(self._http_task, timeout=5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    self._http_task.cancel()
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
        return await fetch_snapshot_bytes(self._js, self._obj, self.bucket, self.config.durable)

    async def _point_consumer(self, start_seq: int) -> None:
        """(Re)create the durable push consumer so it delivers from ``start_seq``, and subscribe.

        A push consumer with a callback: nats-py hands over each message without the
        per-message timer of a pull ``fetch``. The deliver subject is subscribed before the
        consumer exists, so no first message goes unheard.
        """
        try:
            await self._js.delete_consumer(self.stream, self.config.durable)
        except NotFoundError:
            pass
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
        await self._js.add_consumer(self.stream, cfg)

    async def snapshot(self) -> None:
        """Write a snapshot of the current state; returns once it is stored (raises if not)."""
        await (await self._start_snapshot())

    async def _start_snapshot(self) -> asyncio.Task:
        """Capture the index as it is now; encode and store it in a task.

        Callers hold the apply lock. With ``snapshot_fork`` (where ``os.fork`` exists) a
        forked child -- a copy-on-write image of this process -- dumps and encodes the index and
        pipes the bytes back, so consumption pauses only for the fork. Otherwise the dump runs
        in a thread with consumption paused (queries keep being served: they only read); the
        dump's events are new objects, so encoding and writing overlap with consumption again.
        """
        prev = self._put_task
        if prev is not None and not prev.done():
            await asyncio.wait({prev})  # one snapshot in flight at a time
        seq, now = self.applied_seq, time.time()
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
        await self._obj.put(self.config.durable, data,
                            meta=ObjectMeta(name=self.config.durable, description=f"stream_seq={seq}",
                                            options=ObjectMetaOptions(max_chunk_size=self._chunk_bytes())))
        self.snapshot_seq = seq
        self.snapshot_time = now
        self.metrics.snapshots.inc()

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
            batch, careful, reason = self._decode(msg.subject, msg.data)
            if reason is not None or careful:
                self._flush()  # keep the order: everything before it first
                if reason is not None:
                    await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, reason, headers=dict(msg.headers or {}))
                else:
                    await self._apply_one(batch, msg)
                self.applied_seq = sseq
                self._since_snapshot += 1
            else:
                self._buf.append(batch)
            self._taken_seq = sseq
        self._last_msg = msg
        self._unacked += 1
        waiting = self._psub.pending_msgs
        if len(self._buf) >= self._chunk:
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

    def _decode(self, subject: str, data: bytes) -> tuple[KvEventBatch | None, bool, str | None]:
        """``(batch, careful, reason)``: ``careful`` when the fold may still reject it (slow path)."""
        careful = False
        batch = _fast_batch(data)
        if batch is None:
            careful = True
            try:
                batch = decode_event(KvEventBatch, data)
            except ValidationFailure as exc:
                return None, True, str(exc)
        names = self._subjects.get(subject)
        if names is None:
            names = self._subject_names(subject)
            if len(self._subjects) >= 100_000:
                self._subjects.clear()
            self._subjects[subject] = names
        if isinstance(names, str):
            return None, True, names
        if names[0] != batch.pod or names[1] != batch.model:
            return None, True, (f"subject {subject} names pod {names[0]!r} model {names[1]!r} but the "
                                f"batch is for pod {batch.pod!r} model {batch.model!r}")
        return batch, careful, None

    def _subject_names(self, subject: str) -> tuple[str | None, str | None] | str:
        rest = subject[len(self.prefix) + 1:] if self.prefix else subject
        try:
            parts = S.parse(rest)
        except ValueError as exc:
            return str(exc)
        return parts.get("pod"), parts.get("model")

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
        self._buf = []
        st = self.index.apply_many(buf)
        self.applied_seq = self._taken_seq
        self._since_snapshot += len(buf)
        self._count(st)
        if not st.stale_batches:  # replayed (stale) batches would show their age, not our lag
            now = self.clock.now()
            obs = self.metrics.lag.observe
            for b in buf:
                obs(max(0.0, now - b.ts))

    async def _apply_one(self, batch: KvEventBatch, msg) -> None:
        try:
            st = self.index.apply(batch)
        except ValueError as exc:  # e.g. token ids the index cannot key (>= 2**32)
            log.warning("batch %s rejected by the index: %s", batch.msg_id, exc)
            await self._dlq.send(S.KV_EVENTS, msg.subject, msg.data, f"not indexable: {exc}",
                                 headers=dict(msg.headers or {}), reason_class="unindexable")
            return
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
            self.snapshot_clock = time.monotonic()
            return
        task.add_done_callback(self._snapshot_stored)

    def _snapshot_stored(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # keep consuming; retried after the next event past the period
            log.warning("snapshot failed: %s", exc)
            self._since_snapshot += 1

    async def _ticker(self) -> None:
        """Acks and snapshots (by time) when the stream is quiet; otherwise messages do both."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(0.25, self.config.snapshot_every_s))
            except asyncio.TimeoutError:
                pass
            if (self._unacked or self._snapshot_due()) and not self._halted:
                async with self._lock:
                    if not self._halted:
                        self._flush()
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

    def http_app(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

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

        probes = self._probes()

        async def healthz(request: Request):
            status, body = await probes.report(ready=False)
            return JSONResponse(body, status_code=status)

        async def readyz(request: Request):
            status, body = await probes.report(ready=True)
            return JSONResponse(body, status_code=status)

        async def state(request: Request):
            return JSONResponse({"fingerprint": self.index.fingerprint(), "applied_seq": self.applied_seq})

        async def metrics(request: Request):
            if self.registry is None:
                return JSONResponse({"error": "no metrics registry"}, status_code=404)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        app = Starlette(routes=[
            Route("/v1/index/route", route, methods=["POST"]),
            Route("/v1/index/pods", pods, methods=["GET"]),
            Route("/v1/index/state", state, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ])
        json_type = (b"content-type", b"application/json")

        async def asgi(scope, receive, send):
            # the hot path, POST /v1/index/query, as plain ASGI: no routing, request or response
            # objects (half the latency of a Starlette route); everything else goes to Starlette
            if scope["type"] != "http" or scope["path"] != "/v1/index/query":
                return await app(scope, receive, send)
            if scope["method"] != "POST":
                status, out = 405, b'{"error":"use POST"}'
            else:
                msg = await receive()
                body = msg.get("body", b"")
                if msg.get("more_body"):
                    parts = [body]
                    while msg.get("more_body"):
                        msg = await receive()
                        parts.append(msg.get("body", b""))
                    body = b"".join(parts)
                status, out = self.query_json(body, "http")
            await send({"type": "http.response.start", "status": status,
                        "headers": [json_type, (b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})

        return asgi

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
