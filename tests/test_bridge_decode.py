"""Golden vLLM KV-event frames decode into the normalized KvEventBatch.

The frames are built here with msgspec structs written after vLLM's
``vllm/distributed/kv_events.py`` (array-encoded, older vLLM) and as tagged maps (current
vLLM), independently of the bridge's own decoder structs.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Union

import msgspec
import pytest

from consumers.kv_bridge import FrameDecoder, FrameError, OutBatch, SequenceTracker, decode_frame
from schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodReset, kv_binary


# --- vLLM's structs, older array-encoded form -------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's default block hash: sha256(pickle((parent or NONE_HASH, tuple(block), None)))."""
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def to_batch(norm, seq=3, epoch=0, pod="pod-a") -> KvEventBatch:
    """The batch the bridge publishes: the compiled decoder's events (wire structs) in the binary
    encoding, the Python path's as JSON; read back as the schema's batch."""
    out = OutBatch(pod, "m", 0 if norm.dp_rank is None else norm.dp_rank, epoch, seq, norm.ts, norm.events)
    if any(type(e) in (kv_binary.WStored, kv_binary.WRemoved) for e in norm.events):
        return KvEventBatch.model_validate(kv_binary.to_docs(kv_binary.encode(out))[0])
    return KvEventBatch.from_json(msgspec.json.encode(out))


def test_array_encoded_golden_frame():
    tokens = list(range(100, 132))
    payload = msgspec.msgpack.encode(VKVEventBatch(1700000000.5, [
        VBlockStored([11, 12], None, tokens, 16, None, "GPU"),
        VBlockRemoved([7, -1], "GPU"),
        VAllBlocksCleared(),
    ], 2))
    assert payload[0] & 0xF0 == 0x90  # really an array on the wire
    b = to_batch(decode_frame(payload))
    assert b.ts == 1700000000.5 and b.dp_rank == 2
    assert b.events == [
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens, block_size=16, medium="GPU"),
        BlockRemoved(block_hashes=[7, (1 << 64) - 1], medium="GPU"),  # signed -1 -> u64
        AllBlocksCleared(),
    ]


def test_array_encoded_without_medium_from_older_vllm():
    # vLLM before "medium" existed: BlockStored has 5 fields, BlockRemoved 1
    payload = msgspec.msgpack.encode([5.0, [["BlockStored", [1], 9, [1, 2], 2, None], ["BlockRemoved", [1]]]])
    b = to_batch(decode_frame(payload))
    assert b.events[0].parent_block_hash == 9 and b.events[0].medium is None
    assert b.events[1].block_hashes == [1]


def test_map_encoded_frame_with_bytes_hashes_matches_independent_hashing():
    tokens = list(range(5000, 5048))
    digests = vllm_hashes(tokens, 16)
    payload = msgspec.msgpack.encode({
        "ts": 12.0, "data_parallel_rank": 0,
        "events": [
            {"type": "BlockStored", "block_hashes": digests, "parent_block_hash": None, "token_ids": tokens,
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None,
             "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": digests[:1], "medium": "GPU"},
        ],
    })
    b = to_batch(decode_frame(payload))
    want = [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in digests]
    assert b.events[0].block_hashes == want
    assert b.events[1].block_hashes == want[:1]


def test_bridge_hashes_match_the_simulator_hasher():
    from simulator.hashing import BlockHasher
    from simulator.kv_publisher import block_stored, encode_batch

    tokens = list(range(64))
    hasher = BlockHasher(block_size=16)
    ext = hasher.external_hashes(tokens)
    b = to_batch(decode_frame(encode_batch([block_stored(ext, None, tokens, 16)], ts=1.0)))
    independent = [int.from_bytes(d[-8:], "big") for d in vllm_hashes(tokens, 16)]
    assert b.events[0].block_hashes == independent == ext


@pytest.mark.parametrize("payload, needle", [
    (b"", "empty"),
    (b"\xc1garbage", "undecodable"),
    (b"\x93\xcb", "undecodable"),  # an array batch cut short
    (msgspec.msgpack.encode([1.0, "not a list"]), "undecodable"),
    (msgspec.msgpack.encode([-1.0, []]), "not a time"),
    (msgspec.msgpack.encode([1.0, [], -3]), "negative"),
])
def test_unreadable_frames_are_rejected_with_a_reason(payload, needle):
    with pytest.raises(FrameError) as exc:
        decode_frame(payload)
    assert needle in str(exc.value)


