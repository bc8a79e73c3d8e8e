"""Simulated NPU/GPU nodes: deterministic samples, scripted faults, real-format renderers."""

from __future__ import annotations

import httpx
import pytest

from consumers.parsers import parse_dcgm, parse_npu_exporter, parse_npu_smi
from simulator.devices import SCENARIOS, SimulatedNode, make_app, render_dcgm, render_npu_exporter, render_npu_smi


def test_samples_are_deterministic_by_seed_and_vary_with_it():
    a = SimulatedNode("node-a", 8, "npu", seed=7)
    b = SimulatedNode("node-a", 8, "npu", seed=7)
    c = SimulatedNode("node-a", 8, "npu", seed=8)
    for t in (0.0, 12.5, 3600.0):
        assert a.sample(t) == b.sample(t)
    assert [s.temperature_c for s in a.sample(50)] != [s.temperature_c for s in c.sample(50)]
    s = a.sample(10)[0]
    assert (s.kind, s.source, s.device_model, s.health, s.link_status) == ("npu", "sim", "Ascend 910B4", "OK", "UP")
    assert 0 <= s.utilization_pct <= 100 and 30 < s.temperature_c < 70 and s.memory_total_mb == 32768


def test_over_temperature_ramps_and_ends():
    n = SimulatedNode("n", 2, "npu", seed=1)
    n.inject(1, "over_temperature", start=100, duration=60)
    before, during, after = n.sample(90)[1], n.sample(130)[1], n.sample(200)[1]
    assert before.temperature_c < 70 and before.health == "OK"
    assert during.temperature_c >= 100 and during.health in ("Warning", "Alarm")
    assert after.temperature_c < 70 and after.health == "OK"
    assert n.sample(130)[0].health == "OK"  # other device untouched


def test_hbm_ecc_burst_counts_are_cumulative_and_monotonic():
    n = SimulatedNode("n", 1, "npu", seed=1)
    n.inject(0, "hbm_ecc_burst", start=10, duration=20, rate_per_s=50)
    counts = [n.sample(t)[0].ecc_single_bit_total for t in (5, 10, 15, 30, 100)]
    assert counts == [0, 0, 250, 1000, 1000]
    assert n.sample(15)[0].health == "Warning" and n.sample(100)[0].health == "OK"


def test_error_code_link_down_and_xid79():
    n = SimulatedNode("n", 2, "npu", seed=2)
    n.inject(0, "error_code", start=0, code="80e01801")
    n.inject(1, "link_down", start=0, duration=5)
    s0, s1 = n.sample(1)
    assert s0.error_codes == ["0x80E01801"] and s0.health == "Critical"
    assert s1.link_status == "DOWN" and n.sample(6)[1].link_status == "UP"
    g = SimulatedNode("g", 2, "gpu", seed=2)
    g.scenario("xid79", start=10, device=1)
    # dcgm-exporter's XID is the last value seen: 0 before, 79 from the fault on (it stays after it)
    assert g.sample(9)[1].xid_last == 0 and g.sample(11)[1].xid_last == 79
    assert g.sample(10_000)[1].xid_last == 79 and g.sample(11)[1].xid_errors == []
    assert g.sample(11)[1].utilization_pct == 0


@pytest.mark.parametrize("bad", [
    lambda: SimulatedNode("n", 0),
    lambda: SimulatedNode("n", 1, "tpu"),
    lambda: SimulatedNode("n", 1, "npu", "H100"),
    lambda: SimulatedNode("n", 1).inject(5, "link_down", 0),
    lambda: SimulatedNode("n", 1).inject(0, "melt", 0),
    lambda: SimulatedNode("n", 1).inject(0, "xid", 0),
    lambda: SimulatedNode("n", 1).inject(0, "error_code", 0, code="zz"),
    lambda: SimulatedNode("n", 1).scenario("nope", 0),
])
def test_bad_arguments_are_clear_errors(bad):
    with pytest.raises(ValueError):
        bad()


def test_every_scenario_runs_on_a_matching_node():
    for name in SCENARIOS:
        kind = "gpu" if name == "xid79" else "npu"
        n = SimulatedNode("n", 1, kind, seed=0)
        faults = n.scenario(name, start=0)
        assert faults and n.sample(5)[0] != SimulatedNode("n", 1, kind, seed=0).sample(5)[0]


def test_renderers_round_trip_through_the_real_parsers():
    n = SimulatedNode("node-a", 4, "npu", seed=3, pods={"0": ["pod-x"]})
    n.inject(1, "error_code", 0, code="0x80E01801")
    n.inject(1, "error_code", 0, code="0x81078603")
    n.inject(2, "hbm_ecc_burst", 0, 10, rate_per_s=7)
    n.inject(3, "link_down", 0)
    samples = n.sample(20)
    exp = {s.device: s for s in parse_npu_exporter(render_npu_exporter(samples), "node-a", 20)}
    smi = {s.device: s for s in parse_npu_smi(render_npu_smi(samples), "node-a", 20)}
    for s in samples:
        e, m = exp[s.device], smi[s.device]
        assert e.temperature_c == s.temperature_c and e.power_w == s.power_w
        assert e.error_codes == s.error_codes and e.ecc_single_bit_total == s.ecc_single_bit_total
        assert e.link_status == s.link_status and e.memory_used_mb == s.memory_used_mb
        assert m.health == s.health and m.memory_used_mb == s.memory_used_mb and m.power_w == s.power_w
        assert m.temperature_c == round(s.temperature_c)
    assert exp["0"].pods == ["pod-x"] and exp["2"].ecc_single_bit_total == 70

    g = SimulatedNode("gpu-a", 2, "gpu", seed=3)
    g.inject(1, "xid", 0, xid=79)
    g.inject(0, "hbm_ecc_burst", 0, 2, rate_per_s=3)
    gs = g.sample(5)
    parsed = {s.device: s for s in parse_dcgm(render_dcgm(gs), "gpu-a", 5)}
    assert parsed["1"].xid_last == 79 and parsed["0"].ecc_single_bit_total is None  # default counters: no ECC
    parsed = {s.device: s for s in parse_dcgm(render_dcgm(gs, ecc=True), "gpu-a", 5)}
    assert parsed["1"].xid_last == 79 and parsed["0"].ecc_single_bit_total == 6
    assert parsed["0"].device_model == "H100" and parsed["0"].memory_total_mb == gs[0].memory_total_mb


async def test_http_mode_serves_the_formats():
    from streams.clock import ManualClock

    npu = SimulatedNode("npu-1", 2, "npu", seed=1)
    gpu = SimulatedNode("gpu-1", 2, "gpu", seed=1)
    app = make_app([npu, gpu], clock=ManualClock(1000.0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c:
        r = await c.get("/metrics", params={"node": "npu-1"})
        assert r.status_code == 200 and "npu_chip_info_temperature" in r.text
        assert {s.device for s in parse_npu_exporter(r.text, "npu-1", 0)} == {"0", "1"}
        r = await c.get("/metrics")
        assert "DCGM_FI_DEV_GPU_TEMP" in r.text and r.text.count("# TYPE npu_chip_info_temperature") == 1
        r = await c.get("/npu-smi")
        assert len(parse_npu_smi(r.text, "npu-1", 0)) == 2
        r = await c.get("/telemetry", params={"node": "gpu-1"})
        assert [d["device"] for d in r.json()] == ["0", "1"] and r.json()[0]["ts"] == 1000.0
        r = await c.get("/metrics", params={"node": "nope"})
        assert r.status_code == 404 and "unknown node" in r.json()["error"]
