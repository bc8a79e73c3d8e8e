"""The diagnosis service against a real nats-server: telemetry in, one finding out, then a resolution;
bad telemetry dead-lettered; a restart adopts open findings instead of forgetting them."""

from __future__ import annotations

import asyncio
import base64
import time

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.diagnosis import DiagnosisService
from test_diagnosis_helpers import sample
from schemas import DeadLetter, Diagnosis, decode_event
from schemas import subjects as S
from streams.diagnosis import build_ruleset
from streams.diagnosis.rules import DiagnosisConfig

FAST = {"timing": {"hold_s": 2, "update_interval_s": 600, "stale_after_s": 120}}


def make_service(nats_config, topology, registry=None, durable="diag"):
    return DiagnosisService(nats_config, DiagnosisConfig(durable=durable, start="all", tick_s=0.2,
                                                         watch_engine_metrics=False),
                            rules=build_ruleset(FAST), registry=registry or CollectorRegistry(),
                            topology=topology)


async def send(js, prefix, t):
    await bus.publish(js, S.with_prefix(prefix, S.device_telemetry(t.node, t.device)), t.to_json())


async def collect(js, subject, want: int, timeout: float = 20.0, settle: float = 1.0) -> list:
    """All stored messages on ``subject``: waits until ``want`` arrived, then ``settle`` s for extras."""
    sub = await js.subscribe(subject, ordered_consumer=True,
                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    out = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            wait = settle if len(out) >= want else max(0.1, deadline - time.monotonic())
            try:
                msg = await sub.next_msg(timeout=wait)
            except (NatsTimeoutError, asyncio.TimeoutError):
                if len(out) >= want:
                    break
                continue
            out.append(msg)
    finally:
        await sub.unsubscribe()
    return out


async def test_telemetry_in_finding_out_once_then_resolution(nats_config, nc, prefix, topology):
    js = nc.jetstream()
    reg = CollectorRegistry()
    svc = make_service(nats_config, topology, reg)
    await svc.start()
    try:
        base = time.time()
        for i in range(6):  # hot: one finding, not six
            await send(js, prefix, sample(base + i, node="node-a", device="3", temperature_c=97, pods=["pod-x"]))
        got = await collect(js, S.with_prefix(prefix, S.diagnosis("node-a", "3")), want=1)
        opened = [decode_event(Diagnosis, m.data) for m in got]
        assert [(d.status, d.fault_mode, d.severity, d.action, d.revision) for d in opened] == [
            ("open", "over_temperature", "critical", "PreSeparateNPU", 1)]
        assert opened[0].pods == ["pod-x"] and opened[0].first_seen == base
        assert got[0].headers["Nats-Msg-Id"] == f"{opened[0].finding_id}:1"
        assert reg.get_sample_value("infernex_diagnosis_open_findings", {"severity": "critical"}) == 1
        for i in range(6, 12):  # clean for longer than hold_s
            await send(js, prefix, sample(base + i, node="node-a", device="3", pods=["pod-x"]))
        got = await collect(js, S.with_prefix(prefix, S.diagnosis("node-a", "3")), want=2)
        all_ = [decode_event(Diagnosis, m.data) for m in got]
        assert [(d.status, d.revision) for d in all_] == [("open", 1), ("resolved", 2)]
        assert all_[1].finding_id == opened[0].finding_id
        assert reg.get_sample_value("infernex_diagnosis_open_findings", {"severity": "critical"}) == 0
        assert reg.get_sample_value("infernex_diagnosis_telemetry_total", {"result": "ok"}) == 12
        assert reg.get_sample_value("infernex_diagnosis_latency_seconds_count") == 2
    finally:
        await svc.stop()


async def test_malformed_telemetry_is_dead_lettered_and_consumer_keeps_going(nats_config, nc, prefix, topology):
    js = nc.jetstream()
    reg = CollectorRegistry()
    svc = make_service(nats_config, topology, reg)
    await svc.start()
    try:
        subj = S.with_prefix(prefix, S.device_telemetry("n1", "0"))
        await bus.publish(js, subj, b"{not json")
        await bus.publish(js, subj, sample(time.time(), temperature_c=123.5).to_json().replace(b"123.5", b"999"))
        wrong = sample(time.time(), node="other")  # payload for another device than the subject says
        await bus.publish(js, subj, wrong.to_json())
        await send(js, prefix, sample(time.time() + 86400))  # a node whose clock is a day ahead
        await send(js, prefix, sample(time.time(), error_codes=["0x80E18402"]))
        letters = await collect(js, S.with_prefix(prefix, S.dead_letter(S.DEVICE_TELEMETRY)), want=4)
        reasons = [decode_event(DeadLetter, m.data).reason for m in letters]
        assert len(reasons) == 4
        assert "DeviceTelemetry" in reasons[0]
        assert "temperature_c" in reasons[1]
        assert "other/0" in reasons[2]
        assert "future" in reasons[3]
        assert base64.b64decode(decode_event(DeadLetter, letters[0].data).payload) == b"{not json"
        found = await collect(js, S.with_prefix(prefix, S.diagnosis("n1", "0")), want=1)
        d = decode_event(Diagnosis, found[0].data)
        assert (d.fault_mode, d.action) == ("hbm_isolated_rows_limit", "SeparateNPU")
        assert reg.get_sample_value("infernex_dead_letters_total",
                                    {"stream": S.DEVICE_TELEMETRY, "consumer": "diag", "reason": "invalid"}) == 3
    finally:
        await svc.stop()


async def test_restart_adopts_open_finding_and_resolves_it(nats_config, nc, prefix, topology):
    js = nc.jetstream()
    base = time.time()
    first = make_service(nats_config, topology)
    await first.start()
    try:
        for i in range(3):
            await send(js, prefix, sample(base + i, link_status="DOWN"))
        await send(js, prefix, sample(base + 20, link_status="DOWN"))  # down for 20 s > for_s
        got = await collect(js, S.with_prefix(prefix, S.diagnosis("n1", "0")), want=1)
    finally:
        await first.stop()
    opened = decode_event(Diagnosis, got[0].data)
    assert (opened.status, opened.fault_mode) == ("open", "link_down")

    second = make_service(nats_config, topology)  # same durable: continues where the first stopped
    await second.start()
    try:
        assert [d.finding_id for d in second.engine.open_findings()] == [opened.finding_id]
        for i in range(21, 26):
            await send(js, prefix, sample(base + i))
        got = await collect(js, S.with_prefix(prefix, S.diagnosis("n1", "0")), want=2)
        ds = [decode_event(Diagnosis, m.data) for m in got]
        assert [(d.status, d.finding_id, d.revision) for d in ds] == [
            ("open", opened.finding_id, 1), ("resolved", opened.finding_id, 2)]
    finally:
        await second.stop()


async def test_engine_metrics_feed_the_stuck_device_rule(nats_config, nc, prefix, topology):
    from schemas import EngineMetrics

    js = nc.jetstream()
    rules = build_ruleset({**FAST, "defaults": {"stuck_idle": {"for_s": 10}}})
    svc = DiagnosisService(nats_config, DiagnosisConfig(durable="diag", start="all", tick_s=0.2,
                                                        watch_engine_metrics=True),
                           rules=rules, registry=CollectorRegistry(), topology=topology)
    await svc.start()
    try:
        base = time.time()
        m = EngineMetrics(pod="pod-q", model="m", ts=base + 15, num_requests_running=0, num_requests_waiting=4,
                          kv_cache_usage_perc=0.0)
        await bus.publish(js, S.with_prefix(prefix, S.engine_metrics("pod-q")), m.to_json())
        for _ in range(100):  # the load consumer is a separate durable: wait until it applied the sample
            if "pod-q" in svc.engine.health.load:
                break
            await asyncio.sleep(0.1)
        assert svc.engine.health.load["pod-q"][0] == 4
        for i in range(0, 16, 2):
            await send(js, prefix, sample(base + i, utilization_pct=0.0, pods=["pod-q"]))
        got = await collect(js, S.with_prefix(prefix, S.diagnosis("n1", "0")), want=1)
        d = decode_event(Diagnosis, got[0].data)
        assert (d.fault_mode, d.severity, d.action) == ("stuck_idle", "critical", "RestartBusiness")
        assert d.evidence["waiting_requests"] == 4 and len(got) == 1
    finally:
        await svc.stop()


async def test_start_without_streams_is_a_clear_error(nats_config):
    import pytest

    svc = DiagnosisService(nats_config, DiagnosisConfig(adopt_window_s=0), registry=CollectorRegistry())
    with pytest.raises(RuntimeError, match="streams apply"):
        await svc.start()  # no topology applied under this prefix
    assert svc.nc.is_closed
