"""End to end on a real nats-server: vLLM-format publisher -> bridge -> durable consumer."""

from __future__ import annotations

import asyncio
import base64
import time

import msgspec
import pytest
import zmq

from consumers import bus
from consumers.kv_bridge import BridgeConfig, KvBridge
from schemas import DeadLetter, KvEventBatch
from schemas import subjects as S
from simulator.kv_publisher import AllBlocksCleared, KvEventPublisher, block_removed, block_stored
from streams.topology import stream_for_subject

BS = 4


def stored(seq: int):
    toks = [seq * 10 + i for i in range(2 * BS)]
    return [block_stored([seq * 2 + 1, seq * 2 + 2], None, toks, BS), block_removed([seq + 1000])]


async def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def publish_until_joined(pub, bridge, make=stored):
    """PUB/SUB joins asynchronously; frames sent before the join are back-filled by replay."""
    deadline = time.monotonic() + 20
    while bridge.stats.frames == 0:
        assert time.monotonic() < deadline, "bridge never received a frame"
        pub.publish(make(pub.next_seq))
        await asyncio.sleep(0.05)


def expand(m) -> list:
    """``(id, batch)`` per batch of a stored message; a group's batches get the id each would have
    had alone, after checking the group's own id and headers name exactly its first and last batch."""
    batches = KvEventBatch.all_from_bytes(m.data)
    mid = m.headers.get("Nats-Msg-Id")
    if len(batches) == 1 and "Infernex-Batches" not in m.headers:
        return [(mid, batches[0])]
    first, last = batches[0], batches[-1]
    assert mid == f"{first.pod}:{first.epoch}:{first.seq}-{last.epoch}:{last.seq}"
    assert m.headers["Infernex-Batches"] == str(len(batches)) and m.headers["Infernex-Seq"] == str(last.seq)
    assert m.headers["Infernex-First-Seq"] == str(first.seq) and m.headers["Infernex-Epoch"] == str(last.epoch)
    return [(f"{b.pod}:{b.epoch}:{b.seq}", b) for b in batches]


async def collect(js, stream, subject, n, timeout=30.0):
    sub = await js.pull_subscribe(subject, durable="checker", stream=stream)
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            msgs = await sub.fetch(min(256, n - len(out) + 1), timeout=0.5)
        except Exception:  # noqa: BLE001 - fetch timeout: poll again
            continue
        for m in msgs:
            out.extend(expand(m))
            await m.ack()
    # nothing more should arrive (every batch exactly once)
    try:
        extra = await sub.fetch(10, timeout=1.0)
    except Exception:  # noqa: BLE001
        extra = []
    for m in extra:
        out.extend(expand(m))
    return out


@pytest.fixture
def kv(prefix, topology):
    subject = S.with_prefix(prefix, S.kv_events("Qwen/Qwen3-8B", "pod-1"))
    return subject, stream_for_subject(topology, subject).name


async def start_bridge(nc, prefix, pub, stream, **kw):
    cfg = BridgeConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, pod="pod-1",
                       model="Qwen/Qwen3-8B", **{k: v for k, v in kw.items() if k != "drop"})
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    bridge = KvBridge(cfg, nc, subject_prefix=prefix, registry=reg, stream=stream, drop=kw.get("drop"))
    bridge.test_registry = reg
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 10)
    return bridge, stop, task


@pytest.mark.parametrize("fmt", ["0.33", "0.22", "array"])
async def test_every_batch_once_in_order_through_gap_and_restart(nc, prefix, kv, fmt):
    subject, stream = kv
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", fmt=fmt)
    to_drop: set[int] = set()
    bridge, stop, task = await start_bridge(nc, prefix, pub, stream, drop=lambda s: s in to_drop)
    try:
        await publish_until_joined(pub, bridge)
        to_drop.update(range(pub.next_seq + 2, pub.next_seq + 5))  # lost on the way: a gap of 3
        end = pub.next_seq + 10
        while pub.next_seq < end:
            pub.publish(stored(pub.next_seq))
        first_epoch = pub.next_seq
        await wait_for(lambda: bridge.stats.published >= first_epoch, what="first epoch published")
        pub.reset_sequence()  # the engine restarts: sequence back to 0
        for i in range(6):
            pub.publish([AllBlocksCleared()] if i == 0 else stored(100 + i))
        got = await collect(nc.jetstream(), stream, subject, first_epoch + 6)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        pub.close()

    assert [mid for mid, _ in got] == [f"pod-1:0:{s}" for s in range(first_epoch)] + [f"pod-1:1:{s}" for s in range(6)]
    assert [(b.epoch, b.seq) for _, b in got] == [(0, s) for s in range(first_epoch)] + [(1, s) for s in range(6)]
    assert bridge.stats.gaps_filled == 1 and bridge.stats.replayed >= 3 and bridge.stats.restarts == 1
    for _, b in got[:first_epoch]:
        assert b.events[0].type == "stored" and b.events[0].block_hashes == [b.seq * 2 + 1, b.seq * 2 + 2]
        assert b.events[1].block_hashes == [b.seq + 1000]
        assert b.pod == "pod-1" and b.model == "Qwen/Qwen3-8B"
    reg = bridge.test_registry
    n_stored = sum(len(e.block_hashes) for _, b in got for e in b.events if e.type == "stored")
    assert reg.get_sample_value("infernex_kv_bridge_blocks_total", {"pod": "pod-1", "event": "stored"}) == n_stored
    assert reg.get_sample_value("infernex_kv_bridge_published_total", {"pod": "pod-1"}) == len(got)
    assert reg.get_sample_value("infernex_kv_bridge_gaps_total", {"pod": "pod-1", "outcome": "filled"}) == 1
    assert reg.get_sample_value("infernex_kv_bridge_engine_restarts_total", {"pod": "pod-1"}) == 1
    assert reg.get_sample_value("infernex_kv_bridge_frames_total", {"pod": "pod-1", "path": "replay"}) >= 3
    reset_batch = got[first_epoch][1]
    assert [e.type for e in reset_batch.events] == ["reset", "cleared"]
    assert all(e.type != "reset" for _, b in got[first_epoch + 1:] for e in b.events)


