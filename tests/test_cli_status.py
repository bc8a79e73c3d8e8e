"""``infernex status`` (issue 21): NATS, streams, consumer lag, dead letters, router backends,
indexer pods, latest findings and hints, as a table and as JSON, from a real NATS and a real
router process; the parts that cannot be reached say so and the rest still shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from infernex.embedded_nats import free_port

EXE = [sys.executable, "-m", "infernex.cli"]


async def _seed(nc, prefix):
    from consumers import bus
    from schemas import subjects as S
    from schemas.diagnosis import Diagnosis
    from schemas.scaling import ScalingHint

    js = nc.jetstream()
    dlq = bus.DeadLetters(js, consumer="kv-indexer", prefix=prefix)
    await dlq.send("kv-events", f"{prefix}.kv.events.m.p0", b"\x00not msgpack", "undecodable batch: bad tag")
    now = time.time()
    finding = Diagnosis(finding_id="f1", node="n1", device="npu3", fault_mode="over_temperature", severity="critical",
                        status="open", action="SeparateNPU", summary="NPU 3 at 105 C", first_seen=now, last_seen=now)
    await bus.publish(js, S.with_prefix(prefix, S.diagnosis("n1", "npu3")), finding.to_json())
    hint = ScalingHint(pool="p", role="decode", ts=now, current=2, desired=3, reason="TTFT p90 over target")
    await bus.publish(js, S.with_prefix(prefix, S.autoscale_hints("p", "decode")), hint.to_json())
    for i in range(7):
        await bus.publish(js, S.with_prefix(prefix, S.autoscale_hints("p", "prefill")),
                          hint.model_copy(update={"role": "prefill", "ts": now + i}).to_json())
    stream = f"{prefix.upper()}_AUTOSCALE"
    await js.pull_subscribe(S.with_prefix(prefix, "autoscale.hints.>"), durable="status-test", stream=stream)


async def test_status_shows_every_part(nc, topology, prefix, nats_server):
    await _seed(nc, prefix)
    rport = free_port()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_server.url, INFERNEX_NATS__SUBJECT_PREFIX=prefix)
    router = subprocess.Popen(EXE + ["router", "--no-bus", "--host", "127.0.0.1", "--port", str(rport),
                                     "--backend", "p0=http://127.0.0.1:9@m"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 45
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{rport}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        dead_indexer = f"http://127.0.0.1:{free_port()}"
        args = ["status", "--router", f"http://127.0.0.1:{rport}", "--indexer", dead_indexer]
        r = subprocess.run(EXE + args + ["--json"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert data["nats"]["ok"] and data["nats"]["version"]
        streams = {s["stream"]: s for s in data["streams"]}
        assert streams[f"{prefix.upper()}_DLQ"]["messages"] == 1
        lag = {c["name"]: c["lag"] for c in data["consumers"]}
        assert lag["status-test"] == 8
        assert data["dead_letters"]["total"] == 1
        letter = data["dead_letters"]["latest"][0]
        assert letter["reason"] == "undecodable batch: bad tag" and letter["consumer"] == "kv-indexer"
        assert "payload" not in letter  # the bad bytes are not shown
        assert [f["fault_mode"] for f in data["findings"]] == ["over_temperature"]
        assert len(data["hints"]) == 5 and data["hints"][0]["ts"] > data["hints"][-1]["ts"]  # newest first
        assert data["router"]["ok"] and [b["pod"] for b in data["router"]["backends"]] == ["p0"]
        assert not data["indexer"]["ok"] and "not reachable" in data["indexer"]["error"]

        r = subprocess.run(EXE + args, env=dict(env, COLUMNS="160"), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        for text in ("NATS", f"{prefix.upper()}_AUTOSCALE", "status-test", "Dead letters: 1", "undecodable batch",
                     "p0", "over_temperature", "2 -> 3", "Indexer", "not reachable"):
            assert text in r.stdout, (text, r.stdout)
    finally:
        router.terminate()
        router.wait(timeout=20)


def test_status_without_nats_says_so_and_fails():
    env = dict(os.environ, INFERNEX_NATS__SERVERS=f"nats://127.0.0.1:{free_port()}")
    r = subprocess.run(EXE + ["status", "--json", "--timeout", "0.5", "--router", f"http://127.0.0.1:{free_port()}"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert not data["nats"]["ok"] and "cannot connect to NATS" in data["nats"]["error"]
    assert not data["router"]["ok"]
