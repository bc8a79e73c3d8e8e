"""The ends of routes one router replica shared reach the others over a real nats-server
(``router.sync.<pool>.ends``, :class:`schemas.records.RouteEnds`).

Ground truth: a replica routes a prompt to an engine and the other replica records it as that
engine's predicted blocks and piece routes. When the request is over, the piece routes end on the
other replica too (``SETTLE_S`` after the end arrives), and when the request left the engine before
its prefill ran there, the other replica's predicted blocks there end at once, while a prediction of
the same blocks on another engine stays. Before, both lasted the routes' whole time to live on the
other replica. A replica from before the ends subject gets nothing it cannot decode, and its own
routes last their time to live, as before; a malformed ends message is dead-lettered and counted."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import router.lazy_prompt as lp
import router.replica_sync as rs
from router.app import RouterApp
from router.config import RouterConfig, StaticBackend
from router.lazy_prompt import PieceRoutes
from router.replica_sync import ReplicaSync
from router.state import ClusterState
from router.testing import FakeEngine, wait_for
from schemas import ReplicaLoad, ValidationFailure, decode_event
from schemas import subjects as S
from schemas.records import RoutedPrompt, RouteEnd, RouteEnds, pack_keys
from streams.clock import SystemClock
from streams.kv_index import KvIndex
from streams.topology import subject_matches


@dataclass
class GatedEngine(FakeEngine):
    """A FakeEngine that answers only once ``gate`` is set: the request stays in flight meanwhile."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def _handle(self, request, kind):
        await self.gate.wait()
        return await super()._handle(request, kind)


def _router(engines, nats_config, **kw) -> RouterApp:
    cfg = RouterConfig(strategy="kv-aware", seed=1, records=False, connect_timeout_s=2,
                       backends=[StaticBackend(pod=e.pod, url=e.url, model="m") for e in engines], **kw)
    return RouterApp(cfg, nats_config, registry=CollectorRegistry())


async def _started(apps: list[RouterApp]) -> list[RouterApp]:
    for app in apps:
        await app.start("127.0.0.1", 0)
    assert await wait_for(lambda: all(app.sync.peers for app in apps), timeout=5)
    return apps


def _text_routes(routes: PieceRoutes) -> dict[str, int]:
    """Pod -> pieces of text routed there untokenized whose route stands now."""
    now, out = time.monotonic(), {}
    for pod, exp in routes._d.values():  # what a later prompt would read
        if exp > now:
            out[pod] = out.get(pod, 0) + 1
    return out


def _sync(nc, prefix: str, pods=("x", "y"), index=None, **kw) -> ReplicaSync:
    st = ClusterState(RouterConfig(backends=[StaticBackend(pod=p, url=f"http://{p}", model="m") for p in pods]))
    sync = ReplicaSync(nc, st, pool="default", prefix=prefix, index=index, registry=CollectorRegistry(), **kw)
    sync.piece_routes = PieceRoutes(30.0)
    return sync


def _index() -> KvIndex:
    return KvIndex(SystemClock(), default_block_size=16, predict_on_route_ttl_s=30)


def _predicted(index: KvIndex, keys) -> dict[str, int]:
    return {p: n for p, n in index.match_counts("m", np.asarray(keys, dtype=np.uint64))[1].items() if n}


def test_the_ends_subject_is_outside_the_load_subscription():
    """A replica from before the ends subscribes to ``router.sync.<pool>`` exactly: it never gets them."""
    for pool in ("default", "a.b"):
        ends = S.router_sync_ends(pool)
        assert not subject_matches(S.router_sync(pool), ends)
        assert S.parse(ends) == {"kind": "router.sync.ends", "pool": pool}
        assert S.parse(S.router_sync(pool)) == {"kind": "router.sync", "pool": pool}


