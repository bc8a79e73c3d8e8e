"""Admission control from the router's own accounting: per-backend caps (configured, or the
engine's announced max_num_seqs), a bounded queue with a deadline, 429/503 with Retry-After,
per-key quotas and round-robin fairness across keys; the same with and without the bus."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from consumers import bus
from router.admission import Admission, AdmissionConfig, Refused
from router.app import RouterApp
from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from router.testing import FakeEngine, wait_for
from router.types import BackendState
from schemas import EngineAnnouncement, EngineMetrics
from schemas import subjects as S


# -- the policy, directly --------------------------------------------------------------------------

def test_cap_precedence():
    adm = Admission(AdmissionConfig(default_max_inflight=7, overcommit=1.5))
    assert adm.cap(BackendState("a", "http://x", "m")) == 7
    assert adm.cap(BackendState("a", "http://x", "m", max_num_seqs=8)) == 12
    assert adm.cap(BackendState("a", "http://x", "m", max_num_seqs=8, max_inflight=3)) == 3
    adm = Admission(AdmissionConfig(max_inflight_per_backend=5))
    assert adm.cap(BackendState("a", "http://x", "m", max_num_seqs=8)) == 5
    assert adm.cap(BackendState("a", "http://x", "m", max_inflight=2)) == 2


async def test_full_set_follows_inflight_and_wakes_a_waiter():
    adm = Admission(AdmissionConfig())
    b = BackendState("a", "http://x", "m", max_inflight=2)
    for _ in range(2):
        b.inflight += 1
        adm.started(b)
    assert adm.full == {"a"}
    w = asyncio.ensure_future(adm.wait("m", "k", 5))
    await asyncio.sleep(0)
    assert adm.queued == 1 and not w.done()
    b.inflight -= 1
    adm.finished(b)
    await asyncio.wait_for(w, 1)
    assert adm.full == set() and adm.queued == 0


async def test_round_robin_across_keys_and_quota():
    adm = Admission(AdmissionConfig(max_inflight_per_key=4))
    order: list[str] = []

    async def waiter(key, i):
        await adm.wait("m", key, 5)
        order.append(f"{key}{i}")

    tasks = [asyncio.ensure_future(waiter("A", i)) for i in range(4)]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(waiter("B", i)) for i in range(2)]
    await asyncio.sleep(0)
    for _ in range(6):
        assert adm.wake("m")
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    # A queued all four first, yet B is served every other turn
    assert order == ["A0", "B0", "A1", "B1", "A2", "A3"]
    for _ in range(4):
        adm.enter("A")
    with pytest.raises(Refused) as e:
        adm.enter("A")
    assert e.value.status == 429
    adm.enter("B")  # another key is not affected
    adm.leave("A")
    adm.enter("A")


async def test_queue_bound_deadline_and_cancel():
    adm = Admission(AdmissionConfig(queue_size=1))
    t = asyncio.ensure_future(adm.wait("m", "k", 5))
    await asyncio.sleep(0)
    with pytest.raises(Refused) as e:
        await adm.wait("m", "k2", 5)
    assert (e.value.status, e.value.code) == (503, "overloaded")
    t.cancel()  # the client went away: its place is freed
    with pytest.raises(asyncio.CancelledError):
        await t
    assert adm.queued == 0 and not adm.waiting("m")
    t0 = time.monotonic()
    with pytest.raises(Refused) as e:
        await adm.wait("m", "k", 0.1)
    assert e.value.code == "queue_timeout" and time.monotonic() - t0 < 1


# -- the router under a burst ------------------------------------------------------------------------

class CountingEngine(FakeEngine):
    """A fake engine that records the most requests it ever had at once."""

    active: int = 0
    peak: int = 0

    async def _handle(self, request: web.Request, kind: str):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super()._handle(request, kind)
        finally:
            self.active -= 1


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def burst(url: str, n: int, deadline: float, headers=None, body=CHAT):
    async def one(s):
        t = time.monotonic()
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
            await r.read()
            return r.status, r.headers.get("Retry-After"), time.monotonic() - t

    timeout = aiohttp.ClientTimeout(total=deadline)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        return await asyncio.gather(*(one(s) for _ in range(n)))


def check_burst(results, queue_timeout: float):
    statuses = {s for s, _, _ in results}
    assert statuses <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses
    for s, ra, dt in results:
        if s == 503:
            assert ra is not None and int(ra) >= 1
        assert dt < queue_timeout + 2.0  # answered: nobody waits past the queue deadline by much


async def test_burst_is_shed_not_hung_without_bus():
    engines = [CountingEngine(f"e{i}", tokens=4, delay_s=0.05) for i in range(2)]
    for e in engines:
        await e.start()
    cfg = RouterConfig(backends=[StaticBackend(pod=e.pod, url=e.url, model="m", max_inflight=2) for e in engines],
                       bus=False, records=False, strategy="round-robin",
                       admission=AdmissionConfig(queue_timeout_s=0.7, queue_size=100))
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        # engine metrics that lag (nothing waiting) change nothing: admission counts by itself
        for e in engines:
            svc.state.apply_metrics(EngineMetrics(pod=e.pod, model="m", ts=time.time(), num_requests_waiting=0,
                                                  num_requests_running=0, kv_cache_usage_perc=0.0))
        results = await burst(url, 40, deadline=10)
        check_burst(results, 0.7)
        assert all(e.peak <= 2 for e in engines), [e.peak for e in engines]
        ok = sum(1 for s, _, _ in results if s == 200)
        assert ok >= 8  # 4 slots x ~0.2 s per request within 0.7 s of queueing
        reg = svc.registry
        assert reg.get_sample_value("infernex_router_rejected_total", {"reason": "queue_timeout"}) == 40 - ok
        # a queue bound refuses at once
    finally:
        await svc.stop()
        for e in engines:
            await e.stop()


async def test_queue_full_and_key_quota_answer_at_once():
    e = CountingEngine("e0", tokens=4, delay_s=0.1)
    await e.start()
    cfg = RouterConfig(backends=[StaticBackend(pod="e0", url=e.url, model="m", max_inflight=1)],
                       bus=False, records=False, strategy="round-robin", api_keys=["ka", "kb"],
                       admission=AdmissionConfig(queue_timeout_s=5, queue_size=4, max_inflight_per_key=3))
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        t0 = time.monotonic()
        a, b = await asyncio.gather(burst(url, 8, 10, {"Authorization": "Bearer ka"}),
                                    burst(url, 2, 10, {"Authorization": "Bearer kb"}))
        sa = sorted(s for s, _, _ in a)
        assert sa.count(429) == 5 and sa.count(200) == 3  # key A: quota 3, the rest refused at once
        assert all(ra == "1" for s, ra, _ in a if s == 429)
        assert sorted(s for s, _, _ in b) == [200, 200]  # key B is not starved by A
        assert max(dt for s, _, dt in a if s == 429) < 0.5
        assert time.monotonic() - t0 < 5 and e.peak == 1
        # six at once (within both quotas): one runs, the queue (4) overflows -> 503 overloaded at once
        res = await asyncio.gather(*(burst(url, 1, 10, {"Authorization": f"Bearer {k}"}) for k in
                                     ["ka", "ka", "ka", "kb", "kb", "kb"]))
        codes = sorted(r[0][0] for r in res)
        assert codes.count(503) >= 1 and set(codes) <= {200, 503}
    finally:
        await svc.stop()
        await e.stop()


async def test_cap_from_announced_max_num_seqs_with_bus(nats_config, topology, nc, prefix):
    engines = [CountingEngine(f"b{i}", tokens=4, delay_s=0.05) for i in range(2)]
    for e in engines:
        await e.start()
    app = RouterApp(RouterConfig(strategy="round-robin", records=False,
                                 admission=AdmissionConfig(queue_timeout_s=0.7)), nats_config)
    url = await app.start("127.0.0.1", 0)
    try:
        js = nc.jetstream()
        for e in engines:
            await bus.publish(js, S.with_prefix(prefix, S.engine_announce(e.pod)),
                              EngineAnnouncement(pod=e.pod, url=e.url, model="m", ts=time.time(),
                                                 max_num_seqs=2).to_json())
        assert await wait_for(lambda: len(app.state.snapshot()) == 2, timeout=15)
        assert [app.service.admission.cap(b) for b in app.state.snapshot()] == [2, 2]
        results = await burst(url, 40, deadline=10)
        check_burst(results, 0.7)
        assert all(e.peak <= 2 for e in engines), [e.peak for e in engines]
    finally:
        await app.stop(drain=False)
        for e in engines:
            await e.stop()
