"""PD-Bucket falls back to any healthy group when its bucket's groups cannot serve (no usable
prefill or decode pod), and counts it; the HTTP router exports the count."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry

from router.config import RouterConfig, StaticBackend
from router.core import Router
from router.metrics import PluginEventsCollector
from router.server import RouterService
from router.testing import FakeEngine
from router.types import BackendState, RoutingRequest


def B(pod, **kw):
    return BackendState(pod=pod, url=f"http://{pod}", model=kw.pop("model", "m"), **kw)


def cluster(**over):
    bs = {"p1": B("p1", role="prefill", group="g1"), "d1": B("d1", role="decode", group="g1"),
          "p2": B("p2", role="prefill", group="g2"), "d2": B("d2", role="decode", group="g2")}
    for pod, kw in over.items():
        for k, v in kw.items():
            setattr(bs[pod], k, v)
    return list(bs.values())


SHORT = RoutingRequest(model="m", prompt_tokens=100)  # bucket 0 -> g1
LONG = RoutingRequest(model="m", prompt_tokens=5000)  # bucket 1 -> g2


def _fallbacks(r: Router) -> float:
    reg = CollectorRegistry()
    reg.register(PluginEventsCollector(lambda: r.strategy))
    return reg.get_sample_value("infernex_router_plugin_events_total", {"plugin": "bucket", "event": "bucket_fallback"})


def test_bucket_group_without_prefill_falls_back_to_a_healthy_group():
    r = Router("pd-bucket", seed=1)
    d = r.decide(SHORT, cluster())
    assert (d.prefill.pod, d.target.pod) == ("p1", "d1") and _fallbacks(r) == 0
    for why in ({"health": "critical"}, {"circuit_open": True}, {"draining": True}):
        d = r.decide(SHORT, cluster(p1=why))
        assert d.ok and (d.prefill.pod, d.target.pod) == ("p2", "d2"), why
    assert _fallbacks(r) == 3
    # the decode side of the bucket's group is gone: same fallback
    d = r.decide(SHORT, cluster(d1={"health": "critical"}))
    assert d.ok and (d.prefill.pod, d.target.pod) == ("p2", "d2") and _fallbacks(r) == 4
    # a pod already tried (retry) counts as unusable too
    d = r.decide(RoutingRequest(model="m", prompt_tokens=100, exclude=frozenset({"p1"})), cluster())
    assert d.ok and d.prefill.pod == "p2" and _fallbacks(r) == 5
    # the long bucket is unaffected; nothing healthy anywhere is still a clear failure
    assert r.decide(LONG, cluster(p1={"health": "critical"})).prefill.pod == "p2"
    d = r.decide(SHORT, cluster(p1={"health": "critical"}, p2={"health": "critical"}))
    assert not d.ok and d.status == "no_backend"
    assert _fallbacks(r) == 5


def test_fallback_can_be_switched_off():
    from router.profiles import build_strategy
    import yaml
    from router.profiles import BUILTIN_DIR

    spec = yaml.safe_load((BUILTIN_DIR / "pd-bucket.yaml").read_text())
    for p in spec["plugins"]:
        if p["type"] == "pd-bucket-filter":
            p["parameters"]["fallback"] = False
    r = Router(build_strategy("strict-bucket", spec), seed=1)
    d = r.decide(SHORT, cluster(p1={"health": "critical"}))
    assert not d.ok


def test_router_serves_a_short_prompt_when_its_group_lost_the_prefill_pod():
    """p1 (the short bucket's prefill) is gone: its prefill fails, the retry excludes it, and the
    bucket falls back to g2 instead of answering 503."""
    import socket

    async def run():
        engines = [await FakeEngine(p).start() for p in ("d1", "p2", "d2")]
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{sk.getsockname()[1]}"
        roles = {"d1": ("decode", "g1"), "p2": ("prefill", "g2"), "d2": ("decode", "g2")}
        backends = [StaticBackend(pod="p1", url=dead, model=engines[0].model, role="prefill", group="g1")]
        backends += [StaticBackend(pod=e.pod, url=e.url, model=e.model, role=roles[e.pod][0], group=roles[e.pod][1])
                     for e in engines]
        svc = RouterService(RouterConfig(backends=backends, bus=False, records=False, seed=1, strategy="pd-bucket",
                                         connect_timeout_s=1))
        await svc.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(svc.url + "/v1/completions",
                                  json={"model": engines[0].model, "prompt": "hi", "max_tokens": 3}) as r:
                    assert r.status == 200, await r.text()
                async with s.get(svc.url + "/metrics") as r:
                    text = await r.text()
            return text, [len(e.requests) for e in engines]
        finally:
            await svc.stop()
            for e in engines:
                await e.stop()

    text, counts = asyncio.run(run())
    assert counts == [0, 1, 1]
    assert 'infernex_router_plugin_events_total{event="bucket_fallback",plugin="bucket"} 1.0' in text