async def test_text_routed_untokenized_stops_counting_on_the_other_replica_when_its_request_ends(
        nats_config, topology, monkeypatch):
    from simulator.tokenizer import SimpleTokenizer

    monkeypatch.setattr(lp, "SETTLE_S", 0.5)  # (2 s in production; read when an end arrives)
    es = [await FakeEngine(p, delay_s=0.3).start() for p in ("a", "b", "c")]  # 2 tokens: 0.6 s a request
    apps = [_router(es, nats_config, tokenizer="simple") for _ in range(2)]
    doc = " ".join(f"doc{i}" for i in range(2500))  # about 6 of the toy tokenizer's memo pieces
    doc_blocks = len(SimpleTokenizer().encode(doc)) // 16
    try:
        one, two = await _started(apps)
        async with aiohttp.ClientSession() as s:
            async def complete(app, prompt):
                async with s.post(app.service.url + "/v1/completions",
                                  json={"model": "m", "prompt": prompt, "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["served_by"]

            busy = asyncio.create_task(complete(one, doc + " first question"))
            # while it is in flight: the other replica has its untokenized text as routed there
            assert await wait_for(lambda: _text_routes(two.service.piece_routes), timeout=5)
            (x, n), = _text_routes(two.service.piece_routes).items()
            assert n >= 3 and two.index.pods()[x].predicted_blocks > 0  # the text, and the blocks tokenized
            assert await busy == x
            # the request is over: the routes end on both replicas SETTLE_S later, not after 30 s
            assert await wait_for(lambda: not _text_routes(two.service.piece_routes), timeout=3)
            assert not _text_routes(one.service.piece_routes)
            assert two.sync._m_ends.labels("received")._value.get() >= 1
            async with s.post(two.service.url + "/v1/router/decide",
                              json={"model": "m", "prompt": doc + " another question"}) as r:
                assert r.status == 200
        # what two reads of x now: the blocks one tokenized and predicted there (their own TTL), not
        # the whole document as predicted from the ended text routes (as while they stood)
        ids = SimpleTokenizer().encode(doc)
        got = {p: m.predicted_blocks for p, m in two.index.match_tokens("m", ids).items() if m.matched_blocks}
        assert 0 < got.get(x, 0) < doc_blocks // 2
    finally:
        for app in apps:
            await app.stop(drain=False)
        for e in es:
            await e.stop()


async def test_a_route_that_failed_on_an_engine_is_forgotten_there_by_the_other_replica_only(
        nats_config, topology):
    """Replica one's only engine x refuses the prompt (503) after the other replica recorded the route
    there; replica two routed the same prompt to engine y before. Two's predicted blocks on x end with
    the failure, its prediction on y stays."""
    x = await GatedEngine("x", status=503).start()
    y = await FakeEngine("y").start()
    one = _router([x], nats_config, tokenizer="simple", max_retries=0)
    two = _router([y], nats_config, tokenizer="simple")
    prompt = " ".join(f"w{i}" for i in range(100))
    try:
        await _started([one, two])
        async with aiohttp.ClientSession() as s:
            async def complete(app):
                async with s.post(app.service.url + "/v1/completions",
                                  json={"model": "m", "prompt": prompt, "max_tokens": 1}) as r:
                    return r.status

            assert await complete(two) == 200  # y: predicted there on both replicas
            assert await wait_for(lambda: one.index.pods().get("y") and one.index.pods()["y"].predicted_blocks,
                                  timeout=5)
            n = two.index.pods()["y"].predicted_blocks
            assert n >= 5
            failing = asyncio.create_task(complete(one))
            assert await wait_for(lambda: two.index.pods().get("x") and two.index.pods()["x"].predicted_blocks == n,
                                  timeout=5)  # two recorded one's route to x
            x.gate.set()
            assert await failing >= 500  # (the router answers 502: its only engine failed)
            assert one.index.pods()["x"].predicted_blocks == 0  # (the local forget)
            assert await wait_for(lambda: two.index.pods()["x"].predicted_blocks == 0, timeout=3)
            assert two.index.pods()["y"].predicted_blocks == n and one.index.pods()["y"].predicted_blocks == n
    finally:
        for app in (one, two):
            await app.stop(drain=False)
        for e in (x, y):
            await e.stop()


async def test_an_old_replica_gets_nothing_it_cannot_decode_and_its_routes_last_as_before(nc, prefix):
    """Replica b hears an old replica (ReplicaLoad only, on the load subject) and a new one, c. c's
    routes end on b when c says so; the old one's last their time to live on b, as before the ends;
    the old one receives only load messages, every one of which it decodes."""
    index = _index()
    b = _sync(nc, prefix, index=index)
    c = _sync(nc, prefix)
    load_subject = S.with_prefix(prefix, S.router_sync("default"))
    heard: list[bytes] = []
    new_ends: list[RouteEnds] = []

    async def old(m):  # what an old replica reads
        heard.append(m.data)

    async def new(m):
        new_ends.append(decode_event(RouteEnds, m.data))

    old_sub = await nc.subscribe(load_subject, cb=old)
    ends_sub = await nc.subscribe(S.with_prefix(prefix, S.router_sync_ends("default")), cb=new)
    old_keys, new_keys = [11, 12, 13], [21, 22, 23, 24]
    old_text, new_text = [901, 902], [801, 802, 803]
    try:
        await b.start()
        await c.start()
        await nc.publish(load_subject, ReplicaLoad(
            replica="old", pool="default", seq=1, ts=time.time(),
            routes=[RoutedPrompt(model="m", pod="x", keys=pack_keys(old_keys), pieces=pack_keys(old_text))]).to_json())
        assert await wait_for(lambda: "old" in b.peers and c.replica in b.peers and b.replica in c.peers, timeout=5)
        c.add_route("m", "x", new_keys, pieces=new_text)
        assert await wait_for(lambda: _predicted(index, new_keys).get("x") == 4, timeout=5)
        assert _text_routes(b.piece_routes) == {"x": 5}  # both replicas' text
        c.add_end("m", "x", "forget", keys=new_keys)
        c.add_end("m", "x", "settle", pieces=new_text)
        assert await wait_for(lambda: not _predicted(index, new_keys), timeout=3)
        until = time.monotonic() + lp.SETTLE_S
        got = {ch: b.piece_routes._d[("m", ch)][1] for ch in old_text + new_text}
        assert all(got[ch] <= until for ch in new_text)  # c's text: settled
        assert all(got[ch] > until + 20 for ch in old_text)  # the old replica's: its 30 s, as before
        assert _predicted(index, old_keys) == {"x": 3}
        assert new_ends and new_ends[-1].replica == c.replica  # the ends went out, on their own subject
        await asyncio.sleep(0.2)
        assert heard and b.dead.count == 0 and c.dead.count == 0
        for data in heard:  # an old replica decodes every message it gets
            decode_event(ReplicaLoad, data)
            assert set(json.loads(data)) <= set(ReplicaLoad.model_fields)
        assert any(decode_event(ReplicaLoad, d).routes for d in heard if json.loads(d)["replica"] == c.replica)
        with pytest.raises(ValidationFailure):  # (what an old replica would do with an ends message)
            decode_event(ReplicaLoad, new_ends[-1].to_json())
    finally:
        await old_sub.unsubscribe()
        await ends_sub.unsubscribe()
        await c.stop()
        await b.stop()


async def test_a_malformed_ends_message_is_dead_lettered_and_counted_and_the_next_applied(nc, prefix, topology):
    index = _index()
    b = _sync(nc, prefix, index=index)
    load_subject = S.with_prefix(prefix, S.router_sync("default"))
    ends_subject = S.with_prefix(prefix, S.router_sync_ends("default"))
    keys = [31, 32, 33]
    try:
        await b.start()
        await nc.publish(load_subject, ReplicaLoad(replica="r", pool="default", seq=1, ts=time.time(), routes=[
            RoutedPrompt(model="m", pod="x", keys=pack_keys(keys))]).to_json())
        assert await wait_for(lambda: _predicted(index, keys) == {"x": 3}, timeout=5)

        def ends(replica="r", **end) -> bytes:
            return json.dumps({"schema_version": 1, "replica": replica, "pool": "default", "seq": 2, "load_seq": 1,
                               "ts": time.time(), "ends": [{"model": "m", "pod": "x", **end}]}).encode()

        await nc.publish(ends_subject, b"not json")
        await nc.publish(ends_subject, ends(kind="settle", keys=pack_keys(keys)))  # a settle without its pieces
        await nc.publish(ends_subject, ends(kind="forget", keys="***"))
        await nc.publish(ends_subject, ends(kind="forget", keys=pack_keys(keys), extra=1))
        assert await wait_for(lambda: b.dead.count == 4, timeout=5)
        assert _predicted(index, keys) == {"x": 3}
        js = nc.jetstream()
        dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.ROUTER)), ordered_consumer=True)
        reasons = [json.loads((await dlq.next_msg(timeout=5)).data) for _ in range(4)]
        await dlq.unsubscribe()
        assert all(r["subject"] == ends_subject and r["reason"].startswith("RouteEnds") for r in reasons)
        assert "needs pieces" in reasons[1]["reason"] and "ends.0.keys" in reasons[2]["reason"]
        # this replica's own (a connection with echo) and another pool's are not applied
        await nc.publish(ends_subject, ends(replica=b.replica, kind="forget", keys=pack_keys(keys)))
        await asyncio.sleep(0.2)
        assert _predicted(index, keys) == {"x": 3}
        await nc.publish(ends_subject, ends(kind="forget", keys=pack_keys(keys)))
        assert await wait_for(lambda: not _predicted(index, keys), timeout=5)
        assert b.dead.count == 4
    finally:
        await b.stop()


