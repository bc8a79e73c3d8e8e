"""Services that start while NATS is restarting: JetStream does not answer their consumer requests
for a while (each times out after 5 s), and they ask again instead of failing their start
(consumers.bus.while_unanswered). A real nats-server, stopped and started on the same port and
store: the router's bus feeds, then fold what engines publish; a durable consumer (the SLA sink's,
the diagnosis engine's, the Kafka exporter's), then exists where it was asked for."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from consumers import bus
from infernex.embedded_nats import EmbeddedNats
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from schemas import KvEventBatch, kv_binary
from schemas import subjects as S
from schemas.config import NatsConfig
from schemas.kv import BlockStored
from streams.clock import SystemClock
from streams.kv_index import KvIndex
from streams.topology import build_topology


async def test_the_router_starts_its_feeds_while_nats_restarts(tmp_path):
    server = EmbeddedNats(tmp_path / "store")
    server.start()
    nc = feeds = None
    try:
        nc = await bus.connect(NatsConfig(servers=[server.url], connect_timeout_s=3))
        await bus.apply_topology(nc.jetstream(), build_topology())
        index = KvIndex(SystemClock())
        feeds = BusFeeds(nc, ClusterState(RouterConfig()), index=index, registry=CollectorRegistry(),
                         kv_catchup_timeout_s=0)
        server.stop()
        starting = asyncio.create_task(feeds.start())
        await asyncio.sleep(7)  # (longer than one request's 5 s timeout)
        assert not starting.done(), starting.exception()
        server.start()
        await asyncio.wait_for(starting, 60)
        b = KvEventBatch(pod="p", model="m", seq=0, ts=1.0,
                         events=[BlockStored(block_hashes=[11, 12], token_ids=list(range(8)), block_size=4)])
        await bus.publish(nc.jetstream(), S.kv_events("m", "p"), kv_binary.encode(b))
        deadline = time.monotonic() + 20
        while "p" not in index.pods() or sum(index.pods()["p"].blocks.values()) < 2:
            assert time.monotonic() < deadline, "the KV feed never folded the batch"
            await asyncio.sleep(0.1)
    finally:
        if feeds is not None:
            await feeds.stop()
        if nc is not None:
            await nc.close()
        server.stop()


async def test_a_durable_consumer_is_created_once_nats_is_back(tmp_path):
    server = EmbeddedNats(tmp_path / "store")
    server.start()
    nc = None
    try:
        nc = await bus.connect(NatsConfig(servers=[server.url], connect_timeout_s=3))
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        stream = topo[0].name
        server.stop()
        creating = asyncio.create_task(bus.ensure_durable(js, stream, "after-restart", None))
        await asyncio.sleep(7)  # (longer than one request's 5 s timeout)
        assert not creating.done(), creating.exception()
        server.start()
        await asyncio.wait_for(creating, 60)
        info = await js.consumer_info(stream, "after-restart")
        assert info.config.durable_name == "after-restart"
    finally:
        if nc is not None:
            await nc.close()
        server.stop()
