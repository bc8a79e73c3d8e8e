"""The simulator is checked against vLLM itself (tests/fixtures/vllm, made by vLLM 0.11.2 /
0.22.1 / 0.33.0's own classes): its KV-event encoding is byte for byte vLLM's, its replay
replies are the frames vLLM's publisher sent, and its block hashes (sha256, sha256_cbor,
xxhash, xxhash_cbor, with LoRA / multimodal / cache_salt extra keys) are vLLM's."""

from __future__ import annotations

import pytest
import zmq

from simulator.hashing import BlockHasher, event_extra_keys, request_extra_keys, to_external
from simulator.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch
from simulator.kv_publisher import KvEventPublisher
from fixtures import vllm as fx

FMT = {"0.11.2": "0.11", "0.22.1": "0.22", "0.33.0": "0.33"}


def _events(expected: dict):
    out = []
    for e in expected["events"]:
        kw = {k: v for k, v in e.items() if k != "type"}
        if e["type"] == "BlockStored":
            kw.setdefault("lora_name", None)
            if kw.get("extra_keys"):
                kw["extra_keys"] = [None if x is None else tuple(tuple(i) if isinstance(i, list) else i for i in x)
                                    for x in kw["extra_keys"]]
            out.append(BlockStored(**kw))
        elif e["type"] == "BlockRemoved":
            out.append(BlockRemoved(**kw))
        else:
            out.append(AllBlocksCleared())
    return out


FRAMES = fx.all_frames()


@pytest.mark.parametrize("frame", FRAMES, ids=[f"{f.version}-{f.name}" for f in FRAMES])
def test_simulator_encodes_byte_for_byte_as_vllm(frame):
    events = _events(frame.expected)
    got = encode_batch(events, ts=frame.expected["ts"], data_parallel_rank=frame.expected["data_parallel_rank"],
                       fmt=FMT[frame.version])
    assert got == frame.payload
    # and the simulator's own decoder reads vLLM's bytes back to the same events
    back = decode_batch(frame.payload)
    assert back.ts == frame.expected["ts"] and len(back.events) == len(events)
    assert [type(e) for e in back.events] == [type(e) for e in events]


@pytest.mark.parametrize("version", fx.VERSIONS)
def test_simulator_replay_reply_is_vllms(version):
    rec = fx.replay(version)
    ctx = zmq.Context()
    try:
        with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic=rec["topic"],
                              fmt=FMT[version], context=ctx) as pub:
            for frame in fx.frames(version)[:len(rec["pub_frames"])]:
                pub.publish(_events(frame.expected), ts=frame.expected["ts"])
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", rec["request_start_seq"].to_bytes(8, "big")])
            reply = []
            while not reply or reply[-1][-2:] != [b"\xff" * 8, b""]:
                assert dealer.poll(10_000), "no replay reply"
                reply.append(dealer.recv_multipart())
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    assert reply == rec["replay_reply"]


def _cases():
    for v in fx.VERSIONS:
        h = fx.hashes(v)
        for c in h["cases"]:
            yield pytest.param(v, h, c, id=f"{v}-{c['hash_fn']}-{c['case']}-seed{c['pythonhashseed']}")


@pytest.mark.parametrize("version,h,case", list(_cases()))
def test_simulator_hashes_blocks_as_vllm(version, h, case):
    style = FMT[version]
    bs, tokens = h["block_size"], h["token_ids"]
    kw = dict(lora_name=case["lora_name"], lora_path=case["lora_path"], cache_salt=case["cache_salt"],
              mm=[(m["identifier"], m["offset"], m["length"]) for m in case["mm"]], style=style)
    keys = request_extra_keys(len(tokens), bs, **kw)

    def plain(x):
        return [plain(i) for i in x] if isinstance(x, (list, tuple)) else x

    assert plain(keys) == case["hash_extra_keys"]
    if case["event_extra_keys"] is not None:
        assert plain(event_extra_keys(keys, style)) == case["event_extra_keys"]
    hasher = BlockHasher(bs, case["hash_fn"], seed=case["pythonhashseed"], style=style)
    assert hasher.none_hash.hex() == case["none_hash"]
    got = hasher.hash_blocks(tokens, extra_keys=keys)
    assert [g.hex() for g in got] == case["block_hashes"]
    assert [to_external(g) for g in got] == case["external"]
    if case["case"] == "cache_salt":  # the cache_salt shortcut gives the same keys
        assert hasher.hash_blocks(tokens, cache_salt=case["cache_salt"]) == got


def test_hash_fixtures_cover_every_algorithm():
    seen = {(v, c["hash_fn"]) for v in fx.VERSIONS for c in fx.hashes(v)["cases"]}
    for v in ("0.22.1", "0.33.0"):
        assert {a for vv, a in seen if vv == v} == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    assert {a for vv, a in seen if vv == "0.11.2"} == {"sha256", "sha256_cbor"}
