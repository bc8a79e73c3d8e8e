"""KV-event batch decoding (msgspec fast path) and the index snapshot format (packed msgpack).

Pure: no I/O. :func:`decode_batch` turns one ``kv.events`` message, in either of its encodings
(JSON, or the binary form of :mod:`schemas.kv_binary`, told apart by the first byte), into a
:class:`schemas.KvEventBatch`; :func:`encode_dump` / :func:`decode_snapshot` write and read
a :meth:`streams.kv_index.KvIndex.dump` as a snapshot.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated, Any

import msgpack
import msgspec
import numpy as np

from consumers.kv_wire_compiled import raw_arrays
from schemas import KvEventBatch, ValidationFailure, decode_event
from schemas import kv_binary
from schemas.base import SCHEMA_VERSION
from schemas.kv import MAX_EPOCH, MAX_SEQ, U64, AllBlocksCleared, BlockRemoved, BlockStored, PodGone, PodReset
from streams.kv_core import parse_uint_arrays
from streams.kv_index import KvIndex

SNAPSHOT_FORMAT = 5  # 5: keys chain block digests (streams.kv_core, streams.kv_keys.KEY_SCHEME 2); 4 chained tokens directly
_LITTLE = sys.byteorder == "little"


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
                    block_keys=_le_array(r[2]), block_digests=None, block_salts=None))
            elif r[0] == "g":
                events.append(PodGone())
            else:
                raise ValueError(f"unknown snapshot row {r[0]!r}")
        batches.append(_mk_batch(schema_version=1, pod=pod, model=model, dp_rank=0, epoch=epoch, seq=seq, ts=ts,
                                 events=events))
    return int(doc["stream_seq"]), float(doc["created"]), batches

# --------------------------------------------------------------------------- fast decoding
#
# Validating a batch with pydantic costs about twice what applying it does, so the consumer
# first decodes with msgspec into mirror structs, checks the same constraints cheaply, and builds
# the schema objects with ``model_construct``. Anything the fast path does not accept exactly
# (hashes given as bytes or hex, a failed check, an unknown field) goes through
# :func:`schemas.decode_event`, which accepts it or names the offending field.




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
_Epoch = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]
_Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]
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
        ("block_keys", list[_Hash] | None, None), ("block_digests", list[_Hash] | None, None),
        ("block_salts", list[_Hash] | None, None)],
        tag="stored", **opts)
    removed = msgspec.defstruct(f"_{name}Removed", [("block_hashes", hashes), ("medium", _Medium | None, None)],
                                tag="removed", **opts)
    batch = msgspec.defstruct(f"_{name}Batch", [
        ("pod", _Name), ("model", _Name), ("seq", _Seq), ("ts", Annotated[float, msgspec.Meta(ge=0)]),
        ("events", list[stored | removed | _FCleared | _FReset | _FGone]),
        ("schema_version", Annotated[int, msgspec.Meta(gt=0, le=SCHEMA_VERSION)], SCHEMA_VERSION),
        ("dp_rank", _NonNeg, 0), ("epoch", _Epoch, 0)], forbid_unknown_fields=True)
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


_U64_LE = np.dtype("<u8")
_U32_LE = np.dtype("<u4")


class BinaryError(ValueError):
    """A binary ``kv.events`` message that is not a valid batch; the message is the reason."""


def _view(view: memoryview, fmt: str, what: str) -> memoryview:
    try:
        return view.cast(fmt)
    except TypeError:
        raise BinaryError(f"{what} is {len(view)} bytes, not a whole number of "
                          f"{'uint64' if fmt == 'Q' else 'uint32'}s") from None


_MEDIUMS: set[str] = set()  # tier names already checked (an engine names a handful)


def _medium(name: str | None, i: int) -> None:
    if name is None or name in _MEDIUMS:
        return
    if not kv_binary.MEDIUM_RE.match(name):
        raise BinaryError(f"events.{i}.medium {name[:40]!r} is not a tier name ([A-Z][A-Z0-9_]{{0,31}})")
    if len(_MEDIUMS) < 1024:
        _MEDIUMS.add(name)


def wire_batch(data: bytes) -> kv_binary.WBatch:
    """A binary (:mod:`schemas.kv_binary`) message checked as the schema would check it, and left
    as the wire struct: hashes, keys and salts as ``"Q"`` memoryviews, token ids as an ``"I"`` one,
    all over ``data`` (no copy, no object per event beyond the struct). On a little-endian host the
    fold takes it as it is (:meth:`streams.kv_index.KvIndex.apply_many`; the views are native);
    :class:`BinaryError` naming what is wrong.""" 
    try:
        w = kv_binary.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BinaryError(f"undecodable binary KV batch: {exc}") from None
    return _checked(w)


def fold_group(data: bytes) -> list[kv_binary.WBatch] | None:
    """A binary group message as its checked wire structs (:func:`wire_batch`'s checks, one decode
    for the whole group, little-endian hosts), or None when it is not one or any batch in it is
    invalid: then its batches go one by one (:func:`message_parts`), and only the bad one is refused."""
    if not _LITTLE or not kv_binary.is_group(data):
        return None
    try:
        return [_checked(w) for w in kv_binary.decode_group(data)]
    except (msgspec.DecodeError, msgspec.ValidationError, BinaryError):
        return None


def _checked(w: kv_binary.WBatch) -> kv_binary.WBatch:
    """The schema's checks on a decoded wire batch; its arrays become typed views (in place).
    (The views are cast directly and a failed cast is named by :func:`_view`'s message: an error
    text formatted for every field would cost more than the rest of these checks.)"""
    stored, removed = kv_binary.WStored, kv_binary.WRemoved
    for i, e in enumerate(w.events):
        t = type(e)
        if t is not stored and t is not removed:
            if t is not kv_binary.WReset and t is not kv_binary.WGone:
                _medium(e.medium, i)
            continue
        m = e.medium
        if m is not None and m not in _MEDIUMS:
            _medium(m, i)
        try:
            e.block_hashes = hashes = e.block_hashes.cast("Q")
            if t is stored:
                e.token_ids = toks = e.token_ids.cast("I")
                keys, dg, salts = e.block_keys, e.block_digests, e.block_salts
                if keys is not None:
                    e.block_keys = keys = keys.cast("Q")
                elif dg is not None:
                    e.block_digests = dg = dg.cast("Q")
                if salts is not None:
                    e.block_salts = salts = salts.cast("Q")
        except TypeError:
            _recast(e, i, ("block_hashes", "Q"), ("token_ids", "I"), ("block_keys", "Q"), ("block_digests", "Q"),
                    ("block_salts", "Q"))
            raise  # (not reached: _recast names the field)
        nh = len(hashes)
        if not nh:
            raise BinaryError(f"events.{i}.block_hashes is empty")
        if t is removed:
            continue
        if keys is not None:
            if len(keys) != nh or len(toks) or 0 in keys or dg is not None:
                raise BinaryError(f"events.{i}: block_keys must give one non-zero key per block, and no "
                                  f"token_ids or block_digests")
        elif dg is not None:
            if len(dg) != nh or len(toks):
                raise BinaryError(f"events.{i}: block_digests must give one digest per block and no token_ids")
        elif len(toks) != nh * e.block_size:
            raise BinaryError(f"events.{i}.token_ids has {len(toks)} tokens but {nh} blocks of block_size "
                              f"{e.block_size} need {nh * e.block_size}")
        if salts is not None and len(salts) != nh:
            raise BinaryError(f"events.{i}.block_salts has {len(salts)} salts for {nh} blocks")
    return w


def _recast(e, i: int, *fields: tuple[str, str]) -> None:
    """Raise :func:`_view`'s error for the first of ``fields`` of event ``i`` that is not whole."""
    for name, fmt in fields:
        v = getattr(e, name, None)
        if v is not None and v.format == "B":  # (not cast yet)
            _view(v, fmt, f"events.{i}.{name}")


