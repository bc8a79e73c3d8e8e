"""A router that starts with a backlog on the KV stream is not ready until its index has read it.

Ground truth: three engines' histories (blocks stored one batch at a time, then some evicted) are
published before the router's feed starts. While the feed reads them the router says it is not
ready; the moment it says it is, its index must hold exactly what each engine holds."""

from __future__ import annotations

import logging
import time

import aiohttp
from prometheus_client import CollectorRegistry

from consumers import bus
from router.app import RouterApp
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from router.testing import FakeEngine, wait_for
from schemas import BlockRemoved, BlockStored, EngineAnnouncement, KvEventBatch
from schemas import subjects as S
from streams.clock import SystemClock
from streams.kv_index import KvIndex

BS = 16
#: per pod: blocks stored (one batch each), then how many of the last are evicted
HISTORY = {"p0": (300, 40), "p1": (250, 0), "p2": (200, 120)}


def tokens(pod: str) -> list[int]:
    base = 1000 * (int(pod[1:]) + 1)
    return [base + i for i in range(HISTORY[pod][0] * BS)]


async def publish_backlog(js, prefix: str) -> int:
    """Each pod's history as KV batches on the stream; returns how many messages."""
    n = 0
    for pod, (stored, evicted) in HISTORY.items():
        ids = tokens(pod)
        hashes = [hash((pod, i)) & (2**63 - 1) or 1 for i in range(stored)]
        seq = 0
        for i in range(stored):
            ev = BlockStored(block_hashes=[hashes[i]], parent_block_hash=hashes[i - 1] if i else None,
                             token_ids=ids[i * BS:(i + 1) * BS], block_size=BS)
            b = KvEventBatch(pod=pod, model="m", seq=seq, ts=time.time(), events=[ev])
            await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", pod)), b.to_json(), msg_id=b.msg_id)
            seq += 1
            n += 1
        if evicted:
            b = KvEventBatch(pod=pod, model="m", seq=seq, ts=time.time(),
                             events=[BlockRemoved(block_hashes=hashes[stored - evicted:])])
            await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", pod)), b.to_json(), msg_id=b.msg_id)
            n += 1
    return n


def held(index: KvIndex) -> dict[str, int]:
    """Blocks of each pod's own token sequence the index says it holds, from the start."""
    return {pod: (index.match_tokens("m", tokens(pod)).get(pod) or (0,))[0] for pod in HISTORY}


async def test_not_ready_while_reading_the_backlog_and_exact_when_ready(nats_config, nc, topology, prefix):
    n = await publish_backlog(nc.jetstream(), prefix)
    truth = {pod: stored - evicted for pod, (stored, evicted) in HISTORY.items()}
    index = KvIndex(SystemClock(), default_block_size=BS)
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=index, registry=CollectorRegistry(),
                     kv_catchup_timeout_s=60)
    seen_ready: list[bool] = []  # the feed's readiness at each fold of a batch
    apply_many = index.apply_many

    def watched(batches, **kw):
        seen_ready.append(feeds.kv_status()[0])
        return apply_many(batches, **kw)

    index.apply_many = watched
    at_ready: dict[str, int] = {}
    done = feeds._kv_done

    def noted() -> None:
        at_ready.update(held(index))
        done()

    feeds._kv_done = noted
    await feeds.start()
    try:
        ok, why = feeds.kv_status()
        assert feeds.kv_target_seq == n
        if not ok:  # the reason names how far behind the feed is
            assert "messages behind" in why
        assert await wait_for(lambda: feeds.kv_status()[0], timeout=30)
        assert at_ready == truth  # the moment it said ready, the index held what each engine holds
        assert len(seen_ready) == n and not any(seen_ready)  # never ready before the last backlog message
        assert feeds.kv_catchup_s is not None and feeds._behind._value.get() == 0
        # later messages are not the backlog: the feed stays ready
        b = KvEventBatch(pod="p1", model="m", seq=1000, ts=time.time(), events=[BlockRemoved(block_hashes=[1])])
        await bus.publish(nc.jetstream(), S.with_prefix(prefix, S.kv_events("m", "p1")), b.to_json(), msg_id=b.msg_id)
        assert await wait_for(lambda: len(seen_ready) == n + 1, timeout=10)
        assert seen_ready[-1] is True
    finally:
        await feeds.stop()


async def test_an_empty_stream_is_ready_at_once(nats_config, nc, topology, prefix):
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=KvIndex(SystemClock()),
                     registry=CollectorRegistry())
    await feeds.start()
    try:
        assert feeds.kv_status() == (True, None) and feeds.kv_target_seq == 0
    finally:
        await feeds.stop()


def test_the_wait_is_bounded_and_says_so(caplog):
    feeds = BusFeeds.__new__(BusFeeds)
    BusFeeds.__init__(feeds, type("NoBus", (), {"jetstream": lambda self: None})(), ClusterState(RouterConfig()),
                      index=KvIndex(SystemClock()), registry=CollectorRegistry(), kv_catchup_timeout_s=5.0)
    feeds.kv_caught_up, feeds.kv_target_seq, feeds.kv_seen_seq = False, 900, 150
    feeds._kv_t0 = time.monotonic() - 1.0
    ok, why = feeds.kv_status()
    assert not ok and "750 messages behind" in why
    feeds._kv_t0 = time.monotonic() - 6.0
    with caplog.at_level(logging.WARNING, logger="router.feeds"):
        assert feeds.kv_status() == (True, None)
    assert "kv_catchup_timeout_s" in caplog.text
    assert feeds.kv_status() == (True, None)  # stays ready: the warning once


async def test_router_ready_endpoint_reports_the_backlog(nats_config, nc, topology, prefix):
    """The router's /ready and /readyz answer 503 with the reason while its index is behind."""
    engine = await FakeEngine("e0").start()
    app = RouterApp(RouterConfig(strategy="kv-aware", kv_snapshot=None), nats_config)
    url = await app.start("127.0.0.1", 0)
    try:
        await bus.publish(nc.jetstream(), S.with_prefix(prefix, S.engine_announce("e0")),
                          EngineAnnouncement(pod="e0", url=engine.url, model="m", ts=time.time()).to_json())
        assert await wait_for(lambda: len(app.state.snapshot()) == 1, timeout=15)
        app.feeds.kv_caught_up, app.feeds.kv_target_seq, app.feeds.kv_seen_seq = False, 40, 10
        async with aiohttp.ClientSession() as s:
            for path in ("/ready", "/readyz"):
                async with s.get(url + path) as r:
                    body = await r.json()
                    assert r.status == 503 and "30 messages behind" in body["reason"]
            app.feeds._kv_done()
            async with s.get(url + "/ready") as r:
                assert r.status == 200 and (await r.json())["ready"] is True
    finally:
        await app.stop(drain=False)
        await engine.stop()


async def test_no_wait_when_switched_off(nats_config, nc, topology, prefix):
    n = await publish_backlog(nc.jetstream(), prefix)
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=KvIndex(SystemClock(), default_block_size=BS),
                     registry=CollectorRegistry(), kv_catchup_timeout_s=0)
    await feeds.start()
    try:
        assert n > 0 and feeds.kv_status() == (True, None) and feeds.kv_target_seq == 0
    finally:
        await feeds.stop()
