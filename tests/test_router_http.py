"""The router's HTTP layer against tiny fake engines (router.testing.FakeEngine)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from router.testing import FakeEngine, wait_for
from schemas.metrics import EngineMetrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, engines, svc):
        self.engines, self.svc = engines, svc
        self.url = svc.url

    def engine(self, pod):
        return next(e for e in self.engines if e.pod == pod)


async def start_cluster(engines: list[FakeEngine], roles=None, dead: list[str] = (), **cfg_kw) -> Cluster:
    for e in engines:
        await e.start()
    roles = roles or {}
    backends = [StaticBackend(pod=e.pod, url=e.url, model=e.model, role=roles.get(e.pod, ("aggregated", None))[0],
                              group=roles.get(e.pod, ("aggregated", None))[1]) for e in engines]
    backends += [StaticBackend(pod=p, url=f"http://127.0.0.1:{free_port()}", model="m") for p in dead]
    cfg_kw.setdefault("strategy", "round-robin")
    cfg = RouterConfig(backends=backends, bus=False, records=False, seed=1, connect_timeout_s=2, **cfg_kw)
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    return Cluster(engines, svc)


async def stop_cluster(c: Cluster) -> None:
    await c.svc.stop()
    for e in c.engines:
        await e.stop()


@pytest.fixture
async def two():
    c = await start_cluster([FakeEngine("a"), FakeEngine("b")])
    yield c
    await stop_cluster(c)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


async def test_forward_non_stream_keeps_request_id(two):
    async with aiohttp.ClientSession() as s:
        async with s.post(two.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-1"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "abc-1"
            body = await r.json()
        assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 tok4 "
        served = body["served_by"]
        assert two.engine(served).headers[-1]["X-Request-Id"] == "abc-1"
        async with s.post(two.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"].startswith("req-")
            assert (await r.json())["choices"][0]["text"] == "tok0 tok1 "


async def test_openai_client_streaming_and_models(two):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)
    try:
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=3)
        assert out.choices[0].message.content == "tok0 tok1 tok2 "
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        assert "".join(pieces) == "tok0 tok1 tok2 tok3 "
        comp = await client.completions.create(model="m", prompt="say", max_tokens=2, stream=True)
        assert "".join([c.choices[0].text async for c in comp if c.choices]) == "tok0 tok1 "
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
    finally:
        await client.close()


async def test_stream_is_not_buffered():
    c = await start_cluster([FakeEngine("a", tokens=6, delay_s=0.3)])
    try:
        async with aiohttp.ClientSession() as s:
            body = {**CHAT, "stream": True, "max_tokens": 6}
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with s.post(c.url + "/v1/chat/completions", json=body) as r:
                first = await r.content.readuntil(b"\n\n")
                t_first = loop.time() - t0
                rest = await r.read()
            t_all = loop.time() - t0
        assert b"tok0" in first
        assert t_first < t_all - 0.8  # the first event arrived long before the end
        assert rest.endswith(b"data: [DONE]\n\n")
        assert b'"usage"' not in rest  # the usage chunk the router asked for is not shown
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1,2]", 400, "invalid_request"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "invalid_value"),
    (b'{"model": "m", "messages": []}', 400, "invalid_value"),
    (b'{"model": "m", "messages": [{"role":"user","content":"x"}], "max_tokens": -3}', 400, "invalid_value"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
])
async def test_bad_requests_get_openai_errors(two, body, status, code):
    async with aiohttp.ClientSession() as s:
        async with s.post(two.url + "/v1/chat/completions", data=body,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            err = (await r.json())["error"]
            assert err["code"] == code and err["message"] and "Traceback" not in err["message"]


async def test_body_limit_auth_and_rate_limit(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# keys\nk-one\nk-two\n")
    c = await start_cluster([FakeEngine("a")], api_keys_file=keys, admin_key="adm", rate_limit_rps=0.001,
                            rate_limit_burst=2, max_body_bytes=2000)
    try:
        async with aiohttp.ClientSession() as s:
            u = c.url + "/v1/chat/completions"
            async with s.post(u, json=CHAT) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
            async with s.post(u, json=CHAT, headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            for _ in range(2):
                async with s.post(u, json=CHAT, headers={"Authorization": "Bearer k-two"}) as r:
                    assert r.status == 200
            async with s.post(u, json=CHAT, headers={"Authorization": "Bearer k-two"}) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            async with s.post(u, json=CHAT, headers={"Authorization": "Bearer k-one"}) as r:
                assert r.status == 200  # limits are per key
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
            async with s.post(u, json=big, headers={"Authorization": "Bearer k-one"}) as r:
                assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"
            async with s.get(c.url + "/v1/router/backends", headers={"Authorization": "Bearer k-one"}) as r:
                assert r.status == 401  # admin endpoints want the admin key
            async with s.get(c.url + "/v1/router/backends", headers={"Authorization": "Bearer adm"}) as r:
                assert r.status == 200 and (await r.json())["backends"][0]["pod"] == "a"
            async with s.get(c.url + "/health") as r:
                assert r.status == 200
    finally:
        await stop_cluster(c)


async def test_connect_failure_goes_to_another_backend():
    c = await start_cluster([FakeEngine("b")], dead=["a"])  # round-robin tries "a" first
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                assert (await r.json())["served_by"] == "b"
        assert c.svc.metrics.retries.labels("connect")._value.get() == 1
    finally:
        await stop_cluster(c)


async def test_circuit_breaker_opens_after_failures():
    c = await start_cluster([FakeEngine("a", status=500), FakeEngine("b")], breaker_failures=2, max_retries=3)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
        assert c.svc.state.breakers.state("a") == "open"
        n = len(c.engine("a").requests)
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
        assert len(c.engine("a").requests) == n  # no more traffic while open
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_migration_when_backend_dies_mid_stream(kind):
    # no tokenizer: the fake engines read text, so the continuation appends text (with a tokenizer
    # the router sends token ids, see test_router_sim)
    c = await start_cluster([FakeEngine("a", tokens=8, die_after=3), FakeEngine("b", tokens=8)], tokenizer=None)
    try:
        if kind == "chat":
            path, body = "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 8}
        else:
            path, body = "/v1/completions", {"model": "m", "prompt": "go", "stream": True, "max_tokens": 8}
        text = []
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + path, json=body) as r:
                raw = await r.read()
        import json

        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                ch = json.loads(line[6:])["choices"]
                for x in ch:
                    text.append(x.get("text") or (x.get("delta") or {}).get("content") or "")
        assert "".join(text) == "".join(f"tok{i} " for i in range(8))
        assert raw.endswith(b"data: [DONE]\n\n")
        cont = c.engine("b").requests[-1]
        assert cont["max_tokens"] == 5  # 8 minus the 3 already streamed
        if kind == "chat":
            assert cont["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
        else:
            assert cont["prompt"] == "gotok0 tok1 tok2 "
        assert c.svc.metrics.migrations._value.get() == 1
    finally:
        await stop_cluster(c)


async def test_client_disconnect_cancels_upstream():
    c = await start_cluster([FakeEngine("a", tokens=200, delay_s=0.05)])
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 200})
            await r.content.readuntil(b"\n\n")
            r.close()  # the client goes away
        e = c.engine("a")
        assert await wait_for(lambda: e.cancelled == 1, timeout=10)
        assert e.finished == 0
        assert await wait_for(lambda: c.svc.inflight == 0, timeout=5)
        assert c.svc.state.get("a").inflight == 0
    finally:
        await stop_cluster(c)


async def test_all_busy_gets_503_with_retry_after():
    c = await start_cluster([FakeEngine("a"), FakeEngine("b")], retry_after_s=3)
    try:
        now = c.svc.state.clock.now()
        for pod in ("a", "b"):
            c.svc.state.apply_metrics(EngineMetrics(pod=pod, model="m", ts=now, num_requests_running=10,
                                                    num_requests_waiting=1, kv_cache_usage_perc=0.99))
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "3"
                assert (await r.json())["error"]["code"] == "busy"
        assert c.engine("a").requests == [] and c.engine("b").requests == []
        c.svc.state.apply_metrics(EngineMetrics(pod="b", model="m", ts=now + 1, num_requests_running=1,
                                                num_requests_waiting=0, kv_cache_usage_perc=0.2))
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "b"
    finally:
        await stop_cluster(c)


async def test_drain_finishes_in_flight_and_refuses_new():
    c = await start_cluster([FakeEngine("a", tokens=10, delay_s=0.1)])
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 10})
            await r.content.readuntil(b"\n\n")
            drain = asyncio.create_task(c.svc.drain(timeout=20))
            await asyncio.sleep(0.05)
            async with s.post(c.url + "/v1/chat/completions", json=CHAT) as r2:
                assert r2.status == 503 and (await r2.json())["error"]["code"] == "draining"
            async with s.get(c.url + "/ready") as r3:
                assert r3.status == 503
            assert not drain.done()
            rest = await r.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b"tok9" in rest
            assert await asyncio.wait_for(drain, 10) is True
    finally:
        await stop_cluster(c)


async def test_decide_backends_metrics_and_ready(two):
    async with aiohttp.ClientSession() as s:
        async with s.post(two.url + "/v1/router/decide", json=CHAT) as r:
            d = await r.json()
            assert r.status == 200 and d["picked"] in ("a", "b") and d["status"] == "ok"
            assert {c["pod"] for c in d["stages"][0]["candidates"]} == {"a", "b"}
            assert d["prompt_tokens"] > 0
        assert two.engine("a").requests == [] and two.engine("b").requests == []  # not forwarded
        async with s.get(two.url + "/v1/router/backends") as r:
            b = await r.json()
            assert {x["pod"] for x in b["backends"]} == {"a", "b"} and b["strategy"] == "round-robin"
        async with s.post(two.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with s.get(two.url + "/metrics") as r:
            text = await r.text()
            assert 'infernex_router_requests_total{status="ok",strategy="round-robin"} 1.0' in text
        async with s.get(two.url + "/ready") as r:
            assert r.status == 200


async def test_pd_two_stage_matches_aggregated_output():
    engines = [FakeEngine("p1"), FakeEngine("d1"), FakeEngine("agg")]
    roles = {"p1": ("prefill", "g1"), "d1": ("decode", "g1")}
    c = await start_cluster(engines, roles=roles, strategy="pd-random-bucket")
    agg = await start_cluster([FakeEngine("solo")], strategy="round-robin")
    try:
        body = {"model": "m", "prompt": "a long prompt " * 200, "max_tokens": 6, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/completions", json=body, headers={"X-Request-Id": "pd-1"}) as r:
                pd_raw = await r.read()
            async with s.post(agg.url + "/v1/completions", json=body) as r:
                agg_raw = await r.read()
        import json

        def text(raw):
            return "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in raw.split(b"\n")
                           if ln.startswith(b"data: {") and json.loads(ln[6:])["choices"])

        assert text(pd_raw) == text(agg_raw) == "tok0 tok1 tok2 tok3 tok4 tok5 "
        pre, dec = c.engine("p1").requests, c.engine("d1").requests
        assert len(pre) == 1 and len(dec) == 1 and c.engine("agg").requests == []
        assert pre[0]["max_tokens"] == 1 and pre[0]["stream"] is False
        assert pre[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert dec[0]["kv_transfer_params"]["remote_engine_id"] == "p1"
        assert dec[0]["max_tokens"] == 6 and dec[0]["stream"] is True
        assert c.engine("p1").headers[0]["X-Request-Id"] == c.engine("d1").headers[0]["X-Request-Id"] == "pd-1"
    finally:
        await stop_cluster(c)
        await stop_cluster(agg)


async def test_approximate_prefix_mode_follows_its_own_routing_history(tmp_path):
    """No KV events at all: an approximate prefix scorer predicts from the router's own routes."""
    from router.app import RouterApp

    strat = tmp_path / "approx.yaml"
    strat.write_text("""
plugins:
  - {type: model-filter}
  - {name: prefix, type: prefix-scorer, parameters: {mode: approximate}}
  - {type: active-tokens-scorer}
  - {type: max-score-picker}
schedulingProfiles:
  - name: default
    plugins: [{pluginRef: model-filter}, {pluginRef: prefix, weight: 3}, {pluginRef: active-tokens-scorer},
              {pluginRef: max-score-picker}]
""")
    engines = [await FakeEngine(p).start() for p in ("a", "b", "c", "d")]
    backends = [StaticBackend(pod=e.pod, url=e.url, model="m", loras=["ad1"]) for e in engines]
    app = RouterApp(RouterConfig(strategy=str(strat), backends=backends, bus=False, records=False, seed=2))
    url = await app.start("127.0.0.1", 0)
    try:
        shared = " ".join(f"sys{i}" for i in range(64))
        async with aiohttp.ClientSession() as s:
            served = []
            for k in range(5):
                body = {"model": "m", "prompt": f"{shared} question {k}", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    served.append((await r.json())["served_by"])
        assert len(set(served)) == 1  # every sharer followed the first one's predicted blocks
        assert app.index.pods()[served[0]].predicted_blocks > 0
        # the same for a LoRA adapter's requests: predicted under the base model, keyed by the adapter
        async with aiohttp.ClientSession() as s:
            lora = []
            for k in range(5):
                body = {"model": "ad1", "prompt": f"{shared} lora question {k}", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    lora.append((await r.json())["served_by"])
        assert len(set(lora)) == 1
    finally:
        await app.stop(drain=False)
        for e in engines:
            await e.stop()


async def test_routes_predict_only_the_blocks_the_engine_has_not_reported():
    """kv-aware records a routed prompt as predicted on its pod only past the prefix that pod's KV
    events already reported; the match still covers the whole prompt."""
    from router.app import RouterApp
    from schemas.kv import BlockStored, KvEventBatch
    from simulator.tokenizer import SimpleTokenizer, request_to_ids

    eng = await FakeEngine("a").start()
    app = RouterApp(RouterConfig(strategy="kv-aware", backends=[StaticBackend(pod="a", url=eng.url, model="m")],
                                 bus=False, records=False, tokenizer="simple"))
    url = await app.start("127.0.0.1", 0)
    try:
        body = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(100)), "max_tokens": 1}
        ids = request_to_ids(SimpleTokenizer(), "completions", body)
        ix = app.index
        ix.apply(KvEventBatch(pod="a", model="m", seq=0, ts=0.0, events=[  # the engine reported 2 blocks
            BlockStored(block_hashes=[1, 2], token_ids=ids[:32], block_size=16)]))
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        whole = len(ids) // 16
        assert ix.pods()["a"].predicted_blocks == whole - 2
        m = ix.match_tokens("m", ids)["a"]
        assert (m.matched_blocks, m.predicted_blocks) == (whole, whole - 2)
    finally:
        await app.stop(drain=False)
        await eng.stop()


