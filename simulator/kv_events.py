"""vLLM's KV-event structs (``vllm/distributed/kv_events.py``) and their msgpack codecs.

Pure data (msgspec only), shared by the engine core and :mod:`simulator.kv_publisher`.

Every release sends an array batch ``[ts, events, data_parallel_rank]`` (always three elements:
msgspec does not omit defaults of ``array_like`` structs, so a None rank is nil). How the events inside are encoded depends on the release (:data:`WIRE_FORMATS`, checked
byte for byte against frames encoded by vLLM's own classes in ``tests/fixtures/vllm/``):

* 0.33: tagged maps ``{"type": "BlockStored", ...}``; fields with a default in vLLM
  (``extra_keys``, ``group_idx`` ...) are omitted when unset, ``lora_id``, ``medium`` and
  ``lora_name`` have none and are always present (maybe nil); replay replies are
  ``[topic, seq, payload]`` and the end marker has an empty topic slot;
* 0.22: tagged arrays ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``
  (all twelve, defaults as nil); replay replies ``[seq, payload]``;
* 0.11 (also ``array``, the shape SGLang's structs share): tagged arrays up to ``medium``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

BlockHash = Union[int, bytes]


# --- vLLM 0.33: maps (the simulator's event objects) -------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV-cache events (tagged by class name under ``type``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KvCacheEventT = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch every release sends: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[KvCacheEventT]
    data_parallel_rank: int | None = None


ArrayKVEventBatchOfMaps = KVEventBatch  # (old name)


# --- vLLM 0.22: arrays with the group / cache-spec fields --------------------------------


class _Array22Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class Array22BlockStored(_Array22Event, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class Array22BlockRemoved(_Array22Event, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class Array22AllBlocksCleared(_Array22Event, tag="AllBlocksCleared"):
    pass


class Array22KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[Array22BlockStored, Array22BlockRemoved, Array22AllBlocksCleared]]
    data_parallel_rank: int | None = None


# --- vLLM 0.11 (and SGLang's shape): arrays up to medium ---------------------------------


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-encoded events of vLLM 0.11."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


ArrayKvCacheEventT = Union[ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]


class ArrayKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ArrayKvCacheEventT]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class WireFormat:
    """How one vLLM release puts a ``KVEventBatch`` on the wire (the batch is always an array)."""

    name: str
    events: str  # "map" (0.33), "array22" (0.22), "array11" (0.11)
    replay_topic: bool  # replay replies are [topic, seq, payload] (else [seq, payload])

    @property
    def event_array(self) -> bool:
        return self.events != "map"


WIRE_FORMATS: dict[str, WireFormat] = {
    "0.33": WireFormat("0.33", events="map", replay_topic=True),
    "0.22": WireFormat("0.22", events="array22", replay_topic=False),
    "0.11": WireFormat("0.11", events="array11", replay_topic=False),
    "array": WireFormat("array", events="array11", replay_topic=False),
}
DEFAULT_WIRE_FORMAT = "0.33"


def wire_format(name: str) -> WireFormat:
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown vLLM KV-event format {name!r}: use one of {', '.join(WIRE_FORMATS)}") from None


# --- constructors and codecs -------------------------------------------------------------


def block_stored(
    block_hashes: list[BlockHash],
    parent_block_hash: BlockHash | None,
    token_ids: list[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    medium: str | None = MEDIUM_GPU,
    **optional: Any,
) -> BlockStored:
    """A ``BlockStored`` as vLLM fills it (``medium="GPU"``, no LoRA); ``optional`` are the
    fields with a default (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` ...)."""
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=parent_block_hash, token_ids=token_ids,
        block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name, **optional,
    )


def block_removed(block_hashes: list[BlockHash], *, medium: str | None = MEDIUM_GPU, **optional: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=medium, **optional)


def _to_array11(event: KvCacheEventT) -> ArrayKvCacheEventT:
    if isinstance(event, BlockStored):
        return ArrayBlockStored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                event.block_size, event.lora_id, event.medium)
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, AllBlocksCleared):
        return ArrayAllBlocksCleared()
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def _to_array22(event: KvCacheEventT) -> Any:
    if isinstance(event, BlockStored):
        return Array22BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                  event.lora_id, event.medium, event.lora_name, event.extra_keys, event.group_idx,
                                  event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
    if isinstance(event, BlockRemoved):
        return Array22BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    if isinstance(event, AllBlocksCleared):
        return Array22AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: Iterable[KvCacheEventT], *, ts: float, data_parallel_rank: int | None = 0,
                 array_like: bool = False, fmt: WireFormat | str | None = None) -> bytes:
    """msgpack payload of one ``KVEventBatch`` as vLLM release ``fmt`` encodes it (default
    :data:`DEFAULT_WIRE_FORMAT`; ``array_like=True`` is the all-array 0.11 format)."""
    if fmt is None:
        fmt = "array" if array_like else DEFAULT_WIRE_FORMAT
    if isinstance(fmt, str):
        fmt = wire_format(fmt)
    if fmt.events == "array11":
        batch: Any = ArrayKVEventBatch(ts, [_to_array11(e) for e in events], data_parallel_rank)
    elif fmt.events == "array22":
        batch = Array22KVEventBatch(ts, [_to_array22(e) for e in events], data_parallel_rank)
    else:
        batch = KVEventBatch(ts, list(events), data_parallel_rank)
    return _encoder.encode(batch)


_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array22_decoder = msgspec.msgpack.Decoder(Array22KVEventBatch)
_array11_decoder = msgspec.msgpack.Decoder(ArrayKVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode any release's encoding into the 0.33 structs (for tests and tools)."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        pass
    try:
        arr = _array22_decoder.decode(payload)
    except msgspec.ValidationError:
        arr = _array11_decoder.decode(payload)  # 0.11's shorter arrays
    events: list[KvCacheEventT] = []
    for e in arr.events:
        if isinstance(e, ArrayBlockStored):
            events.append(block_stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                       lora_id=e.lora_id, medium=e.medium))
        elif isinstance(e, ArrayBlockRemoved):
            events.append(block_removed(e.block_hashes, medium=e.medium))
        elif isinstance(e, Array22BlockStored):
            events.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                                      e.medium, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                                      e.kv_cache_spec_sliding_window))
        elif isinstance(e, Array22BlockRemoved):
            events.append(BlockRemoved(e.block_hashes, e.medium, e.group_idx))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(arr.ts, events, arr.data_parallel_rank)
