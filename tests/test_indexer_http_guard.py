"""The indexer's HTTP API locked down: the router's key scheme, body size and time limits, a
deadline for request heads, a cap on predicted-route TTLs (the project's HTTP server, real sockets)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from consumers.indexer import IndexerConfig, IndexerService


@pytest.fixture
async def guarded(nats_config, topology, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# router keys\nk-file\n")
    cfg = IndexerConfig(http_port=0, nats_query=False, durable="guard", snapshot_on_stop=False,
                        api_keys=["k-inline"], api_keys_file=keys, max_body_bytes=2000, header_timeout_s=0.5,
                        body_timeout_s=0.5, max_route_ttl_s=60)
    svc = IndexerService(cfg, nats_config)
    await svc.start()
    yield svc
    await svc.stop()


async def test_keys_are_required_except_for_probes(guarded):
    q = {"model": "m", "token_ids": [1, 2, 3, 4]}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{guarded.http_port}", timeout=5) as http:
        r = await http.post("/v1/index/query", json=q)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.post("/v1/index/query", json=q, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "wrong" not in r.text  # the key is never echoed
        for key in ("k-inline", "k-file"):
            r = await http.post("/v1/index/query", json=q, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert (await http.get("/v1/index/pods")).status_code == 401
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code in (200, 404)


async def test_body_limits_and_route_ttl_cap(guarded):
    auth = {"Authorization": "Bearer k-inline"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{guarded.http_port}", timeout=5) as http:
        big = {"model": "m", "token_ids": list(range(2000))}
        r = await http.post("/v1/index/query", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks():  # no Content-Length: counted while read
            for _ in range(10):
                yield b"[" + b"1," * 200

        r = await http.post("/v1/index/query", content=chunks(), headers=auth)
        assert r.status_code == 413
        ok = {"model": "m", "pod": "pod-1", "token_ids": [1, 2, 3, 4], "ttl_s": 30}
        assert (await http.post("/v1/index/route", json=ok, headers=auth)).status_code == 200
        r = await http.post("/v1/index/route", json={**ok, "ttl_s": 1e12}, headers=auth)
        assert r.status_code == 400 and "ttl_s" in r.text
        r = await http.post("/v1/index/route", json={**ok, "pod": "x" * 300}, headers=auth)
        assert r.status_code == 400


async def test_slow_heads_and_bodies_are_cut_off(guarded):
    port = guarded.http_port

    async def closed_within(payload: bytes, limit: float) -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        if payload:
            writer.write(payload)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(), limit)  # until the server closes
        writer.close()
        return time.monotonic() - t0, data

    # connects and says nothing; sends half a head; sends a head and trickles no body
    took, _ = await closed_within(b"", 5)
    assert took < 3
    took, data = await closed_within(b"POST /v1/index/query HTTP/1.1\r\nHost: x\r\n", 5)
    assert took < 3 and b"408" in data
    took, data = await closed_within(b"POST /v1/index/query HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-inline"
                                     b"\r\nContent-Length: 100\r\n\r\n{", 5)
    assert took < 3 and b"408" in data
    # the server still answers afterwards
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        assert (await http.get("/health")).status_code == 200
