"""PD protocol conformance: the router's two-stage requests per KV connector, against the
simulator running that connector's mode (it fails a request that lacks a field the real
connector reads, as the real engine would), plus a table of the fields the upstream proxies send."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import pytest

from router.config import RouterConfig, StaticBackend
from router.pd_protocol import PdConnectorConfig, PdProtocol, PrefillPeer
from router.server import RouterService
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig

MODEL = "sim-pd"
PROMPT = [(i * 7919) % 30000 + 20 for i in range(300)]
CONNECTORS = ["nixl", "mooncake", "mooncake_ascend"]

# What the upstream proxies put on the prefill request (vLLM toy_proxy_server.py for NIXL/P2P,
# vLLM mooncake_connector_proxy.py, vllm-ascend load_balance_proxy_server_example.py).
UPSTREAM_PREFILL = {
    "nixl": {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None},
             "stream": False, "max_tokens": 1, "min_tokens": "removed"},
    "mooncake": {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                        "transfer_id": "xfer-R1"},
                 "stream": False, "max_tokens": 1},
    "mooncake_ascend": {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                               "remote_engine_id": None, "remote_block_ids": None,
                                               "remote_host": None, "remote_port": None},
                        "stream": False, "max_tokens": 1, "min_tokens": 1},
}


@pytest.mark.parametrize("conn", CONNECTORS)
def test_prefill_request_fields_match_the_upstream_proxy(conn):
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 8,
            "min_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    pre = PdProtocol(PdConnectorConfig(connector=conn)).prefill_body(body, "R1")
    want = UPSTREAM_PREFILL[conn]
    assert pre["kv_transfer_params"] == want["kv_transfer_params"]
    assert pre["stream"] is False and pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert "stream_options" not in pre and "min_completion_tokens" not in pre
    if want.get("min_tokens") == 1:
        assert pre["min_tokens"] == 1
    else:
        assert "min_tokens" not in pre
    assert body["stream"] is True and body["min_tokens"] == 8  # the client's body is untouched


def test_mooncake_decode_params_name_the_prefill_bootstrap_and_engine():
    p = PdProtocol(PdConnectorConfig(connector="mooncake"))
    d = p.decode_params(None, PrefillPeer("http://10.0.0.5:8000", "prefill-0-dp1"), "R1")
    assert d == {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-R1",
                 "remote_bootstrap_addr": "http://10.0.0.5:8998", "remote_engine_id": "prefill-0-dp1"}
    # NIXL / ascend: the decode needs the prefill's answer; none is an error, not a silent re-prefill
    with pytest.raises(ValueError):
        PdProtocol().decode_params({}, PrefillPeer("http://h:1", "p"), "R1")


def _cfg(eid: str, role: str, conn: str) -> EngineConfig:
    return EngineConfig(engine_id=eid, served_model_name=MODEL, role=role, num_gpu_blocks=1024, kv_connector=conn)


@pytest.fixture(scope="module", params=CONNECTORS)
def cluster(request):
    conn = request.param
    c = SimCluster([EngineSpec(_cfg("agg-0", "aggregated", conn), kv_events=False),
                    EngineSpec(_cfg("prefill-0", "prefill", conn), kv_events=False),
                    EngineSpec(_cfg("decode-0", "decode", conn), kv_events=False)], time_scale=50).start()
    yield conn, c
    c.stop()


async def _router(conn: str, c: SimCluster) -> RouterService:
    backends = [StaticBackend(pod="prefill-0", url=c[1].url, model=MODEL, role="prefill", group="g1"),
                StaticBackend(pod="decode-0", url=c[2].url, model=MODEL, role="decode", group="g1")]
    cfg = RouterConfig(backends=backends, bus=False, records=False, seed=1, strategy="pd-bucket", tokenizer=None,
                       pd=PdConnectorConfig(connector=conn, bootstrap_port=None))
    svc = RouterService(cfg)
    await svc.start("127.0.0.1", 0)
    return svc


def _sse_text(raw: bytes) -> tuple[str, list[dict]]:
    evs = [json.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: {")]
    return "".join(e["choices"][0].get("text") or "" for e in evs if e.get("choices")), evs


def test_two_stage_request_serves_from_the_transferred_kv(cluster):
    conn, c = cluster
    ref = httpx.post(c[0].url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
                     timeout=30).json()["choices"][0]["text"]

    async def run():
        svc = await _router(conn, c)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "min_tokens": 4}
                async with s.post(svc.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    one = await r.json()
                async with s.post(svc.url + "/v1/completions",
                                  json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                    assert r.status == 200
                    raw = await r.read()
            return one, raw
        finally:
            await svc.stop()

    one, raw = asyncio.run(run())
    assert one["choices"][0]["text"] == ref
    # the decode pulled the prompt's KV: everything but the last prompt token was cached there
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    text, evs = _sse_text(raw)
    assert text == ref
    usage = [e["usage"] for e in evs if e.get("usage")]
    assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
    assert c[1].call(lambda e: len(e.core.transfers)) == 0  # every pinned prefill was pulled


def test_the_simulator_refuses_what_the_real_connector_would(cluster):
    conn, c = cluster
    post = lambda url, **b: httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **b},
                                       timeout=30)
    # vLLM: min_tokens above max_tokens is a 400 (why the proxies drop it or set it to 1)
    r = post(c[1].url, max_tokens=1, min_tokens=5, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and "min_tokens" in r.text
    if conn == "mooncake":
        r = post(c[1].url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert r.status_code == 400 and "transfer_id" in r.text
        # NIXL-style decode fields are not what MooncakeConnector reads
        r = post(c[2].url, max_tokens=2, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "prefill-0",
                                                             "remote_request_id": "x", "remote_host": "127.0.0.1",
                                                             "remote_port": 1, "remote_block_ids": [1]})
        assert r.status_code == 400 and "remote_bootstrap_addr" in r.text
        # a bootstrap address that is not the named engine's
        r = post(c[1].url, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t1"})
        assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
        r = post(c[2].url, max_tokens=2, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": "t1", "remote_engine_id": "prefill-0",
            "remote_bootstrap_addr": c[0].url})
        assert r.status_code == 400 and "bootstrap" in r.text
        r = post(c[2].url, max_tokens=2, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": "t1", "remote_engine_id": "prefill-0",
            "remote_bootstrap_addr": c[1].url})
        assert r.status_code == 200, r.text
    else:
        kvp = post(c[1].url, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
        broken = {k: v for k, v in kvp.items() if k != "remote_block_ids"}
        r = post(c[2].url, max_tokens=2, kv_transfer_params=broken)
        assert r.status_code == 400 and "remote_block_ids" in r.text
        r = post(c[2].url, max_tokens=2, kv_transfer_params=kvp)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_recomputed_decode_is_reissued_as_vllm_ascend_proxy_does(stream):
    c = SimCluster([EngineSpec(_cfg("prefill-0", "prefill", "mooncake_ascend"), kv_events=False),
                    EngineSpec(_cfg("decode-0", "decode", "mooncake_ascend"), kv_events=False)],
                   time_scale=50).start()
    try:
        c[1].set_faults(recompute_after_tokens=3)

        async def run():
            backends = [StaticBackend(pod="prefill-0", url=c[0].url, model=MODEL, role="prefill", group="g1"),
                        StaticBackend(pod="decode-0", url=c[1].url, model=MODEL, role="decode", group="g1")]
            svc = RouterService(RouterConfig(backends=backends, bus=False, records=False, seed=1, strategy="pd-bucket",
                                             tokenizer=None, pd=PdConnectorConfig(connector="mooncake_ascend")))
            await svc.start("127.0.0.1", 0)
            try:
                body = {"model": MODEL, "prompt": "tell me a long story about kv caches", "max_tokens": 8,
                        "stream": stream}
                async with aiohttp.ClientSession() as s:
                    async with s.post(svc.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        raw = await r.read()
                rec = svc.registry.get_sample_value("infernex_router_retries_total", {"reason": "recomputed"})
                return raw, rec
            finally:
                await svc.stop()

        raw, recomputes = asyncio.run(run())
        if stream:
            text, evs = _sse_text(raw)
            assert raw.rstrip().endswith(b"data: [DONE]")
            assert not any(e["choices"] and e["choices"][0].get("stop_reason") == "recomputed" for e in evs)
            assert len([e for e in evs if e.get("choices") and e["choices"][0].get("text")]) == 8
        else:
            out = json.loads(raw)
            text = out["choices"][0]["text"]
            assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["stop_reason"] is None
        assert text.strip()
        # 3 tokens, recomputed; 3 more, recomputed; the last 2 finish
        assert recomputes == 2
    finally:
        c.stop()
