"""The binary encoding of a :class:`schemas.kv.KvEventBatch` on ``kv.events`` (no I/O).

A ``kv.events`` message is either the batch's JSON (the schema's own form: for humans,
``infernex pub`` and every message stored before this encoding existed) or this compact
msgpack form, which the bridge publishes by default. Consumers tell them apart by the first
byte (JSON text starts with ``{`` or whitespace, this form with a msgpack array header) and
the ``Content-Type`` header names it; both decode to the same batch.

Layout (msgpack, every struct an array, ``u64le`` / ``u32le`` = a msgpack ``bin`` of packed
little-endian unsigned integers, so a consumer maps them straight into arrays)::

    batch   = ["kv1", schema_version, pod, model, dp_rank, epoch, seq, ts, [event, ...]]
    stored  = ["s", block_hashes: u64le, token_ids: u32le, block_size, parent_block_hash|nil,
               lora_id|nil, lora_name|nil, medium|nil, block_salts: u64le|nil,
               parent_key|nil, block_keys: u64le|nil, block_digests: u64le|nil]
    removed = ["r", block_hashes: u64le, medium|nil]
    cleared = ["c", medium|nil]
    reset   = ["x", reason]
    gone    = ["g", reason]

A bridge that has several batches of one pod ready at once sends them as one message, a group
(what the batches would be one by one, in order; the headers name the last batch, plus
:data:`HDR_FIRST_SEQ` and :data:`HDR_BATCHES`)::

    group   = ["kvg", [batch, batch, ...]]

The rules are the JSON schema's (:mod:`schemas.kv`): at least one block hash, ``token_ids``
holding ``len(block_hashes) * block_size`` ids (or none when ``block_keys`` or
``block_digests`` is given), one salt / key / digest per block. The bridge sends each block's
digest (:func:`streams.kv_core.block_digests`) in place of its token ids by default: 8 bytes per
block instead of 4 per token, and the index chains digests into the keys tokens would give. A
message without the last field is read as before. Token ids must fit 32 bits here: a batch with larger ones is sent as
JSON. The message also carries the batch's identity in headers (:data:`HDR_POD`,
:data:`HDR_MODEL`, :data:`HDR_EPOCH`, :data:`HDR_SEQ`), so tools can filter or find a position
without decoding; the payload stays complete on its own (a replayed or dead-lettered message
needs no headers to be read).
"""

from __future__ import annotations

import re
import sys
from array import array
from typing import Annotated, Any, ClassVar, Union

import msgspec

from schemas.base import SCHEMA_VERSION
from schemas.kv import MAX_EPOCH, MAX_SEQ

CONTENT_TYPE = "application/vnd.infernex.kv+msgpack"
JSON_CONTENT_TYPE = "application/json"
HDR_CONTENT_TYPE = "Content-Type"
HDR_POD = "Infernex-Pod"
HDR_MODEL = "Infernex-Model"
HDR_EPOCH = "Infernex-Epoch"
HDR_SEQ = "Infernex-Seq"
HDR_FIRST_SEQ = "Infernex-First-Seq"
HDR_BATCHES = "Infernex-Batches"
BATCH_TAG = "kv1"
GROUP_TAG = "kvg"
ENCODINGS = ("binary", "json")

_LITTLE = sys.byteorder == "little"
assert array("I").itemsize == 4 and array("Q").itemsize == 8

