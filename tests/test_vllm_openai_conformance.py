"""The engine's OpenAI answers as vLLM 0.33 itself builds them (tests/fixtures/vllm/0.33.0/openai.json,
made from the release's own response classes by make_openai_fixtures.py; 0.22.1's and 0.11.2's too,
which build them differently): the router reads them right (text so far, output, prompt and cached tokens, the end of a stream, the usage chunk it
asked for on the client's behalf), and the simulator answers in the same shape."""

from __future__ import annotations

import json

import httpx
import pytest

from router import flow as answer
from router.flow import Flow
from router.types import RoutingRequest
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig
from fixtures.vllm import openai_answers, sse_events

SCENARIOS = openai_answers()
#: what the router reads: 0.33's answers and older releases' (vllm-ascend follows vLLM with a lag)
READ = [{**s, "name": f"{v}-{s['name']}"} for v in ("0.33.0", "0.22.1", "0.11.2") for s in openai_answers(v)]
STREAMED = [s for s in READ if "stream" in s and "error" not in s["expect"]]
FAILING = [s for s in READ if "stream" in s and "error" in s["expect"]]
WHOLE = [s for s in READ if "json" in s and s.get("status", 200) == 200 and "output_tokens" in s["expect"]]


def _flow(s: dict, wants_usage: bool) -> Flow:
    kind = "chat" if "chat" in s["path"] else "completions"
    return Flow(rid="r1", kind=kind, path=s["path"], body={"model": "m", **s["request"]}, stream="stream" in s,
                arrival=0.0, t0=0.0, rreq=RoutingRequest(model="m"), wants_usage=wants_usage)


@pytest.mark.parametrize("s", STREAMED, ids=lambda s: s["name"])
@pytest.mark.parametrize("wants_usage", [False, True], ids=["router-asked-usage", "client-asked-usage"])
def test_the_router_reads_vllms_streamed_answer(s, wants_usage):
    f = _flow(s, wants_usage)
    passed = []
    for ev in sse_events(s["stream"]):
        keep = answer.on_event(f, ev)
        if keep is True:
            passed.append(ev)
        elif keep:
            passed.append(keep)
    exp = s["expect"]
    assert f.text == exp["text"]
    assert f.out_tokens == exp["output_tokens"]
    assert f.done
    assert f.prompt_tokens_reported == exp["prompt_tokens"]
    assert f.cached_tokens == (exp["cached_tokens"] or 0)
    assert f.cached_reported is (exp["cached_tokens"] is not None)
    usage_chunks = [e for e in sse_events(s["stream"]) if b'"choices":[]' in e]
    # the usage chunk reaches the client only if the client asked for it; every other event passes as sent
    assert passed == [e for e in sse_events(s["stream"]) if wants_usage or e not in usage_chunks]
    assert passed[-1] == b"data: [DONE]\n\n"


@pytest.mark.parametrize("s", FAILING, ids=lambda s: s["name"])
def test_the_router_sees_vllms_error_in_place_of_the_rest_of_a_stream(s):
    """vLLM answers a generation that failed mid-stream with an error event and [DONE]: the
    router keeps the text so far, drops the error event and all after it (it continues the request
    elsewhere), and does not take the stream for finished."""
    f = _flow(s, False)
    passed = [ev for ev in sse_events(s["stream"]) if answer.on_event(f, ev) is True]
    exp = s["expect"]
    assert f.text == exp["text"] and f.out_tokens == exp["output_tokens"]
    assert f.engine_error is not None and f.engine_error[:2] == (exp["error"]["code"], exp["error"]["type"])
    assert not f.done
    assert passed == sse_events(s["stream"])[:exp["output_tokens"]]  # the tokens before it, nothing after


@pytest.mark.parametrize("s", WHOLE, ids=lambda s: s["name"])
def test_the_router_reads_vllms_whole_answer(s):
    f = _flow(s, False)
    answer.account_json(f, json.dumps(s["json"]).encode())
    exp = s["expect"]
    assert f.out_tokens == exp["output_tokens"]
    assert f.prompt_tokens_reported == exp["prompt_tokens"]
    assert f.cached_tokens == (exp["cached_tokens"] or 0)
    assert f.cached_reported is (exp["cached_tokens"] is not None)


