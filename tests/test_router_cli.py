"""``infernex router`` as a process: serves, and on SIGTERM drains in-flight streams before exiting."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import aiohttp

from router.testing import FakeEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigterm_drains_in_flight_stream_then_exits():
    eng = await FakeEngine("a", tokens=12, delay_s=0.15).start()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--port", str(port),
                             "--profile", "least-load", "-b", f"a={eng.url}@m"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(150):
                try:
                    async with s.get(url + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("router did not become ready")
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "stream": True}
            r = await s.post(url + "/v1/chat/completions", json=body)
            await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with s.post(url + "/v1/chat/completions", json=body) as r2:
                assert r2.status == 503
            rest = await r.read()
            assert b"tok11" in rest and rest.endswith(b"data: [DONE]\n\n")
        rc = await asyncio.to_thread(proc.wait, 30)
        out = proc.stdout.read()
        assert rc == 0, out
        assert "draining 1 in-flight" in out and "stopped." in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await eng.stop()


def test_cli_rejects_bad_strategy_and_backend():
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--profile", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown strategy" in r.stderr
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "router", "--no-bus", "-b", "justapod"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pod=url@model" in (r.stderr + r.stdout)