_Name = Annotated[str, msgspec.Meta(min_length=1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # the upper bound (2**64-1) is msgpack's own: larger ints do not exist there
# a tier name ([A-Z][A-Z0-9_]{0,31}): checked by the consumers' decode (consumers.index_codec.wire_batch,
# against a cache of names seen), not here, where a regular expression per event cost half the decode
_Medium = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
MEDIUM_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,31}$")


class WStored(msgspec.Struct, tag="s", array_like=True, gc=False):
    type: ClassVar[str] = "stored"  # the schema's event type (the fold dispatches on it)
    block_hashes: memoryview
    token_ids: memoryview
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    parent_block_hash: Union[_U64, None] = None
    lora_id: Union[int, None] = None
    lora_name: Union[str, None] = None
    medium: Union[_Medium, None] = None
    block_salts: Union[memoryview, None] = None
    parent_key: Union[_U64, None] = None
    block_keys: Union[memoryview, None] = None
    block_digests: Union[memoryview, None] = None


class WRemoved(msgspec.Struct, tag="r", array_like=True, gc=False):
    type: ClassVar[str] = "removed"  # the schema's event type (the fold dispatches on it)
    block_hashes: memoryview
    medium: Union[_Medium, None] = None


class WCleared(msgspec.Struct, tag="c", array_like=True, gc=False):
    type: ClassVar[str] = "cleared"  # the schema's event type (the fold dispatches on it)
    medium: Union[_Medium, None] = None


class WReset(msgspec.Struct, tag="x", array_like=True, gc=False):
    type: ClassVar[str] = "reset"  # the schema's event type (the fold dispatches on it)
    reason: str = "engine restart"


class WGone(msgspec.Struct, tag="g", array_like=True, gc=False):
    type: ClassVar[str] = "gone"  # the schema's event type (the fold dispatches on it)
    reason: str = "pod deleted"


WEvent = Union[WStored, WRemoved, WCleared, WReset, WGone]
_WIRE_EVENTS = frozenset((WStored, WRemoved, WCleared, WReset, WGone))


class WBatch(msgspec.Struct, tag=BATCH_TAG, array_like=True, gc=False):
    schema_version: Annotated[int, msgspec.Meta(gt=0, le=SCHEMA_VERSION)]
    pod: _Name
    model: _Name
    dp_rank: _NonNeg
    epoch: Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
    ts: Annotated[float, msgspec.Meta(ge=0)]
    events: list[WEvent]

    @property
    def msg_id(self) -> str:
        return f"{self.pod}:{self.epoch}:{self.seq}"


class WGroupRaw(msgspec.Struct, tag=GROUP_TAG, array_like=True, gc=False):
    """A group with its batches still encoded: each is decoded (and, if invalid, refused) alone."""
    batches: Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1)]


class WGroup(msgspec.Struct, tag=GROUP_TAG, array_like=True, gc=False):
    """A group decoded whole (one call for all its batches; a bad one fails it: then
    :class:`WGroupRaw` takes the batches one by one)."""
    batches: Annotated[list[WBatch], msgspec.Meta(min_length=1)]


class WRun:
    """A group message's batches in columns: consecutive batches of one pod, epoch and model whose
    events are all stores with block digests (no keys, salts or LoRA; one block size) and removals,
    what a bridge sends all day. Made by a consumer's compiled reader
    (:func:`consumers.index_columns.wire_run`) after the schema's checks; the fold takes it in a few
    array operations (:meth:`streams.kv_index.KvIndex.apply_many`), or batch by batch through
    :meth:`batches` when the pod is not simply at its next batch.

    Per event: ``kind`` (0 stored, 1 removed), ``medium`` (an index into ``mediums``; -1: none,
    the primary tier), ``parent`` / ``has_parent`` (a store's parent block hash), ``hash_end`` and
    ``digest_end`` (where its hashes end in ``hashes``, its digests in ``digests``, counted in
    ``uint32`` halves as the fold's token buffer counts them). Per batch: ``ts``."""

    __slots__ = ("pod", "model", "epoch", "first_seq", "seq", "ts", "block_size", "kind", "medium", "mediums",
                 "parent", "has_parent", "hash_end", "digest_end", "hashes", "digests", "stored", "removed",
                 "data", "_decode")

    def __init__(self, pod: str, model: str, epoch: int, first_seq: int, ts: Any, block_size: int, kind: Any,
                 medium: Any, mediums: list[str], parent: Any, has_parent: Any, hash_end: Any, digest_end: Any,
                 hashes: Any, digests: Any, stored: int, removed: int, data: bytes, decode: Any) -> None:
        self.pod, self.model, self.epoch = pod, model, epoch
        self.first_seq, self.seq = first_seq, first_seq + len(ts) - 1
        self.ts, self.block_size = ts, block_size
        self.kind, self.medium, self.mediums = kind, medium, mediums
        self.parent, self.has_parent, self.hash_end, self.digest_end = parent, has_parent, hash_end, digest_end
        self.hashes, self.digests = hashes, digests
        self.stored, self.removed = stored, removed
        self.data = data
        self._decode = decode

    def __len__(self) -> int:
        return len(self.ts)

    def batches(self) -> list[WBatch]:
        """The same batches as checked wire structs (the decoder the reader was given)."""
        return self._decode(self.data)

    def positions(self) -> list[tuple[str, int, int]]:
        """``(pod, epoch, seq)`` of each batch, in order."""
        return [(self.pod, self.epoch, s) for s in range(self.first_seq, self.seq + 1)]


_decoder = msgspec.msgpack.Decoder(WBatch)
_group_decoder = msgspec.msgpack.Decoder(WGroup)
_any_decoder = msgspec.msgpack.Decoder(Union[WBatch, WGroupRaw])
_encoder = msgspec.msgpack.Encoder()
_GROUP_HEAD = _encoder.encode(GROUP_TAG)


