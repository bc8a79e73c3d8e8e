"""Publish N events, stop the server, start it again on the same store: a durable
consumer receives all N, none twice."""

from __future__ import annotations

import asyncio

from consumers import bus
from infernex.embedded_nats import EmbeddedNats
from schemas import KvEventBatch, decode_event, subjects as S
from schemas.config import NatsConfig
from streams.topology import build_topology


async def test_durable_consumer_survives_server_restart(tmp_path):
    server = EmbeddedNats(tmp_path / "store").start()
    cfg = NatsConfig(servers=[server.url], connect_timeout_s=3)
    specs = build_topology()
    n = 200
    try:
        nc = await bus.connect(cfg)
        js = nc.jetstream()
        await bus.apply_topology(js, specs)
        for i in range(n):
            b = KvEventBatch(pod="p", model="m", seq=i, ts=1.0, events=[])
            await bus.publish(js, S.kv_events("m", "p"), b.to_json(), msg_id=b.msg_id)
        # consume half and ack them before the restart
        await bus.ensure_durable(js, "KV_EVENTS", "dur", S.ALL_KV_EVENTS)
        sub = await js.pull_subscribe_bind(durable="dur", stream="KV_EVENTS")
        seen: list[int] = []
        while len(seen) < n // 2:
            for m in await sub.fetch(min(50, n // 2 - len(seen)), timeout=5):
                seen.append(decode_event(KvEventBatch, m.data).seq)
                await m.ack_sync()
        await nc.close()

        server.stop()
        server.start()

        nc = await bus.connect(cfg)
        js = nc.jetstream()
        assert {r.action for r in await bus.apply_topology(js, specs)} == {"unchanged"}
        sub = await js.pull_subscribe_bind(durable="dur", stream="KV_EVENTS")
        while len(seen) < n:
            try:
                msgs = await sub.fetch(100, timeout=2)
            except asyncio.TimeoutError:
                break
            for m in msgs:
                seen.append(decode_event(KvEventBatch, m.data).seq)
                await m.ack_sync()
        try:
            extra = await sub.fetch(1, timeout=1)
        except asyncio.TimeoutError:
            extra = []
        assert extra == []
        assert seen == list(range(n))
        await nc.close()
    finally:
        server.cleanup()


async def test_unacked_messages_are_redelivered(nc, prefix, topology):
    js = nc.jetstream()
    stream = f"{prefix.upper()}_KV_EVENTS"
    for i in range(3):
        b = KvEventBatch(pod="p", model="m", seq=i, ts=1.0, events=[])
        await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", "p")), b.to_json(), msg_id=b.msg_id)
    await bus.ensure_durable(js, stream, "redeliver", None, ack_wait_s=1.0)
    sub = await js.pull_subscribe_bind(durable="redeliver", stream=stream)
    first = await sub.fetch(3, timeout=5)
    await first[0].ack_sync()  # ack one, drop two
    again = []
    deadline = asyncio.get_running_loop().time() + 15
    while len(again) < 2 and asyncio.get_running_loop().time() < deadline:
        try:
            again += await sub.fetch(2, timeout=2)
        except asyncio.TimeoutError:
            pass
    assert sorted(decode_event(KvEventBatch, m.data).seq for m in again) == [1, 2]
    assert all(m.metadata.num_delivered == 2 for m in again)
    for m in again:
        await m.ack_sync()