# --- the simulator against the same answers ------------------------------------------------------

def shape(v):
    """The JSON shape of an answer: keys in order, each value's JSON type (a list: its items')."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(x) for x in v]
    return type(v).__name__


def _payloads(body: str) -> list:
    return [json.loads(e[len(b"data: "):]) for e in sse_events(body) if e != b"data: [DONE]\n\n"]


@pytest.fixture(scope="module")
def engines():
    specs = [EngineSpec(EngineConfig(engine_id=f"e-{d}", served_model_name="sim", num_gpu_blocks=512,
                                     enable_prompt_tokens_details=d)) for d in (True, False)]
    c = SimCluster(specs, time_scale=50).start()
    yield {True: c[0].url, False: c[1].url}
    c.stop()


def _request(s: dict) -> dict:
    body = {"model": "sim", **{k: v for k, v in s["request"].items() if k not in ("stop", "kv_transfer_params")}}
    body["max_tokens"] = s["expect"]["output_tokens"]
    body["ignore_eos"] = True
    if "chat" in s["path"]:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "hello there"
    return body


SIM_CASES = [s for s in SCENARIOS if s.get("status", 200) == 200 and s["expect"].get("finish_reason") == "length"
             and "kv_transfer_params" not in s["request"]]


@pytest.mark.parametrize("s", SIM_CASES, ids=lambda s: s["name"])
def test_the_simulator_answers_in_vllms_shape(s, engines):
    details = bool(s.get("server", {}).get("enable_prompt_tokens_details"))
    r = httpx.post(engines[details] + s["path"], json=_request(s), timeout=30)
    assert r.status_code == 200, r.text
    if "json" in s:
        assert shape(r.json()) == shape(s["json"])
        return
    got, want = _payloads(r.text), _payloads(s["stream"])
    assert [shape(p) for p in got] == [shape(p) for p in want]
    assert r.text.endswith("data: [DONE]\n\n")


def test_the_simulators_model_list_is_vllms_shape(engines):
    want = next(s for s in SCENARIOS if s["name"] == "models")["json"]
    got = httpx.get(engines[True] + "/v1/models", timeout=30).json()
    assert shape(got) == shape(want)


def test_the_simulators_error_is_vllms_shape(engines):
    want = next(s for s in SCENARIOS if s["name"] == "error-400")["json"]
    r = httpx.post(engines[True] + "/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 10**7},
                   timeout=30)
    assert r.status_code == 400
    got = r.json()
    assert list(got) == list(want) and list(got["error"]) == list(want["error"])
    assert got["error"]["type"] == want["error"]["type"] and got["error"]["code"] == 400


async def test_an_engine_without_cached_token_reports_is_counted_and_named(engines, caplog):
    """vLLM leaves prompt_tokens_details out unless started with --enable-prompt-tokens-details:
    the router's records then say 0 cached tokens for that engine, so it counts such answers per
    engine and says so once in the log, with the flag to set."""
    import aiohttp

    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend

    backends = [StaticBackend(pod="with", url=engines[True], model="sim"),
                StaticBackend(pod="without", url=engines[False], model="sim")]
    app = RouterApp(RouterConfig(strategy="round-robin", backends=backends, bus=False, records=False))
    url = await app.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(44):  # (round-robin: 22 each; the log speaks after 20)
                body = {"model": "sim", "prompt": f"question {i}", "max_tokens": 2, "stream": i % 4 < 2}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
    finally:
        await app.stop(drain=False)
    count = app.registry.get_sample_value
    name = "infernex_router_answers_without_cached_tokens_total"
    assert count(name, {"pod": "without", "reason": "no_details"}) == 22
    assert count(name, {"pod": "with", "reason": "no_details"}) == 0  # (there, at 0)
    assert count(name, {"pod": "without", "reason": "no_usage"}) == 0  # (streams: the router asked for usage)
    said = [r.getMessage() for r in caplog.records if "--enable-prompt-tokens-details" in r.getMessage()]
    assert len(said) == 1 and "without" in said[0]


@pytest.mark.parametrize("options", [None, {"continuous_usage_stats": True}, {"include_usage": True},
                                     {"include_usage": True, "continuous_usage_stats": True}])
async def test_the_router_hands_the_client_the_usage_it_asked_for(engines, options):
    """The router asks the engine for the usage event on every stream (for the record) and drops it
    when the client did not ask: the client gets the events the engine gives it directly. vLLM
    reads ``continuous_usage_stats`` only with ``include_usage``, so a client asking for it alone
    gets no usage at all, not a usage on every chunk."""
    import aiohttp

    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend

    body = {"model": "sim", "prompt": "count to five", "max_tokens": 5, "ignore_eos": True, "stream": True,
            **({"stream_options": options} if options is not None else {})}
    app = RouterApp(RouterConfig(strategy="round-robin", backends=[StaticBackend(pod="e", url=engines[True], model="sim")],
                                 bus=False, records=False))
    url = await app.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            got = []
            for u in (engines[True], url):  # the engine directly, then through the router
                async with s.post(u + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    got.append(_payloads((await r.read()).decode()))
        direct, routed = got
    finally:
        await app.stop(drain=False)
    assert [shape(e) for e in routed] == [shape(e) for e in direct]
    assert [e.get("usage") is not None for e in routed] == [e.get("usage") is not None for e in direct]
    assert sum(1 for e in routed if e["choices"]) == 5


@pytest.fixture(scope="module")
def failing():
    """Engines whose generations fail after 2 tokens (FaultConfig.fail_generation_after_tokens), and a
    healthy one."""
    from simulator.config import FaultConfig

    specs = [EngineSpec(EngineConfig(engine_id="bad", served_model_name="sim", num_gpu_blocks=512,
                                     faults=FaultConfig(fail_generation_after_tokens=2))),
             EngineSpec(EngineConfig(engine_id="good", served_model_name="sim", num_gpu_blocks=512))]
    c = SimCluster(specs, time_scale=50).start()
    yield {"bad": c[0].url, "good": c[1].url}
    c.stop()


def test_the_simulators_failed_generation_is_vllms_shape(failing):
    want = next(s for s in SCENARIOS if s["name"] == "completions-stream-generation-error")
    body = {"model": "sim", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # (vLLM's error path sends no usage chunk)
    r = httpx.post(failing["bad"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert [shape(p) for p in _payloads(r.text)] == [shape(p) for p in _payloads(want["stream"])]
    assert sse_events(r.text)[-2] == sse_events(want["stream"])[-2]  # the error event itself, byte for byte
    whole = httpx.post(failing["bad"] + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "InternalServerError"


async def test_a_generation_that_fails_mid_stream_goes_on_elsewhere(failing):
    """The engine's error event is not passed to the client: the request continues on another engine
    with the text so far (a migration), and the client gets one whole answer."""
    import aiohttp

    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend

    backends = [StaticBackend(pod="bad", url=failing["bad"], model="sim"),
                StaticBackend(pod="good", url=failing["good"], model="sim")]
    app = RouterApp(RouterConfig(strategy="round-robin", backends=backends, bus=False, records=False))
    url = await app.start("127.0.0.1", 0)
    try:
        started_bad = 0
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # round-robin: at least one of the two starts on the failing engine
                body = {"model": "sim", "prompt": "tell me", "max_tokens": 6, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    started_bad += r.headers["X-InferNex-Backend"] == "bad"  # (the engine it started on)
                    text = (await r.read()).decode()
                assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
                events = _payloads(text)
                assert sum(1 for e in events if e["choices"]) == 6  # every token once
                assert events[-1]["usage"]["completion_tokens"] == 6
    finally:
        await app.stop(drain=False)
    assert started_bad >= 1
    assert app.registry.get_sample_value("infernex_router_migrations_total") == started_bad


def test_the_endpoint_pickers_record_says_a_generation_failed():
    """Through a gateway the picker only watches the answer: vLLM's error event in place of the rest
    of a stream reaches the client, and the request's record says error with the engine's code."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from router.epp.observe import ResponseWatch

    finished = []

    class _Svc:
        class pd:  # noqa: N801 - the one attribute of RouterService.pd the watch reads
            retries_recomputed = False

        def _finish(self, flow):
            finished.append(flow)

    s = next(x for x in SCENARIOS if x["name"] == "completions-stream-generation-error")
    w = ResponseWatch(_Svc(), _flow(s, False))
    w.headers(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]))))
    body = s["stream"].encode()
    w.body(body[:100], False)
    w.body(body[100:], True)
    assert w.finish()
    (f,) = finished
    assert f.status == "error" and f.http_status == 500 and "InternalServerError" in f.error
    assert f.out_tokens == 2


