"""vLLM's (and SGLang's) KV-event wire format -> normalized events. Pure decoding, no I/O.

What engines put on the wire (checked against frames encoded by vLLM's own classes, see
``tests/fixtures/vllm/``):

* a ZMQ PUB frame ``(topic, seq as 8-byte big-endian, payload)``; the payload is one msgpack
  ``KVEventBatch(ts, events, data_parallel_rank)``;
* the batch is an array ``[ts, events, dp_rank]`` or a map ``{"ts": ..., "events": ...}``;
* each event is a tagged map (``{"type": "BlockStored", ...}``, current vLLM) or a tagged
  array (``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]``,
  older vLLM and SGLang). vLLM 0.33 sends an array batch of map events.

Every combination decodes. The common one (a batch in the shape the last one had) takes one
typed decode; a batch that does not fit is decoded event by event, so one bad event costs
only itself: it is skipped and counted by reason (:attr:`Normalized.skipped`), and the rest
of its batch goes on. Only a frame whose batch cannot be read at all raises
:class:`FrameError` (the bridge dead-letters it).

Events the index cannot key are skipped and counted, never guessed: offload placeholders
(``token_ids=[]``, ``block_size=0``), blocks of a KV-cache group that is not full attention
(hybrid models: sliding-window and mamba groups hold no full prefix; vLLM >= 0.22 names the
kind on stores, removals follow their group; without a kind only group 0 is indexed), stores whose
``token_ids`` cover more blocks than ``block_hashes`` (vLLM omits the hashes of a hybrid
model's null blocks; counted as ``null_blocks``), and malformed ones. The field order of
array events per release (0.11: up to ``medium``; 0.22 adds ``lora_name, extra_keys,
group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window``) and 0.33's map fields are
pinned by ``tests/test_kv_wire_vllm_fixtures.py``.

``extra_keys`` (vLLM >= 0.11: per block, the multimodal identifiers, LoRA name, cache salt and
prompt-embedding hashes vLLM mixes into its block hash) become one 64-bit salt per block
(:func:`streams.kv_keys.extra_salt`), so two prompts vLLM would not share a block for never
share a key in the index either.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

import msgspec

from consumers import kv_wire_compiled as _compiled
from schemas import SCHEMA_VERSION
from schemas.kv import normalize_medium as _normalize_medium
from schemas.kv_binary import WRemoved, WStored
from streams.kv_keys import extra_salt

U64 = (1 << 64) - 1

TokenId = Annotated[int, msgspec.Meta(ge=0)]
Hash = Union[int, bytes]


# --- wire structs: events as tagged maps (current vLLM) ------------------------------------------

class _MStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Union[Hash, None] = None
    token_ids: list[TokenId] = []
    block_size: int = 0
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    extra_keys: Union[list[Any], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None


class _MRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: Union[str, None] = None
    group_idx: Union[int, None] = None


class _MCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    medium: Union[str, None] = None


_MapEvent = Union[_MStored, _MRemoved, _MCleared]


# --- wire structs: events as tagged arrays (older vLLM, SGLang) ----------------------------------

class _AStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Union[Hash, None]
    token_ids: list[TokenId]
    block_size: int
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    extra_keys: Union[list[Any], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None


class _ARemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[Hash]
    medium: Union[str, None] = None
    group_idx: Union[int, None] = None


class _ACleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    medium: Union[str, None] = None


_ArrEvent = Union[_AStored, _ARemoved, _ACleared]


def _batch_types(name: str, events: Any) -> tuple[type, type]:
    fields_ = [("ts", float), ("events", list[events]), ("data_parallel_rank", Union[int, None], None)]
    return (msgspec.defstruct(f"_{name}ArrBatch", fields_, array_like=True, gc=False),
            msgspec.defstruct(f"_{name}MapBatch", fields_, gc=False))


def _raw_arrays(cls: type) -> type:
    """``cls`` with its block hashes and token ids left as raw msgpack (for the compiled walk)."""
    fields_: list[tuple] = []
    for f in msgspec.structs.fields(cls):
        t = msgspec.Raw if f.name in ("block_hashes", "token_ids") else f.type
        if f.required:
            fields_.append((f.name, t))
        elif f.default_factory is list:  # token_ids=[] by default: an empty msgpack array
            fields_.append((f.name, t, msgspec.Raw(b"\x90")))
        else:
            fields_.append((f.name, t, f.default))
    cfg = cls.__struct_config__
    return msgspec.defstruct(f"{cls.__name__}Raw", fields_, tag=cfg.tag, array_like=cfg.array_like, gc=False)


_MStoredR, _MRemovedR, _AStoredR, _ARemovedR = map(_raw_arrays, (_MStored, _MRemoved, _AStored, _ARemoved))
_STORED = (_MStored, _AStored, _MStoredR, _AStoredR)
_REMOVED = (_MRemoved, _ARemoved, _MRemovedR, _ARemovedR)

_ABM, _MBM = _batch_types("MapEv", _MapEvent)
_ABA, _MBA = _batch_types("ArrEv", _ArrEvent)
_ABR, _MBR = _batch_types("RawEv", msgspec.Raw)
_ABMR, _MBMR = _batch_types("MapEvRaw", Union[_MStoredR, _MRemovedR, _MCleared])
_ABAR, _MBAR = _batch_types("ArrEvRaw", Union[_AStoredR, _ARemovedR, _ACleared])

# (batch is an array, events are maps) -> decoder; vLLM 0.33 is (True, True)
_TYPED = {(True, True): msgspec.msgpack.Decoder(_ABM), (False, True): msgspec.msgpack.Decoder(_MBM),
          (True, False): msgspec.msgpack.Decoder(_ABA), (False, False): msgspec.msgpack.Decoder(_MBA)}
_RAW = {True: msgspec.msgpack.Decoder(_ABR), False: msgspec.msgpack.Decoder(_MBR)}
# the same with block hashes and token ids as raw msgpack, for the compiled walk
_TYPED_RAW = {(True, True): msgspec.msgpack.Decoder(_ABMR), (False, True): msgspec.msgpack.Decoder(_MBMR),
              (True, False): msgspec.msgpack.Decoder(_ABAR), (False, False): msgspec.msgpack.Decoder(_MBAR)}
_EVENT = {True: msgspec.msgpack.Decoder(_MapEvent), False: msgspec.msgpack.Decoder(_ArrEvent)}


# --- normalized output structs (the JSON of schemas.KvEventBatch) --------------------------------

class OutStored(msgspec.Struct, gc=False):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    lora_name: Union[str, None]
    medium: Union[str, None]
    block_salts: Union[list[int], None] = None
    type: str = "stored"


class OutRemoved(msgspec.Struct, gc=False):
    block_hashes: list[int]
    medium: Union[str, None]
    type: str = "removed"


class OutCleared(msgspec.Struct, gc=False):
    medium: Union[str, None]
    type: str = "cleared"


class OutReset(msgspec.Struct, gc=False):
    reason: str
    type: str = "reset"


class OutBatch(msgspec.Struct, gc=False):
    pod: str
    model: str
    dp_rank: int
    epoch: int
    seq: int
    ts: float
    events: list[Any]
    schema_version: int = SCHEMA_VERSION


class FrameError(ValueError):
    """A frame that cannot become a KvEventBatch; the message is the dead-letter reason."""


class _Skip(Exception):
    """One event the index cannot use; the message is its reason (a counter label)."""


@dataclass(slots=True)
class Normalized:
    events: list[Any]
    ts: float
    dp_rank: int | None
    blocks_stored: int
    blocks_removed: int
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> events skipped


def _hashes(values: list) -> list[int]:
    if not values:
        raise _Skip("no_block_hashes")
    try:
        if min(values) >= 0 and max(values) <= U64:  # all ints in range: the common case, no copy
            return values
    except TypeError:  # bytes digests (or a mix)
        pass
    return [_hash(v) for v in values]


def _hash(v: int | bytes) -> int:
    if isinstance(v, bytes):
        if not v:
            raise _Skip("empty_hash")
        return int.from_bytes(v[-8:], "big")
    if v < -(1 << 63) or v > U64:
        raise _Skip("hash_out_of_range")
    return v & U64


_MEDIUMS: dict[str | None, str | None] = {}


def normalize_medium(value: str | None) -> str | None:
    """:func:`schemas.kv.normalize_medium`, remembered (an engine names a handful of tiers)."""
    try:
        return _MEDIUMS[value]
    except KeyError:
        up = _normalize_medium(value)  # ValueError: not remembered
        if len(_MEDIUMS) < 256:
            _MEDIUMS[value] = up
        return up


# KV-cache group kinds (vLLM's KVCacheSpecKind) whose blocks hold a request's whole prefix
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def _group_skip(e: Any, groups: dict[int, bool]) -> str | None:
    """Why an event of a KV-cache group must not be indexed, or None.

    vLLM >= 0.22 tags stores with ``group_idx`` and ``kv_cache_spec_kind`` and removals with
    ``group_idx`` only ("consumers classify groups as they are learned"): groups of a full
    attention kind are indexed (their blocks hold the whole prefix), sliding-window, mamba
    and other partial groups are not, and a removal follows what its group's stores taught
    (``groups``: group -> is full). Without a kind, group 0 (or none) is indexed."""
    g = e.group_idx
    kind = getattr(e, "kv_cache_spec_kind", None)
    if kind is not None and g is not None:
        full = kind.lower() in FULL_KINDS
        groups[g] = full
        return None if full else "partial_kv_group"
    if g is None or g == 0:
        return None if groups.get(0, True) else "partial_kv_group"
    known = groups.get(g)
    if known is None:
        return "other_kv_group"
    return None if known else "partial_kv_group"


def _salts(extra: list | None, n: int, lora_name: str | None) -> list[int] | None:
    if not extra:
        return None
    if len(extra) != n:
        raise _Skip("extra_keys_length")
    out = [extra_salt(x, lora_name) for x in extra]
    return out if any(out) else None


def _convert(e: Any, out: list, counts: list[int], groups: dict[int, bool], hashes: Any = None,
             toks: Any = None) -> None:
    """Append the normalized form of one wire event (raises :class:`_Skip`). ``hashes`` / ``toks``:
    its block hashes and token ids already decoded (the compiled walk: typed memoryviews), and
    then the event is appended as the bus's binary wire struct; else the event's own lists are
    used."""
    wire = hashes is not None
    cls = type(e)
    if cls in _STORED:
        why = _group_skip(e, groups)
        if why is not None:
            raise _Skip(why)
        bs = e.block_size
        if toks is None:
            toks = e.token_ids
        if bs <= 0 or not len(toks):
            raise _Skip("no_tokens")  # offload placeholders: nothing to key them by
        if hashes is None:
            hashes = _hashes(e.block_hashes)
        elif not len(hashes):
            raise _Skip("no_block_hashes")
        n_tok = len(toks)
        if n_tok != len(hashes) * bs:
            if n_tok % bs == 0 and n_tok // bs > len(hashes):
                # hybrid models: vLLM leaves the hashes of null (or masked) blocks out while
                # token_ids still cover the whole range, so which tokens a hash covers is unknown
                raise _Skip("null_blocks")
            raise _Skip("token_count")
        parent = e.parent_block_hash
        if parent is not None and not (type(parent) is int and 0 <= parent <= U64):
            parent = _hash(parent)
        try:
            medium = normalize_medium(e.medium)
        except ValueError:
            raise _Skip("bad_medium") from None
        salts = _salts(e.extra_keys, len(hashes), e.lora_name)
        if wire:
            out.append(WStored(hashes, toks, bs, parent, e.lora_id, e.lora_name, medium,
                               None if salts is None else memoryview(array("Q", salts))))
        else:
            out.append(OutStored(hashes, parent, toks, bs, e.lora_id, e.lora_name, medium, salts))
        counts[0] += len(hashes)
    elif cls in _REMOVED:
        why = _group_skip(e, groups)
        if why is not None:
            raise _Skip(why)
        if hashes is None:
            hashes = _hashes(e.block_hashes)
        elif not len(hashes):
            raise _Skip("no_block_hashes")
        try:
            medium = normalize_medium(e.medium)
        except ValueError:
            raise _Skip("bad_medium") from None
        out.append(WRemoved(hashes, medium) if wire else OutRemoved(hashes, medium))
        counts[1] += len(hashes)
    else:
        try:
            medium = normalize_medium(e.medium)
        except ValueError:
            raise _Skip("bad_medium") from None
        out.append(OutCleared(medium))


def _is_array(b: int) -> bool:
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


class FrameDecoder:
    """Decodes payloads; remembers the event shape of the last good batch (engines do not
    change it) so the common frame takes exactly one typed decode."""

    __slots__ = ("map_events", "groups", "compiled", "arrays")

    def __init__(self, *, compiled: bool = False) -> None:
        """``compiled``: block hashes and token ids are decoded by :mod:`consumers.kv_wire_compiled`
        (when numba is installed) and stores and removals come out as the bus's binary wire structs
        (:class:`schemas.kv_binary.WStored` / ``WRemoved``, arrays as typed memoryviews), ready to
        encode; otherwise as ``OutStored`` / ``OutRemoved`` with lists. Same events either way."""
        self.map_events = True  # current vLLM
        self.groups: dict[int, bool] = {}  # KV-cache group -> holds full prefixes (learned from stores)
        self.compiled = compiled and _compiled.AVAILABLE
        self.arrays = _compiled.Arrays() if self.compiled else None

    def decode(self, payload: bytes) -> Normalized:
        if not payload:
            raise FrameError("empty payload")
        arr = _is_array(payload[0])
        if not arr and not (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF)):
            raise FrameError(f"undecodable KVEventBatch: not a msgpack array or map (first byte 0x{payload[0]:02x})")
        if self.compiled:
            got = self._decode_compiled(payload, arr)
            if got is not None:
                return got
        batch = self._typed(_TYPED, payload, arr)
        skipped: dict[str, int] = {}
        out: list[Any] = []
        counts = [0, 0]
        groups = self.groups
        if batch is not None:
            events = batch.events
            for e in events:
                try:
                    _convert(e, out, counts, groups)
                except _Skip as s:
                    skipped[str(s)] = skipped.get(str(s), 0) + 1
        else:  # some event does not fit: read the batch with raw events, then each event alone
            try:
                batch = _RAW[arr].decode(payload)
            except msgspec.DecodeError as exc:
                raise FrameError(f"undecodable {'array' if arr else 'map'}-encoded KVEventBatch: {exc}") from None
            for raw in batch.events:
                buf = bytes(raw)
                if not buf:
                    skipped["undecodable_event"] = skipped.get("undecodable_event", 0) + 1
                    continue
                try:
                    e = _EVENT[not _is_array(buf[0])].decode(buf)
                    _convert(e, out, counts, groups)
                except msgspec.DecodeError:
                    skipped["undecodable_event"] = skipped.get("undecodable_event", 0) + 1
                except _Skip as s:
                    skipped[str(s)] = skipped.get(str(s), 0) + 1
        return _normalized(batch, out, counts, skipped)

    def _typed(self, decoders: dict, payload: bytes, arr: bool) -> Any:
        """The batch by the typed decoder of the event shape the last batch had, else the other
        shape's (remembered); None when neither fits."""
        for maps in (self.map_events, not self.map_events):
            try:
                batch = decoders[(arr, maps)].decode(payload)
            except msgspec.DecodeError:
                continue
            self.map_events = maps
            return batch
        return None

    def _decode_compiled(self, payload: bytes, arr: bool) -> Normalized | None:
        """The frame with its integer arrays walked by the compiled kernel, or None when it does not
        fit a typed shape or one of its arrays is refused (the Python path then decides, per event)."""
        batch = self._typed(_TYPED_RAW, payload, arr)
        if batch is None:
            return None
        raws, kinds = _compiled.raw_arrays(batch.events, _STORED, _REMOVED)
        if raws:
            got = self.arrays.parse(raws, kinds)
            if got is None:
                return None
            h64, t32, lens = got
        i = o64 = o32 = 0
        skipped: dict[str, int] = {}
        out: list[Any] = []
        counts = [0, 0]
        groups = self.groups
        for e in batch.events:
            cls = type(e)
            hashes = toks = None
            if cls in _STORED:
                nh, nt = lens[i], lens[i + 1]
                i += 2
                hashes, toks = h64[o64:o64 + nh], t32[o32:o32 + nt]
                o64 += nh
                o32 += nt
            elif cls in _REMOVED:
                nh = lens[i]
                i += 1
                hashes = h64[o64:o64 + nh]
                o64 += nh
            try:
                _convert(e, out, counts, groups, hashes, toks)
            except _Skip as s:
                skipped[str(s)] = skipped.get(str(s), 0) + 1
        return _normalized(batch, out, counts, skipped)


def _normalized(batch: Any, out: list, counts: list[int], skipped: dict[str, int]) -> Normalized:
    ts = batch.ts
    if not ts >= 0:  # also rejects NaN
        raise FrameError(f"batch ts {ts} is not a time")
    dp = batch.data_parallel_rank
    if dp is not None and dp < 0:
        raise FrameError(f"data_parallel_rank {dp} is negative")
    return Normalized(out, ts, dp, counts[0], counts[1], skipped)


_default = FrameDecoder()


def decode_frame(payload: bytes) -> Normalized:
    """One ``KVEventBatch`` payload -> normalized events; :class:`FrameError` if unreadable.

    Stateless about KV-cache groups (what one engine's stores taught never judges another
    engine's removals): a consumer of one engine's stream keeps its own :class:`FrameDecoder`."""
    _default.groups.clear()
    return _default.decode(payload)


__all__ = ["FrameDecoder", "FrameError", "Normalized", "OutBatch", "OutCleared", "OutRemoved", "OutReset",
           "OutStored", "decode_frame"]
