"""PD disaggregation through producer and consumer engines (in one process and across
clusters over HTTP), and fault injection."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig, FaultConfig

MODEL = "sim-pd"
PROMPT = [(i * 104729) % 30000 + 20 for i in range(700)]


def cfg(engine_id: str, role: str, **kw) -> EngineConfig:
    return EngineConfig(engine_id=engine_id, served_model_name=MODEL, role=role, num_gpu_blocks=1024, **kw)


@pytest.fixture(scope="module")
def pd():
    c = SimCluster([EngineSpec(cfg("agg-0", "aggregated"), kv_events=False),
                    EngineSpec(cfg("prefill-0", "prefill"), kv_events=False),
                    EngineSpec(cfg("decode-0", "decode"), kv_events=False)], time_scale=20).start()
    yield c
    c.stop()


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)


def prefill(url: str, prompt=PROMPT) -> dict:
    r = complete(url, prompt=prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 1
    return body["kv_transfer_params"]


def test_pd_same_tokens_as_aggregated_and_reports_cached(pd):
    agg, prod, cons = pd[0], pd[1], pd[2]
    ref = complete(agg.url, prompt=PROMPT, max_tokens=12).json()
    params = prefill(prod.url)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-0"
    (group,) = params["remote_block_ids"]  # vLLM's NixlConnector: the block ids per KV cache group
    assert len(group) == -(-700 // 16)
    assert params["remote_port"] == int(prod.url.rsplit(":", 1)[1])
    held = prod.call(lambda e: e.core.num_free_blocks)
    r = complete(cons.url, prompt=PROMPT, max_tokens=12, kv_transfer_params=params)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 699
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the producer released the pinned blocks once pulled; the consumer did not recompute the prompt
    assert prod.call(lambda e: e.core.num_free_blocks) == held + len(group)
    assert cons.call(lambda e: e.core.stats.prompt_tokens) == 700
    assert cons.call(lambda e: e.core.stats.prefix_cache_hits) == 0
    # the same params a second time: the blocks are gone
    again = complete(cons.url, prompt=PROMPT, max_tokens=2, kv_transfer_params=params)
    assert again.status_code == 400 and "unknown KV transfer" in again.json()["error"]["message"]


def test_pd_streaming_via_openai_client(pd):
    prod, cons, agg = pd[1], pd[2], pd[0]
    prompt = PROMPT[:300]
    params = prefill(prod.url, prompt)
    client = openai.OpenAI(base_url=cons.url + "/v1", api_key="none", timeout=30, max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True,
                                       extra_body={"kv_transfer_params": params})
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    ref = complete(agg.url, prompt=prompt, max_tokens=6).json()["choices"][0]["text"]
    assert text == ref


def test_pd_bad_params_are_clear_errors(pd):
    cons, prod = pd[2], pd[1]
    r = complete(cons.url, prompt=PROMPT, max_tokens=2, kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": "nowhere", "remote_request_id": "x"})
    assert r.status_code == 400 and "lack remote_block_ids, remote_host, remote_port" in r.json()["error"]["message"]
    params = prefill(prod.url)
    r = complete(cons.url, prompt=PROMPT[:-1], max_tokens=2, kv_transfer_params=params)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    r = complete(prod.url, prompt=PROMPT, max_tokens=2, kv_transfer_params=params)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    other_prompt = [t + 1 for t in PROMPT]  # same length, different tokens
    r = complete(cons.url, prompt=other_prompt, max_tokens=2, kv_transfer_params=params)
    assert r.status_code == 400 and "different prompt" in r.json()["error"]["message"]


def test_pd_expired_transfer():
    c = SimCluster([EngineSpec(cfg("p-0", "kv_producer", kv_transfer_timeout_s=2.0), kv_events=False),
                    EngineSpec(cfg("d-0", "kv_consumer"), kv_events=False)], time_scale=20).start()
    try:
        params = prefill(c[0].url)
        time.sleep(0.5)  # 10 virtual seconds
        r = complete(c[1].url, prompt=PROMPT, max_tokens=2, kv_transfer_params=params)
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "expired" in msg or "unknown" in msg
        assert c[0].call(lambda e: e.core.num_free_blocks) == 1024
    finally:
        c.stop()


def test_pd_across_processes_uses_http_pull(pd):
    """A consumer in another cluster (no shared peer map) pulls over /internal/kv/pull."""
    agg, prod = pd[0], pd[1]
    other = SimCluster([EngineSpec(cfg("remote-decode", "kv_consumer"), kv_events=False)], time_scale=20).start()
    try:
        params = prefill(prod.url, PROMPT[:200])
        r = complete(other[0].url, prompt=PROMPT[:200], max_tokens=5, kv_transfer_params=params)
        assert r.status_code == 200, r.text
        ref = complete(agg.url, prompt=PROMPT[:200], max_tokens=5).json()
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
        again = complete(other[0].url, prompt=PROMPT[:200], max_tokens=5, kv_transfer_params=params)
        assert again.status_code == 400 and "KV transfer failed" in again.json()["error"]["message"]
    finally:
        other.stop()


# ----------------------------------------------------------------------------- faults


@pytest.fixture
def one():
    c = SimCluster([EngineSpec(cfg("f-0", "aggregated"), kv_events=False)], time_scale=20).start()
    yield c[0]
    c.stop()


def test_error_rate_gives_500s(one):
    one.set_faults(error_rate=1.0)
    r = complete(one.url, prompt="x", max_tokens=1)
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    assert httpx.get(one.url + "/health", timeout=30).status_code == 200
    one.set_faults(error_rate=0.5, seed=3)
    with httpx.Client(timeout=30) as client:
        codes = [client.post(one.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code
                 for _ in range(40)]
    assert 5 <= codes.count(500) <= 35 and codes.count(200) + codes.count(500) == 40


def test_die_mid_stream(one):
    r = httpx.post(one.url + "/admin/faults", json={"die_after_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["die_after_tokens"] == 3
    received = []
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", one.url + "/v1/completions", timeout=30,
                          json={"prompt": "a b c", "max_tokens": 10, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line:
                    received.append(line)
    assert len([x for x in received if x.startswith("data: {")]) == 3
    assert "data: [DONE]" not in received
    with pytest.raises(httpx.HTTPError):
        complete(one.url, prompt="a b c", max_tokens=10)
    # the engine freed the aborted requests' blocks
    deadline = time.monotonic() + 10
    while one.call(lambda e: e.core.has_work) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not one.call(lambda e: e.core.has_work)
    httpx.post(one.url + "/admin/faults", json={"die_after_tokens": None}, timeout=30)
    assert complete(one.url, prompt="a b c", max_tokens=10).status_code == 200


def test_refuse_connections_and_recover(one):
    url = one.url
    one.set_faults(refuse_connections=True)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    one.set_faults(refuse_connections=False)
    assert one.url == url  # same port again
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_refuse_at_start():
    c = SimCluster([EngineSpec(cfg("r-0", "aggregated", faults=FaultConfig(refuse_connections=True)),
                               kv_events=False)]).start()
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(c[0].url + "/health", timeout=5)
    finally:
        c.stop()


def test_slow_factor_stretches_engine_time(one):
    def e2e_sum():
        return one.call(lambda e: e.core.stats.busy_time)

    b0 = e2e_sum()
    complete(one.url, prompt=PROMPT[:100], max_tokens=5)
    normal = e2e_sum() - b0
    httpx.post(one.url + "/admin/faults", json={"slow_factor": 4.0}, timeout=30)
    one.call(lambda e: e.core.reset_prefix_cache())
    b1 = e2e_sum()
    complete(one.url, prompt=PROMPT[:100], max_tokens=5)
    slow = e2e_sum() - b1
    assert slow == pytest.approx(4 * normal, rel=0.05)
    r = httpx.post(one.url + "/admin/faults", json={"slow_factor": 0.5}, timeout=30)
    assert r.status_code == 400


def test_kv_both_engines_serve_either_side():
    c = SimCluster([EngineSpec(cfg("both-0", "kv_both"), kv_events=False),
                    EngineSpec(cfg("both-1", "kv_both"), kv_events=False)], time_scale=20).start()
    try:
        for p_eng, d_eng in ((c[0], c[1]), (c[1], c[0])):
            params = prefill(p_eng.url, PROMPT[:100])
            assert params["remote_engine_id"] == p_eng.engine_id
            r = complete(d_eng.url, prompt=PROMPT[:100], max_tokens=4, kv_transfer_params=params)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 99
    finally:
        c.stop()


def test_a_failing_step_fails_requests_clearly_and_engine_recovers(one):
    def boom(now, horizon=None):
        raise RuntimeError("model bug")

    one.call(lambda e: setattr(e.core, "step", boom))
    r = complete(one.url, prompt="a b c", max_tokens=3)
    assert r.status_code == 500 and "aborted" in r.json()["error"]["message"]
    r = complete(one.url, prompt="a b c", max_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