def test_the_simulators_nixl_prefill_answer_carries_vllms_fields():
    """A prefill engine's answer (do_remote_decode) carries the kv_transfer_params vLLM 0.33's
    NixlConnector returns: the same fields in the same order, block ids per KV cache group; a decode
    engine takes them and pulls the prompt's KV."""
    import json as _json

    from fixtures.vllm import HERE, OPENAI_VERSION

    want = _json.loads((HERE / OPENAI_VERSION / "openai.json").read_text())["nixl_kv_transfer_params"]
    specs = [EngineSpec(EngineConfig(engine_id="p", served_model_name="sim", num_gpu_blocks=512, role="kv_producer")),
             EngineSpec(EngineConfig(engine_id="d", served_model_name="sim", num_gpu_blocks=512, role="kv_consumer"))]
    c = SimCluster(specs, time_scale=50).start()
    try:
        body = {"model": "sim", "prompt": "a prompt long enough for a couple of blocks " * 4, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        r = httpx.post(c[0].url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        kvp = r.json()["kv_transfer_params"]
        assert list(kvp) == want
        assert isinstance(kvp["remote_block_ids"], list) and all(isinstance(g, list) for g in kvp["remote_block_ids"])
        dec = httpx.post(c[1].url + "/v1/completions", json={**body, "max_tokens": 3, "kv_transfer_params": kvp},
                         timeout=30)
        assert dec.status_code == 200, dec.text
        assert dec.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the pulled KV counts as cached
    finally:
        c.stop()


def test_a_record_without_any_usage_is_counted_apart():
    """Through the endpoint picker a stream carries no usage unless its client asks: its record says
    0 cached tokens for another reason than a missing flag, and is counted as such."""
    from prometheus_client import CollectorRegistry

    from router.config import RouterConfig
    from router.server import RouterService

    reg = CollectorRegistry()
    svc = RouterService(RouterConfig(bus=False, records=False), registry=reg)
    s = next(x for x in SCENARIOS if x["name"] == "completions-stream")  # (no usage in it)
    f = _flow(s, False)
    for ev in sse_events(s["stream"]):
        answer.on_event(f, ev)
    f.pods = ["e-1"]
    svc._finish(f)
    name = "infernex_router_answers_without_cached_tokens_total"
    assert reg.get_sample_value(name, {"pod": "e-1", "reason": "no_usage"}) == 1
    assert reg.get_sample_value(name, {"pod": "e-1", "reason": "no_details"}) is None


def test_an_engine_that_has_reported_cached_tokens_is_not_counted_when_it_leaves_them_out():
    """vLLM 0.22 and before send prompt_tokens_details only when the prompt took some tokens from the
    cache (``if enable_prompt_tokens_details and num_cached_tokens``; 0.33 sends it whenever the flag
    is on): an engine that reported them once runs with the flag, and its later answers without
    them say 0 cached tokens truly. Before that first report, its answers count as without. The
    answers are 0.22.1's own, from an engine with the flag."""
    from prometheus_client import CollectorRegistry

    from router.config import RouterConfig
    from router.server import RouterService

    reg = CollectorRegistry()
    svc = RouterService(RouterConfig(bus=False, records=False), registry=reg)

    old = {s["name"]: s for s in openai_answers("0.22.1")}

    def answer_with(name: str) -> None:
        s = old[name]
        f = _flow(s, False)
        for ev in sse_events(s["stream"]):
            answer.on_event(f, ev)
        f.pods = ["old-vllm"]
        svc._finish(f)

    answer_with("completions-stream-usage-nothing-cached")  # (its first answers: nothing cached yet)
    answer_with("chat-stream-usage-nothing-cached")
    answer_with("completions-stream-usage")  # (32 cached tokens)
    for _ in range(5):
        answer_with("completions-stream-usage-nothing-cached")
    name = "infernex_router_answers_without_cached_tokens_total"
    assert reg.get_sample_value(name, {"pod": "old-vllm", "reason": "no_details"}) == 2
