"""The simulated engine's HTTP server: OpenAI formats (also through the official client),
SSE, metrics, KV events on ZMQ, prefix cache effects, errors."""

from __future__ import annotations

import json
import time

import httpx
import msgpack
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig
from simulator.hashing import BlockHasher

MODEL = "sim-llama"


@pytest.fixture(scope="module")
def cluster():
    cfg = EngineConfig(served_model_name=MODEL, num_gpu_blocks=2048, block_size=16)
    c = SimCluster([EngineSpec(cfg)], time_scale=20).start()
    yield c
    c.stop()


@pytest.fixture
def url(cluster):
    return cluster[0].url


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for (n, lbl), v in metrics(url).items():
        if n == name and all(dict(lbl).get(k) == v2 for k, v2 in labels.items()):
            total += v
    return total


def wait_subscribed(url: str, sub) -> None:
    """PUB/SUB joins asynchronously: send small requests until a KV-event frame arrives."""
    deadline = time.monotonic() + 30
    base = 20_000
    while time.monotonic() < deadline:
        base += 100
        httpx.post(url + "/v1/completions", json={"prompt": list(range(base, base + 20)), "max_tokens": 1},
                   timeout=30)
        if sub.poll(300):
            while sub.poll(300):  # drain what the warm-up produced
                sub.recv_multipart()
            return
    raise AssertionError("no KV-event frame reached the subscriber")


def test_completion_json_and_usage(url):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "the quick brown fox " * 10,
                                                  "max_tokens": 7}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 7
    assert body["usage"]["prompt_tokens"] == 40 and body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == 47
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    # deterministic output for the same prompt (token ids too)
    again = httpx.post(url + "/v1/completions", json={"prompt": "the quick brown fox " * 10, "max_tokens": 7},
                       timeout=30).json()
    assert again["choices"][0]["text"] == choice["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16


def test_sse_stream_format(url):
    lines = []
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
        "prompt": [101, 102, 103, 104], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True},
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    assert len(text_chunks) == 4
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None, None, None, "length"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["prompt_tokens"] == 4
    lines.extend(events)


def test_official_openai_client(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content.split()) == 5
    assert chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for ch in stream:
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.completion_tokens == 5 and usage.prompt_tokens_details.cached_tokens >= 0
    comp = client.completions.create(model=MODEL, prompt="one two three", max_tokens=3)
    assert comp.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**7)
    assert "maximum context length" in str(exc.value)