def is_binary(data: bytes) -> bool:
    """True when ``data`` is in this encoding (a msgpack array), False for JSON text."""
    if not data:
        return False
    b = data[0]
    return 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD


def pack(values: Any, typecode: str) -> bytes:
    """Integers as packed little-endian ``typecode`` (``"Q"`` u64, ``"I"`` u32); OverflowError
    when one does not fit. Takes a list, an ``array`` or a numpy array."""
    if isinstance(values, array):
        a = values if values.typecode == typecode else array(typecode, values)
    elif hasattr(values, "astype") and hasattr(values, "dtype"):  # numpy, without importing it here
        kind = values.dtype.kind
        size = 8 if typecode == "Q" else 4
        if kind == "u" and values.dtype.itemsize <= size:
            return values.astype(f"<u{size}", copy=False).tobytes()
        a = array(typecode, values.tolist())
    else:
        a = array(typecode, values)  # OverflowError past the type's range
    if not _LITTLE:
        a = array(typecode, a)
        a.byteswap()
    return a.tobytes()


def to_wire(batch: Any) -> WBatch:
    """A batch (a :class:`schemas.kv.KvEventBatch`, or any object with its fields, such as the
    bridge's normalized structs) as the wire struct. OverflowError / ValueError when it cannot be
    expressed (token ids past 32 bits, hashes past 64): send it as JSON then."""
    events: list = []
    for e in batch.events:
        if type(e) in _WIRE_EVENTS:  # already in this form (the bridge's compiled decoder)
            events.append(e)
            continue
        t = e.type
        if t == "stored":
            salts = getattr(e, "block_salts", None)
            keys = getattr(e, "block_keys", None)
            digests = getattr(e, "block_digests", None)
            events.append(WStored(
                pack(e.block_hashes, "Q"), pack(e.token_ids, "I"), e.block_size, e.parent_block_hash,
                e.lora_id, e.lora_name, e.medium, None if salts is None else pack(salts, "Q"),
                getattr(e, "parent_key", None), None if keys is None else pack(keys, "Q"),
                None if digests is None else pack(digests, "Q")))
        elif t == "removed":
            events.append(WRemoved(pack(e.block_hashes, "Q"), e.medium))
        elif t == "cleared":
            events.append(WCleared(e.medium))
        elif t == "reset":
            events.append(WReset(e.reason))
        elif t == "gone":
            events.append(WGone(e.reason))
        else:
            raise ValueError(f"unknown KV event type {t!r}")
    return WBatch(getattr(batch, "schema_version", SCHEMA_VERSION), batch.pod, batch.model, batch.dp_rank,
                  batch.epoch, batch.seq, batch.ts, events)


def encode(batch: Any) -> bytes:
    """The batch in this encoding (see :func:`to_wire` for what cannot be)."""
    return _encoder.encode(to_wire(batch))


def encode_wire(w: WBatch) -> bytes:
    """A wire struct (:func:`to_wire`'s, possibly changed since) in this encoding."""
    return _encoder.encode(w)


def group(encoded: list[bytes]) -> bytes:
    """One message holding the batches ``encoded`` (each :func:`encode`'s output), in order: the
    bytes are joined under a msgpack header, not re-encoded."""
    n = len(encoded)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return b"".join((b"\x92", _GROUP_HEAD, head, *encoded))


def split(data: bytes) -> list[bytes] | None:
    """The encoded batches of a group message, or None when ``data`` is one batch.
    ``msgspec.DecodeError`` / ``ValidationError`` when it is neither."""
    w = _any_decoder.decode(data)
    if type(w) is WGroupRaw:
        return [bytes(r) for r in w.batches]
    return None


def decode_group(data: bytes) -> list[WBatch]:
    """Every batch of a group message, decoded in one call; ``msgspec.DecodeError`` /
    ``ValidationError`` when the message or any of its batches is not valid."""
    return _group_decoder.decode(data).batches


def is_group(data: bytes) -> bool:
    """Cheap test on the first bytes: a ``["kvg", ...]`` message."""
    return data[:1] == b"\x92" and data[1:1 + len(_GROUP_HEAD)] == _GROUP_HEAD


def decode(data: bytes) -> WBatch:
    """The wire struct; ``msgspec.DecodeError`` / ``ValidationError`` (both ``ValueError``s)
    when ``data`` is not a valid message of this encoding. Array fields are memoryviews into
    ``data`` (no copy); the array lengths are checked by the consumer that maps them."""
    return _decoder.decode(data)


