"""The router against bad input and its API surface.

Property-based fuzzing (Hypothesis) of every endpoint the served ``/openapi.json`` lists, with
simulated vLLM engines behind the router: valid requests with fields replaced by arbitrary JSON,
arbitrary JSON documents, arbitrary bytes. The assertion is that the router never answers 5xx
and every 4xx is an OpenAI-shaped error (string ``code``, ``type``, ``param``). Then the named
cases from the issue, and the surface: ``/openapi.json``, ``/docs``, ``/version``,
``/v1/models/{id}``, pass-through of embeddings / responses / tokenize / detokenize, the
``X-InferNex-Backend`` header.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import logging
import threading
import time

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig

MODEL = "sim"


class RouterThread:
    """A RouterService on its own event loop in a thread, for synchronous Hypothesis tests."""

    def __init__(self, cfg: RouterConfig, index=None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.svc = RouterService(cfg, index=index)
        self.url = asyncio.run_coroutine_threadsafe(self.svc.start("127.0.0.1", 0), self.loop).result(10)
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.svc.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module", params=["round-robin", "pd-kv-aware"])
def served(request):
    # round-robin over two aggregated engines; PD with prefix-aware scoring (the tokenizer and the
    # KV index read every prompt) over a prefill and a decode engine
    pd = request.param.startswith("pd-")
    roles = ("kv_producer", "kv_consumer") if pd else ("aggregated", "aggregated")
    specs = [EngineSpec(EngineConfig(engine_id=f"e{i}", served_model_name=MODEL, num_gpu_blocks=512, block_size=16,
                                     max_model_len=512, role=roles[i]), kv_events=False) for i in range(2)]
    cluster = SimCluster(specs, time_scale=200).start()
    backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL, loras=["ad1"] if i == 0 else [],
                              role=("prefill", "decode")[i] if pd else "aggregated", group="g" if pd else None)
                for i, h in enumerate(cluster.engines)]
    from streams.clock import SystemClock
    from streams.kv_index import KvIndex

    r = RouterThread(RouterConfig(strategy=request.param, backends=backends, bus=False, records=False,
                                  read_timeout_s=10, request_timeout_s=5), index=KvIndex(SystemClock()))
    try:
        yield r
    finally:
        r.stop()
        cluster.stop()


def call(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def assert_openai_error(status: int, data: bytes) -> dict:
    err = json.loads(data)["error"]
    assert isinstance(err["code"], str) and err["code"], err
    assert isinstance(err["type"], str) and isinstance(err["message"], str) and "param" in err, err
    assert "Traceback" not in err["message"]
    return err


# -- strategies ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
VALID = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "once upon", "max_tokens": 3},
    "/v1/embeddings": {"model": MODEL, "input": "hello"},
    "/v1/responses": {"model": MODEL, "input": "hello", "max_output_tokens": 3},
    "/tokenize": {"model": MODEL, "prompt": "hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    "/v1/router/decide": CHAT,
}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
          "temperature", "top_p", "n", "stop", "seed", "lora", "cache_salt", "kv_transfer_params", "input",
          "tokens", "logprobs", "prompt_token_ids", "tools", "min_tokens", "echo"]


@st.composite
def mutated(draw, base: dict) -> dict:
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "del", "nested", "stream"]))
        key = draw(st.sampled_from(FIELDS) | st.text(max_size=8))
        if op == "set":
            body[key] = draw(json_values)
        elif op == "del":
            body.pop(key, None)
        elif op == "stream":
            body["stream"] = True
            body["stream_options"] = draw(st.sampled_from(["yes", 1, None, {}, {"include_usage": True},
                                                            {"include_usage": "yes"}, []]))
        elif isinstance(body.get("messages"), list) and body["messages"]:
            m = body["messages"][0]
            if isinstance(m, dict):
                m[draw(st.sampled_from(["role", "content", "name", "x"]))] = draw(json_values)
    return body


def bodies(path: str):
    raw_junk = st.sampled_from([b"\xff", b'{"model": "\xff\xfe"}', b"[" * 100_000, b"{" * 50_000, b"",
                                b'{"model": "sim", "messages": [{"role": "user", "content": "\xc3"}]}'])
    return (mutated(VALID[path]).map(lambda b: json.dumps(b).encode())
            | json_values.map(lambda v: json.dumps(v).encode())
            | st.binary(max_size=64) | raw_junk)


def openapi_paths(port: int) -> dict:
    status, _, data = call(port, "GET", "/openapi.json")
    assert status == 200
    return json.loads(data)["paths"]


# -- the fuzz ------------------------------------------------------------------------------------

def fuzz_post(port: int, path: str, seen: dict) -> None:
    @settings(max_examples=70, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def one(body):
        status, headers, data = call(port, "POST", path, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (path, body[:300], status, data[:300])
        if status >= 400:  # the router's own errors and the engines' alike
            assert headers.get("content-type") == "application/json", headers
            assert_openai_error(status, data)
    one()


def fuzz_get(port: int, path: str, seen: dict) -> None:
    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(tail=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"),
                        max_size=20))
    def one(tail):
        p = path.replace("{model}", tail or MODEL)
        status, _, data = call(port, "GET", p)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (p, status, data[:300])
    one()


def test_fuzz_every_endpoint_no_5xx(served):
    """Every path and method the OpenAPI document lists, ~600 requests, none answered 5xx."""
    paths = openapi_paths(served.port)
    assert set(VALID) <= set(paths)
    seen: dict[int, int] = {}
    t0 = time.monotonic()
    for path, ops in paths.items():
        if "post" in ops:
            fuzz_post(served.port, path, seen)
        if "get" in ops:
            fuzz_get(served.port, path, seen)
    assert time.monotonic() - t0 < 60
    # the fuzz reached the engines, not only the validators
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 20, seen


@pytest.mark.parametrize("body,param", [
    (json.dumps({**CHAT, "stream": True, "stream_options": "yes"}).encode(), "stream_options"),
    (json.dumps({**CHAT, "max_tokens": "3"}).encode(), "max_tokens"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content"),
    (json.dumps({**CHAT, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({**CHAT, "stream": "true"}).encode(), "stream"),
    (b'{"model": "sim", "messages": [{"role": "user", "content": "\xff"}]}', None),
    (b"[" * 100_000, None),
])
def test_named_bad_inputs_are_400(served, body, param):
    status, _, data = call(served.port, "POST", "/v1/chat/completions", body)
    assert status == 400
    err = assert_openai_error(status, data)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_unknown_lora_adapter_is_404_not_503(served):
    if not any(f.type_name == "lora-filter" for p in served.svc.router.strategy.profiles.values() for f in p.filters):
        pytest.skip("this strategy does not filter by LoRA adapter")
    status, headers, data = call(served.port, "POST", "/v1/chat/completions",
                                 json.dumps({**CHAT, "lora": "no-such-adapter"}).encode())
    assert status == 404 and "retry-after" not in headers
    assert assert_openai_error(status, data)["code"] == "model_not_found"
    status, headers, data = call(served.port, "POST", "/v1/chat/completions", json.dumps({**CHAT, "lora": "ad1"}).encode())
    assert status == 200 and headers["x-infernex-backend"] == "e0"  # the adapter's holder


# -- the surface ---------------------------------------------------------------------------------

def test_openapi_docs_version_and_models(served):
    doc = json.loads(call(served.port, "GET", "/openapi.json")[2])
    assert doc["openapi"].startswith("3.1")
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    comp = doc["components"]["schemas"][chat["$ref"].rsplit("/", 1)[1]]
    assert {"model", "messages"} <= set(comp["required"]) and "stream_options" in comp["properties"]
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(comp)
    status, headers, html = call(served.port, "GET", "/docs")
    assert status == 200 and b"/openapi.json" in html and headers["content-type"].startswith("text/html")
    v = json.loads(call(served.port, "GET", "/version")[2])
    assert isinstance(v["version"], str) and v["version"]
    status, _, data = call(served.port, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and json.loads(data)["id"] == MODEL
    status, _, data = call(served.port, "GET", "/v1/models/Qwen%2Fnope")
    assert status == 404 and assert_openai_error(status, data)["code"] == "model_not_found"


def test_backend_header_on_answers(served):
    status, headers, _ = call(served.port, "POST", "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 200 and headers["x-infernex-backend"] in ("e0", "e1")
    status, headers, data = call(served.port, "POST", "/v1/completions",
                                 json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}).encode())
    assert status == 200 and headers["x-infernex-backend"] in ("e0", "e1") and data.endswith(b"data: [DONE]\n\n")


class AuxEngine:
    """An engine with the endpoints the simulator lacks (shapes as vLLM answers them), requiring a key."""

    def __init__(self, model: str, key: str | None = None):
        self.model, self.key, self.seen = model, key, []

    async def start(self) -> str:
        app = web.Application()

        def guard(h):
            async def w(request):
                self.seen.append((request.path, request.headers.get("Authorization")))
                if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
                    return web.json_response({"error": "Unauthorized"}, status=401)
                return await h(request, await request.json())
            return w

        async def emb(request, body):
            return web.json_response({"object": "list", "model": body["model"],
                                      "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}]})

        async def tok(request, body):
            return web.json_response({"count": 2, "max_model_len": 512, "tokens": [7, 8]})

        async def detok(request, body):
            return web.json_response({"prompt": " ".join(map(str, body["tokens"]))})

        async def responses(request, body):
            if not body.get("stream"):
                return web.json_response({"id": "resp_1", "object": "response", "status": "completed"})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for ev in ("response.created", "response.output_text.delta", "response.completed"):
                await resp.write(f"event: {ev}\ndata: {json.dumps({'type': ev})}\n\n".encode())
            return resp

        for path, h in (("/v1/embeddings", emb), ("/tokenize", tok), ("/detokenize", detok),
                        ("/v1/responses", responses)):
            app.router.add_post(path, guard(h))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001


async def test_passthrough_and_upstream_auth():
    a, b = AuxEngine("emb", key="engine-secret-1"), AuxEngine("other", key="engine-secret-2")
    ua, ub = await a.start(), await b.start()
    cfg = RouterConfig(backends=[StaticBackend(pod="pa", url=ua, model="emb"),
                                 StaticBackend(pod="pb", url=ub, model="other", api_key="engine-secret-2")],
                       engine_api_key="engine-secret-1", bus=False, records=False, strategy="round-robin")
    svc = RouterService(cfg)
    url = await svc.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/embeddings", json={"model": "emb", "input": "hi"}) as r:
                assert r.status == 200 and r.headers["X-InferNex-Backend"] == "pa"
                assert (await r.json())["data"][0]["embedding"] == [0.1, 0.2]
            async with s.post(url + "/tokenize", json={"model": "other", "prompt": "hi"}) as r:
                assert r.status == 200 and (await r.json())["tokens"] == [7, 8]
                assert r.headers["X-InferNex-Backend"] == "pb"
            async with s.post(url + "/detokenize", json={"model": "emb", "tokens": [3, 4]}) as r:
                assert (await r.json())["prompt"] == "3 4"
            async with s.post(url + "/v1/responses", json={"model": "emb", "input": "hi", "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                raw = await r.read()
            assert raw.count(b"event: ") == 3 and raw.endswith(b'{"type": "response.completed"}\n\n')
            async with s.post(url + "/v1/embeddings", json={"model": "nope", "input": "hi"}) as r:
                assert r.status == 404
            async with s.post(url + "/detokenize", json={"model": "emb", "tokens": ["x"]}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "tokens[0]"
        # the global key went to pa, the per-backend key to pb; no request reached an engine unauthorized
        assert {h for _, h in a.seen} == {"Bearer engine-secret-1"}
        assert {h for _, h in b.seen} == {"Bearer engine-secret-2"}
    finally:
        await svc.stop()
        await a.runner.cleanup()
        await b.runner.cleanup()


async def test_408_is_read_by_a_trickling_client_and_logs_no_task_error(caplog):
    svc = RouterService(RouterConfig(bus=False, records=False, request_timeout_s=0.5))
    url = await svc.start("127.0.0.1", 0)
    port = int(url.rsplit(":", 1)[1])
    caplog.set_level(logging.DEBUG)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        got = b""
        for _ in range(8):  # keeps trickling bytes past the deadline (within the 2 s linger), as a slow client does
            await asyncio.sleep(0.15)
            try:
                writer.write(b" ")
                await writer.drain()
            except ConnectionError:
                break
            if reader.at_eof():
                break
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert got.startswith(b"HTTP/1.1 408 ")
        err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout"
    finally:
        await svc.stop()
    gc.collect()
    await asyncio.sleep(0.05)
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text


async def test_migrated_chat_stream_sends_the_role_delta_once():
    from simulator.config import FaultConfig

    dying = EngineConfig(engine_id="e0", served_model_name=MODEL, num_gpu_blocks=512, block_size=16,
                         faults=FaultConfig(die_after_tokens=3))
    cluster = await asyncio.to_thread(lambda: SimCluster([
        EngineSpec(dying, kv_events=False),
        EngineSpec(EngineConfig(engine_id="e1", served_model_name=MODEL, num_gpu_blocks=512, block_size=16),
                   kv_events=False)], time_scale=50).start())
    backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL) for h in cluster.engines]
    svc = RouterService(RouterConfig(strategy="round-robin", backends=backends, bus=False, records=False))
    url = await svc.start("127.0.0.1", 0)
    try:
        body = {**CHAT, "max_tokens": 10, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=body) as r:  # round-robin: e0 first
                raw = await r.read()
        events = [json.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: {")]
        assert svc.metrics.migrations._value.get() == 1
        deltas = [c["delta"] for e in events for c in e.get("choices", [])]
        assert sum("role" in d for d in deltas) == 1 and "role" in deltas[0]
        assert sum(1 for d in deltas if d.get("content")) == 10  # every token, once
        assert raw.endswith(b"data: [DONE]\n\n")
    finally:
        await svc.stop()
        await asyncio.to_thread(cluster.stop)


def test_engine_errors_come_back_openai_shaped(served):
    """vLLM answers errors with an int ``code``; the client gets a string one, the engine's message kept."""
    status, headers, data = call(served.port, "POST", "/v1/chat/completions", json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode())
    assert status == 400 and headers["content-type"] == "application/json"
    err = assert_openai_error(status, data)
    assert err["message"] == "only text content parts are supported" and err["code"] == "invalid_request"
    # an endpoint the simulated engine does not have: its plain 404 becomes an OpenAI error too
    status, headers, data = call(served.port, "POST", "/v1/embeddings", json.dumps({"model": MODEL, "input": "x"}).encode())
    assert status == 404 and assert_openai_error(status, data)["code"] == "not_found"
    assert headers["x-infernex-backend"] in ("e0", "e1")