def _array(view: memoryview | None, dtype: np.dtype) -> np.ndarray | None:
    return None if view is None else np.frombuffer(view, dtype=dtype)


def binary_batch(data: bytes) -> KvEventBatch:
    """A binary (:mod:`schemas.kv_binary`) message as a batch whose hashes, token ids, salts and
    keys are numpy arrays over ``data`` (no copy, no Python int per value); :class:`BinaryError`
    naming what is wrong otherwise. The checks are the schema's (:func:`wire_batch`)."""
    w = wire_batch(data)  # (lengths and non-zero keys do not depend on byte order; the arrays below are read LE)
    events: list = []
    for e in w.events:
        t = type(e)
        if t is kv_binary.WStored:
            events.append(_mk_stored(
                type="stored", block_hashes=np.frombuffer(e.block_hashes, dtype=_U64_LE), parent_block_hash=e.parent_block_hash,
                token_ids=np.frombuffer(e.token_ids, dtype=_U32_LE), block_size=e.block_size, lora_id=e.lora_id,
                lora_name=e.lora_name, medium=e.medium, parent_key=e.parent_key,
                block_keys=_array(e.block_keys, _U64_LE), block_digests=_array(e.block_digests, _U64_LE),
                block_salts=_array(e.block_salts, _U64_LE)))
        elif t is kv_binary.WRemoved:
            events.append(_mk_removed(type="removed", block_hashes=np.frombuffer(e.block_hashes, dtype=_U64_LE),
                                      medium=e.medium))
        elif t is kv_binary.WCleared:
            events.append(AllBlocksCleared.model_construct(type="cleared", medium=e.medium))
        elif t is kv_binary.WReset:
            events.append(PodReset.model_construct(type="reset", reason=e.reason))
        else:
            events.append(PodGone.model_construct(type="gone", reason=e.reason))
    return _mk_batch(schema_version=w.schema_version, pod=w.pod, model=w.model, dp_rank=w.dp_rank, epoch=w.epoch,
                     seq=w.seq, ts=w.ts, events=events)


