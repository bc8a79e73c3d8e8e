"""Collectors publish onto a real nats-server; unreachable sources are reported, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from consumers.device_collector import DeviceCollector, make_reader
from consumers.metrics_collector import MetricsCollector, Target
from infernex.embedded_nats import free_port
from schemas import DeviceTelemetry, EngineMetrics
from schemas import subjects as S
from simulator.devices import SimulatedNode
from streams.topology import stream_for_subject

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture
async def vllm_server():
    text = (FIX / "vllm-metrics.prom").read_text()

    async def metrics(_req):
        return web.Response(text=text, content_type="text/plain")

    async def broken(_req):
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/broken/metrics", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def fetch_all(js, topology, subject, n, timeout=10):
    spec = stream_for_subject(topology, subject.replace(">", "x.y.z"))
    sub = await js.pull_subscribe(subject, durable="check", stream=spec.name)
    msgs = await sub.fetch(n, timeout=timeout)
    for m in msgs:
        await m.ack()
    return msgs


async def test_metrics_collector_publishes_and_reports_unreachable_targets(nc, prefix, topology, vllm_server):
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    reg = CollectorRegistry()
    col = MetricsCollector([Target(f"{vllm_server}/metrics", "pod-1"), Target(dead, "pod-2"),
                            Target(f"{vllm_server}/broken/metrics", "pod-3")], nc.jetstream(),
                           subject_prefix=prefix, registry=reg, timeout_s=2)
    first = await col.scrape_once()
    second = await col.scrape_once()  # keeps going after failures
    assert [s.pod for s in first + second] == ["pod-1", "pod-1"]
    assert col.status[dead].up is False and "unreachable" in col.status[dead].last_error
    assert col.status[dead].consecutive_failures == 2
    assert "HTTP 500" in col.status[f"{vllm_server}/broken/metrics"].last_error
    assert reg.get_sample_value("infernex_metrics_scrape_errors_total", {"pod": "pod-2", "reason": "unreachable"}) == 2
    assert reg.get_sample_value("infernex_metrics_target_up", {"pod": "pod-2"}) == 0
    assert reg.get_sample_value("infernex_metrics_target_up", {"pod": "pod-1"}) == 1
    msgs = await fetch_all(nc.jetstream(), topology, S.with_prefix(prefix, S.engine_metrics("pod-1")), 2)
    snaps = [EngineMetrics.from_json(m.data) for m in msgs]
    assert len(snaps) == 2 and snaps[0].num_requests_running == 7 and snaps[0].block_size == 16
    assert snaps[0].time_to_first_token_seconds.count == 206


async def test_device_collector_sim_and_file_sources(nc, prefix, topology):
    sim = SimulatedNode("npu-node-1", 4, "npu", seed=5)
    sim.inject(2, "error_code", 0, code="0x80E01801")
    col = DeviceCollector(make_reader("sim", "npu-node-1", sim_node=sim, clock=lambda: 50.0), nc.jetstream(),
                          node="npu-node-1", source="sim", subject_prefix=prefix, registry=CollectorRegistry())
    published = await col.collect_once()
    assert len(published) == 4
    msgs = await fetch_all(nc.jetstream(), topology, S.with_prefix(prefix, "device.telemetry.npu-node-1.>"), 4)
    got = {m.subject.rsplit(".", 1)[-1]: DeviceTelemetry.from_json(m.data) for m in msgs}
    assert sorted(got) == ["0", "1", "2", "3"] and got["2"].error_codes == ["0x80E01801"]
    assert got["0"] == sim.sample(50.0)[0]

    reg = CollectorRegistry()
    bad = DeviceCollector(make_reader("dcgm", "g", str(FIX / "missing.prom")), nc.jetstream(), node="g",
                          source="dcgm", subject_prefix=prefix, registry=reg)
    assert await bad.collect_once() == [] and "neither a URL nor a readable file" in bad.last_error
    assert reg.get_sample_value("infernex_device_collect_errors_total", {"node": "g", "source": "dcgm"}) == 1

    dcgm = DeviceCollector(make_reader("dcgm", "gpu-node-7", str(FIX / "dcgm-exporter.prom")), nc.jetstream(),
                           node="gpu-node-7", source="dcgm", subject_prefix=prefix, registry=CollectorRegistry())
    assert [s.device for s in await dcgm.collect_once()] == ["0", "1", "2", "3"]


def test_cli_collect_devices_once(nats_server, prefix, monkeypatch):
    from infernex.cli import app

    monkeypatch.setenv("INFERNEX_NATS__SERVERS", nats_server.url)
    monkeypatch.setenv("INFERNEX_NATS__SUBJECT_PREFIX", prefix)
    runner = CliRunner()
    assert runner.invoke(app, ["streams", "apply"]).exit_code == 0
    res = runner.invoke(app, ["collect", "devices", "--source", "npu-smi", "--node", "n1",
                              "--url", str(FIX / "npu-smi-info-910b4.txt"), "--once"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert [d["device"] for d in lines] == [str(i) for i in range(8)] and lines[2]["health"] == "Warning"
    res = runner.invoke(app, ["collect", "devices", "--source", "dcgm", "--node", "n1", "--once"])
    assert res.exit_code == 2 and "needs --url" in res.output
    res = runner.invoke(app, ["collect", "metrics", "--target", "http://x", "--once"])
    assert res.exit_code == 2 and "one --pod per --target" in res.output


async def test_npu_smi_source_runs_the_command(tmp_path, monkeypatch):
    fake = tmp_path / "npu-smi"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = info ] || exit 3\ncat {FIX / 'npu-smi-info-910b4.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    samples = await make_reader("npu-smi", "n9", clock=lambda: 3.0)()
    assert [s.device for s in samples] == [str(i) for i in range(8)] and samples[4].health == "Critical"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    from consumers.device_collector import SourceError

    with pytest.raises(SourceError, match="not found"):
        await make_reader("npu-smi", "n9")()
