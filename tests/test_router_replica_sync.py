"""Router replicas of one pool share their own in-flight load over a real nats-server: a replica
counts the requests another has in flight on each engine (and so does not pick an engine that
only looks idle to it), forgets them when they finish, when the other stops and when the other
goes silent; a malformed sync message is dead-lettered and changes nothing."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from router.app import RouterApp
from router.config import RouterConfig, StaticBackend
from router.replica_sync import ReplicaSync
from router.state import ClusterState, backend_from_static
from router.testing import FakeEngine, wait_for
from schemas import ReplicaLoad
from schemas import subjects as S

PODS = [f"e{i}" for i in range(6)]


def test_own_load_excludes_the_other_replicas_and_counts_add_up():
    st = ClusterState(RouterConfig(backends=[StaticBackend(pod=p, url=f"http://{p}", model="m") for p in ("a", "b")]))
    a = st.get("a")
    st.started(a, 100, 60)
    st.add_peer_load("a", 2, 300, 200)
    st.add_peer_load("c", 1, 10, 10)  # a pod this replica does not know yet
    assert (a.inflight, a.active_tokens, a.pending_prefill_tokens) == (3, 400, 260)
    assert st.own_load() == {"a": (1, 100, 60)}
    st.first_token(a, 60)
    st.add_peer_load("a", -1, -100, -200)
    assert (a.inflight, a.active_tokens, a.pending_prefill_tokens) == (2, 300, 0)
    st.finished(a, 100, 0)
    assert (a.inflight, a.active_tokens) == (1, 200) and st.own_load() == {}
    st.add_static(backend_from_static(StaticBackend(pod="c", url="http://c", model="m"), "default"))  # with their load
    c = st.get("c")
    assert (c.inflight, c.active_tokens, c.pending_prefill_tokens) == (1, 10, 10) and st.own_load() == {}


@pytest.fixture
async def engines():
    es = [await FakeEngine(p, delay_s=0.5).start() for p in PODS]  # 8 tokens: 4 s a request
    yield es
    for e in es:
        await e.stop()


def _app(engines, nats_config, **kw) -> RouterApp:
    cfg = RouterConfig(strategy="least-load", seed=1, records=False, connect_timeout_s=2,
                       backends=[StaticBackend(pod=e.pod, url=e.url, model="m") for e in engines], **kw)
    return RouterApp(cfg, nats_config, registry=CollectorRegistry())


def _peer_inflight(app: RouterApp) -> int:
    return sum(b.inflight for b in app.state.snapshot())


async def test_a_replica_counts_the_others_requests_and_picks_the_engine_idle_for_both(engines, nats_config, topology):
    one, two = _app(engines, nats_config), _app(engines, nats_config)
    await one.start("127.0.0.1", 0)
    await two.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async def complete():
                async with s.post(one.service.url + "/v1/completions",
                                  json={"model": "m", "prompt": "hi", "max_tokens": 8}) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["served_by"]

            busy = [asyncio.create_task(complete()) for _ in range(len(PODS) - 1)]
            assert await wait_for(lambda: _peer_inflight(two) == len(PODS) - 1, timeout=5)
            assert two.state.own_load() == {}  # all of it is the other replica's
            async with s.get(two.service.url + "/v1/router/backends") as r:  # what an operator sees
                seen = await r.json()
            assert sum(b["inflight_other_replicas"] for b in seen["backends"]) == len(PODS) - 1
            assert seen["replicas"]["self"] == two.sync.replica and one.sync.replica in seen["replicas"]["others"]
            held = {p for p, (i, _, _) in one.state.own_load().items() if i}
            idle = set(PODS) - held
            assert len(held) == len(PODS) - 1 and len(idle) == 1
            for _ in range(5):  # a dry-run decision: only the engine idle for both replicas
                async with s.post(two.service.url + "/v1/router/decide",
                                  json={"model": "m", "prompt": "hello"}) as r:
                    assert (await r.json())["picked"] in idle
            served = await asyncio.gather(*busy)
            assert set(served) == held
        assert await wait_for(lambda: _peer_inflight(two) == 0, timeout=5)  # finished: forgotten
        assert one.sync.replica in two.sync.peers and two.sync.replica in one.sync.peers
    finally:
        await two.stop(drain=False)
        await one.stop(drain=False)


async def test_a_stopping_replica_is_forgotten_at_once_a_silent_one_after_the_timeout(nc, nats_config, prefix):
    st = ClusterState(RouterConfig(backends=[StaticBackend(pod="a", url="http://a", model="m")]))
    sync = ReplicaSync(nc, st, pool="default", prefix=prefix, expire_s=1.5, registry=CollectorRegistry())
    await sync.start()
    subject = S.with_prefix(prefix, S.router_sync("default"))
    try:
        for rep in ("loud", "quiet"):
            await nc.publish(subject, ReplicaLoad(replica=rep, pool="default", seq=1, ts=time.time(),
                                                  pods={"a": (2, 50, 20)}).to_json())
        assert await wait_for(lambda: st.get("a").inflight == 4, timeout=5)
        # an older message from a replica is ignored (one connection's messages arrive in order)
        await nc.publish(subject, ReplicaLoad(replica="loud", pool="default", seq=0, ts=time.time(),
                                              pods={"a": (9, 9, 9)}).to_json())
        await nc.publish(subject, ReplicaLoad(replica="quiet", pool="default", seq=2, ts=time.time(),
                                              pods={"a": (3, 60, 0)}).to_json())
        assert await wait_for(lambda: st.get("a").inflight == 5, timeout=5)
        assert st.get("a").active_tokens == 110 and st.get("a").pending_prefill_tokens == 20
        await nc.publish(subject, ReplicaLoad(replica="loud", pool="default", seq=2, ts=time.time(),
                                              final=True).to_json())
        assert await wait_for(lambda: st.get("a").inflight == 3, timeout=5)  # "loud" said goodbye
        t = time.monotonic()
        assert await wait_for(lambda: st.get("a").inflight == 0, timeout=5)  # "quiet" timed out
        assert time.monotonic() - t > 0.5 and st.get("a").active_tokens == 0 and not sync.peers
    finally:
        await sync.stop()


async def test_a_malformed_sync_message_is_dead_lettered_and_changes_nothing(nc, nats_config, prefix, topology):
    st = ClusterState(RouterConfig(backends=[StaticBackend(pod="a", url="http://a", model="m")]))
    sync = ReplicaSync(nc, st, pool="default", prefix=prefix, registry=CollectorRegistry())
    await sync.start()
    subject = S.with_prefix(prefix, S.router_sync("default"))
    try:
        bad = json.dumps({"schema_version": 1, "replica": "r", "pool": "default", "seq": 1, "ts": 1.0,
                          "pods": {"a": [-3, 0, 0]}}).encode()
        await nc.publish(subject, bad)
        await nc.publish(subject, b"not json")
        assert await wait_for(lambda: sync.dead.count == 2, timeout=5)
        assert st.get("a").inflight == 0 and not sync.peers
        js = nc.jetstream()
        dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.ROUTER)), ordered_consumer=True)
        letter = json.loads((await dlq.next_msg(timeout=5)).data)
        await dlq.unsubscribe()
        assert letter["subject"] == subject and "pods" in letter["reason"]
    finally:
        await sync.stop()


async def test_alone_a_replica_sends_only_its_heartbeat_and_with_a_peer_its_changes(nc, prefix):
    cfg = RouterConfig(backends=[StaticBackend(pod="a", url="http://a", model="m")])
    st = ClusterState(cfg)
    sync = ReplicaSync(nc, st, pool="default", prefix=prefix, registry=CollectorRegistry())
    await sync.start()
    subject = S.with_prefix(prefix, S.router_sync("default"))
    try:
        async def churn(seconds: float) -> int:
            seq0, end = sync._seq, time.monotonic() + seconds
            while time.monotonic() < end:
                st.started(st.get("a"), 10, 10)
                await asyncio.sleep(0.02)
                st.finished(st.get("a"), 10, 10)
                await asyncio.sleep(0.02)
            return sync._seq - seq0

        alone = await churn(1.5)
        assert alone <= 2  # the heartbeat, not one message per change
        await nc.publish(subject, ReplicaLoad(replica="other", pool="default", seq=1, ts=time.time()).to_json())
        assert await wait_for(lambda: "other" in sync.peers, timeout=5)
        assert await churn(1.5) >= 20  # now every change goes out (at most one per 10 ms)
    finally:
        await sync.stop()


async def test_after_a_nats_kill9_the_replicas_find_each_other_and_their_counts_are_true_again(tmp_path, caplog):
    from consumers import bus
    from infernex.embedded_nats import EmbeddedNats, free_port
    from schemas.config import NatsConfig

    server = EmbeddedNats(tmp_path / "store", port=free_port()).start()
    cfg = NatsConfig(servers=[server.url], connect_timeout_s=2)
    ncs = [await bus.connect(cfg, no_echo=True) for _ in range(2)]
    backends = [StaticBackend(pod=p, url=f"http://{p}", model="m") for p in ("a", "b")]
    states = [ClusterState(RouterConfig(backends=backends)) for _ in range(2)]
    syncs = [ReplicaSync(nc, st, pool="default", expire_s=1.5, registry=CollectorRegistry())
             for nc, st in zip(ncs, states)]
    try:
        for s in syncs:
            await s.start()
        one, two = states
        one.started(one.get("a"), 100, 40)
        assert await wait_for(lambda: two.get("a").inflight == 1, timeout=5)
        server.kill()
        one.finished(one.get("a"), 100, 40)  # while the bus is down: the news cannot go out
        two.started(two.get("b"), 30, 30)
        await asyncio.sleep(3.2)  # longer than expire_s plus a heartbeat: each forgets the other
        assert two.get("a").inflight == 0 and one.get("b").inflight == 0 and not syncs[1].peers
        server.start()
        # ground truth: each replica's own requests; after the reconnect both views equal it
        truth = {"a": (0, 0), "b": (1, 30)}

        def agreed() -> bool:
            return all({p: (st.get(p).inflight, st.get(p).active_tokens) for p in "ab"} == truth for st in states)

        assert await wait_for(agreed, timeout=15)
        assert sum("replica sync:" in r.getMessage() for r in caplog.records) < 20  # no warning per tick
    finally:
        for s in syncs:
            await s.stop()
        for nc in ncs:
            await nc.close()
        server.cleanup()


def _kv_aware_pair(es, nats_config, share: bool, **kw) -> list[RouterApp]:
    """Two kv-aware replicas over ``es``, sharing their routes or not."""
    return [RouterApp(RouterConfig(strategy="kv-aware", seed=1, records=False, replica_sync_routes=share,
                                   backends=[StaticBackend(pod=e.pod, url=e.url, model="m") for e in es], **kw),
                      nats_config, registry=CollectorRegistry()) for _ in range(2)]


async def _started(apps: list[RouterApp]) -> list[RouterApp]:
    for app in apps:
        await app.start("127.0.0.1", 0)
    assert await wait_for(lambda: all(app.sync.peers for app in apps), timeout=5)
    return apps


async def _served_by(s: aiohttp.ClientSession, app: RouterApp, prompt: str) -> str:
    async with s.post(app.service.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}) as r:
        return (await r.json())["served_by"]


@pytest.mark.parametrize("share", [True, False])
async def test_a_prompt_one_replica_routed_is_predicted_on_that_engine_by_the_other(share, nats_config, topology):
    from simulator.tokenizer import SimpleTokenizer

    es = [await FakeEngine(p).start() for p in ("a", "b", "c")]
    apps = _kv_aware_pair(es, nats_config, share)
    prompt = " ".join(f"doc{i}" for i in range(200))  # a long new prefix: no engine has seen it
    ids = SimpleTokenizer().encode(prompt)
    try:
        one, two = await _started(apps)
        async with aiohttp.ClientSession() as s:
            served = await _served_by(s, one, prompt)
            held = lambda: {p: m.predicted_blocks for p, m in two.index.match_tokens("m", ids).items()  # noqa: E731
                            if m.matched_blocks}
            if share:
                assert await wait_for(lambda: set(held()) == {served}, timeout=5)
                assert held()[served] == (len(ids) - 1) // 16  # every reusable block, as predicted
                async with s.post(two.service.url + "/v1/router/decide", json={"model": "m", "prompt": prompt}) as r:
                    assert (await r.json())["picked"] == served
            else:
                await asyncio.sleep(0.5)  # the load messages have gone both ways meanwhile
                assert held() == {}
    finally:
        for app in apps:
            await app.stop(drain=False)
        for e in es:
            await e.stop()


async def test_a_backend_full_with_the_other_replicas_requests_makes_this_one_queue(nats_config, topology):
    eng = await FakeEngine("a", delay_s=0.25).start()  # 8 tokens: 2 s a request
    apps = [RouterApp(RouterConfig(strategy="least-load", seed=1, records=False,
                                   backends=[StaticBackend(pod="a", url=eng.url, model="m", max_inflight=2)]),
                      nats_config, registry=CollectorRegistry()) for _ in range(2)]
    body = {"model": "m", "prompt": "hi", "max_tokens": 8}
    try:
        for app in apps:
            await app.start("127.0.0.1", 0)
        one, two = apps
        async with aiohttp.ClientSession() as s:
            async def complete(app):
                async with s.post(app.service.url + "/v1/completions", json=body) as r:
                    return r.status, time.monotonic()

            async def until(cond, timeout=5.0) -> float:  # polls every millisecond; when it held
                end = time.monotonic() + timeout
                while not cond():
                    assert time.monotonic() < end, "timed out"
                    await asyncio.sleep(0.001)
                return time.monotonic()

            first = [asyncio.create_task(complete(one)) for _ in range(2)]  # a's cap, from the other replica
            await until(lambda: two.state.get("a").inflight == 2)
            assert "a" in two.service.admission.full  # at once, not at the next periodic resync (1 s)
            late = asyncio.create_task(complete(two))
            await until(lambda: two.service.admission.queued == 1)  # it waits; it is not sent
            assert len(eng.requests) == 2
            await until(lambda: two.state.get("a").inflight < 2)  # one of the other replica's has finished
            t_free = time.monotonic()
            t_woken = await until(lambda: two.service.admission.queued == 0)
            assert t_woken - t_free < 0.25  # woken by the news, not by the periodic resync
            done = await asyncio.gather(*first)
            status, _ = await late
            assert [d[0] for d in done] == [200, 200] and status == 200  # woken when the others' finished
            assert len(eng.requests) == 3 and two.service.admission.queued == 0
    finally:
        for app in apps:
            await app.stop(drain=False)
        await eng.stop()


@pytest.mark.parametrize("share", [True, False])
async def test_text_one_replica_left_untokenized_is_predicted_on_that_engine_by_the_other(share, nats_config, topology):
    """A long new prompt is tokenized only in part (router.lazy_prompt); the other replica learns
    where its untokenized text went, and a prompt sharing that text counts it as predicted there."""
    from simulator.tokenizer import SimpleTokenizer

    es = [await FakeEngine(p).start() for p in ("a", "b", "c")]
    apps = _kv_aware_pair(es, nats_config, share, tokenizer="simple")
    doc = " ".join(f"doc{i}" for i in range(2500))  # about 6 of the toy tokenizer's memo pieces
    doc_ids = SimpleTokenizer().encode(doc)
    try:
        one, two = await _started(apps)
        async with aiohttp.ClientSession() as s:
            served = await _served_by(s, one, doc + " first question")
            predicted = lambda: {p: m.predicted_blocks  # noqa: E731
                                 for p, m in two.index.match_tokens("m", doc_ids).items() if m.matched_blocks}
            await asyncio.sleep(0.5)  # the load messages have gone both ways meanwhile
            # what one tokenized (its first piece) is predicted there at once, the rest is text
            assert max(predicted().values(), default=0) < len(doc_ids) // 16 // 2
            async with s.post(two.service.url + "/v1/router/decide",
                              json={"model": "m", "prompt": doc + " another question"}) as r:
                picked = (await r.json())["picked"]
        got = predicted()
        if share:
            assert picked == served
            assert got[served] >= len(doc_ids) // 16 - 2048 // 4 // 16  # the document, short of at most a piece
        else:
            assert got.get(served, 0) < len(doc_ids) // 16 // 2
    finally:
        for app in apps:
            await app.stop(drain=False)
        for e in es:
            await e.stop()
