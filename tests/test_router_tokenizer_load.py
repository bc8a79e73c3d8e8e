"""A served model's tokenizer.json (``tokenizer: auto``) is found and loaded on a thread the
first time a request needs it: reading and checking a large one takes up to a second or two, and
the router's event loop keeps answering other requests meanwhile. Requests for that model wait for
the one load, then are tokenized with it. The models the backends serve are loaded so from the
start, before any request asks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

import router.tokenize as rtok
from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from router.testing import FakeEngine
from simulator.tokenizer import HFTokenizer

FIX = Path(__file__).parent / "fixtures" / "tokenize"
LOAD_S = 0.8


def _hub(tmp_path: Path) -> Path:
    hub = tmp_path / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes((FIX / "tokenizer.json").read_bytes())
    return hub


async def test_the_first_requests_wait_for_one_load_off_the_event_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub(tmp_path)))
    loads = []
    real = rtok.load_tokenizer

    def slow_load(spec, *a, **kw):  # a large tokenizer.json: the read and checks take a while
        loads.append(spec)
        time.sleep(LOAD_S)
        return real(spec, *a, **kw)

    monkeypatch.setattr(rtok, "load_tokenizer", slow_load)
    engines = [FakeEngine("a", model="acme/tiny"), FakeEngine("b", model="acme/tiny")]
    for e in engines:
        await e.start()
    cfg = RouterConfig(backends=[StaticBackend(pod=e.pod, url=e.url, model=e.model) for e in engines], bus=False,
                       records=False, seed=1, strategy="kv-aware", tokenizer="auto")
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    base = svc.url
    try:
        async with aiohttp.ClientSession() as s:
            async def complete(prompt: str) -> int:
                async with s.post(f"{base}/v1/completions", json={"model": "acme/tiny", "prompt": prompt,
                                                                  "max_tokens": 2}) as r:
                    await r.read()
                    return r.status

            async def health_gaps() -> float:  # the longest /health answer while the load runs
                worst = 0.0
                t_end = time.monotonic() + LOAD_S + 0.2
                while time.monotonic() < t_end:
                    t = time.monotonic()
                    async with s.get(f"{base}/health") as r:
                        assert r.status == 200
                    worst = max(worst, time.monotonic() - t)
                    await asyncio.sleep(0.02)
                return worst

            prompts = [f"hello world, request {i} to the router" for i in range(3)]
            got = await asyncio.gather(health_gaps(), *(complete(p) for p in prompts))
        worst, statuses = got[0], got[1:]
        assert statuses == [200, 200, 200]
        assert len(loads) == 1  # one load for the three first requests
        assert worst < LOAD_S / 2, f"/health took {worst:.2f}s while the tokenizer loaded"
        tok = svc.encoder.tokenizer_for("acme/tiny")
        assert isinstance(tok, HFTokenizer)
        # and the prompts were routed with its ids (the engines saw them in full)
        sent = [b["prompt"] for e in engines for b in e.requests]
        assert sorted(sent) == sorted(prompts)
        assert svc.encoder.ready("acme/tiny")
    finally:
        await svc.stop()
        for e in engines:
            await e.stop()


async def test_the_backends_models_are_loaded_before_any_request(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub(tmp_path)))
    loads = []
    real = rtok.load_tokenizer

    def counted(spec, *a, **kw):
        loads.append(spec)
        return real(spec, *a, **kw)

    monkeypatch.setattr(rtok, "load_tokenizer", counted)
    cfg = RouterConfig(backends=[StaticBackend(pod=p, url=f"http://127.0.0.1:9/{p}", model="acme/tiny")
                                 for p in ("a", "b")], bus=False, records=False, strategy="kv-aware", tokenizer="auto")
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    try:
        assert svc.encoder.loading("acme/tiny") or svc.encoder.ready("acme/tiny")  # begun at start
        for _ in range(100):
            if svc.encoder.ready("acme/tiny"):
                break
            await asyncio.sleep(0.05)
        assert svc.encoder.ready("acme/tiny") and not svc.encoder.loading("acme/tiny")
        assert isinstance(svc.encoder.tokenizer_for("acme/tiny"), HFTokenizer)
        await asyncio.sleep(1.2)  # the refresher's next pass finds it loaded: no second load
        assert len(loads) == 1
    finally:
        await svc.stop()

    rr = RouterService(cfg.model_copy(update={"strategy": "round-robin"}))  # reads no prefixes: loads nothing
    await rr.start("127.0.0.1", 0)
    try:
        await asyncio.sleep(0.2)
        assert not rr.encoder.ready("acme/tiny") and len(loads) == 1
    finally:
        await rr.stop()
