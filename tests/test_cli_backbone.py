"""`infernex up` starts JetStream with the topology; `tail` shows what `pub` sends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infernex.embedded_nats import free_port

EXE = [sys.executable, "-m", "infernex.cli"]


def run(args, env, **kw):
    return subprocess.run(EXE + args, env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture
def up(tmp_path):
    port = free_port()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=f"nats://127.0.0.1:{port}")
    proc = subprocess.Popen(EXE + ["up", "--port", str(port), "--store-dir", str(tmp_path / "store")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.time() + 30
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Ctrl-C" in line:
            break
        if proc.poll() is not None:
            break
    assert any("ready" in l for l in lines), "".join(lines)
    yield env, lines
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "stopped" in out


def test_up_pub_tail(up):
    env, lines = up
    assert sum("created" in l for l in lines) == 7
    info = run(["streams", "info", "--json"], env)
    assert info.returncode == 0, info.stderr
    assert {r["stream"] for r in json.loads(info.stdout)} >= {"KV_EVENTS", "DLQ", "ROUTER"}

    tail = subprocess.Popen(EXE + ["tail", "kv.events.>", "-n", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    payload = {"pod": "pod.1", "model": "m", "seq": 5, "ts": 1.0,
               "events": [{"type": "stored", "block_hashes": [7], "token_ids": [1, 2], "block_size": 2}]}
    subject = "kv.events.m.pod%2E1"
    r = run(["pub", subject, json.dumps(payload), "--msg-id", "pod.1:0:5"], env)
    assert r.returncode == 0 and "duplicate" not in r.stdout, r.stdout + r.stderr
    r = run(["pub", subject, json.dumps(payload), "--msg-id", "pod.1:0:5"], env)
    assert "duplicate" in r.stdout
    payload["seq"] = 6
    assert run(["pub", subject, json.dumps(payload)], env).returncode == 0
    out, err = tail.communicate(timeout=30)
    shown = [l for l in out.splitlines() if l.strip()]
    assert len(shown) == 2, out + err
    assert "KvEventBatch" in shown[0] and '"seq":5' in shown[0] and '"seq":6' in shown[1]

    apply = run(["streams", "apply"], env)
    assert apply.stdout.count("unchanged") == 7


def test_pub_rejects_invalid_events_naming_the_field(up):
    env, _ = up
    bad = {"pod": "p", "model": "m", "seq": 0, "ts": 1.0,
           "events": [{"type": "stored", "block_hashes": [1], "token_ids": [1, 2, 3], "block_size": 2}]}
    r = run(["pub", "kv.events.m.p", json.dumps(bad)], env)
    assert r.returncode == 2
    assert "events.0.stored" in r.stderr and "block_size" in r.stderr
    r = run(["pub", "no.such.subject", "{}"], env)
    assert r.returncode == 2 and "not an InferNex subject" in r.stderr


def test_version():
    r = subprocess.run(EXE + ["version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("infernex ")
