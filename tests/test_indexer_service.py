"""The indexer service on a real nats-server: consume, query over HTTP and NATS, dead letters,
snapshots, SIGKILL-and-restart."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.indexer import IndexerConfig, IndexerService
from schemas import subjects as S
from schemas.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodReset
from streams.clock import ManualClock
from streams.kv_index import KvIndex

BS = 4
MODEL = "Qwen/Qwen3-8B"


def toks(*blocks: int) -> list[int]:
    return [t for b in blocks for t in range(b * 10, b * 10 + BS)]


class Workload:
    """A deterministic stream of valid batches over a few pods (stores with chains, removals)."""

    def __init__(self, pods=("p0", "p1", "p2", "p3"), seed: int = 7):
        self.rng = random.Random(seed)
        self.pods = list(pods)
        self.seq = {p: -1 for p in pods}
        self.held: dict[str, dict[int, tuple]] = {p: {} for p in pods}

    def next(self) -> KvEventBatch:
        rng = self.rng
        pod = rng.choice(self.pods)
        mine = self.held[pod]
        events = []
        if mine and rng.random() < 0.3:
            gone = rng.sample(sorted(mine), min(len(mine), rng.randint(1, 3)))
            for h in gone:
                mine.pop(h)
            events.append(BlockRemoved(block_hashes=gone))
        else:
            if mine and rng.random() < 0.6:
                parent = rng.choice(sorted(mine))
                path = mine[parent]
            else:
                parent, path = None, ()
            blocks = [rng.randint(0, 5) for _ in range(rng.randint(1, 4))]
            hashes = []
            for b in blocks:
                path = path + (b,)
                h = (hash(path) & 0xFFFFFFFFFFFF) | 1
                hashes.append(h)
                mine[h] = path
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks(*blocks),
                                      block_size=BS))
        self.seq[pod] += 1
        return KvEventBatch(pod=pod, model=MODEL, seq=self.seq[pod], ts=time.time(), events=events)


async def publish(js, prefix, batch: KvEventBatch):
    subject = S.with_prefix(prefix, S.kv_events(batch.model, batch.pod))
    return await bus.publish(js, subject, batch.to_json(), msg_id=batch.msg_id)


async def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]


@pytest.fixture
async def service(nats_config, topology):
    registry = CollectorRegistry()
    cfg = IndexerConfig(http_port=0, durable="ix-test", snapshot_every_events=5)
    svc = IndexerService(cfg, nats_config, registry=registry, tokenizer=WordTokenizer())
    await svc.start()
    yield svc
    await svc.stop()
    js_nc = await bus.connect(nats_config)
    try:
        await js_nc.jetstream().delete_object_store(svc.bucket)
    except Exception:  # noqa: BLE001
        pass
    await js_nc.close()


async def test_consumes_and_answers_over_http_and_nats(service, nc, prefix):
    js = nc.jetstream()
    b1 = KvEventBatch(pod="pod-a", model=MODEL, seq=0, ts=time.time(),
                      events=[BlockStored(block_hashes=[1, 2, 3], token_ids=toks(1, 2, 3), block_size=BS)])
    b2 = KvEventBatch(pod="pod-b", model=MODEL, seq=0, ts=time.time(),
                      events=[BlockStored(block_hashes=[1], token_ids=toks(1), block_size=BS, medium="CPU")])
    for b in (b1, b2):
        ack = await publish(js, prefix, b)
    last = ack.seq

    async def applied():
        return service.applied_seq >= last

    await wait_for(applied, what="batches applied")
    base = f"http://127.0.0.1:{service.http_port}"
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        r = await http.post("/v1/index/query", json={"model": MODEL, "token_ids": toks(1, 2, 9)})
        assert r.status_code == 200
        body = r.json()
        assert body["block_size"] == BS
        assert body["pods"]["pod-a"]["matched_blocks"] == 2 and body["pods"]["pod-a"]["tiers"] == {"GPU": 2}
        assert body["pods"]["pod-b"]["tiers"] == {"CPU": 1}
        # prompt through the configured tokenizer gives the same answer
        r2 = await http.post("/v1/index/query", json={"model": MODEL, "prompt": " ".join(map(str, toks(1, 2, 9)))})
        assert r2.json() == body
        # NATS request-reply, same JSON
        reply = await nc.request(S.with_prefix(prefix, S.KV_INDEX_QUERY),
                                 json.dumps({"model": MODEL, "token_ids": toks(1, 2, 9)}).encode(), timeout=5)
        assert json.loads(reply.data) == body
        # bad queries: 4xx with a message, over both
        bad = await http.post("/v1/index/query", json={"model": MODEL})
        assert bad.status_code == 400 and "exactly one" in bad.json()["error"]
        bad = await http.post("/v1/index/query", content=b"{nope")
        assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]
        bad = await http.get("/v1/index/query")
        assert bad.status_code == 405 and bad.json()["error"]
        reply = await nc.request(S.with_prefix(prefix, S.KV_INDEX_QUERY), b'{"model": 3}', timeout=5)
        assert json.loads(reply.data)["status"] == 400
        # approximate mode: a recorded route shows up as predicted blocks
        r = await http.post("/v1/index/route", json={"model": MODEL, "pod": "pod-c", "token_ids": toks(1, 2)})
        assert r.status_code == 200
        got = (await http.post("/v1/index/query", json={"model": MODEL, "token_ids": toks(1, 2, 9)})).json()
        assert got["pods"]["pod-c"]["matched_blocks"] == 2 and got["pods"]["pod-c"]["predicted_blocks"] == 2
        bad = await http.post("/v1/index/route", json={"model": MODEL, "pod": "pod-c"})
        assert bad.status_code == 400
        pods = (await http.get("/v1/index/pods")).json()["pods"]
        assert pods["pod-a"]["blocks"] == {"GPU": 3} and pods["pod-b"]["blocks"] == {"CPU": 1}
        assert (await http.get("/health")).json()["applied_seq"] == last

        # cache reset and engine restart remove a pod's blocks
        ack = await publish(js, prefix, KvEventBatch(pod="pod-b", model=MODEL, seq=1, ts=time.time(),
                                                     events=[AllBlocksCleared()]))
        ack = await publish(js, prefix, KvEventBatch(pod="pod-a", model=MODEL, epoch=1, seq=0, ts=time.time(),
                                                     events=[PodReset()]))
        last = ack.seq
        await wait_for(applied, what="reset applied")
        r = await http.post("/v1/index/query", json={"model": MODEL, "token_ids": toks(1, 2, 9)})
        assert set(r.json()["pods"]) == {"pod-c"}  # only the (unexpired) prediction is left
        metrics = (await http.get("/metrics")).text
        assert "infernex_indexer_batches_total 4.0" in metrics
        assert "infernex_indexer_query_seconds_count{via=\"http\"}" in metrics
        assert "infernex_indexer_snapshot_age_seconds" in metrics
        # tables made ahead of a doubling: none for a handful of blocks (they start at 65,536 rows)
        assert 'infernex_indexer_spare_tables_total{outcome="made"} 0.0' in metrics
        assert 'infernex_indexer_spare_tables_total{outcome="dropped"} 0.0' in metrics


async def test_poison_messages_go_to_the_dead_letter_subject(service, nc, prefix):
    js = nc.jetstream()
    dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.KV_EVENTS)), ordered_consumer=True)
    subj = S.with_prefix(prefix, S.kv_events(MODEL, "pod-x"))
    await bus.publish(js, subj, b"not json")
    wrong = KvEventBatch(pod="someone-else", model=MODEL, seq=0, ts=time.time(), events=[])
    await bus.publish(js, subj, wrong.to_json())
    huge = KvEventBatch(pod="pod-x", model=MODEL, seq=0, ts=time.time(),
                        events=[BlockStored(block_hashes=[9], token_ids=[1 << 40] * BS, block_size=BS)])
    await bus.publish(js, subj, huge.to_json())
    good = KvEventBatch(pod="pod-x", model=MODEL, seq=1, ts=time.time(),
                        events=[BlockStored(block_hashes=[5], token_ids=toks(5), block_size=BS)])
    ack = await bus.publish(js, subj, good.to_json())
    letters = [json.loads((await dlq.next_msg(timeout=10)).data) for _ in range(3)]
    assert "KvEventBatch" in letters[0]["reason"] and letters[0]["subject"] == subj
    assert "someone-else" in letters[1]["reason"]
    assert letters[2]["reason"].startswith("not indexable")

    async def applied():
        return service.applied_seq >= ack.seq

    await wait_for(applied, what="consumer kept going")
    assert service.query({"model": MODEL, "token_ids": toks(5)})["pods"]["pod-x"]["matched_blocks"] == 1
    assert service._dlq.count == 3


@pytest.mark.parametrize("fork", [True, False], ids=["forked-snapshots", "threaded-snapshots"])
async def test_snapshot_and_restart_in_process(nats_config, topology, nc, prefix, fork):
    js = nc.jetstream()
    wl = Workload(seed=3)
    truth = KvIndex(ManualClock())
    cfg = IndexerConfig(http_port=None, nats_query=False, durable="ix-snap", snapshot_every_events=10,
                        snapshot_fork=fork)
    a = IndexerService(cfg, nats_config, registry=CollectorRegistry())
    await a.start()
    for _ in range(60):
        b = wl.next()
        truth.apply(b)
        ack = await publish(js, prefix, b)

    async def a_done():
        return a.applied_seq >= ack.seq

    await wait_for(a_done, what="first instance caught up")
    await a.stop()
    assert a.snapshot_seq == ack.seq  # the final snapshot covers everything
    for _ in range(40):
        b = wl.next()
        truth.apply(b)
        ack = await publish(js, prefix, b)
    b_svc = IndexerService(cfg, nats_config, registry=CollectorRegistry())
    await b_svc.start()
    try:
        assert b_svc.restored_batches > 0

        async def b_done():
            return b_svc.applied_seq >= ack.seq

        await wait_for(b_done, what="second instance caught up")
        assert b_svc.index == truth
        assert b_svc.index.totals.stale_batches == 0  # resumed exactly after the snapshot
        assert a.metrics.snapshots._value.get() >= 2  # periodic ones (every 10 batches) and the final one
    finally:
        await b_svc.stop()
        await js.delete_object_store(b_svc.bucket)


def _start_indexer(env, port):
    return subprocess.Popen(
        [sys.executable, "-m", "infernex.cli", "indexer", "--http-port", str(port), "--durable", "ix-kill",
         "--snapshot-every-events", "40"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def test_sigkill_mid_stream_then_restart_equals_ground_truth(nats_config, topology, nc, prefix):
    from infernex.embedded_nats import free_port

    js = nc.jetstream()
    port = free_port()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_config.servers[0], INFERNEX_NATS__SUBJECT_PREFIX=prefix,
               INFERNEX_LOG_LEVEL="WARNING")
    wl = Workload(seed=11)
    truth = KvIndex(ManualClock())
    batches = [wl.next() for _ in range(400)]
    for b in batches:
        truth.apply(b)
    proc = _start_indexer(env, port)
    procs = [proc]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            async def health():
                try:
                    return (await http.get("/health")).json()
                except httpx.HTTPError:
                    return None

            async def up():
                return await health() is not None

            await wait_for(up, timeout=60, what="indexer subprocess up")

            async def feed():
                for i, b in enumerate(batches):
                    await publish(js, prefix, b)
                    if i % 20 == 19:
                        await asyncio.sleep(0.05)

            feeder = asyncio.create_task(feed())

            async def midway():
                h = await health()
                return h is not None and h["applied_seq"] >= 150

            await wait_for(midway, timeout=60, what="indexer midway")
            before = await health()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            assert before["applied_seq"] < len(batches)
            await feeder
            proc = _start_indexer(env, port)
            procs.append(proc)

            async def caught_up():
                h = await health()
                return h is not None and h["applied_seq"] >= len(batches)

            await wait_for(caught_up, timeout=60, what="restarted indexer caught up")
            h = await health()
            # resumed from a snapshot taken before the kill, so events after it were replayed
            assert h["restored_batches"] > 0 and 0 < h["restored_seq"] < len(batches)
            state = (await http.get("/v1/index/state")).json()
            assert state["fingerprint"] == truth.fingerprint()
            # and queries agree with the ground truth
            for path in ([0], [1, 2], [3, 4, 5], [2, 0, 1]):
                body = {"model": MODEL, "token_ids": toks(*path)}
                got = (await http.post("/v1/index/query", json=body)).json()["pods"]
                expect = {p: m.matched_blocks for p, m in truth.match_tokens(MODEL, toks(*path)).items()}
                assert {p: v["matched_blocks"] for p, v in got.items()} == expect
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=20)
            assert "indexer stopped" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        try:
            await js.delete_object_store(f"{prefix}_kv-index-snapshots")
        except Exception:  # noqa: BLE001
            pass


async def test_acks_follow_applies_and_a_delivery_gap_rereads_the_stream(nats_config, topology, nc, prefix):
    js = nc.jetstream()
    wl = Workload(seed=5)
    truth = KvIndex(ManualClock())
    registry = CollectorRegistry()
    cfg = IndexerConfig(http_port=None, nats_query=False, durable="ix-acks", snapshot_every_events=10**6,
                        snapshot_every_s=0.5)
    svc = IndexerService(cfg, nats_config, registry=registry)
    await svc.start()
    try:
        async def feed(n):
            for _ in range(n):
                b = wl.next()
                truth.apply(b)
                ack = await publish(js, prefix, b)
            return ack.seq

        last = await feed(50)

        async def applied():
            return svc.applied_seq >= last

        await wait_for(applied, what="batches applied")

        async def acked():  # AckPolicy.ALL on the last applied message: nothing left pending
            info = await js.consumer_info(svc.stream, "ix-acks")
            return info.ack_floor.stream_seq == last and info.num_ack_pending == 0

        await wait_for(acked, what="all applied messages acked")
        assert (await js.consumer_info(svc.stream, "ix-acks")).config.deliver_subject  # a push consumer

        async def snapshotted():  # by time, while the stream is idle
            return svc.snapshot_seq == last

        await wait_for(snapshotted, what="idle snapshot")

        # a message the client dropped shows as a jump of the delivery sequence: the service
        # re-reads the stream from the last applied sequence, missing nothing, applying nothing twice
        class Skipped:
            subject = S.with_prefix(prefix, S.kv_events(MODEL, "p0"))
            reply = f"$JS.ACK.{svc.stream}.ix-acks.1.{last + 7}.{svc._next_dseq + 3}.0.0"
            data = b"{}"
            headers = None

        await svc._on_msg(Skipped())
        last = await feed(30)
        await wait_for(applied, what="batches after the re-read applied")
        assert registry.get_sample_value("infernex_indexer_consumer_resyncs_total") == 1
        assert svc.index == truth and svc.index.totals.stale_batches == 0
        assert registry.get_sample_value("infernex_indexer_batches_total") == 80
        assert svc._dlq.count == 0
    finally:
        await svc.stop()
        await js.delete_object_store(svc.bucket)


async def test_an_unreadable_snapshot_means_replaying_the_whole_stream(nats_config, topology, nc, prefix):
    js = nc.jetstream()
    wl = Workload(seed=9)
    truth = KvIndex(ManualClock())
    for _ in range(30):
        b = wl.next()
        truth.apply(b)
        ack = await publish(js, prefix, b)
    cfg = IndexerConfig(http_port=None, nats_query=False, durable="ix-bad", snapshot_on_stop=False)
    svc = IndexerService(cfg, nats_config, registry=CollectorRegistry())
    obj = await js.create_object_store(svc.bucket)
    await obj.put("ix-bad", b"garbage, not an indexer snapshot")
    await svc.start()
    try:
        assert svc.restored_batches == 0

        async def applied():
            return svc.applied_seq >= ack.seq

        await wait_for(applied, what="the stream replayed")
        assert svc.index == truth
    finally:
        await svc.stop()
        await js.delete_object_store(svc.bucket)


async def test_a_router_replica_starts_from_the_indexer_snapshot(nats_config, topology, nc, prefix):
    """A router's embedded index loads the indexer's snapshot and reads only what came after it,
    instead of replaying the whole KV stream."""
    from router.config import RouterConfig
    from router.feeds import BusFeeds
    from router.state import ClusterState

    js = nc.jetstream()
    wl = Workload(seed=11)
    truth = KvIndex(ManualClock())
    cfg = IndexerConfig(http_port=None, nats_query=False, durable="ix-for-router", snapshot_every_events=10_000)
    ix = IndexerService(cfg, nats_config, registry=CollectorRegistry())
    await ix.start()
    feeds = None
    try:
        for _ in range(80):
            b = wl.next()
            truth.apply(b)
            ack = await publish(js, prefix, b)

        async def ix_done():
            return ix.applied_seq >= ack.seq

        await wait_for(ix_done, what="indexer caught up")
        await ix.snapshot()
        covered = ix.snapshot_seq
        after = 30
        for _ in range(after):
            b = wl.next()
            truth.apply(b)
            ack = await publish(js, prefix, b)

        registry = CollectorRegistry()
        embedded = KvIndex(ManualClock())
        feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=embedded, registry=registry,
                         kv_snapshot=f"{cfg.snapshot_bucket}/{cfg.durable}")
        await feeds.start()
        assert feeds.kv_start_seq == covered + 1 and feeds.kv_restored_batches > 0

        def kv_applied() -> float:
            return registry.get_sample_value("infernex_router_feed_messages_total", {"kind": "KvEventBatch"}) or 0.0

        async def router_done():
            return kv_applied() >= after

        await wait_for(router_done, what="router feed caught up")
        await asyncio.sleep(0.2)
        assert kv_applied() == after  # only the batches after the snapshot were read from the stream
        assert embedded == truth
    finally:
        if feeds is not None:
            await feeds.stop()
        await ix.stop()
        await js.delete_object_store(ix.bucket)
