"""``infernex sim`` starts engines that answer, prints their endpoints, stops on SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
from typer.testing import CliRunner

from infernex.cli import app


def test_sim_command_serves_and_stops():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "infernex.cli", "sim", "--engines", "2", "--base-port", "0", "--model", "m",
         "--role", "prefill,decode", "--num-gpu-blocks", "256", "--time-scale", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        urls: list[str] = []
        while time.monotonic() < deadline and len(urls) < 2:
            urls = re.findall(r"http://127\.0\.0\.1:\d+", "".join(lines))
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        assert len(urls) == 2, "".join(lines)
        out = "".join(lines)
        assert len(re.findall(r"tcp://127\.0\.0\.1:\d+", out)) == 4
        assert "kv_producer" in out and "kv_consumer" in out
        r = httpx.post(urls[0] + "/v1/completions",
                       json={"prompt": list(range(100, 150)), "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        r = httpx.post(urls[1] + "/v1/completions",
                       json={"prompt": list(range(100, 150)), "max_tokens": 3, "kv_transfer_params": params},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 49
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        proc.stdout.close()
    assert proc.returncode == 0, "".join(lines)


def test_sim_command_rejects_bad_settings():
    res = CliRunner().invoke(app, ["sim", "--profile", "tpu-v9"])
    assert res.exit_code == 2
    assert "unknown hardware profile" in res.output
