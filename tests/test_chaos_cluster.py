"""Chaos (b): a 3-node JetStream cluster on loopback with every stream and bucket at R3; under
load, SIGKILL the leader of the KV events stream, then the leader of the snapshot bucket, then
restart the indexer while a node is down. At the end the indexer's and the router's indexes
equal the engines' caches, snapshots are written again, and nothing was lost."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from chaos_tools import NatsCluster, Rig, compare, record, until
from consumers import bus
from consumers.indexer import IndexerConfig, IndexerService
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from schemas.config import NatsConfig, TopologyConfig
from streams.clock import SystemClock
from streams.kv_index import KvIndex
from streams.topology import build_topology


def _indexer(cfg, topo) -> IndexerService:
    return IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="chaos-b", snapshot_every_events=200,
                                        snapshot_every_s=1.0, snapshot_timeout_s=5, reorder_window_s=30),
                          cfg, registry=CollectorRegistry(), topology=topo)


async def test_kill_the_stream_and_bucket_leaders_of_an_r3_cluster(tmp_path):
    cluster = NatsCluster(tmp_path, 3)
    cluster.start_all()
    cfg = NatsConfig(servers=cluster.urls, connect_timeout_s=2)
    topo = build_topology(TopologyConfig(replicas=3))
    nc = None
    rig = Rig(cfg)
    indexer = feeds = None
    try:
        nc = await _connect_and_apply(cfg, topo)
        js = nc.jetstream()
        await rig.start_bridges(topo)
        indexer = _indexer(cfg, topo)
        await indexer.start()
        bucket_stream = f"OBJ_{indexer.bucket}"
        router_index = KvIndex(SystemClock())
        feeds = BusFeeds(nc, ClusterState(RouterConfig()), index=router_index, registry=CollectorRegistry())
        await feeds.start()
        rig.start_load(every_s=0.005)
        await until(lambda: indexer.metrics.snapshots._value.get() >= 1, 30, "a first snapshot")
        # (a young cluster may refuse the bucket's placement at start: the indexer then replays
        # and creates the bucket at its first snapshot, so the bucket is checked after that)
        assert (await js.stream_info(bucket_stream)).config.num_replicas == 3

        killed = []
        restored_after_kill = None
        for stream in ("KV_EVENTS", bucket_stream):
            await asyncio.sleep(1.5)
            leader = (await _info(js, stream)).cluster.leader
            i = cluster.index_of(leader)
            cluster.kill(i)
            killed.append((stream, leader))
            if stream == bucket_stream:
                # the bucket's leader is gone: a new one is elected, snapshots go on, and an
                # indexer starting now restores from it
                snaps = indexer.metrics.snapshots._value.get()
                await until(lambda: indexer.metrics.snapshots._value.get() > snaps, 30,
                            "a snapshot after the bucket leader died")
                await indexer.stop()
                indexer = _indexer(cfg, topo)
                await asyncio.wait_for(indexer.start(), 30)
                # restored from the R3 bucket, or -- if the bucket did not answer within its
                # timeout on a loaded machine -- replayed from the stream: either way it starts
                restored_after_kill = indexer.restored_batches
            await asyncio.sleep(1.0)
            cluster.start(i)
        restarted = time.monotonic()
        await asyncio.sleep(1.0)
        await rig.stop_load()

        def converged() -> bool:
            return rig.published_all() and not compare(indexer.index, rig.engines) \
                and not compare(router_index, rig.engines)

        try:
            await until(converged, 60, "the indexes to equal the engines' caches")
        except AssertionError:
            raise AssertionError(f"indexer: {compare(indexer.index, rig.engines)}; router: "
                                 f"{compare(router_index, rig.engines)}; published "
                                 f"{[b.stats.published for b in rig.bridges]} of {[e.batches for e in rig.engines]}") \
                from None
        recovered = time.monotonic() - restarted
        assert indexer.index.totals.unknown_removed == 0
        info = await _info(js, "KV_EVENTS")
        assert indexer.applied_seq == info.state.last_seq and info.config.num_replicas == 3
        record("3-node R3 cluster: kill the KV_EVENTS leader, then the snapshot bucket's leader, restart the "
               "indexer meanwhile", True, 0, recovered, killed=[k[1] for k in killed],
               restarted_indexer_restored_batches=restored_after_kill,
               batches=sum(e.batches for e in rig.engines))
    finally:
        await rig.close()
        if feeds is not None:
            await feeds.stop()
        if indexer is not None:
            await indexer.stop()
        if nc is not None:
            await nc.close()
        cluster.stop_all()


async def _connect_and_apply(cfg, topo):
    """A client of the new cluster once it has elected its meta leader, with the topology applied."""
    nc = None

    async def connected():
        nonlocal nc
        try:
            nc = await bus.connect(cfg)
            await nc.jetstream().account_info()
            return True
        except Exception:  # noqa: BLE001 - the cluster is still electing its meta leader
            if nc is not None:
                await nc.close()
                nc = None
            return False

    await until(connected, 30, "the JetStream cluster", every=0.5)
    try:
        await until(lambda: _apply(nc.jetstream(), topo), 30, "the topology applied at R3", every=0.5)
    except BaseException:
        await nc.close()
        raise
    return nc


async def _apply(js, topo) -> bool:
    try:
        await bus.apply_topology(js, topo)
        return True
    except Exception:  # noqa: BLE001 - not enough peers yet
        return False


async def _info(js, stream):
    for _ in range(50):
        try:
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return info
        except Exception:  # noqa: BLE001 - during an election
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"stream {stream} has no leader")


async def test_a_bridge_starting_while_the_cluster_is_down_waits_for_it(tmp_path):
    """Every node down (a full restart): JetStream does not answer at all. A bridge starting then asks
    for its last stored batch again until the cluster is back, and continues after it: it neither
    dies (as it did at the first request's timeout) nor starts numbering afresh. With two of three
    nodes down the survivor still answers this read, so the whole cluster goes down here."""
    from consumers.kv_bridge import last_stored_position
    from schemas import KvEventBatch, kv_binary
    from schemas import subjects as S
    from schemas.kv import BlockStored
    from streams.topology import stream_for_subject

    cluster = NatsCluster(tmp_path, 3)
    cluster.start_all()
    cfg = NatsConfig(servers=cluster.urls, connect_timeout_s=2)
    topo = build_topology(TopologyConfig(replicas=3))
    nc = None
    try:
        nc = await _connect_and_apply(cfg, topo)
        js = nc.jetstream()
        subject = S.kv_events("m", "p")
        stream = stream_for_subject(topo, subject).name
        b = KvEventBatch(pod="p", model="m", epoch=3, seq=7, ts=1.0,
                         events=[BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2)])
        await _info(js, stream)  # its leader elected first: a publish before it has no responder
        await bus.publish(js, subject, kv_binary.encode(b))
        cluster.stop_all()
        asking = asyncio.create_task(last_stored_position(js, stream, subject, wait_s=120))
        await asyncio.sleep(7)  # (longer than one request's 5 s timeout)
        assert not asking.done(), asking.result() if not asking.exception() else asking.exception()
        cluster.start_all()
        assert await asyncio.wait_for(asking, 120) == (3, 7)
    finally:
        if nc is not None:
            await nc.close()
        cluster.stop_all()
