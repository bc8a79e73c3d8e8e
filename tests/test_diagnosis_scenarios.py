"""Scenario suite with the device simulator: every injected fault is diagnosed with the right fault mode
and action, a clean run diagnoses nothing, a flapping fault does not storm, a silent device is UNKNOWN."""

from __future__ import annotations

import pytest

from simulator.devices import SimulatedNode
from streams.clock import ManualClock
from streams.diagnosis import DiagnosisEngine, build_ruleset
from streams.health import PodHealthView

T0 = 1_000.0


def drive(engine: DiagnosisEngine, clock: ManualClock, nodes: list[SimulatedNode], start: float, seconds: int):
    out = []
    for i in range(seconds):
        t = start + i
        clock.set(t)
        for n in nodes:
            for s in n.sample(t):
                out.extend(engine.observe(s))
        out.extend(engine.tick())
    return out


def fresh():
    clock = ManualClock(T0)
    return DiagnosisEngine(build_ruleset(), clock), clock


@pytest.mark.parametrize("kind,model,load", [("npu", "Ascend 910B4", 0.6), ("npu", "Ascend 910B2", 1.0),
                                             ("gpu", "H100", 0.6), ("gpu", "A100", 1.0)])
def test_clean_run_diagnoses_nothing(kind, model, load):
    engine, clock = fresh()
    node = SimulatedNode("clean", 8, kind, model, seed=3, load=load)
    assert drive(engine, clock, [node], T0, 1200) == []


# fault kind, params, expected (fault_mode, action) that must be among the opened findings
NPU_FAULTS = [
    ("over_temperature", {}, ("over_temperature", "PreSeparateNPU")),
    ("over_temperature", {"temp_c": 88}, ("over_temperature", "SubHealth")),
    ("hbm_ecc_burst", {"rate_per_s": 60}, ("hbm_ecc_burst", "SubHealth")),
    ("hbm_ecc_burst", {"rate_per_s": 5, "double_bit": 2}, ("hbm_ecc_uncorrectable", "RestartBusiness")),
    ("link_down", {}, ("link_down", "SubHealth")),
    ("error_code", {"code": "0x80E01801"}, ("hbm_multi_bit_ecc", "RestartBusiness")),
    ("error_code", {"code": "0x80E18402"}, ("hbm_isolated_rows_limit", "SeparateNPU")),
    ("error_code", {"code": "0x80CB800A", "health": "Warning"}, ("aiv_operator_timeout", "RestartRequest")),
    ("error_code", {"code": "0x81078603"}, ("parameter_plane_network_fault", "NotHandle")),
    ("error_code", {"code": "0x28000049", "health": "Warning"}, ("hccs_link_degradation", "SubHealth")),
    ("power_spike", {}, ("over_power", "SubHealth")),
]
GPU_FAULTS = [
    ("xid", {"xid": 79}, ("xid_79", "DrainNode")),
    ("xid", {"xid": 48}, ("xid_48", "ResetGPU")),
    ("xid", {"xid": 63}, ("xid_63", "ResetGPU")),
    ("over_temperature", {}, ("over_temperature", "DrainNode")),
    ("hbm_ecc_burst", {"rate_per_s": 60}, ("hbm_ecc_burst", "Observe")),
    ("hbm_ecc_burst", {"rate_per_s": 1, "double_bit": 1}, ("hbm_ecc_uncorrectable", "ResetGPU")),
    ("power_spike", {}, ("over_power", "SubHealth")),
]


@pytest.mark.parametrize("kind,fault,params,expected",
                         [("npu", *f) for f in NPU_FAULTS] + [("gpu", *f) for f in GPU_FAULTS])
def test_injected_fault_is_diagnosed(kind, fault, params, expected):
    engine, clock = fresh()
    node = SimulatedNode("n1", 4, kind, seed=11, pods={"2": ["pod-2"]})
    node.inject(2, fault, start=T0 + 30, duration=90, **params)
    out = drive(engine, clock, [node], T0, 240)
    opened = [d for d in out if d.status == "open"]
    # the finding is opened, maybe escalated ("updated") as the reading worsens
    assert expected in {(d.fault_mode, d.action) for d in out if d.status != "resolved"}, out
    assert {d.device for d in out} == {"2"}  # healthy neighbours stay clean
    first = next(d for d in opened if d.fault_mode == expected[0])
    assert T0 + 30 <= first.first_seen <= T0 + 60 and first.pods == ["pod-2"]
    # each finding opened once; those that cleared were resolved once
    for fid in {d.finding_id for d in out}:
        statuses = [d.status for d in out if d.finding_id == fid]
        assert statuses.count("open") == 1 and statuses.count("resolved") <= 1


def test_cleared_fault_publishes_a_resolution():
    engine, clock = fresh()
    node = SimulatedNode("n1", 2, "npu", seed=5)
    node.inject(0, "over_temperature", start=T0 + 10, duration=60)
    out = drive(engine, clock, [node], T0, 200)
    temps = [d for d in out if d.fault_mode == "over_temperature"]
    assert temps[0].status == "open" and temps[-1].status == "resolved"
    assert len({d.finding_id for d in temps}) == 1
    assert engine.open == {}


def test_flapping_fault_does_not_storm():
    engine, clock = fresh()
    node = SimulatedNode("n1", 1, "npu", seed=5)
    for k in range(60):  # link down 3 s out of every 10 s, for 10 minutes
        node.inject(0, "link_down", start=T0 + 10 * k, duration=3)
        node.inject(0, "over_temperature", start=T0 + 10 * k + 5, duration=4, temp_c=97)
    out = drive(engine, clock, [node], T0, 600)
    assert all(d.fault_mode != "link_down" for d in out)  # never down for for_s in a row
    per_mode: dict[str, list] = {}
    for d in out:
        per_mode.setdefault(d.fault_mode, []).append(d)
    for mode, ds in per_mode.items():
        assert len({d.finding_id for d in ds}) <= 2, (mode, len(ds))
        assert len(ds) <= 2 + 600 / 60 + 2, (mode, len(ds))


def test_silent_device_becomes_unknown():
    engine, clock = fresh()
    node = SimulatedNode("n1", 2, "gpu", seed=5)
    drive(engine, clock, [node], T0, 10)
    quiet = SimulatedNode("n1", 1, "gpu", seed=5)  # device 1 stops reporting
    out = drive(engine, clock, [quiet], T0 + 10, 30)
    assert [(d.status, d.fault_mode, d.device) for d in out] == [("open", "device_silent", "1")]
    assert engine.health.device_health("n1", "1").stale


def test_pod_on_critical_device_is_excluded_by_the_health_view():
    engine, clock = fresh()
    node = SimulatedNode("n1", 2, "gpu", seed=5, pods={"0": ["pod-a"], "1": ["pod-b"]})
    node.inject(0, "xid", start=T0 + 5, xid=79)
    view = PodHealthView()
    for d in drive(engine, clock, [node], T0, 20):
        view.apply(d)
    assert view.status("pod-a") == ("critical", 0.0)
    assert view.status("pod-b") == ("ok", 1.0)