def unpack(view: memoryview | bytes, typecode: str) -> list[int]:
    """Inverse of :func:`pack` (Python ints; consumers on the hot path map the bytes into
    numpy arrays instead). ValueError when the length is not a whole number of items."""
    a = array(typecode)
    if len(view) % a.itemsize:
        raise ValueError(f"{len(view)} bytes are not a whole number of {a.itemsize}-byte integers")
    a.frombytes(view)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def to_dict(w: WBatch) -> dict[str, Any]:
    """The wire struct as the JSON document of the same batch (for full validation, tools and
    humans: ``infernex tail`` prints binary messages this way)."""
    events = []
    for e in w.events:
        t = type(e)
        if t is WStored:
            d: dict[str, Any] = {"type": "stored", "block_hashes": unpack(e.block_hashes, "Q"),
                                 "parent_block_hash": e.parent_block_hash, "token_ids": unpack(e.token_ids, "I"),
                                 "block_size": e.block_size, "lora_id": e.lora_id, "lora_name": e.lora_name,
                                 "medium": e.medium}
            if e.block_salts is not None:
                d["block_salts"] = unpack(e.block_salts, "Q")
            if e.parent_key is not None:
                d["parent_key"] = e.parent_key
            if e.block_keys is not None:
                d["block_keys"] = unpack(e.block_keys, "Q")
            if e.block_digests is not None:
                d["block_digests"] = unpack(e.block_digests, "Q")
        elif t is WRemoved:
            d = {"type": "removed", "block_hashes": unpack(e.block_hashes, "Q"), "medium": e.medium}
        elif t is WCleared:
            d = {"type": "cleared", "medium": e.medium}
        elif t is WReset:
            d = {"type": "reset", "reason": e.reason}
        else:
            d = {"type": "gone", "reason": e.reason}
        events.append(d)
    return {"schema_version": w.schema_version, "pod": w.pod, "model": w.model, "dp_rank": w.dp_rank,
            "epoch": w.epoch, "seq": w.seq, "ts": w.ts, "events": events}


def to_docs(data: bytes) -> list[dict[str, Any]]:
    """Every batch of a binary message (one, or a group's) as its JSON document, in order.
    ``ValueError`` when the message is not valid in this encoding."""
    parts = split(data)
    return [to_dict(decode(p)) for p in parts] if parts is not None else [to_dict(decode(data))]


def headers(pod: str, model: str, epoch: int, seq: int, content_type: str = CONTENT_TYPE) -> dict[str, str]:
    """The NATS headers of one ``kv.events`` message."""
    return {HDR_CONTENT_TYPE: content_type, HDR_POD: pod, HDR_MODEL: model, HDR_EPOCH: str(epoch),
            HDR_SEQ: str(seq)}


def group_headers(pod: str, model: str, epoch: int, first_seq: int, seq: int, n: int) -> dict[str, str]:
    """The headers of a group: the last batch's position (where a restarted bridge continues), the
    first batch's sequence and how many batches it holds."""
    h = headers(pod, model, epoch, seq)
    h[HDR_FIRST_SEQ] = str(first_seq)
    h[HDR_BATCHES] = str(n)
    return h



def positions(headers: dict[str, str] | None) -> list[tuple[str, str, int, int]]:
    """``(pod, model, epoch, seq)`` of each batch a ``kv.events`` message holds, in order, from its
    headers alone (a group's batches are consecutive from :data:`HDR_FIRST_SEQ`); empty when the
    headers do not say (a message published without them, or headers that do not add up). What a
    consumer that refused a message needs to know which positions it leaves empty."""
    h = headers or {}
    try:
        pod, model, epoch, seq = h[HDR_POD], h[HDR_MODEL], int(h[HDR_EPOCH]), int(h[HDR_SEQ])
        first, n = int(h.get(HDR_FIRST_SEQ, seq)), int(h.get(HDR_BATCHES, 1))
    except (KeyError, ValueError):
        return []
    if not (pod and model and 0 <= epoch <= MAX_EPOCH and 0 <= first <= seq <= MAX_SEQ and seq - first + 1 == n):
        return []
    return [(pod, model, epoch, s) for s in range(first, seq + 1)]

# --- the contract as JSON Schema (for the AsyncAPI document) -------------------------------------

def _bin(what: str) -> dict[str, Any]:
    return {"type": "string", "contentEncoding": "binary", "description": f"msgpack bin: {what}"}


_OPT = {"type": ["integer", "null"], "minimum": 0}
_STR_OPT = {"type": ["string", "null"]}