async def test_ends_that_arrive_before_the_load_message_they_follow_wait_for_it(nc, prefix):
    """The two subjects are read by two subscriptions: an ends message may be handled before the
    load message carrying its routes. It waits for that one, or for the sender to go silent."""
    index = _index()
    b = _sync(nc, prefix, index=index, expire_s=1.5)
    keys, text = [41, 42], [701, 702]
    now = time.monotonic()
    b.apply(ReplicaLoad(replica="r", pool="default", seq=1, ts=time.time()), now)
    b.apply_ends(RouteEnds(replica="r", pool="default", seq=3, load_seq=2, ts=time.time(), ends=[
        RouteEnd(model="m", pod="x", kind="forget", keys=pack_keys(keys)),
        RouteEnd(model="m", pod="x", kind="settle", pieces=pack_keys(text))]), now)
    assert b._held
    b.apply(ReplicaLoad(replica="r", pool="default", seq=2, ts=time.time(), routes=[
        RoutedPrompt(model="m", pod="x", keys=pack_keys(keys), pieces=pack_keys(text))]), now)
    assert not _predicted(index, keys) and not b._held  # recorded, then ended
    assert all(b.piece_routes._d[("m", ch)][1] <= now + lp.SETTLE_S for ch in text)
    # ends whose load message never comes (lost: core NATS) are dropped after expire_s
    b.apply_ends(RouteEnds(replica="r", pool="default", seq=5, load_seq=4, ts=time.time(), ends=[
        RouteEnd(model="m", pod="x", kind="forget", keys=pack_keys(keys))]), now)
    await b.tick(now + 1.0)
    b.apply(ReplicaLoad(replica="r", pool="default", seq=3, ts=time.time()), now + 1.9)  # r is alive
    assert b._held
    await b.tick(now + 2.0)
    assert not b._held and "r" in b.peers


