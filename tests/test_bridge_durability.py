"""The bridge survives a nats-server restart without losing or duplicating batches."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.kv_bridge import BridgeConfig, KvBridge
from infernex.embedded_nats import EmbeddedNats
from schemas import KvEventBatch
from schemas import subjects as S
from schemas.config import NatsConfig
from simulator.kv_publisher import KvEventPublisher, block_stored
from streams.topology import build_topology, stream_for_subject


def batch(seq: int):
    return [block_stored([seq + 1], None, [seq, seq + 1], 2)]


async def _bus(server: EmbeddedNats, prefix: str):
    """(settings, a connected client, the topology applied) for ``prefix`` on ``server``."""
    cfg = NatsConfig(servers=[server.url], subject_prefix=prefix, connect_timeout_s=3)
    nc = await bus.connect(cfg)
    topo = build_topology(prefix=prefix)
    await bus.apply_topology(nc.jetstream(), topo)
    return cfg, nc, topo


async def stored_batches(js, subject: str, stream: str, durable: str) -> list:
    """Every batch the stream holds for ``subject``, in stored order."""
    sub = await js.pull_subscribe(subject, durable=durable, stream=stream)
    got = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=2)
        except Exception:  # noqa: BLE001 - no more messages
            break
        for m in msgs:
            got.extend(KvEventBatch.all_from_bytes(m.data))
            await m.ack()
    return got


async def test_nats_restart_loses_nothing(tmp_path):
    server = EmbeddedNats(tmp_path / "store")
    server.start()
    prefix = "dur"
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    nc = None
    try:
        cfg, nc, topo = await _bus(server, prefix)
        subject = S.with_prefix(prefix, S.kv_events("m", "pod-r"))
        stream = stream_for_subject(topo, subject).name
        reg = CollectorRegistry()
        bridge = KvBridge(BridgeConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, pod="pod-r",
                                       model="m", ack_timeout_s=1.5), nc, subject_prefix=prefix, registry=reg,
                          stream=stream)
        stop = asyncio.Event()
        task = asyncio.create_task(bridge.run(stop))
        await asyncio.wait_for(bridge.ready.wait(), 10)
        deadline = time.monotonic() + 20
        while bridge.stats.frames == 0:
            assert time.monotonic() < deadline
            pub.publish(batch(pub.next_seq))
            await asyncio.sleep(0.05)
        for _ in range(20):
            pub.publish(batch(pub.next_seq))
            await asyncio.sleep(0.01)
        server.stop()  # NATS goes away while the engine keeps publishing
        for _ in range(30):
            pub.publish(batch(pub.next_seq))
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)
        server.start()
        for _ in range(20):
            pub.publish(batch(pub.next_seq))
            await asyncio.sleep(0.01)
        total = pub.next_seq
        deadline = time.monotonic() + 60
        while bridge.stats.published < total and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert bridge.stats.published == total, (bridge.stats, total)
        stop.set()
        await asyncio.wait_for(task, 30)

        got = await stored_batches(nc.jetstream(), subject, stream, "dur-check")
        seqs = [b.seq for b in got]
        assert sorted(seqs) == list(range(total))  # every batch, once
        assert seqs == list(range(total))  # and in order
        assert reg.get_sample_value("infernex_kv_bridge_publish_retries_total", {"pod": "pod-r"}) >= 1
    finally:
        pub.close()
        if nc is not None:
            await nc.close()
        server.cleanup()


async def test_nats_restart_loses_nothing_with_one_bridge_process_for_two_engines(tmp_path):
    """Two engines bridged by one process share one NATS connection: across a nats-server restart
    every batch of each engine is stored once, in order, under its own subject (the ground truth is
    what each engine published)."""
    from consumers.kv_bridge import run_bridges

    server = EmbeddedNats(tmp_path / "store")
    server.start()
    prefix = "dur2"
    pubs = {p: KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for p in ("dp0", "dp1")}
    nc = None
    stop = asyncio.Event()
    task = None
    try:
        cfg, nc, topo = await _bus(server, prefix)
        subjects = {p: S.with_prefix(prefix, S.kv_events("m", p)) for p in pubs}
        stream = stream_for_subject(topo, subjects["dp0"]).name
        reg = CollectorRegistry()
        task = asyncio.create_task(run_bridges(
            [BridgeConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, pod=p, model="m",
                          ack_timeout_s=1.5) for p, pub in pubs.items()], cfg, topology=topo, registry=reg, stop=stop))

        def frames(p: str) -> float:
            return (reg.get_sample_value("infernex_kv_bridge_frames_total", {"pod": p, "path": "live"}) or 0)

        def published(p: str) -> float:
            return reg.get_sample_value("infernex_kv_bridge_published_total", {"pod": p}) or 0

        deadline = time.monotonic() + 30
        while not all(frames(p) for p in pubs):  # both SUB sockets have joined
            assert time.monotonic() < deadline and not task.done(), task.done() and task.exception()
            for pub in pubs.values():
                pub.publish(batch(pub.next_seq))
            await asyncio.sleep(0.05)

        def burst():
            for pub in pubs.values():
                pub.publish(batch(pub.next_seq))

        for _ in range(20):
            burst()
            await asyncio.sleep(0.01)
        server.stop()  # NATS goes away while both engines keep publishing
        for _ in range(30):
            burst()
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)
        server.start()
        for _ in range(20):
            burst()
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 60
        while any(published(p) < pubs[p].next_seq for p in pubs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert all(published(p) == pubs[p].next_seq for p in pubs), {p: (published(p), pubs[p].next_seq) for p in pubs}
        stop.set()
        await asyncio.wait_for(task, 30)

        for p, subject in subjects.items():
            got = await stored_batches(nc.jetstream(), subject, stream, f"dur-check-{p}")
            assert [b.seq for b in got] == list(range(pubs[p].next_seq)), p  # every batch, once, in order
            assert {b.pod for b in got} == {p}
        assert sum(reg.get_sample_value("infernex_kv_bridge_publish_retries_total", {"pod": p}) or 0 for p in pubs) >= 1
    finally:
        stop.set()
        if task is not None and not task.done():
            await bus.cancel_task(task, timeout=10)
        for pub in pubs.values():
            pub.close()
        if nc is not None:
            await nc.close()
        server.cleanup()
