"""vLLM's KV-event structs (``vllm/distributed/kv_events.py``) and their msgpack codecs.

Pure data (msgspec only), shared by the engine core and :mod:`simulator.kv_publisher`.

Current vLLM encodes ``KVEventBatch(ts, events, data_parallel_rank)`` and its events as
msgpack maps, events tagged ``"type": "BlockStored"`` etc.; fields that have a default in
vLLM (``extra_keys``, ``group_idx`` ...) are omitted when unset, while ``lora_id``, ``medium``
and ``lora_name`` have no default there and are always present (maybe nil). Older vLLM
encodes everything ``array_like``: ``[ts, [["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium], ...], dp_rank]``.
"""

from __future__ import annotations

from collections.abc import Iterable
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
                 array_like: bool = False) -> bytes:
    """msgpack payload of one ``KVEventBatch`` (map-encoded, or array-encoded if asked)."""
    if array_like:
        batch: Any = ArrayKVEventBatch(ts, [_to_array(e) for e in events], data_parallel_rank)
    else:
        batch = KVEventBatch(ts, list(events), data_parallel_rank)
    return msgspec.msgpack.encode(batch)


_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(ArrayKVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode either encoding into the map structs (for tests and tools)."""
    first = payload[0] if payload else 0
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # msgpack array: older vLLM
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