async def test_ends_go_out_batched_bounded_and_only_to_replicas_that_listen(nc, prefix, monkeypatch):
    monkeypatch.setattr(rs, "MAX_ENDS", 3)
    a = _sync(nc, prefix)
    got: list[RouteEnds] = []

    async def on(m):
        got.append(decode_event(RouteEnds, m.data))

    sub = await nc.subscribe(S.with_prefix(prefix, S.router_sync_ends("default")), cb=on)
    try:
        a.add_end("m", "x", "forget", keys=[1, 2])  # alone: no replica holds its routes
        assert not a._ends
        now = time.monotonic()
        a.apply(ReplicaLoad(replica="r", pool="default", seq=1, ts=time.time()), now)
        a._changed = asyncio.Event()  # (start() makes it; not started here)
        for i in range(5):
            a.add_end("m", "x", "settle", pieces=[100 + i])
        a.add_end("m", "x", "forget", keys=[])  # nothing to end
        assert len(a._ends) == 3 and a._m_ends.labels("dropped")._value.get() == 2
        await a.tick(now)
        await a.tick(now)  # nothing new: no second ends message
        assert await wait_for(lambda: len(got) == 1, timeout=5)
        await asyncio.sleep(0.1)
        assert len(got) == 1 and [e.kind for e in got[0].ends] == ["settle"] * 3
        assert got[0].load_seq == got[0].seq - 1 == a._load_seq  # right after its load message
    finally:
        await sub.unsubscribe()