#: the message's JSON Schema: tuple arrays (msgpack arrays) in the field order above
PAYLOAD_SCHEMA: dict[str, Any] = {
    "title": "KvEventBatchBinary",
    "description": "A KvEventBatch in the binary encoding (schemas/kv_binary.py): msgpack arrays, block "
                   "hashes / token ids / salts / keys / digests as packed little-endian uint64 / uint32 in msgpack bin.",
    "type": "array",
    "items": [
        {"const": BATCH_TAG}, {"type": "integer", "minimum": 1, "maximum": SCHEMA_VERSION, "title": "schema_version"},
        {"type": "string", "minLength": 1, "title": "pod"}, {"type": "string", "minLength": 1, "title": "model"},
        {"type": "integer", "minimum": 0, "title": "dp_rank"},
        {"type": "integer", "minimum": 0, "maximum": MAX_EPOCH, "title": "epoch"},
        {"type": "integer", "minimum": 0, "maximum": MAX_SEQ, "title": "seq"},
        {"type": "number", "minimum": 0, "title": "ts"},
        {"type": "array", "title": "events", "items": {"oneOf": [
            {"title": "stored", "type": "array", "items": [
                {"const": "s"}, _bin("block_hashes, uint64 LE, at least one"),
                _bin("token_ids, uint32 LE, len(block_hashes) * block_size of them (none with block_keys "
                     "or block_digests)"),
                {"type": "integer", "minimum": 1, "title": "block_size"}, _OPT, {"type": ["integer", "null"]},
                _STR_OPT, _STR_OPT, _bin("block_salts, uint64 LE, one per block, or nil"), _OPT,
                _bin("block_keys, uint64 LE, one per block, or nil"),
                _bin("block_digests, uint64 LE, one per block (in place of token_ids), or nil; may be absent")]},
            {"title": "removed", "type": "array", "items": [{"const": "r"}, _bin("block_hashes, uint64 LE"),
                                                              _STR_OPT]},
            {"title": "cleared", "type": "array", "items": [{"const": "c"}, _STR_OPT]},
            {"title": "reset", "type": "array", "items": [{"const": "x"}, {"type": "string"}]},
            {"title": "gone", "type": "array", "items": [{"const": "g"}, {"type": "string"}]},
        ]}},
    ],
}

#: a group of batches in one message (the bridge's form when several are ready at once)
GROUP_SCHEMA: dict[str, Any] = {
    "title": "KvEventBatchGroupBinary",
    "description": "Several KvEventBatches of one pod in one message, in order (schemas/kv_binary.py).",
    "type": "array",
    "items": [{"const": GROUP_TAG}, {"type": "array", "minItems": 1,
                                     "items": {"$ref": "#/components/schemas/KvEventBatchBinary"}}],
}

#: the headers every kv.events message carries (the binary ones always; the bridge sets them on JSON too)
HEADERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        HDR_CONTENT_TYPE: {"type": "string", "enum": [CONTENT_TYPE, JSON_CONTENT_TYPE]},
        HDR_POD: {"type": "string"}, HDR_MODEL: {"type": "string"},
        HDR_EPOCH: {"type": "string", "pattern": "^[0-9]+$"}, HDR_SEQ: {"type": "string", "pattern": "^[0-9]+$"},
        HDR_FIRST_SEQ: {"type": "string", "pattern": "^[0-9]+$", "description": "groups: the first batch's seq"},
        HDR_BATCHES: {"type": "string", "pattern": "^[0-9]+$", "description": "groups: how many batches"},
        "Nats-Msg-Id": {"type": "string", "description": "<pod>:<epoch>:<seq> (de-duplication); a group: "
                                                         "<pod>:<first epoch>:<first seq>-<epoch>:<seq>"},
    },
}


__all__ = ["BATCH_TAG", "GROUP_TAG", "HDR_BATCHES", "HDR_FIRST_SEQ", "group", "group_headers", "is_group", "split", "to_docs",
           "CONTENT_TYPE", "GROUP_SCHEMA", "HEADERS_SCHEMA", "PAYLOAD_SCHEMA", "ENCODINGS", "HDR_CONTENT_TYPE", "HDR_EPOCH", "HDR_MODEL", "HDR_POD",
           "HDR_SEQ", "JSON_CONTENT_TYPE", "WBatch", "WCleared", "WEvent", "WGone", "WRemoved", "WReset",
           "WStored", "decode", "encode", "headers", "is_binary", "pack", "to_dict", "to_wire", "unpack"]