def _fast_batch(data: bytes) -> KvEventBatch | None:
    """The batch, or None when only the full pydantic validation can decide (or, for a binary
    message, when it is invalid: :func:`decode_slow` names why)."""
    if kv_binary.is_binary(data):
        try:
            return binary_batch(data)
        except BinaryError:
            return None
    raw = len(data) >= RAW_PARSE_MIN_BYTES
    try:
        b = (_raw_decoder if raw else _list_decoder).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    stored_t, removed_t = (_RStored, _RRemoved) if raw else (_LStored, _LRemoved)
    if raw:
        raws, to32 = raw_arrays(b.events, (stored_t,), (removed_t,))
        if raws:
            bad, v64, v32, counts = parse_uint_arrays(np.frombuffer(b"".join(raws), dtype=np.uint8),
                                                      np.frombuffer(to32, dtype=np.uint8))
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
                if (len(e.block_keys) != nh or nt or min(e.block_keys) == 0 or max(e.block_keys) > U64
                        or e.block_digests is not None):
                    return None
            elif e.block_digests is not None:
                if len(e.block_digests) != nh or nt or max(e.block_digests) > U64:
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
                block_digests=e.block_digests, block_salts=salts))
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


def fold_batch(data: bytes) -> Any:
    """What :meth:`streams.kv_index.KvIndex.apply_many` takes, decoded the cheapest way: a binary
    message's checked wire struct (on little-endian hosts, :func:`wire_batch`), else as
    :func:`_fast_batch`. None when only :func:`decode_slow` can decide (and name the reason)."""
    if _LITTLE and kv_binary.is_binary(data):
        try:
            return wire_batch(data)
        except BinaryError:
            return None
    return _fast_batch(data)


def decode_slow(data: bytes) -> KvEventBatch:
    """The careful decode, after :func:`_fast_batch` declined: pydantic for JSON (it accepts
    every form the schema does, or names the offending field), the binary decode for binary
    (whose only reason to decline is an invalid message). :class:`schemas.ValidationFailure`."""
    if kv_binary.is_binary(data):
        try:
            return binary_batch(data)
        except BinaryError as exc:
            raise ValidationFailure("KvEventBatch", [{"loc": ("binary",), "msg": str(exc)}]) from None
    return decode_event(KvEventBatch, data)


def message_parts(data: bytes) -> list[bytes]:
    """The batches one ``kv.events`` message holds, each still encoded (a binary group holds
    several; every other message is one). Each part decodes, or is refused, on its own.
    :class:`schemas.ValidationFailure` when a group's own frame is broken."""
    if not kv_binary.is_group(data):
        return [data]
    try:
        parts = kv_binary.split(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValidationFailure("KvEventBatch", [{"loc": ("group",), "msg": f"undecodable batch group: {exc}"}]) \
            from None
    return parts if parts is not None else [data]


def decode_batch(data: bytes) -> KvEventBatch:
    """Decode one ``kv.events`` message (JSON or binary); raise :class:`schemas.ValidationFailure`
    when invalid."""
    batch = _fast_batch(data)
    return batch if batch is not None else decode_slow(data)


def to_json(data: bytes) -> bytes:
    """A ``kv.events`` message as the batch's JSON (binary ones converted, JSON as it is): for
    tools that show or export messages to humans. :class:`schemas.ValidationFailure` if invalid."""
    if not kv_binary.is_binary(data):
        return data
    b = decode_batch(data)
    return msgspec.json.encode({
        "schema_version": b.schema_version, "pod": b.pod, "model": b.model, "dp_rank": b.dp_rank, "epoch": b.epoch,
        "seq": b.seq, "ts": b.ts, "events": [_event_doc(e) for e in b.events]})


def _event_doc(e) -> dict:
    d = {k: v for k, v in e.__dict__.items() if v is not None}
    for k, v in d.items():
        if isinstance(v, np.ndarray):
            d[k] = v.tolist()
    return d

