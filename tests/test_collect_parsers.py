"""The collectors' parsers read the real formats (fixtures under tests/fixtures/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.metrics_collector import MetricsParseError, parse_vllm_metrics
from consumers.parsers import ParseError, parse_dcgm, parse_npu_exporter, parse_npu_smi, parse_npu_smi_rows

FIX = Path(__file__).parent / "fixtures"


def test_npu_smi_910b4_table():
    version, rows = parse_npu_smi_rows((FIX / "npu-smi-info-910b4.txt").read_text())
    assert version == "24.1.rc2"
    assert [r.npu for r in rows] == [str(i) for i in range(8)]
    r2 = rows[2]
    assert (r2.name, r2.health, r2.power_w, r2.temp_c, r2.bus_id, r2.aicore_pct, r2.hbm) == (
        "910B4", "Warning", 88.7, 97.0, "0000:41:00.0", 12.0, (29398, 32768))
    assert rows[0].processes == [(1843021, "python3.11", 28932)]
    assert rows[4].processes == [] and rows[4].health == "Critical"

    samples = parse_npu_smi((FIX / "npu-smi-info-910b4.txt").read_text(), "node-a", 100.0)
    s = samples[2]
    assert (s.node, s.device, s.kind, s.source, s.device_model) == ("node-a", "2", "npu", "npu-smi", "Ascend 910B4")
    assert (s.temperature_c, s.memory_used_mb, s.memory_total_mb, s.health) == (97.0, 29398, 32768, "Warning")


def test_npu_smi_310p_table_without_hbm_column():
    samples = parse_npu_smi((FIX / "npu-smi-info-310p3.txt").read_text(), "edge-1", 1.0)
    assert [s.device for s in samples] == ["0", "1"]
    assert samples[0].memory_used_mb == 1081 and samples[0].memory_total_mb == 21534
    assert samples[1].power_w is None  # "NA"
    assert samples[0].device_model == "Ascend 310P3"


def test_npu_exporter_metrics():
    samples = {s.device: s for s in parse_npu_exporter((FIX / "npu-exporter.prom").read_text(), "n1", 5.0)}
    assert sorted(samples) == ["0", "1", "2", "3"]
    assert samples["0"].health == "OK" and samples["0"].pods == ["qwen3-8b-decode-0"]
    assert samples["1"].error_codes == ["0x80E01801", "0x81078603"]
    assert samples["1"].ecc_single_bit_total == 1840 and samples["1"].health != "OK"
    assert samples["2"].temperature_c == 101 and samples["2"].error_codes == ["0x80E3A602"]
    assert samples["3"].link_status == "DOWN" and samples["0"].link_status == "UP"
    assert samples["0"].device_model == "Ascend 910B4" and samples["0"].memory_total_mb == 32768


def test_dcgm_metrics():
    samples = {s.device: s for s in parse_dcgm((FIX / "dcgm-exporter.prom").read_text(), "gpu-node-7", 5.0)}
    assert sorted(samples) == ["0", "1", "2", "3"]
    g0 = samples["0"]
    assert (g0.device_model, g0.driver, g0.temperature_c, g0.power_w) == ("H100", "550.127.05", 41, 402.871)
    assert g0.memory_used_mb == 73085 and g0.memory_total_mb == 73085 + 7634 and g0.pods == ["llama-70b-0"]
    assert samples["2"].ecc_single_bit_total == 312  # counter declared without _total
    # the last-Xid gauge is a value, not "new events": the health fold turns a change into an event
    assert samples["3"].xid_last == 79 and samples["0"].xid_last == 0
    assert samples["3"].xid_errors == [] and samples["0"].xid_errors == []
    assert samples["3"].ecc_double_bit_total == 2


def test_vllm_metrics_snapshot():
    [snap] = parse_vllm_metrics((FIX / "vllm-metrics.prom").read_text(), "pod-1", 9.0)
    assert (snap.model, snap.engine, snap.num_requests_running, snap.num_requests_waiting) == (
        "Qwen/Qwen3-8B", "0", 7, 3)
    assert snap.kv_cache_usage_perc == pytest.approx(0.4127)
    assert snap.prefix_cache_hits_total == 90112 and snap.prefix_cache_queries_total == 182736
    assert (snap.block_size, snap.num_gpu_blocks) == (16, 27417)
    ttft = snap.time_to_first_token_seconds
    assert ttft.count == 206 and ttft.sum == pytest.approx(21.73) and ttft.buckets["0.1"] == 151
    assert ttft.buckets["+Inf"] == 206
    assert snap.request_queue_time_seconds.buckets["0.3"] == 190


@pytest.mark.parametrize("fn", [parse_npu_exporter, parse_dcgm, parse_npu_smi])
def test_wrong_format_is_a_clear_error(fn):
    with pytest.raises(ParseError):
        fn("hello world\n", "n", 1.0)
    with pytest.raises(ParseError):
        fn((FIX / "vllm-metrics.prom").read_text(), "n", 1.0)


def test_metrics_parser_rejects_non_vllm_text():
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics((FIX / "dcgm-exporter.prom").read_text(), "p", 1.0)
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics("{{{ not prometheus", "p", 1.0)
