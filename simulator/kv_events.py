"""vLLM's KV-event structs (``vllm/distributed/kv_events.py``) and their msgpack codecs.

Pure data (msgspec only), shared by the engine core and :mod:`simulator.kv_publisher`.

Events are msgpack maps tagged ``"type": "BlockStored"`` etc.; fields that have a default in
vLLM (``extra_keys``, ``group_idx`` ...) are omitted when unset, while ``lora_id``, ``medium``
and ``lora_name`` have no default there and are always present (maybe nil). How the batch
around them is encoded depends on the vLLM release (:data:`WIRE_FORMATS`, checked against
frames encoded by vLLM's own classes in ``tests/fixtures/vllm/``): vLLM 0.33 sends an array
``[ts, events, dp_rank]`` and answers replay requests with ``[topic, seq, payload]``; older
releases send a map batch and answer ``[seq, payload]``. The oldest releases (and SGLang)
encode everything ``array_like``: ``[ts, [["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium], ...], dp_rank]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"

BlockHash = Union[int, bytes]


# --- current vLLM: maps ------------------------------------------------------------------


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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KvCacheEventT = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[KvCacheEventT]
    data_parallel_rank: int | None = None


class ArrayKVEventBatchOfMaps(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.33's batch: an array around map-encoded events."""

    ts: float
    events: list[KvCacheEventT]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class WireFormat:
    """How one vLLM release puts a ``KVEventBatch`` on the wire."""

    name: str
    batch_array: bool  # the batch is an array (else a map)
    event_array: bool  # the events are arrays (else tagged maps)
    replay_topic: bool  # replay replies are [topic, seq, payload] (else [seq, payload])


WIRE_FORMATS: dict[str, WireFormat] = {
    "0.33": WireFormat("0.33", batch_array=True, event_array=False, replay_topic=True),
    "0.22": WireFormat("0.22", batch_array=False, event_array=False, replay_topic=False),
    "0.11": WireFormat("0.11", batch_array=False, event_array=False, replay_topic=False),
    "array": WireFormat("array", batch_array=True, event_array=True, replay_topic=False),
}
DEFAULT_WIRE_FORMAT = "0.33"


def wire_format(name: str) -> WireFormat:
    try:
        return WIRE_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown vLLM KV-event format {name!r}: use one of {', '.join(WIRE_FORMATS)}") from None


# --- older vLLM: arrays ------------------------------------------------------------------


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-encoded events of older vLLM."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


ArrayKvCacheEventT = Union[ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]


class ArrayKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ArrayKvCacheEventT]
    data_parallel_rank: int | None = None


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
) -> BlockStored:
    """A ``BlockStored`` as vLLM fills it (``medium="GPU"``, no LoRA)."""
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=parent_block_hash, token_ids=token_ids,
        block_size=block_size, lora_id=lora_id, medium=medium, lora_name=lora_name,
    )


def block_removed(block_hashes: list[BlockHash], *, medium: str | None = MEDIUM_GPU) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=medium)


def _to_array(event: KvCacheEventT) -> ArrayKvCacheEventT:
    if isinstance(event, BlockStored):
        return ArrayBlockStored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                event.block_size, event.lora_id, event.medium)
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium)
    if isinstance(event, AllBlocksCleared):
        return ArrayAllBlocksCleared()
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def encode_batch(events: Iterable[KvCacheEventT], *, ts: float, data_parallel_rank: int = 0,
                 array_like: bool = False, fmt: WireFormat | str | None = None) -> bytes:
    """msgpack payload of one ``KVEventBatch`` as vLLM release ``fmt`` encodes it (default
    :data:`DEFAULT_WIRE_FORMAT`; ``array_like=True`` is the all-array format)."""
    if fmt is None:
        fmt = "array" if array_like else DEFAULT_WIRE_FORMAT
    if isinstance(fmt, str):
        fmt = wire_format(fmt)
    if fmt.event_array:
        batch: Any = ArrayKVEventBatch(ts, [_to_array(e) for e in events], data_parallel_rank)
    elif fmt.batch_array:
        batch = ArrayKVEventBatchOfMaps(ts, list(events), data_parallel_rank)
    else:
        batch = KVEventBatch(ts, list(events), data_parallel_rank)
    return msgspec.msgpack.encode(batch)


_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(ArrayKVEventBatch)
_array_of_maps_decoder = msgspec.msgpack.Decoder(ArrayKVEventBatchOfMaps)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode any of the encodings into the map structs (for tests and tools)."""
    first = payload[0] if payload else 0
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # msgpack array
        try:
            a = _array_of_maps_decoder.decode(payload)
            return KVEventBatch(a.ts, a.events, a.data_parallel_rank)
        except msgspec.ValidationError:
            pass
        arr = _array_decoder.decode(payload)
        events: list[KvCacheEventT] = []
        for e in arr.events:
            if isinstance(e, ArrayBlockStored):
                events.append(block_stored(e.block_hashes, e.parent_block_hash, e.token_ids,
                                           e.block_size, lora_id=e.lora_id, medium=e.medium))
            elif isinstance(e, ArrayBlockRemoved):
                events.append(block_removed(e.block_hashes, medium=e.medium))
            else:
                events.append(AllBlocksCleared())
        return KVEventBatch(arr.ts, events, arr.data_parallel_rank)
    return _map_decoder.decode(payload)
