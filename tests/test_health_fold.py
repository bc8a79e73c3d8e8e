"""HealthState and PodHealthView: rates, staleness, facts, per-pod status, dump/restore."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_diagnosis_helpers import GPU, NPU, sample
from schemas import Diagnosis, EngineAnnouncement
from streams.clock import ManualClock
from streams.health import HealthState, PodHealthView

T0 = 1_700_000_000.0


def diag(fid="f1", node="n1", device="0", severity="critical", status="open", pods=("pod-a",), mode="x"):
    return Diagnosis(finding_id=fid, node=node, device=device, fault_mode=mode, severity=severity, status=status,
                     action="SeparateNPU", summary="s", first_seen=T0, last_seen=T0, pods=list(pods))


def test_facts_latest_and_node_view():
    hs = HealthState(ManualClock(T0))
    hs.apply(sample(T0, device="0"))
    hs.apply(sample(T0 + 1, device="1", base=GPU, driver=None))
    h = hs.device_health("n1", "0")
    assert h.facts == {"device_model": "Ascend 910B4", "driver": "24.1.rc3", "firmware": "7.5.0.1",
                       "source": "npu-exporter"}
    assert h.readings["temperature_c"] == 55.0 and h.status == "ok" and h.score == 1.0
    assert "driver" not in hs.device_health("n1", "1").facts  # unknown facts are absent, not None
    hs.apply(sample(T0 + 2, device="0", driver=None))  # a sample without the fact keeps the known one
    assert hs.device_health("n1", "0").facts["driver"] == "24.1.rc3"
    status, devs = hs.node_health("n1")
    assert status == "ok" and {d.device for d in devs} == {"0", "1"}
    assert hs.device_health("n1", "9") is None


def test_ecc_rate_per_minute_and_counter_reset():
    hs = HealthState(ManualClock(T0))
    for i in range(61):
        rec = hs.apply(sample(T0 + i, ecc_single_bit_total=100 + 2 * i))
    assert rec.ecc_single_bit_per_min(60) == pytest.approx(120.0)
    rec = hs.apply(sample(T0 + 61, ecc_single_bit_total=0))  # counter reset: not negative, not a burst
    assert rec.ecc_single_bit_per_min(60) == pytest.approx(118.0)


def test_temperature_slope():
    hs = HealthState(ManualClock(T0))
    for i in range(301):
        rec = hs.apply(sample(T0 + i, temperature_c=50 + i * 0.05))  # 3 °C per minute
    slope, r2 = rec.temperature_slope_per_min(300, 120)
    assert slope == pytest.approx(3.0) and r2 == pytest.approx(1.0)
    short = HealthState(ManualClock(T0))
    for i in range(30):
        r = short.apply(sample(T0 + i, temperature_c=50 + i))
    assert r.temperature_slope_per_min(300, 120) is None


def test_staleness_makes_device_unknown():
    clock = ManualClock(T0)
    hs = HealthState(clock, stale_after_s=15)
    hs.apply(sample(T0))
    clock.advance(10)
    assert hs.device_health("n1", "0").status == "ok"
    clock.advance(10)
    h = hs.device_health("n1", "0")
    assert (h.status, h.stale) == ("unknown", True) and h.score < 1
    assert hs.pod_health("pod-n1-0")[0] == "unknown"


def test_findings_drive_pod_health():
    hs = HealthState(ManualClock(T0))
    hs.apply(sample(T0, pods=["pod-a"]))
    hs.apply_diagnosis(diag(severity="warning", pods=["pod-a"]))
    sev, score, reasons = hs.pod_health("pod-a")
    assert sev == "warning" and 0 < score < 1 and reasons
    hs.apply_diagnosis(diag(fid="f2", severity="critical"))
    assert hs.pod_health("pod-a")[:2] == ("critical", 0.0)
    hs.apply_diagnosis(diag(fid="f2", status="resolved"))
    hs.apply_diagnosis(diag(fid="f1", status="resolved"))
    assert hs.pod_health("pod-a") == ("ok", 1.0, [])
    # a finding on another node that names the pod still counts
    hs.apply_diagnosis(diag(fid="f3", node="n9", severity="critical", pods=["pod-a"]))
    assert hs.pod_health("pod-a")[0] == "critical"


telemetry = st.builds(
    lambda i, dev, temp, sbe, codes: sample(T0 + i, device=str(dev), temperature_c=temp, ecc_single_bit_total=sbe,
                                            error_codes=codes),
    st.integers(0, 1000), st.integers(0, 3), st.floats(20, 110), st.integers(0, 10_000),
    st.lists(st.sampled_from(["0x80E01801", "81078603"]), max_size=2))


@settings(max_examples=40, deadline=None)
@given(st.lists(telemetry, max_size=40), st.lists(st.sampled_from(["f1", "f2"]), max_size=3))
def test_dump_restore_round_trip(events, fids):
    clock = ManualClock(T0 + 1000)
    hs = HealthState(clock)
    for e in events:
        hs.apply(e)
    for f in fids:
        hs.apply_diagnosis(diag(fid=f))
    back = HealthState.restore(hs.dump(), clock)
    assert back.dump() == hs.dump()
    for key in hs.devices:
        assert back.device_health(*key) == hs.device_health(*key)


@settings(max_examples=40, deadline=None)
@given(st.lists(telemetry, min_size=1, max_size=40))
def test_sample_order_within_a_device_does_not_matter_for_latest(events):
    """Whatever the arrival order, each device ends with its newest sample."""
    hs = HealthState(ManualClock(T0 + 1000))
    for e in events:
        hs.apply(e)
    for (node, dev), rec in hs.devices.items():
        newest = max(e.ts for e in events if e.device == dev)
        assert rec.last_ts == newest


# -- PodHealthView ---------------------------------------------------------------------------------

def test_pod_view_critical_excludes_warning_lowers_resolved_clears():
    v = PodHealthView(warning_score=0.5)
    assert v.status("pod-a") == ("ok", 1.0)
    v.apply(diag(fid="w1", severity="warning"))
    assert v.status("pod-a") == ("warning", 0.5)
    v.apply(diag(fid="w2", severity="warning"))
    assert v.status("pod-a") == ("warning", 0.25)
    v.apply(diag(fid="c1", severity="critical"))
    assert v.status("pod-a") == ("critical", 0.0)
    for fid in ("w1", "w2", "c1"):
        v.apply(diag(fid=fid, status="resolved"))
    assert v.status("pod-a") == ("ok", 1.0)
    v.apply(diag(fid="i1", severity="info"))
    assert v.status("pod-a") == ("ok", 1.0)


def test_pod_view_maps_device_findings_through_announcements():
    v = PodHealthView()
    v.apply(EngineAnnouncement(pod="pod-b", url="http://x:8000", model="m", node="n1", devices=["0", "1"], ts=T0))
    v.apply(diag(fid="c", device="1", pods=()))  # finding without pods
    assert v.status("pod-b") == ("critical", 0.0)
    assert v.status("pod-c") == ("ok", 1.0)
    assert v.device_status("n1", "1") == "critical" and v.device_status("n1", "0") == "ok"
    back = PodHealthView.restore(v.dump())
    assert back.status("pod-b") == v.status("pod-b") and back.dump() == v.dump()
    v.apply(EngineAnnouncement(pod="pod-b", url="http://x:8000", model="m", node="n1", devices=["0"], ts=T0))
    assert v.status("pod-b") == ("ok", 1.0)


def test_pod_view_rejects_other_events():
    with pytest.raises(TypeError):
        PodHealthView().apply(sample(T0))
    with pytest.raises(ValueError):
        PodHealthView(warning_score=0)


def test_sample_from_the_future_is_rejected():
    from streams.health import FutureSample

    hs = HealthState(ManualClock(T0), max_future_s=300)
    with pytest.raises(FutureSample, match="future"):
        hs.apply(sample(T0 + 3600))
    assert hs.devices == {}
    hs.apply(sample(T0 + 10))  # a little ahead is fine (clock skew)


def test_device_status_agrees_with_device_health():
    clock = ManualClock(T0)
    hs = HealthState(clock, stale_after_s=15)
    hs.apply(sample(T0, device="0"))
    hs.apply(sample(T0, device="1"))
    hs.apply(sample(T0, device="2", health="UNKNOWN"))
    hs.apply_diagnosis(diag(fid="a", device="1", severity="warning"))
    for dev in ("0", "1", "2"):
        assert hs.device_status("n1", dev) == hs.device_health("n1", dev).status
    clock.advance(60)
    assert [hs.device_status("n1", d) for d in ("0", "1")] == ["unknown", "warning"]
    assert hs.device_status("n1", "9") is None
