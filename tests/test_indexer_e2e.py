"""Simulated engines -> ZMQ -> bridge -> JetStream -> indexer: after a scripted workload every
query matches what each engine actually caches (ground truth from the engine itself)."""

from __future__ import annotations

import asyncio
import random
import time

from prometheus_client import CollectorRegistry

from consumers.indexer import IndexerConfig, IndexerService
from consumers.kv_bridge import BridgeConfig, KvBridge
from schemas import subjects as S
from simulator.config import EngineConfig
from simulator.engine_core import EngineCore
from simulator.hashing import to_external
from simulator.kv_publisher import KvEventPublisher
from streams.topology import stream_for_subject

MODEL = "sim-model"
BS = 4


async def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def engine_prefix(engine: EngineCore, prompt: list[int]) -> int:
    """How many leading blocks of ``prompt`` the engine has in its prefix cache."""
    cached = engine.cached_block_hashes()
    n = 0
    for h in engine.hasher.hash_blocks(prompt):
        if to_external(h) not in cached:
            break
        n += 1
    return n


def run_request(engine: EngineCore, pub: KvEventPublisher, rid: str, prompt: list[int], now: float) -> float:
    engine.add_request(rid, prompt, max_tokens=3, arrival_time=now)
    while engine.has_work:
        res = engine.step(now)
        now = max(now + 1e-3, res.end)
        events = list(res.events) + engine.take_pending_events()
        if events:
            pub.publish(events)
    return now


async def test_simulator_bridge_indexer_agree_with_engine_caches(nats_config, nc, prefix, topology):
    # two engines that hash differently: the index must not care
    engines = {
        "pod-1": EngineCore(EngineConfig(engine_id="e1", served_model_name=MODEL, block_size=BS, num_gpu_blocks=48,
                                         prefix_caching_hash_algo="sha256", vocab_size=1000)),
        "pod-2": EngineCore(EngineConfig(engine_id="e2", served_model_name=MODEL, block_size=BS, num_gpu_blocks=48,
                                         prefix_caching_hash_algo="xxhash", hash_seed="7", vocab_size=1000)),
    }
    pubs = {p: KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for p in engines}
    subject = S.with_prefix(prefix, S.kv_events(MODEL, "pod-1"))
    stream = stream_for_subject(topology, subject).name
    bridges, stops, tasks = [], [], []
    service = IndexerService(IndexerConfig(http_port=None, durable="ix-e2e"), nats_config,
                             registry=CollectorRegistry())
    try:
        for pod, pub in pubs.items():
            cfg = BridgeConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, pod=pod, model=MODEL)
            bridge = KvBridge(cfg, nc, subject_prefix=prefix, registry=CollectorRegistry(), stream=stream)
            stop = asyncio.Event()
            tasks.append(asyncio.create_task(bridge.run(stop)))
            await asyncio.wait_for(bridge.ready.wait(), 10)
            bridges.append(bridge)
            stops.append(stop)
        # PUB/SUB joins asynchronously: send empty steps until each bridge sees frames
        deadline = time.monotonic() + 20
        while any(b.stats.frames == 0 for b in bridges):
            assert time.monotonic() < deadline, "bridges never joined"
            for pub in pubs.values():
                pub.publish([])
            await asyncio.sleep(0.05)
        await service.start()

        rng = random.Random(5)
        systems = [[rng.randrange(100, 1000) for _ in range(BS * rng.randint(2, 5))] for _ in range(4)]
        prompts = []
        now = 0.0
        for i in range(40):
            prompt = rng.choice(systems) + [rng.randrange(100, 1000) for _ in range(rng.randint(1, 10))]
            prompts.append(prompt)
            pod = rng.choice(sorted(engines))
            now = run_request(engines[pod], pubs[pod], f"r{i}", prompt, now)
            if i == 25:
                assert engines["pod-1"].reset_prefix_cache()  # a cache reset mid-workload
                pubs["pod-1"].publish(engines["pod-1"].take_pending_events())
            await asyncio.sleep(0)

        js = nc.jetstream()

        pods = sorted(engines)

        async def all_applied():
            # every batch each engine sent has reached its bridge (PUB/SUB delivers asynchronously) ...
            if any(b.tracker.last_seq != pubs[p].next_seq - 1 for p, b in zip(pods, bridges)):
                return False
            # ... been published, and been folded by the indexer
            if any(b.stats.published < b.stats.frames for b in bridges):
                return False
            last = (await js.stream_info(stream)).state.last_seq
            return service.applied_seq >= last

        await wait_for(all_applied, timeout=60, what="every engine batch indexed")
        removed = service.index.totals.blocks_removed
        assert removed > 0, "the workload should evict blocks"
        checked = 0
        for prompt in prompts + [s + [1, 2, 3, 4, 5] for s in systems]:
            got = service.query({"model": MODEL, "token_ids": prompt})["pods"]
            for pod, engine in engines.items():
                expect = engine_prefix(engine, prompt)
                assert got.get(pod, {}).get("matched_blocks", 0) == expect, (pod, prompt)
                checked += expect
        assert checked > 0
        assert service.index.totals.unknown_parent == 0
    finally:
        for s in stops:
            s.set()
        for t in tasks:
            await asyncio.wait_for(t, 30)
        for pub in pubs.values():
            pub.close()
        await service.stop()
        try:
            await nc.jetstream().delete_object_store(service.bucket)
        except Exception:  # noqa: BLE001
            pass
