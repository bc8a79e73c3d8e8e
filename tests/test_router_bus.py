"""The router fed from a real NATS JetStream: discovery by announcement, KV events -> prefix
routing, diagnoses -> exclusion, malformed input -> dead letters, records published."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from consumers import bus
from router.app import RouterApp
from router.config import RouterConfig
from router.testing import FakeEngine, wait_for
from schemas import BlockStored, DeadLetter, Diagnosis, EngineAnnouncement, KvEventBatch, RequestRecord, RoutingDecision
from schemas import subjects as S
from simulator.tokenizer import SimpleTokenizer
from streams.kv_index import block_keys

PROMPT = " ".join(f"word{i}" for i in range(80))  # 80+ tokens: 5 blocks of 16


async def pub(js, prefix, subject, event, msg_id=None):
    await bus.publish(js, S.with_prefix(prefix, subject), event.to_json(), msg_id=msg_id)


@pytest.fixture
async def routed(nats_config, topology, nc, prefix):
    engines = [await FakeEngine(p).start() for p in ("a", "b", "c")]
    cfg = RouterConfig(strategy="kv-aware", seed=1, records=True)
    app = RouterApp(cfg, nats_config)
    url = await app.start("127.0.0.1", 0)
    js = nc.jetstream()
    now = time.time()
    for e in engines:
        await pub(js, prefix, S.engine_announce(e.pod),
                  EngineAnnouncement(pod=e.pod, url=e.url, model="m", ts=now, node="n1", devices=[f"d-{e.pod}"]))
    assert await wait_for(lambda: len(app.state.snapshot()) == 3, timeout=15)
    yield app, url, js, engines
    await app.stop(drain=True)
    for e in engines:
        await e.stop()


async def served_by(url, prompt, n=1):
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
                out.append((await r.json())["served_by"])
    return out


async def test_kv_events_steer_prefix_requests_and_diagnosis_excludes(routed, prefix):
    app, url, js, engines = routed
    ids = SimpleTokenizer().encode(PROMPT)
    blocks = len(ids) // 16
    batch = KvEventBatch(pod="b", model="m", seq=0, ts=time.time(), events=[
        BlockStored(block_hashes=list(range(1, blocks + 1)), token_ids=ids[:blocks * 16], block_size=16)])
    await pub(js, prefix, S.kv_events("m", "b"), batch, msg_id=batch.msg_id)
    assert await wait_for(lambda: app.index.match_tokens("m", ids).get("b") is not None, timeout=15)
    assert await served_by(url, PROMPT, 4) == ["b"] * 4  # the pod holding the prefix, every time
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/router/backends") as r:
            info = {x["pod"]: x for x in (await r.json())["backends"]}
    assert info["b"]["cached_blocks"] == blocks and info["a"]["cached_blocks"] == 0
    other = await served_by(url, "something else entirely", 6)
    assert set(other) >= {"a", "c"}  # no prefix: spread by load

    # a critical finding on b's device (the finding does not name the pod; the announcement maps it)
    d = Diagnosis(finding_id="f1", node="n1", device="d-b", fault_mode="hbm_ecc_burst", severity="critical",
                  status="open", action="SeparateNPU", summary="ECC burst", first_seen=time.time(),
                  last_seen=time.time())
    await pub(js, prefix, S.diagnosis("n1", "d-b"), d)
    assert await wait_for(lambda: app.state.get("b").health == "critical", timeout=15)
    assert "b" not in await served_by(url, PROMPT, 4)
    resolved = d.model_copy(update={"status": "resolved", "last_seen": time.time()})
    await pub(js, prefix, S.diagnosis("n1", "d-b"), resolved)
    assert await wait_for(lambda: app.state.get("b").health == "ok", timeout=15)
    assert await served_by(url, PROMPT, 2) == ["b", "b"]

    # records: one request record and decisions per request, on the ROUTER stream
    sub = await js.subscribe(S.with_prefix(prefix, S.router_requests("default")), ordered_consumer=True)
    recs = []
    deadline = time.monotonic() + 15
    while len(recs) < 16 and time.monotonic() < deadline:
        try:
            msg = await sub.next_msg(timeout=1)
        except Exception:  # noqa: BLE001 - nats TimeoutError: keep polling until the deadline
            continue
        recs.append(RequestRecord.from_json(msg.data))
    await sub.unsubscribe()
    assert len(recs) == 16
    reusable = (len(ids) - 1) // 16  # vLLM computes the last prompt token even when it is cached
    prefixed = [r for r in recs if r.best_overlap_blocks == reusable]
    assert len(prefixed) == 10  # 4 + 4 (b critical) + 2
    assert sum(1 for r in prefixed if r.chosen_overlap_blocks == reusable and r.pods == ["b"]) == 6
    # while b was excluded the prompt went elsewhere: the first time with nothing cached there, then
    # to where this router just sent it (kv-aware counts its own routes as predicted blocks)
    away = [r for r in prefixed if r.pods != ["b"]]
    assert len(away) == 4 and len({tuple(r.pods) for r in away}) == 1
    assert [r.chosen_overlap_blocks for r in sorted(away, key=lambda r: r.ts)] == [0, reusable, reusable, reusable]
    assert all(r.status == "ok" and r.output_tokens == 2 and r.cached_tokens == 4 for r in recs)
    dsub = await js.subscribe(S.with_prefix(prefix, S.router_decisions("default")), ordered_consumer=True)
    msg = await dsub.next_msg(timeout=10)
    dec = RoutingDecision.from_json(msg.data)
    await dsub.unsubscribe()
    assert dec.profile == "kv-aware" and dec.picked == "b" and len(dec.candidates) == 3
    # the prompt's block keys travel packed (base64 of uint64) and read back as the index's own keys
    assert isinstance(json.loads(msg.data)["inputs"]["prefix_keys"], str)
    assert dec.inputs.prefix_keys == list(block_keys(ids[: len(ids) - 1], 16)) and len(dec.inputs.prefix_keys) == reusable


async def test_bus_metrics_make_backends_busy_and_bad_messages_are_dead_lettered(routed, prefix, nc):
    app, url, js, engines = routed
    await bus.publish(js, S.with_prefix(prefix, S.engine_metrics("a")), b'{"pod": "a", "oops": 1}')
    from schemas import EngineMetrics

    for pod in ("a", "b", "c"):
        await pub(js, prefix, S.engine_metrics(pod), EngineMetrics(
            pod=pod, model="m", ts=time.time(), num_requests_running=4, num_requests_waiting=0,
            kv_cache_usage_perc=0.99 if pod != "c" else 0.3))
    assert await wait_for(lambda: app.state.get("a").kv_usage == 0.99 and app.state.get("c").kv_usage == 0.3,
                          timeout=15)
    assert await served_by(url, "hi", 3) == ["c"] * 3
    await pub(js, prefix, S.engine_metrics("c"), EngineMetrics(
        pod="c", model="m", ts=time.time(), num_requests_running=4, num_requests_waiting=0, kv_cache_usage_perc=0.99))
    assert await wait_for(lambda: app.state.get("c").kv_usage == 0.99, timeout=15)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 503 and "Retry-After" in r.headers
    sub = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.ENGINE)), ordered_consumer=True)
    msg = await sub.next_msg(timeout=10)
    await sub.unsubscribe()
    letter = DeadLetter.from_json(msg.data)
    assert letter.subject == S.engine_metrics("a") and "EngineMetrics" in letter.reason
