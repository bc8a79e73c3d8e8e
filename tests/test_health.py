"""``/healthz`` and ``/readyz`` check something (issue 21: bridges, collectors and diagnose
answered 200 on any path): the checks, the HTTP server, and a real bridge process whose NATS
goes away."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from consumers.health import Check, Health, age_check, bound_port, lag_check, nats_check, serve, tasks_check
from infernex.embedded_nats import EmbeddedNats, free_port


async def test_report_fails_with_reasons():
    h = Health("x", expect=("nats", "lag"))
    status, body = await h.report(ready=True)
    assert status == 503 and body["checks"]["nats"]["state"] == "starting"  # not connected yet
    assert (await h.report(ready=False))[0] == 200  # alive though

    async def lag():
        return Check(True, {"consumer_lag": {"d": 3}})

    h.add("nats", lambda: Check(True)).add("lag", lag)
    status, body = await h.report(ready=True)
    assert status == 200 and body["checks"]["lag"]["consumer_lag"] == {"d": 3}

    def boom():
        raise RuntimeError("stream gone")

    h.add("store", boom)
    status, body = await h.report(ready=True)
    assert status == 503 and "stream gone" in body["checks"]["store"]["error"]
    assert (await h.report(ready=False))[0] == 200  # a readiness check does not decide liveness


async def test_age_and_task_checks():
    now = [100.0]
    last = [None]
    report_only = age_check(lambda: last[0], clock=lambda: now[0])
    strict = age_check(lambda: last[0], max_age_s=30, clock=lambda: now[0])
    assert report_only().ok and not strict().ok  # nothing seen yet
    last[0] = 80.0
    assert strict().ok and strict().detail["last_frame_age_s"] == 20
    now[0] = 200.0
    assert not strict().ok and report_only().ok

    task = asyncio.create_task(asyncio.sleep(0), name="fold")
    check = tasks_check(lambda: [task])
    await task
    assert not check().ok and check().detail["ended"] == ["fold"]


async def test_server_lag_and_nats(nats_server, prefix):
    import nats

    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    stream = f"{prefix}_S"
    await js.add_stream(name=stream, subjects=[f"{prefix}.x"])
    for i in range(5):
        await js.publish(f"{prefix}.x", b"%d" % i)
    await js.pull_subscribe(f"{prefix}.x", durable=f"{prefix}-fold", stream=stream)
    h = Health("fold", expect=("nats", "consumer_lag"))
    h.add("nats", nats_check(nc)).add("consumer_lag", lag_check(js, f"{prefix}-fold", max_lag=3))
    runner = await serve(h, 0, host="127.0.0.1")
    base = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/readyz") as r:
                body = await r.json()
                assert r.status == 503 and body["checks"]["consumer_lag"]["consumer_lag"] == {f"{prefix}-fold": 5}
                assert body["checks"]["nats"] == {"ok": True, "state": "connected",
                                                  "server": f"127.0.0.1:{nats_server.port}"}
            psub = await js.pull_subscribe_bind(durable=f"{prefix}-fold", stream=stream)
            for m in await psub.fetch(5, timeout=5):
                await m.ack()
            await nc.flush()
            async with s.get(base + "/readyz") as r:
                assert r.status == 200, await r.text()
            async with s.get(base + "/metrics") as r:
                assert r.status == 404  # no registry given: no /metrics
            async with s.get(base + "/anything") as r:
                assert r.status == 404
            await nc.close()
            async with s.get(base + "/readyz") as r:
                assert r.status == 503 and (await r.json())["checks"]["nats"]["state"] == "closed"
            async with s.get(base + "/healthz") as r:
                assert r.status == 200
    finally:
        await runner.cleanup()
        if not nc.is_closed:
            await nc.close()


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    except (OSError, http.client.HTTPException) as exc:  # not listening yet, or half-started
        return 0, str(exc)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _wait(url: str, want: int, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = _get(url)
        if last[0] == want:
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"{url}: wanted {want}, last {last}")


def test_bridge_process_not_ready_without_nats(tmp_path):
    """A real ``infernex bridge vllm-kv`` sidecar: ready with NATS, not ready when NATS goes,
    ready again when it returns; alive throughout; a typo path is a 404, not a 200."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    port = free_port()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=server.url, INFERNEX_NATS__MAX_RECONNECT_ATTEMPTS="-1")
    proc = subprocess.Popen([sys.executable, "-m", "infernex.cli", "bridge", "vllm-kv",
                             "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--pod", "p0", "--model", "m",
                             "--metrics-port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        body = _wait(base + "/readyz", 200)
        assert body["checks"]["nats"]["state"] == "connected"
        assert body["checks"]["kv_frames"] == {"ok": True, "last_frame_age_s": None}  # idle engine: reported
        assert _get(base + "/healthz")[0] == 200
        assert _get(base + "/metrics")[0] == 200
        assert _get(base + "/nonsense")[0] == 404
        server.stop()
        body = _wait(base + "/readyz", 503)
        assert body["checks"]["nats"]["state"] in ("reconnecting", "connecting")
        assert _get(base + "/healthz")[0] == 200
        server.start()
        _wait(base + "/readyz", 200)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.cleanup()


def test_collector_and_diagnose_processes_check_nats_and_lag(nats_server, prefix, tmp_path):
    """``collect metrics`` and ``diagnose`` (started together): /readyz names what it checked,
    including the diagnosis durable's consumer lag; unknown paths are 404s."""
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_server.url, INFERNEX_NATS__SUBJECT_PREFIX=prefix)
    subprocess.run([sys.executable, "-m", "infernex.cli", "streams", "apply"], env=env, check=True,
                   capture_output=True, timeout=60)
    ports = {"collect": free_port(), "diagnose": free_port()}
    cmds = {
        "collect": ["collect", "metrics", "--target", f"http://127.0.0.1:{free_port()}", "--pod", "p0",
                    "--metrics-port", str(ports["collect"])],
        "diagnose": ["diagnose", "--metrics-port", str(ports["diagnose"]), "--durable", f"{prefix}-diag"],
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "infernex.cli", *c], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for k, c in cmds.items()}
    try:
        body = _wait(f"http://127.0.0.1:{ports['collect']}/readyz", 200, timeout=90)
        assert body["checks"]["nats"]["state"] == "connected"
        assert "down" in next(v for k, v in body["checks"]["scrapes"].items() if k.startswith("http"))
        body = _wait(f"http://127.0.0.1:{ports['diagnose']}/readyz", 200, timeout=90)
        assert body["checks"]["consumer_lag"]["consumer_lag"] == {f"{prefix}-diag": 0, f"{prefix}-diag-load": 0}
        assert body["checks"]["tasks"]["ok"]
        for port in ports.values():
            assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            assert _get(f"http://127.0.0.1:{port}/health")[0] == 404  # not a catch-all any more
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