async def test_undecodable_frame_goes_to_dlq_and_bridge_keeps_going(nc, prefix, kv, topology):
    subject, stream = kv
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    good = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [5],
                                                          "medium": "GPU"}], "data_parallel_rank": 0})

    class Raw:
        endpoint, replay_endpoint, next_seq = f"tcp://127.0.0.1:{port}", None, 0

        def publish(self, _events):
            pub.send_multipart([b"kv-events", self.next_seq.to_bytes(8, "big"), good])
            self.next_seq += 1

    raw = Raw()
    bridge, stop, task = await start_bridge(nc, prefix, raw, stream)
    js = nc.jetstream()
    dlq_subject = S.with_prefix(prefix, S.dead_letter(S.KV_EVENTS))
    try:
        await publish_until_joined(raw, bridge)
        n0 = raw.next_seq
        await wait_for(lambda: bridge.stats.published == bridge.stats.frames, what="joined frames published")
        base = bridge.stats.frames  # frames before the join are lost (no replay socket here)
        pub.send_multipart([b"kv-events", n0.to_bytes(8, "big"), b"\x93not msgpack at all"])
        pub.send_multipart([b"kv-events", (n0 + 1).to_bytes(8, "big"), good])
        pub.send_multipart([b"only-one-part"])
        pub.send_multipart([b"kv-events", (n0 + 2).to_bytes(8, "big"), good])
        await wait_for(lambda: bridge.stats.published >= base + 2 and bridge.stats.dead_letters >= 2,
                       what="good frames after the bad one")
        dlq_stream = stream_for_subject(topology, dlq_subject).name
        sub = await js.pull_subscribe(dlq_subject, durable="dlq-check", stream=dlq_stream)
        msgs = await sub.fetch(2, timeout=10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        ctx.destroy(linger=0)
    letters = [DeadLetter.from_json(m.data) for m in msgs]
    assert letters[0].reason.startswith("undecodable") and letters[0].headers["vllm-seq"] == str(n0)
    assert base64.b64decode(letters[0].payload) == b"\x93not msgpack at all"
    assert "parts" in letters[1].reason
    assert letters[0].subject == subject
    got = await collect(js, stream, subject, base + 2)
    assert [b.seq for _, b in got] == [s for s in range(n0 - base, n0 + 3) if s != n0]


async def test_restarted_bridge_continues_epoch_and_fills_missed_frames(nc, prefix, kv):
    subject, stream = kv
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        bridge, stop, task = await start_bridge(nc, prefix, pub, stream)
        await publish_until_joined(pub, bridge)
        for _ in range(4):
            pub.publish(stored(pub.next_seq))
        n1 = pub.next_seq
        await wait_for(lambda: bridge.stats.published >= n1, what="first run")
        stop.set()
        await asyncio.wait_for(task, 30)
        for _ in range(3):  # published while no bridge runs
            pub.publish(stored(pub.next_seq))
        bridge2, stop2, task2 = await start_bridge(nc, prefix, pub, stream)
        assert bridge2.tracker.last_seq == n1 - 1 and bridge2.tracker.epoch == 0
        deadline = time.monotonic() + 20
        while bridge2.stats.frames == 0:
            assert time.monotonic() < deadline
            pub.publish(stored(pub.next_seq))
            await asyncio.sleep(0.05)
        total = pub.next_seq
        got = await collect(nc.jetstream(), stream, subject, total)
        stop2.set()
        await asyncio.wait_for(task2, 30)
    finally:
        pub.close()
    assert [b.seq for _, b in got] == list(range(total))
    assert all(b.epoch == 0 for _, b in got)


@pytest.mark.parametrize("policy", ["keep", "reset"])
async def test_frames_lost_for_good_keep_the_pods_blocks_unless_told(nc, prefix, kv, policy):
    """Frames the engine no longer buffers are counted; the pod's blocks stay (default) or
    the next batch starts with a reset (``gap_policy="reset"``)."""
    subject, stream = kv
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2)
    to_drop: set[int] = set()
    bridge, stop, task = await start_bridge(nc, prefix, pub, stream, drop=lambda s: s in to_drop,
                                            gap_policy=policy)
    try:
        await publish_until_joined(pub, bridge)
        lost = range(pub.next_seq, pub.next_seq + 4)  # the replay buffer keeps only the last 2 frames,
        to_drop.update(lost)  # which are the ones after these 4
        for _ in range(6):
            pub.publish(stored(pub.next_seq))
        total = pub.next_seq
        await wait_for(lambda: bridge.stats.gaps_lost == 1 and bridge.stats.published >= total - 4,
                       what="the gap handled")
        got = await collect(nc.jetstream(), stream, subject, total - 4)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        pub.close()
    seqs = [b.seq for _, b in got]
    assert seqs == [s for s in range(total) if s not in lost]
    resets = [b.seq for _, b in got for e in b.events if e.type == "reset"]
    assert resets == ([] if policy == "keep" else [lost[-1] + 1])
    assert bridge.test_registry.get_sample_value("infernex_kv_bridge_gaps_total",
                                                 {"pod": "pod-1", "outcome": "lost"}) == 1