GOOD = ["BlockStored", [41], None, [1, 2], 2, None, "GPU"]


@pytest.mark.parametrize("bad, reason", [
    (["BlockStored", [1, 2], None, [1, 2, 3], 2, None, None], "token_count"),
    (["BlockStored", [1], None, [1, -2], 2, None, None], "undecodable_event"),
    (["Bogus", 1], "undecodable_event"),
    ({"type": "BlockRemoved", "block_hashes": ["ab"]}, "undecodable_event"),
    (["BlockRemoved", []], "no_block_hashes"),
    (["BlockStored", [5], None, [], 0, None, "CPU"], "no_tokens"),  # an offload placeholder
    (["BlockStored", [1], None, [1, 2], 2, None, "not a tier!"], "bad_medium"),
    (["BlockStored", [1.5], None, [1, 2], 2, None, None], "undecodable_event"),
    ({"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [3, 4],
      "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1}, "other_kv_group"),
])
@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_bad_event_costs_only_itself(bad, reason, compiled):
    """The good events around a bad one are kept, in order; the bad one is counted by reason
    (the compiled decoder hands a frame it refuses to the Python path, which says why)."""
    payload = msgspec.msgpack.encode([1.0, [GOOD, bad, ["BlockRemoved", [41], "GPU"]], 0])
    norm = FrameDecoder(compiled=compiled).decode(payload)
    assert norm.skipped == {reason: 1}
    b = to_batch(norm)
    assert [type(e) for e in b.events] == [BlockStored, BlockRemoved]
    assert b.events[0].block_hashes == [41] and b.events[1].block_hashes == [41]
    assert (norm.blocks_stored, norm.blocks_removed) == (1, 1)


def test_sequence_tracker_gap_restart_and_owed_reset():
    t = SequenceTracker()
    assert t.observe(5).kind == "first"
    assert t.accept(5) is None
    assert t.observe(6).kind == "next"
    t.accept(6)
    d = t.observe(9)
    assert (d.kind, d.replay_from) == ("gap", 7)
    d = t.observe(0)
    assert (d.kind, d.replay_from) == ("restart", None)
    d = t.observe(3)
    assert (d.kind, d.replay_from) == ("restart", 0)
    t.start_epoch()
    assert t.epoch == 1 and t.observe(0).kind == "first"
    assert t.accept(0) == "engine restart"
    assert t.accept(1) is None
    t.lost(2, 4)
    assert t.accept(5) == "lost KV events seq 2..4"


def test_reset_event_is_a_valid_pod_reset():
    norm = decode_frame(msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]]))
    from consumers.kv_bridge import OutReset

    norm.events.insert(0, OutReset("engine restart"))
    b = to_batch(norm, seq=0, epoch=1)
    assert b.events == [PodReset(reason="engine restart"), AllBlocksCleared()]
    assert b.msg_id == "pod-a:1:0"


# --- SGLang's structs (python/sglang/srt/disaggregation/kv_events.py): all arrays, no dp rank ---
class SgEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class SgKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SgBlockStored(SgKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]


class SgBlockRemoved(SgKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SgAllBlocksCleared(SgKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SgKVEventBatch(SgEventBatch):
    events: list[Union[SgBlockStored, SgBlockRemoved, SgAllBlocksCleared]]


def test_sglang_frames_decode():
    toks = list(range(7, 7 + 8))
    payload = msgspec.msgpack.encode(SgKVEventBatch(12.5, [
        SgBlockStored([-5, 6], 4, toks, 4, None), SgBlockRemoved([6]), SgAllBlocksCleared()]))
    norm = decode_frame(payload)
    assert norm.skipped == {} and norm.dp_rank is None and norm.ts == 12.5
    b = to_batch(norm)
    assert b.events[0] == BlockStored(block_hashes=[(1 << 64) - 5, 6], parent_block_hash=4, token_ids=toks,
                                      block_size=4, medium=None)
    assert b.events[1] == BlockRemoved(block_hashes=[6]) and b.events[2] == AllBlocksCleared()
