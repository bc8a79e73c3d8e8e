"""infernex_router_dispatch_seconds: the router's own time before a request reaches an engine.

It must leave out what is not the router's work: the admission queue's wait (its own histogram)
and, for the PD protocol, the prefill engine's time (the request reached an engine at the
prefill send). Each request is observed once, however many engines it is sent to."""

from __future__ import annotations

import asyncio

import aiohttp

from router.admission import AdmissionConfig
from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from router.testing import FakeEngine

BODY = {"model": "m", "prompt": "a prompt of a few words", "max_tokens": 2}


def sample(svc: RouterService, name: str, labels: dict) -> float:
    v = svc.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def post_all(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one():
            async with s.post(url + "/v1/completions", json=BODY) as r:
                await r.read()
                return r.status
        return await asyncio.gather(*(one() for _ in range(n)))


async def test_dispatch_time_leaves_out_the_admission_queue():
    # one slot, 0.2 s an answer: the second request waits ~0.4 s in the queue, the third ~0.8 s
    e = FakeEngine("e0", tokens=2, delay_s=0.2)
    await e.start()
    cfg = RouterConfig(backends=[StaticBackend(pod="e0", url=e.url, model="m", max_inflight=1)], bus=False,
                       records=False, strategy="round-robin", admission=AdmissionConfig(queue_timeout_s=10))
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        assert await post_all(url, 3) == [200, 200, 200]
        await asyncio.sleep(0.05)  # (metrics are taken after the answer is written)
        queued = sample(svc, "infernex_router_queue_seconds_sum",
                        {"strategy": "round-robin", "pool": svc.state.pool, "role": "aggregated"})
        assert queued >= 0.9, queued  # the queue did hold them
        lab = {"strategy": "round-robin"}
        assert sample(svc, "infernex_router_dispatch_seconds_count", lab) == 3
        # each request's own dispatch is short, although two of them waited 0.4 s and more to be sent
        assert sample(svc, "infernex_router_dispatch_seconds_bucket", {**lab, "le": "0.25"}) == 3
        assert 0 < sample(svc, "infernex_router_dispatch_seconds_sum", lab) < 0.75
    finally:
        await svc.stop()
        await e.stop()


async def test_dispatch_ends_at_the_prefill_send_and_counts_once():
    pre, dec = FakeEngine("p1", delay_s=0.4), FakeEngine("d1")
    for e in (pre, dec):
        await e.start()
    backends = [StaticBackend(pod="p1", url=pre.url, model="m", role="prefill", group="g1"),
                StaticBackend(pod="d1", url=dec.url, model="m", role="decode", group="g1")]
    cfg = RouterConfig(backends=backends, bus=False, records=False, seed=1, strategy="pd-random-bucket")
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        body = {**BODY, "prompt": "a long prompt " * 200}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
        await asyncio.sleep(0.05)
        assert len(pre.requests) == 1 and len(dec.requests) == 1  # both stages ran
        lab = {"strategy": "pd-random-bucket"}
        assert sample(svc, "infernex_router_dispatch_seconds_count", lab) == 1
        # the prefill took 0.4 s before the decode was sent: not the router's time
        assert sample(svc, "infernex_router_dispatch_seconds_sum", lab) < 0.25
    finally:
        await svc.stop()
        for e in (pre, dec):
            await e.stop()


async def test_a_request_no_engine_took_is_not_observed():
    cfg = RouterConfig(backends=[StaticBackend(pod="e0", url="http://127.0.0.1:9", model="other")], bus=False,
                       records=False, strategy="round-robin")
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        statuses = await post_all(url, 2)
        assert all(s >= 400 for s in statuses), statuses  # no backend serves model m
        await asyncio.sleep(0.05)
        assert sample(svc, "infernex_router_dispatch_seconds_count", {"strategy": "round-robin"}) == 0
        assert sample(svc, "infernex_router_requests_total", {"strategy": "round-robin", "status": "rejected"}) + \
            sample(svc, "infernex_router_requests_total", {"strategy": "round-robin", "status": "error"}) == 2
    finally:
        await svc.stop()
