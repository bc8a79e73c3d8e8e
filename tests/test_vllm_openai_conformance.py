"""The engine's OpenAI answers as vLLM 0.33 itself builds them (tests/fixtures/vllm/0.33.0/openai.json,
made from the release's own response classes by make_openai_fixtures.py): the router reads them
right (text so far, output, prompt and cached tokens, the end of a stream, the usage chunk it
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
STREAMED = [s for s in SCENARIOS if "stream" in s]
WHOLE = [s for s in SCENARIOS if "json" in s and s.get("status", 200) == 200 and "output_tokens" in s["expect"]]


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
            for i in range(6):
                body = {"model": "sim", "prompt": f"question {i}", "max_tokens": 2, "stream": i % 2 == 0}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
    finally:
        await app.stop(drain=False)
    count = app.registry.get_sample_value
    assert count("infernex_router_answers_without_cached_tokens_total", {"pod": "without"}) == 3
    assert count("infernex_router_answers_without_cached_tokens_total", {"pod": "with"}) is None
    said = [r.getMessage() for r in caplog.records if "--enable-prompt-tokens-details" in r.getMessage()]
    assert len(said) == 1 and "without" in said[0]
