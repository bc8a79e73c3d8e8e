"""Issue 22: slowness is not failure. Engines that are merely slow must not be ejected all at once;
engines that refuse connections are; when every engine is tripped, requests still go out."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp

from router.config import RouterConfig, StaticBackend
from router.resilience import is_breaker_failure
from router.server import RouterService
from router.testing import FakeEngine, wait_for
from router.upstream import UpstreamError

# ~130k characters: tens of thousands of prompt tokens pending prefill on a slow engine
LONG = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(20000)), "max_tokens": 1}
SHORT = {"model": "m", "prompt": "hello", "max_tokens": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _router(engines, dead=(), **kw) -> RouterService:
    for e in engines:
        await e.start()
    backends = [StaticBackend(pod=e.pod, url=e.url, model="m") for e in engines]
    backends += [StaticBackend(pod=p, url=f"http://127.0.0.1:{_free_port()}", model="m") for p in dead]
    kw.setdefault("strategy", "kv-aware")
    svc = RouterService(RouterConfig(backends=backends, bus=False, records=False, seed=1, **kw))
    await svc.start("127.0.0.1", 0)
    return svc


async def _stop(svc, engines):
    await svc.stop()
    for e in engines:
        await e.stop()


def _url(svc) -> str:
    return svc.url + "/v1/completions"


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str | None]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
        await r.read()
        return r.status, r.headers.get("X-InferNex-Backend")


def _events(svc, plugin: str) -> dict[str, int]:
    for prof in svc.router.strategy.profiles.values():
        for f in prof.filters:
            if f.name == plugin:
                return f.events()
    raise AssertionError(f"no plugin {plugin}")


def test_breaker_failure_classification():
    assert is_breaker_failure(UpstreamError("connect", "connect to h:1 failed: Connection refused"))
    assert is_breaker_failure(UpstreamError("read", "connection reset"))
    assert is_breaker_failure(ConnectionResetError())
    assert is_breaker_failure("http_503") and is_breaker_failure("connect")
    assert not is_breaker_failure(UpstreamError("timeout", "no data from the backend for 1 s"))
    assert not is_breaker_failure(UpstreamError("connect", "connect to h:1 timed out"))
    assert not is_breaker_failure(TimeoutError())
    assert not is_breaker_failure("slow") and not is_breaker_failure(None)


async def test_slow_engines_burst_all_answered_no_breaker_opens():
    """Engines wait 2 s before their first byte; a burst of long prompts piles up pending prefill
    tokens past the busy threshold. Admission is on, so the busy filter defers to it: all 200."""
    engines = [FakeEngine("a", tokens=1, delay_s=2.0), FakeEngine("b", tokens=1, delay_s=2.0)]
    svc = await _router(engines)
    try:
        async with aiohttp.ClientSession() as s:
            got = await asyncio.wait_for(asyncio.gather(*[_post(s, _url(svc), LONG) for _ in range(40)]), 25)
        assert [st for st, _ in got] == [200] * 40
        assert {pod for _, pod in got} == {"a", "b"}
        assert svc.state.breakers.state("a") == svc.state.breakers.state("b") == "closed"
        assert _events(svc, "not-busy")["deferred_to_admission"] > 0
    finally:
        await _stop(svc, engines)


async def test_read_timeouts_on_slow_engines_do_not_trip_breakers():
    """A slow first byte past the read timeout fails that request, but is not counted against the
    engine: when the engines speed up, nothing was ejected and every request is served at once."""
    engines = [FakeEngine("a", tokens=1, delay_s=1.0), FakeEngine("b", tokens=1, delay_s=1.0)]
    svc = await _router(engines, read_timeout_s=0.3, max_retries=1, breaker_failures=2, breaker_cooldown_s=60)
    try:
        async with aiohttp.ClientSession() as s:
            first = await asyncio.wait_for(asyncio.gather(*[_post(s, _url(svc), SHORT) for _ in range(6)]), 15)
            assert all(st >= 500 for st, _ in first)  # these did time out
            assert svc.state.breakers.state("a") == svc.state.breakers.state("b") == "closed"
            for e in engines:
                e.delay_s = 0.0
            then = await asyncio.wait_for(asyncio.gather(*[_post(s, _url(svc), SHORT) for _ in range(6)]), 15)
        assert [st for st, _ in then] == [200] * 6
        assert _events(svc, "healthy")["fail_open"] == 0
    finally:
        await _stop(svc, engines)


async def test_refused_connections_open_breakers_and_traffic_goes_to_the_healthy_one():
    engines = [FakeEngine("ok")]
    svc = await _router(engines, dead=["d1", "d2"], strategy="round-robin", breaker_failures=1,
                        breaker_cooldown_s=60)
    try:
        async with aiohttp.ClientSession() as s:
            got = [await _post(s, _url(svc), SHORT) for _ in range(8)]
        assert got == [(200, "ok")] * 8
        assert svc.state.breakers.state("d1") == svc.state.breakers.state("d2") == "open"
        assert svc.state.breakers.state("ok") == "closed"
        assert _events(svc, "healthy")["fail_open"] == 0  # a healthy one was left: no floor needed
        n = len(engines[0].requests)
        assert n == 8
    finally:
        await _stop(svc, engines)


async def test_all_tripped_fails_open_and_recovers_without_waiting_for_cooldown(caplog):
    engines = [FakeEngine("a", status=503), FakeEngine("b", status=503)]
    svc = await _router(engines, strategy="round-robin", breaker_failures=1, breaker_cooldown_s=60,
                        max_retries=1)
    caplog.set_level(logging.WARNING, logger="router.plugins.filters")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                await _post(s, _url(svc), SHORT)
            assert svc.state.breakers.state("a") == svc.state.breakers.state("b") == "open"
            async with s.get(svc.url + "/readyz") as r:  # still ready: it fails open, not out
                assert r.status == 200 and (await r.json())["circuit_open"] == 2
            sent = sum(len(e.requests) for e in engines)
            st, _ = await _post(s, _url(svc), SHORT)  # every breaker open: still sent out (fail-open)
            assert st == 502
            assert sum(len(e.requests) for e in engines) > sent
            for e in engines:
                e.status = 200  # the engines recover; the cooldown (60 s) is far from over
            got = [await _post(s, _url(svc), SHORT) for _ in range(4)]
        assert [st for st, _ in got] == [200] * 4
        assert svc.state.breakers.state("a") == "closed" or svc.state.breakers.state("b") == "closed"
        assert _events(svc, "healthy")["fail_open"] >= 1
        episodes = [r for r in caplog.records if "failing open" in r.getMessage()]
        assert len(episodes) == 1  # logged once for the episode, not per request
    finally:
        await _stop(svc, engines)


async def test_busy_filter_still_refuses_without_admission():
    engines = [FakeEngine("a", tokens=1, delay_s=1.0)]
    svc = await _router(engines, admission={"enabled": False})
    try:
        async with aiohttp.ClientSession() as s:
            got = await asyncio.wait_for(asyncio.gather(*[_post(s, _url(svc), LONG) for _ in range(30)]), 15)
        assert 503 in [st for st, _ in got]
        assert _events(svc, "not-busy")["deferred_to_admission"] == 0
        assert await wait_for(lambda: svc.inflight == 0, timeout=5)
    finally:
        await _stop(svc, engines)


def test_fail_open_keeps_the_least_recently_failed_and_never_the_unusable():
    from router.plugins import build_plugin
    from router.plugins.base import Ctx
    from router.resilience import CircuitBreakers
    from router.types import BackendState, RoutingRequest

    class Clock:
        t = 100.0

        def now(self):
            return self.t

    clock = Clock()
    br = CircuitBreakers(1, 10.0, clock)
    pods = {p: BackendState(pod=p, url=f"http://{p}", model="m") for p in ("a", "b", "c", "d", "e")}
    for i, p in enumerate(("c", "a", "d", "b")):  # c failed first, b last
        clock.t = 100.0 + i
        br.failure(p)
    pods["e"].draining = True
    for b in pods.values():
        b.circuit_open, b.circuit_until = br.is_open(b.pod), br.open_until(b.pod)
    f = build_plugin("healthy-filter", "healthy", {})
    req = RoutingRequest(model="m", exclude=frozenset({"d"}))
    assert [b.pod for b in f.apply(req, list(pods.values()), Ctx())] == ["c"]  # of c, a, b: the older half
    assert f.events() == {"fail_open": 1}
    pods["a"].circuit_open = False  # one usable again: the floor is not used
    assert [b.pod for b in f.apply(req, list(pods.values()), Ctx())] == ["a"]
    off = build_plugin("healthy-filter", "healthy", {"fail_open": False})
    pods["a"].circuit_open = True
    assert off.apply(req, list(pods.values()), Ctx()) == []