def test_bad_requests_get_clear_json_errors(url):
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, "a"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}},
                   timeout=30)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_metrics_have_vllm_names_and_labels(url):
    httpx.post(url + "/v1/completions", json={"prompt": "metrics please", "max_tokens": 3}, timeout=30)
    m = metrics(url)
    names = {n for n, _ in m}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:cache_config_info"):
        assert name in names, name
    labels = dict(next(lbl for n, lbl in m if n == "vllm:num_requests_running"))
    assert labels == {"model_name": MODEL, "engine": "0"}  # vLLM's engine index (the DP rank), not the pod
    info = dict(next(lbl for n, lbl in m if n == "vllm:cache_config_info"))
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "2048"
    assert metric(url, "vllm:generation_tokens_total") >= 3
    assert metric(url, "vllm:time_to_first_token_seconds_count") >= 1
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_kv_events_on_zmq_match_cache_and_reset(cluster):
    eng = cluster[0]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(eng.kv_endpoint)
    try:
        wait_subscribed(eng.url, sub)
        prompt = list(range(1000, 1000 + 16 * 5 + 3))
        r = httpx.post(eng.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        expected = BlockHasher(16).external_hashes(prompt)
        stored = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not set(expected) <= set(stored):
            if sub.poll(500):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"" and len(seq) == 8  # vLLM's default topic
                ts, events, dp_rank = msgpack.unpackb(payload)  # vLLM 0.33: an array batch of map events
                for ev in events:
                    if ev["type"] == "BlockStored":
                        stored.extend(ev["block_hashes"])
        assert set(expected) <= set(stored)
        assert set(expected) <= eng.cached_block_hashes()
        # a cache reset publishes AllBlocksCleared (retry while a previous request still holds blocks)
        deadline = time.monotonic() + 20
        while True:
            r = httpx.post(eng.url + "/reset_prefix_cache", timeout=30)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200
        seen_clear = False
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not seen_clear:
            if sub.poll(500):
                _, events, _ = msgpack.unpackb(sub.recv_multipart()[2])
                seen_clear = any(ev["type"] == "AllBlocksCleared" for ev in events)
        assert seen_clear
        assert eng.cached_block_hashes() == set()
    finally:
        sub.close()
        ctx.term()


def test_cached_prefix_shortens_ttft():
    """70B on 4x H100: a 6000-token prefill is ~0.5 s of engine time, a cached one ~20 ms.

    Run in slow motion (time x0.2) so that a stalled host (a shared 2-core machine) adds little
    virtual time; TTFT is read from the engine's own histogram, as a scraper would."""
    cfg = EngineConfig(served_model_name=MODEL, model_profile="llama-3.1-70b", tensor_parallel_size=4,
                       num_gpu_blocks=4096)
    with SimCluster([EngineSpec(cfg, kv_events=False)], time_scale=0.2) as c:
        url = c[0].url
        prompt = [(i * 7919) % 30000 + 20 for i in range(6000)]

        def run(p):
            busy0 = c[0].call(lambda e: e.core.stats.busy_time)
            ttft0 = metric(url, "vllm:time_to_first_token_seconds_sum")
            r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=120)
            assert r.status_code == 200, r.text
            return (metric(url, "vllm:time_to_first_token_seconds_sum") - ttft0,
                    c[0].call(lambda e: e.core.stats.busy_time) - busy0, r.json()["usage"])

        cold, cold_busy, u1 = run(prompt)
        warm, warm_busy, u2 = run(prompt[:-1] + [7])
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        assert u2["prompt_tokens_details"]["cached_tokens"] == (5999 // 16) * 16
        assert warm_busy < cold_busy / 10  # modelled prefill time
        assert cold > 0.4 and warm < cold / 3, (warm, cold)  # TTFT as /metrics reports it
        assert metric(url, "vllm:prefix_cache_hits_total") == (5999 // 16) * 16


def test_kv_gap_and_restart_seen_by_subscriber():
    cfg = EngineConfig(served_model_name=MODEL, num_gpu_blocks=512)
    with SimCluster([EngineSpec(cfg)], time_scale=20) as c:
        eng = c[0]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(eng.kv_endpoint)
        try:
            wait_subscribed(eng.url, sub)

            def seqs_after(prompt_base: int, max_tokens: int, expect: int) -> list[int]:
                # 40 prompt tokens: one batch for the prompt blocks, one more per 16 generated tokens
                r = httpx.post(eng.url + "/v1/completions", timeout=30,
                               json={"prompt": list(range(prompt_base, prompt_base + 40)),
                                     "max_tokens": max_tokens})
                assert r.status_code == 200
                out = []
                deadline = time.monotonic() + 20
                while len(out) < expect and time.monotonic() < deadline:
                    if sub.poll(200):
                        out.append(int.from_bytes(sub.recv_multipart()[1], "big"))
                assert not sub.poll(300), "more frames than expected"
                return out

            first = seqs_after(1000, 1, expect=1)
            eng.drop_kv_batches(1)
            second = seqs_after(2000, 30, expect=2)  # 3 batches (prompt, 48, 64 tokens), 1 lost
            assert second == [first[-1] + 2, first[-1] + 3]  # a gap where the lost frame was
            eng.restart()
            assert eng.cached_block_hashes() == set()
            third = seqs_after(3000, 1, expect=1)
            assert third == [0]  # a restarted engine counts from 0 again
        finally:
            sub.close()
            ctx.term()


def test_a_client_hanging_up_mid_stream_aborts_its_request_quietly(url, caplog):
    import logging

    caplog.set_level(logging.ERROR)
    with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
        "prompt": list(range(300, 340)), "max_tokens": 4000, "stream": True, "ignore_eos": True,
    }) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    # the connection is closed after the first chunk: the engine drops the request ...
    deadline = time.monotonic() + 30
    while metric(url, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(url, "vllm:num_requests_running") == 0
    time.sleep(0.2)
    # ... without an error logged for the write that found the connection gone
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []


def test_a_request_that_is_not_http1_gets_a_400_and_one_log_line(url, caplog):
    """sglang-router probes engines with HTTP/2 (h2c): vLLM's server answers 400 and logs one
    warning line; so does the simulated engine, where aiohttp alone logged a traceback."""
    import logging
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    with caplog.at_level(logging.WARNING, logger="simulator.http"):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            reply = s.recv(4096)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not [r for r in caplog.records if r.name == "simulator.http"]:
            time.sleep(0.02)
    assert reply.split(b" ", 2)[1] == b"400"
    recs = [r for r in caplog.records if r.name == "simulator.http"]
    assert recs and all(r.exc_info is None and r.levelno == logging.WARNING for r in recs)
    assert "Invalid HTTP request received" in recs[0].getMessage()
    assert all("PRI" not in r.getMessage() and "\n" not in r.getMessage() for r in recs)  # one line, no request bytes
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200  # and the server goes on
