"""The KV-event publisher speaks vLLM's ZMQ wire format (checked with raw SUB / DEALER
sockets and plain msgpack, independent of the publisher's own structs)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from simulator.kv_publisher import (
    END_SEQ,
    AllBlocksCleared,
    KvEventPublisher,
    block_removed,
    block_stored,
    decode_batch,
)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _sub(ctx, endpoint, topic=b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def _publish_until_received(pub, sub, events):
    """PUB/SUB joins asynchronously: publish until the first frame arrives."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pub.publish(events)
        if sub.poll(200):
            return sub.recv_multipart()
    raise AssertionError("no frame received from the publisher")


@pytest.mark.parametrize("fmt", ["0.33", "0.22"])
def test_frames_are_vllm_encoded(ctx, fmt):
    """Every release: an array batch [ts, events, dp_rank]; vLLM 0.33's events are tagged maps,
    0.22's tagged arrays in 0.22's field order (see tests/test_sim_vllm_parity.py for the
    byte-for-byte comparison with vLLM's own encoder)."""
    with KvEventPublisher("tcp://127.0.0.1:0", fmt=fmt) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        sub = _sub(ctx, pub.endpoint)
        ev = [block_stored([11, 12], None, list(range(8)), 4), block_removed([7]), AllBlocksCleared()]
        topic, seq_bytes, payload = _publish_until_received(pub, sub, ev)
        assert topic == b""  # vLLM's default topic
        assert len(seq_bytes) == 8
        first_seq = int.from_bytes(seq_bytes, "big")
        raw = msgpack.unpackb(payload)
        assert isinstance(raw, list) and len(raw) == 3
        raw = dict(zip(("ts", "events", "data_parallel_rank"), raw))
        assert raw["data_parallel_rank"] == 0
        assert abs(raw["ts"] - time.time()) < 60
        stored, removed, cleared = raw["events"]
        if fmt == "0.33":
            assert stored == {
                "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                "lora_name": None,
            }
            assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
            assert cleared == {"type": "AllBlocksCleared"}
        else:
            # array_like structs encode every field, defaults too (msgspec ignores omit_defaults there)
            assert stored == ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU", None, None, None, None, None]
            assert removed == ["BlockRemoved", [7], "GPU", None]
            assert cleared == ["AllBlocksCleared"]
        # next publish gets the next sequence number
        seq = pub.publish([block_removed([1])])
        assert seq == pub.next_seq - 1
        while True:
            _, sb, _ = sub.recv_multipart()
            if int.from_bytes(sb, "big") == seq:
                break
        assert seq > first_seq
        sub.close()


def test_array_like_encoding_for_older_vllm(ctx):
    with KvEventPublisher("tcp://127.0.0.1:0", array_like=True, data_parallel_rank=2, topic="") as pub:
        sub = _sub(ctx, pub.endpoint, topic=b"")
        _, _, payload = _publish_until_received(
            pub, sub, [block_stored([5], 3, [1, 2], 2), block_removed([5]), AllBlocksCleared()])
        raw = msgpack.unpackb(payload)
        assert isinstance(raw, list) and len(raw) == 3
        ts, events, rank = raw
        assert rank == 2
        assert events[0] == ["BlockStored", [5], 3, [1, 2], 2, None, "GPU"]
        assert events[1] == ["BlockRemoved", [5], "GPU"]
        assert events[2] == ["AllBlocksCleared"]
        back = decode_batch(payload)
        assert back.events[0].block_hashes == [5] and back.events[0].parent_block_hash == 3
        sub.close()


def _replay_frame(frames, fmt):
    """(empty, seq, payload) of one replay reply; vLLM 0.33 puts the topic before the seq."""
    if fmt == "0.33":
        empty, topic, seq_b, payload = frames
        assert topic == b""  # vLLM's default topic; the end marker's topic slot is always empty
        return empty, seq_b, payload
    return tuple(frames)


@pytest.mark.parametrize("fmt", ["0.33", "0.22"])
def test_replay_returns_buffered_batches_then_end_marker(ctx, fmt):
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3,
                          fmt=fmt) as pub:
        assert pub.replay_endpoint and not pub.replay_endpoint.endswith(":0")
        for i in range(5):
            assert pub.publish([block_removed([i])]) == i
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(20_000), "replay did not answer"
            frames = dealer.recv_multipart()
            empty, seq_b, payload = _replay_frame(frames, fmt)
            assert empty == b""
            if seq_b == END_SEQ:
                assert frames == ([b"", b"", END_SEQ, b""] if fmt == "0.33" else [b"", END_SEQ, b""])
                assert payload == b""
                break
            got.append((int.from_bytes(seq_b, "big"), decode_batch(payload).events[0].block_hashes))
        # buffer holds only the last 3 steps (2, 3, 4); start_seq=1 asks from 1 onwards
        assert got == [(2, [2]), (3, [3]), (4, [4])]

        # restart: sequence back to 0 and buffer emptied
        pub.reset_sequence()
        assert pub.publish([AllBlocksCleared()]) == 0
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(20_000)
            _, seq_b, payload = _replay_frame(dealer.recv_multipart(), fmt)
            if seq_b == END_SEQ:
                break
            frames.append(int.from_bytes(seq_b, "big"))
        assert frames == [0]
        dealer.close()


def test_closed_publisher_refuses(ctx):
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([])


def test_bind_conflict_is_a_clear_error():
    with KvEventPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(OSError, match="cannot bind"):
            KvEventPublisher(pub.endpoint)


def test_dropped_frame_is_a_gap_filled_by_replay(ctx):
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        sub = _sub(ctx, pub.endpoint)
        _, first, _ = _publish_until_received(pub, sub, [block_removed([1])])
        start = int.from_bytes(first, "big")
        while sub.poll(300):  # drain the warm-up frames
            start = int.from_bytes(sub.recv_multipart()[1], "big")
        lost = pub.publish([block_removed([2])], drop=True)
        after = pub.publish([block_removed([3])])
        assert sub.poll(20_000)
        got = int.from_bytes(sub.recv_multipart()[1], "big")
        assert got == after == lost + 1 and lost == start + 1  # the subscriber sees a gap
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", lost.to_bytes(8, "big")])
        assert dealer.poll(20_000)
        _, seq_b, payload = _replay_frame(dealer.recv_multipart(), "0.33")
        assert int.from_bytes(seq_b, "big") == lost
        assert decode_batch(payload).events[0].block_hashes == [2]
        dealer.close()
        sub.close()
