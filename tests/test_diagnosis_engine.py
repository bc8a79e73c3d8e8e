"""Scenario suite of the pure diagnosis engine: telemetry built directly, time moved by hand."""

from __future__ import annotations

import random

import pytest

from test_diagnosis_helpers import GPU, NPU, sample
from streams.clock import ManualClock
from streams.diagnosis import DiagnosisEngine, build_ruleset, msg_id
from schemas import EngineMetrics

T0 = 1_700_000_000.0


def run(engine: DiagnosisEngine, clock: ManualClock, seconds: int, start: float, make) -> list:
    """Feed one sample per second from ``start``; ``make(i, ts)`` builds it. Returns all findings."""
    out = []
    for i in range(seconds):
        ts = start + i
        clock.set(ts)
        out.extend(engine.observe(make(i, ts)))
    return out


@pytest.fixture
def clock():
    return ManualClock(T0)


@pytest.fixture
def engine(clock):
    return DiagnosisEngine(build_ruleset(), clock)


def noisy(i: int, rng: random.Random, base: dict) -> dict:
    return dict(temperature_c=55 + rng.uniform(-3, 3), power_w=250 + rng.uniform(-40, 40),
                utilization_pct=rng.uniform(30, 95), base=base)


def test_clean_run_diagnoses_nothing(engine, clock):
    rng = random.Random(7)
    out = []
    for i in range(900):
        ts = T0 + i
        clock.set(ts)
        for dev in range(4):
            kw = noisy(i, rng, NPU if dev < 2 else GPU)
            out += engine.observe(sample(ts, device=str(dev), ecc_single_bit_total=3 + i // 300, **kw))
        out += engine.tick()
    assert out == []
    assert engine.health.pod_health("pod-n1-0") == ("ok", 1.0, [])


@pytest.mark.parametrize("base,temp,mode,severity,action", [
    (NPU, 88.0, "over_temperature", "warning", "SubHealth"),
    (NPU, 97.0, "over_temperature", "critical", "PreSeparateNPU"),
    (GPU, 92.0, "over_temperature", "critical", "DrainNode"),
])
def test_over_temperature(engine, clock, base, temp, mode, severity, action):
    out = run(engine, clock, 30, T0, lambda i, ts: sample(ts, base=base, temperature_c=temp if i >= 10 else 55))
    assert [(d.status, d.fault_mode, d.severity, d.action) for d in out] == [("open", mode, severity, action)]
    assert out[0].first_seen == T0 + 10
    assert out[0].evidence["temperature_c"] == temp
    assert out[0].pods == ["pod-n1-0"]


def test_power_threshold_is_per_model(engine, clock):
    # 350 W is over the 910B4 warning (330) but fine for an H100 (690)
    npu = run(engine, clock, 5, T0, lambda i, ts: sample(ts, device="0", power_w=350))
    gpu = run(engine, clock, 5, T0 + 5, lambda i, ts: sample(ts, device="1", base=GPU, power_w=350))
    assert [(d.fault_mode, d.severity) for d in npu] == [("over_power", "warning")]
    assert gpu == []


@pytest.mark.parametrize("code,mode,severity,action", [
    ("0x80E01801", "hbm_multi_bit_ecc", "critical", "RestartBusiness"),
    ("0x80E18402", "hbm_isolated_rows_limit", "critical", "SeparateNPU"),
    ("0x80CB800A", "aiv_operator_timeout", "warning", "RestartRequest"),
    ("0x28000049", "hccs_link_degradation", "warning", "SubHealth"),
    ("80E3A201", "ascend_code_80E3A201", "critical", "SeparateNPU"),  # level from faultCode.json only
    ("8C1F8608", "device_cqe_error", "info", "NotHandle"),
])
def test_ascend_error_codes(engine, clock, code, mode, severity, action):
    out = run(engine, clock, 10, T0, lambda i, ts: sample(ts, error_codes=[code] if i >= 3 else []))
    assert [(d.status, d.fault_mode, d.severity, d.action) for d in out] == [("open", mode, severity, action)]
    assert out[0].evidence["error_code"] == code


def test_parameter_plane_fault_needs_20s(engine, clock):
    short = run(engine, clock, 15, T0, lambda i, ts: sample(ts, error_codes=["81078603"]))
    assert short == []
    longer = run(engine, clock, 10, T0 + 15, lambda i, ts: sample(ts, error_codes=["81078603"]))
    assert [(d.fault_mode, d.action, d.first_seen) for d in longer] == [
        ("parameter_plane_network_fault", "NotHandle", T0)]


@pytest.mark.parametrize("xid,severity,action", [
    (79, "critical", "DrainNode"), (48, "critical", "ResetGPU"), (46, "critical", "ResetGPU"),
    (63, "warning", "ResetGPU"), (64, "critical", "ResetGPU"), (31, "info", "RestartRequest"),
])
def test_nvidia_xids(engine, clock, xid, severity, action):
    # an Xid is an event: reported in one sample only, the finding stays open afterwards
    out = run(engine, clock, 60, T0, lambda i, ts: sample(ts, base=GPU, health=None,
                                                         xid_errors=[xid] if i == 5 else []))
    assert [(d.status, d.fault_mode, d.severity, d.action) for d in out] == [
        ("open", f"xid_{xid}", severity, action)]


def test_xid_resolves_after_clear_after_s_and_hold(engine, clock):
    out = run(engine, clock, 200, T0, lambda i, ts: sample(ts, base=GPU, health=None,
                                                          xid_errors=[13] if i == 0 else []))
    statuses = [(d.status, d.fault_mode) for d in out if d.status != "updated"]
    assert statuses == [("open", "xid_13"), ("resolved", "xid_13")]
    resolved = out[-1]
    assert resolved.evidence["clear_since"] == T0 + 120  # clear_after_s 120
    assert resolved.evidence["resolved_at"] == T0 + 120 + 15  # plus hold_s
    assert resolved.last_seen == T0 + 119


def test_single_bit_ecc_burst_and_double_bit(engine, clock):
    def make(i, ts):
        sbe = 3 + (40 * (i - 30) if i >= 30 else 0)  # 40 errors / s from t=30
        dbe = 1 if i >= 50 else 0
        return sample(ts, ecc_single_bit_total=sbe, ecc_double_bit_total=dbe)
    out = run(engine, clock, 60, T0, make)
    got = [(d.fault_mode, d.severity, d.action) for d in out if d.status == "open"]
    assert ("hbm_ecc_burst", "warning", "SubHealth") in got
    assert ("hbm_ecc_uncorrectable", "critical", "RestartBusiness") in got
    burst = next(d for d in out if d.fault_mode == "hbm_ecc_burst")
    assert burst.evidence["ecc_single_bit_per_min"] >= 10


def test_ecc_counter_reset_is_not_a_burst(engine, clock):
    out = run(engine, clock, 60, T0, lambda i, ts: sample(ts, ecc_single_bit_total=5000 if i < 30 else 0))
    assert out == []


def test_link_down_persisting_vs_blip(engine, clock):
    blip = run(engine, clock, 30, T0, lambda i, ts: sample(ts, link_status="DOWN" if 5 <= i < 8 else "UP"))
    assert blip == []
    down = run(engine, clock, 30, T0 + 30, lambda i, ts: sample(ts, link_status="DOWN"))
    assert [(d.fault_mode, d.severity, d.action) for d in down] == [("link_down", "warning", "SubHealth")]


@pytest.mark.parametrize("health,mode,severity,action", [
    ("Warning", "npu_health_warning", "warning", "SubHealth"),
    ("Alarm", "npu_health_alarm", "critical", "RestartBusiness"),
    ("Critical", "npu_health_critical", "critical", "SeparateNPU"),
])
def test_npu_smi_health_is_evidence(engine, clock, health, mode, severity, action):
    out = run(engine, clock, 5, T0, lambda i, ts: sample(ts, health=health))
    assert [(d.fault_mode, d.severity, d.action) for d in out] == [(mode, severity, action)]
    assert out[0].remediation  # an operator is told what to do, not only what is wrong


def test_steady_temperature_rise(engine, clock):
    # 66 °C rising 2 °C/min: below the 85 °C threshold, yet a trend worth a warning
    out = run(engine, clock, 700, T0, lambda i, ts: sample(ts, temperature_c=60 + i * 2 / 60))
    opened = [d for d in out if d.status == "open"]
    assert [d.fault_mode for d in opened] == ["temperature_rising"]
    assert opened[0].evidence["temperature_rise_c_per_min"] == pytest.approx(2.0, rel=0.05)


def test_stuck_idle_needs_waiting_requests(engine, clock):
    idle = run(engine, clock, 120, T0, lambda i, ts: sample(ts, utilization_pct=0.0))
    assert idle == []  # no load input: idle is fine

    def make(i, ts):
        engine.apply_load(EngineMetrics(pod="pod-n1-0", model="m", ts=ts, num_requests_running=0,
                                        num_requests_waiting=7, kv_cache_usage_perc=0.1))
        return sample(ts, utilization_pct=0.0)
    out = run(engine, clock, 90, T0 + 120, make)
    assert [(d.fault_mode, d.severity, d.action, d.first_seen) for d in out] == [
        ("stuck_idle", "critical", "RestartBusiness", T0 + 120)]
    assert out[0].evidence["waiting_requests"] == 7


def test_persisting_fault_is_one_finding_updated_with_throttle(engine, clock):
    out = run(engine, clock, 600, T0, lambda i, ts: sample(ts, temperature_c=90))
    assert {d.finding_id for d in out} == {out[0].finding_id}
    assert [d.status for d in out][0] == "open"
    assert all(d.status == "updated" for d in out[1:])
    assert 8 <= len(out) - 1 <= 10  # one update per 60 s
    assert [d.revision for d in out] == list(range(1, len(out) + 1))
    assert len({msg_id(d) for d in out}) == len(out)


def test_escalation_is_immediate_and_resolution_once(engine, clock):
    def make(i, ts):
        temp = 88 if i < 20 else 97 if i < 40 else 55
        return sample(ts, temperature_c=temp)
    out = run(engine, clock, 100, T0, make)
    assert [(d.status, d.severity) for d in out] == [("open", "warning"), ("updated", "critical"),
                                                     ("resolved", "critical")]
    assert out[1].last_seen == T0 + 20
    assert out[2].last_seen == T0 + 39  # last time the condition held
    assert out[2].evidence["resolved_at"] == T0 + 40 + 15  # after hold_s
    assert engine.open == {}
    assert engine.health.pod_health("pod-n1-0")[0] == "ok"


@pytest.mark.parametrize("low,high", [(84.0, 96.0), (60.0, 97.0), (94.0, 96.0)])
def test_flapping_reading_does_not_storm(engine, clock, low, high):
    seconds = 600
    out = run(engine, clock, seconds, T0, lambda i, ts: sample(ts, temperature_c=high if i % 2 else low))
    ids = {d.finding_id for d in out}
    assert len(ids) == 1
    assert sum(d.status == "open" for d in out) == 1
    assert not any(d.status == "resolved" for d in out)
    assert len(out) <= 1 + seconds / 60 + 1
    # once it settles, it resolves exactly once
    after = run(engine, clock, 60, T0 + seconds, lambda i, ts: sample(ts, temperature_c=55))
    assert [d.status for d in after] == ["resolved"]


def test_silent_device_becomes_unknown_then_recovers(engine, clock):
    run(engine, clock, 10, T0, lambda i, ts: sample(ts))
    clock.advance(10)
    assert engine.tick() == []  # 11 s silent: within stale_after_s
    clock.advance(10)
    out = engine.tick()
    assert [(d.status, d.fault_mode, d.severity) for d in out] == [("open", "device_silent", "warning")]
    health = engine.health.device_health("n1", "0")
    assert health.stale and health.status in ("unknown", "warning")
    assert engine.health.pod_health("pod-n1-0")[0] != "ok"
    clock.advance(5)
    assert engine.tick() == []  # still silent: no storm
    back = engine.observe(sample(clock.now()))
    assert [(d.status, d.fault_mode) for d in back] == [("resolved", "device_silent")]


def test_silent_device_health_is_unknown_without_findings(clock):
    eng = DiagnosisEngine(build_ruleset(), clock)
    eng.observe(sample(T0))
    clock.advance(60)
    h = eng.health.device_health("n1", "0")
    assert (h.status, h.stale) == ("unknown", True)
    assert h.score < 1.0


def test_out_of_order_sample_is_ignored(engine, clock):
    run(engine, clock, 5, T0, lambda i, ts: sample(ts))
    assert engine.observe(sample(T0 + 1, temperature_c=99)) == []
    assert engine.health.devices[("n1", "0")].out_of_order == 1


def test_adopted_finding_is_resolved_by_clean_telemetry(clock):
    first = DiagnosisEngine(build_ruleset(), clock)
    opened = run(first, clock, 5, T0, lambda i, ts: sample(ts, temperature_c=97))[0]
    second = DiagnosisEngine(build_ruleset(), clock)  # e.g. after a restart
    second.adopt(opened)
    again = run(second, clock, 5, T0 + 5, lambda i, ts: sample(ts, temperature_c=97))
    assert again == []  # not reopened under a new id
    out = run(second, clock, 30, T0 + 10, lambda i, ts: sample(ts))
    assert [(d.status, d.finding_id, d.revision) for d in out] == [("resolved", opened.finding_id, 2)]


def test_user_rules_change_the_diagnosis(clock):
    rules = build_ruleset({"models": {"Ascend 910B4": {"thresholds": {"temperature_c": {"warning": 60}}}},
                           "error_codes": {"0xDEAD0001": {"fault_mode": "custom_fault", "level": "SeparateNPU"}}})
    eng = DiagnosisEngine(rules, clock)
    out = run(eng, clock, 5, T0, lambda i, ts: sample(ts, temperature_c=65, error_codes=["dead0001"]))
    assert {(d.fault_mode, d.severity, d.action) for d in out} == {
        ("over_temperature", "warning", "SubHealth"), ("custom_fault", "critical", "SeparateNPU")}
