"""Topology and publishing against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import DeliverPolicy

from consumers import bus
from schemas import KvEventBatch, subjects as S
from schemas.config import StreamLimits, TopologyConfig
from streams.topology import build_topology


async def test_apply_is_idempotent(nc, prefix):
    js = nc.jetstream()
    specs = build_topology(prefix=prefix)
    first = await bus.apply_topology(js, specs)
    assert {r.action for r in first} == {"created"}
    second = await bus.apply_topology(js, specs)
    assert {r.action for r in second} == {"unchanged"}
    # a changed limit is an update, then unchanged again
    changed = build_topology(TopologyConfig(limits={"KV_EVENTS": StreamLimits(max_age_s=600)}), prefix=prefix)
    third = await bus.apply_topology(js, changed)
    assert [r.action for r in third if r.action != "unchanged"] == ["updated"]
    info = await js.stream_info(f"{prefix.upper()}_KV_EVENTS")
    assert info.config.max_age == pytest.approx(600)
    assert {r.action for r in await bus.apply_topology(js, changed)} == {"unchanged"}
    rows = await bus.topology_info(js, changed)
    assert all(r["exists"] and r["messages"] == 0 for r in rows)
    for spec in specs:
        await js.delete_stream(spec.name)


def test_topology_rejects_unknown_stream_limits():
    with pytest.raises(ValueError, match="unknown streams"):
        build_topology(TopologyConfig(limits={"NOPE": StreamLimits(max_age_s=1)}))


def test_duplicate_window_cannot_exceed_age():
    with pytest.raises(ValueError, match="duplicate window"):
        build_topology(TopologyConfig(duplicate_window_s=1000, limits={"KV_EVENTS": StreamLimits(max_age_s=10)}))


async def test_same_msg_id_is_stored_once(nc, prefix, topology):
    js = nc.jetstream()
    subject = S.with_prefix(prefix, S.kv_events("m", "pod.1"))
    batch = KvEventBatch(pod="pod.1", model="m", seq=3, ts=1.0, events=[])
    a = await bus.publish(js, subject, batch.to_json(), msg_id=batch.msg_id)
    b = await bus.publish(js, subject, batch.to_json(), msg_id=batch.msg_id)
    c = await bus.publish(js, subject, batch.to_json(), msg_id="pod.1:0:4")
    assert not a.duplicate and b.duplicate and not c.duplicate
    assert a.seq == b.seq and c.seq == a.seq + 1
    info = await js.stream_info(f"{prefix.upper()}_KV_EVENTS")
    assert info.state.messages == 2


async def test_dead_letters_carry_reason_and_count(nc, prefix, topology):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    js = nc.jetstream()
    dl = bus.DeadLetters(js, consumer="test", registry=reg, prefix=prefix)
    await dl.send("kv-events", "kv.events.m.p", b"\x00garbage", "not JSON")
    sub = await js.subscribe(S.with_prefix(prefix, "dlq.>"), ordered_consumer=True,
                             config=__import__("nats").js.api.ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    msg = await sub.next_msg(timeout=5)
    from schemas import DeadLetter, decode_event
    import base64

    letter = decode_event(DeadLetter, msg.data)
    assert letter.reason == "not JSON" and base64.b64decode(letter.payload) == b"\x00garbage"
    assert reg.get_sample_value("infernex_dead_letters_total",
                                {"stream": "kv-events", "consumer": "test", "reason": "invalid"}) == 1
    await sub.unsubscribe()


async def test_connect_error_is_clear():
    from schemas.config import NatsConfig
    from infernex.embedded_nats import free_port

    with pytest.raises(ConnectionError, match="cannot connect to NATS"):
        await bus.connect(NatsConfig(servers=[f"nats://127.0.0.1:{free_port()}"], connect_timeout_s=0.5))


async def test_dead_letter_is_bounded_and_one_per_message(nc, prefix, topology):
    """A message near max_payload gets a dead letter that fits; two consumers rejecting the same
    message (same stream sequence) leave one letter; a different message leaves another."""
    import base64
    import hashlib

    from prometheus_client import CollectorRegistry

    from schemas import DeadLetter, decode_event

    js = nc.jetstream()
    reg = CollectorRegistry()
    a = bus.DeadLetters(js, consumer="indexer", registry=reg, prefix=prefix)
    b = bus.DeadLetters(js, consumer="router", registry=CollectorRegistry(), prefix=prefix)
    big = bytes(range(256)) * (nc.max_payload // 256 - 16)  # just under the server's max_payload
    assert await a.send("kv-events", "kv.events.m.p", big, "not JSON", stream_seq=41)
    assert await b.send("kv-events", "kv.events.m.p", big, "not JSON", stream_seq=41)
    assert await b.send("kv-events", "kv.events.m.p", b"x", "not JSON", stream_seq=42)
    info = await js.stream_info(f"{prefix.upper()}_DLQ")
    assert info.state.messages == 2
    sub = await js.subscribe(S.with_prefix(prefix, "dlq.>"), ordered_consumer=True,
                             config=__import__("nats").js.api.ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    msg = await sub.next_msg(timeout=5)
    await sub.unsubscribe()
    assert len(msg.data) < 32 * 1024
    letter = decode_event(DeadLetter, msg.data)
    assert letter.truncated and letter.payload_size == len(big) and letter.stream_seq == 41
    assert letter.payload_sha256 == hashlib.sha256(big).hexdigest()
    assert base64.b64decode(letter.payload) == big[:16 * 1024]
    assert msg.headers["Nats-Msg-Id"] == "dlq:kv-events:41"


async def test_failed_dead_letter_is_counted_not_raised(nc, prefix):
    """No DLQ stream (nothing stores dlq.>): send returns False at once-ish, counts a failure and
    does not count a dead letter."""
    import time

    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    dl = bus.DeadLetters(nc.jetstream(), consumer="c", registry=reg, prefix=prefix, timeout_s=1.0)
    t0 = time.monotonic()
    assert await dl.send("kv-events", "kv.events.m.p", b"junk", "bad") is False
    assert time.monotonic() - t0 < 3
    assert dl.failed == 1 and dl.count == 0
    assert reg.get_sample_value("infernex_dead_letter_publish_failures_total",
                                {"stream": "kv-events", "consumer": "c"}) == 1
    assert reg.get_sample_value("infernex_dead_letters_total",
                                {"stream": "kv-events", "consumer": "c", "reason": "invalid"}) is None


def test_store_budget_gives_every_stream_a_share_and_an_own_limit_wins():
    from streams.topology import STORE_SHARES

    topo = build_topology(TopologyConfig(store_bytes="10Gi",
                                         limits={"DLQ": StreamLimits(max_age_s=3600, max_bytes=5000)}))
    got = {s.name: s.max_bytes for s in topo}
    assert got["DLQ"] == 5000 and got["ROUTER"] == int(10 * 2**30 * STORE_SHARES["ROUTER"])
    assert set(STORE_SHARES) == set(got) and sum(STORE_SHARES.values()) <= 0.9
    assert all(s.discard == "old" for s in topo)  # a full share drops its oldest, never refuses a write
    assert TopologyConfig(store_bytes="500M").store_bytes == 500 * 10**6
    assert TopologyConfig(store_bytes=1234).store_bytes == 1234
    assert all(s.max_bytes == -1 for s in build_topology())  # no budget given (infernex up): unlimited
    with pytest.raises(ValueError, match="not a storage size"):
        TopologyConfig(store_bytes="ten gigs")


async def test_a_stream_at_its_share_drops_its_oldest_and_keeps_taking_writes(nc, prefix):
    js = nc.jetstream()
    specs = build_topology(TopologyConfig(store_bytes=400_000), prefix=prefix)  # ROUTER: 120 kB
    await bus.apply_topology(js, specs)
    router = next(s for s in specs if s.logical == S.ROUTER)
    try:
        subject = S.with_prefix(prefix, S.router_requests("p"))
        for i in range(100):  # 100 x 4 kB: over three times the share
            ack = await bus.publish(js, subject, b"x" * 4000, msg_id=f"r{i}")
            assert ack.seq == i + 1
        info = await js.stream_info(router.name)
        assert info.state.bytes <= router.max_bytes and info.state.last_seq == 100 and info.state.first_seq > 1
    finally:
        for spec in specs:
            await js.delete_stream(spec.name)


async def test_a_publish_waits_for_a_stream_that_is_not_answering_yet(nc, prefix):
    """No stream answering a subject (a leader being elected, a cluster restarting, the topology not
    applied yet) is retried like a timeout: the publish lands once the stream is there, stored once;
    with no stream at all it fails after its retries with nats-py's own error."""
    import nats.js.errors

    js = nc.jetstream()
    subject = f"{prefix}.late.x"
    name = f"{prefix.upper()}_LATE"
    task = asyncio.create_task(bus.publish(js, subject, b"first", msg_id="m-1", retries=6))
    await asyncio.sleep(0.3)  # the first attempts find no stream
    assert not task.done()
    await js.add_stream(name=name, subjects=[f"{prefix}.late.>"])
    try:
        ack = await asyncio.wait_for(task, 10)
        assert ack.stream == name and ack.seq == 1
        info = await js.stream_info(name)
        assert info.state.messages == 1
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await bus.publish(js, f"{prefix}.nowhere", b"x", retries=2)
    finally:
        await js.delete_stream(name)