@pytest.mark.parametrize("status", [503, 400])
async def test_a_request_an_engine_refused_leaves_no_predicted_blocks_there(status):
    """Ground truth for a failed route: the engine answered an error, so it computed nothing of the
    prompt; the blocks predicted there when the request was routed end with it, and the next
    request with that prompt reads the engine as holding none of it (they counted 30 s before)."""
    from router.app import RouterApp
    from simulator.tokenizer import SimpleTokenizer, request_to_ids

    eng = await FakeEngine("a", status=status).start()
    app = RouterApp(RouterConfig(strategy="kv-aware", backends=[StaticBackend(pod="a", url=eng.url, model="m")],
                                 bus=False, records=False, tokenizer="simple", max_retries=0))
    url = await app.start("127.0.0.1", 0)
    try:
        body = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(100)), "max_tokens": 1}
        ids = request_to_ids(SimpleTokenizer(), "completions", body)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status >= 400
        assert len(eng.requests) >= 1  # it reached the engine, which refused it
        ix = app.index
        assert ix.pods()["a"].predicted_blocks == 0
        assert ix.match_tokens("m", ids).get("a") is None or ix.match_tokens("m", ids)["a"].matched_blocks == 0
    finally:
        await app.stop(drain=False)
        await eng.stop()


def test_route_predictions_outlive_the_engines_queue_on_pods_that_send_events():
    """An engine's KV events come only once the prefill ran, which under load is seconds after the
    route: a routed prompt counts as predicted on its pod for ``route_prediction_ttl_s`` (30 s by
    default), also on pods whose exact events the index has, then expires."""
    from router.app import RouterApp
    from schemas.kv import BlockStored, KvEventBatch
    from streams.clock import ManualClock

    clock = ManualClock(1000.0)
    app = RouterApp(RouterConfig(bus=False, records=False), clock=clock)
    assert app.index.predict_on_route_ttl_s == 30.0
    ix = app.index
    ix.apply(KvEventBatch(pod="a", model="m", seq=0, ts=1000.0,
                          events=[BlockStored(block_hashes=[1], token_ids=list(range(16)), block_size=16)]))
    toks = list(range(100, 164))
    ix.record_route("m", "a", token_ids=toks)
    clock.set(1020.0)  # queueing: still no events for these blocks
    assert ix.match_tokens("m", toks)["a"].predicted_blocks == 4
    clock.set(1031.0)
    assert "a" not in ix.match_tokens("m", toks) or ix.match_tokens("m", toks)["a"].matched_blocks == 0
    short = RouterApp(RouterConfig(bus=False, records=False, route_prediction_ttl_s=2.0), clock=clock)
    assert short.index.predict_on_route_ttl_s == 2.0
