"""The indexer when its snapshot bucket is slow or gone, and the bucket's replication, on a
real nats-server."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.indexer import IndexerConfig, IndexerService
from schemas import subjects as S
from schemas.kv import BlockStored, KvEventBatch
from streams.topology import build_topology

BS = 4


def batch(pod: str, seq: int) -> KvEventBatch:
    return KvEventBatch(pod=pod, model="m", seq=seq, ts=time.time(), events=[
        BlockStored(block_hashes=[seq + 1], parent_block_hash=seq or None,
                    token_ids=list(range(seq * BS, seq * BS + BS)), block_size=BS)])


async def _until(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_unreachable_bucket_replays_the_stream_and_never_blocks_the_fold(nats_config, nc, prefix, topology,
                                                                                 monkeypatch):
    js = nc.jetstream()
    for s in range(20):
        b = batch("p", s)
        await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", "p")), b.to_json(), msg_id=b.msg_id)

    hang = asyncio.Event()
    real_bucket = IndexerService._bucket

    async def unreachable(self):  # the bucket's stream leader is gone: requests time out
        if not hang.is_set():
            await hang.wait()
        return await real_bucket(self)

    monkeypatch.setattr(IndexerService, "_bucket", unreachable)
    reg = CollectorRegistry()
    svc = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="ha", snapshot_every_events=5,
                                       snapshot_timeout_s=0.5, snapshot_on_stop=False), nats_config,
                         registry=reg)
    t0 = time.monotonic()
    await asyncio.wait_for(svc.start(), 10)
    try:
        assert time.monotonic() - t0 < 5
        await _until(lambda: svc.applied_seq >= 20)  # replayed from the start
        assert svc.index.pods()["p"].seq == 19
        # snapshots keep failing (counted) while later batches keep being applied at once
        for s in range(20, 40):
            b = batch("p", s)
            await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", "p")), b.to_json(), msg_id=b.msg_id)
        await _until(lambda: svc.index.pods()["p"].seq == 39, timeout=5)
        await _until(lambda: (reg.get_sample_value("infernex_indexer_snapshot_failures_total") or 0) >= 1)
        assert svc.snapshot_seq == 0
        # the bucket answers again: the next snapshot opens it and is stored
        hang.set()
        await _until(lambda: svc.snapshot_seq >= 39, timeout=10)
        assert (reg.get_sample_value("infernex_indexer_snapshots_total") or 0) >= 1
    finally:
        hang.set()
        await svc.stop()


async def test_snapshot_bucket_follows_topology_replicas(nats_config, nc, prefix, topology):
    """R1 on one server; an existing bucket made with other settings is brought to the topology's
    replica count (checked here by the stream config the indexer asks for)."""
    js = nc.jetstream()
    svc = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="rep", snapshot_on_stop=False),
                         nats_config, topology=build_topology(prefix=prefix))
    await svc.start()
    try:
        info = await js.stream_info(f"OBJ_{svc.bucket}")
        assert info.config.num_replicas == 1
        svc._replicas = 3  # what topology.replicas=3 asks for: a single server refuses, the error is clear
        obj = await svc._open_bucket()
        assert obj is None  # refused (a single node cannot hold R3): start-up would replay instead
    finally:
        await svc.stop()
        await js.delete_object_store(svc.bucket)
