"""Chaos (a): kill -9 of nats-server (file store, same store directory on restart) three times
under load. Simulated engines with known caches -> bridges -> JetStream -> the indexer and a
router's embedded index; at the end both indexes equal every engine's cache."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry

from chaos_tools import Rig, compare, record, until
from consumers import bus
from consumers.indexer import IndexerConfig, IndexerService
from infernex.embedded_nats import EmbeddedNats, free_port
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from schemas.config import NatsConfig
from streams.clock import SystemClock
from streams.kv_index import KvIndex
from streams.topology import build_topology

log = logging.getLogger(__name__)


async def test_kill9_nats_three_times_under_load_loses_and_reorders_nothing(tmp_path):
    server = EmbeddedNats(tmp_path / "store", port=free_port()).start()
    cfg = NatsConfig(servers=[server.url], connect_timeout_s=2)
    topo = build_topology()
    nc = await bus.connect(cfg)
    rig = Rig(cfg)
    indexer = feeds = None
    try:
        await bus.apply_topology(nc.jetstream(), topo)
        await rig.start_bridges(topo)
        indexer = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="chaos-a",
                                               snapshot_every_events=300, reorder_window_s=30),
                                 cfg, registry=CollectorRegistry(), topology=topo)
        await indexer.start()
        router_index = KvIndex(SystemClock())
        feeds = BusFeeds(nc, ClusterState(RouterConfig()), index=router_index, registry=CollectorRegistry())
        await feeds.start()
        rig.start_load(every_s=0.002, requests=2)
        outages = []
        for _ in range(3):
            await asyncio.sleep(1.0)
            before = sum(e.batches for e in rig.engines)
            server.kill()  # SIGKILL: no flush, no goodbye
            await asyncio.sleep(3.0)  # the engines keep serving meanwhile
            server.start()
            outages.append(sum(e.batches for e in rig.engines) - before)
        restarted = time.monotonic()
        await asyncio.sleep(1.0)
        await rig.stop_load()
        assert all(n > 0 for n in outages), f"no load during an outage: {outages}"

        def converged() -> bool:
            return rig.published_all() and not compare(indexer.index, rig.engines) \
                and not compare(router_index, rig.engines)

        try:
            await until(converged, 60, "the indexes to equal the engines' caches")
        except AssertionError:
            raise AssertionError(f"indexer: {compare(indexer.index, rig.engines)}; "
                                 f"router: {compare(router_index, rig.engines)}; "
                                 f"published {[b.stats.published for b in rig.bridges]} of "
                                 f"{[e.batches for e in rig.engines]}") from None
        recovered = time.monotonic() - restarted
        # nothing applied twice, nothing lost, no consumer stuck
        st = indexer.index.totals
        assert st.unknown_removed == 0, st  # a removal of a block never stored: something was lost
        info = await nc.jetstream().stream_info(indexer.stream)
        assert indexer.applied_seq == info.state.last_seq
        assert indexer.index.waiting_count == 0 and router_index.waiting_count == 0
        assert sum(b.stats.dead_letters for b in rig.bridges) == 0
        record("kill -9 nats-server x3, 3 s down each, under load (file store)", True, 0, recovered,
               batches=sum(e.batches for e in rig.engines), held_for_order=st.held,
               router_held=router_index.totals.held)
    finally:
        await rig.close()
        if feeds is not None:
            await feeds.stop()
        if indexer is not None:
            await indexer.stop()
        await nc.close()
        server.cleanup()
