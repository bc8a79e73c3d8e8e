"""Device readings as the exporters define them, on the exporters' own output samples
(``tests/fixtures/devices/``, sources in its README), in the orders they emit them."""

from __future__ import annotations

import random
import re
import typing
from pathlib import Path

import pytest

from test_diagnosis_helpers import GPU, sample
from consumers.parsers import parse_dcgm, parse_npu_exporter, parse_npu_smi
from consumers.parsers.npu_smi import chip_ids_from_exporter
from schemas.diagnosis import ActionLevel
from simulator.devices import SimulatedNode, render_dcgm, render_npu_exporter
from streams.clock import ManualClock
from streams.diagnosis import DiagnosisEngine, build_ruleset
from streams.diagnosis.rules import version_key

FIX = Path(__file__).parent / "fixtures" / "devices"
T0 = 1_700_000_000.0


def families(text: str) -> tuple[list[str], list[list[str]]]:
    """Prometheus text split into its leading lines and one block (HELP, TYPE, samples) per family."""
    head: list[str] = []
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("# HELP"):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
        else:
            head.append(line)
    return head, blocks


def reorder(text: str, key) -> str:
    head, blocks = families(text)
    return "\n".join(head + [ln for b in sorted(blocks, key=key) for ln in b]) + "\n"


# ----------------------------------------------------------------------------- npu-exporter
def test_npu_exporter_testdata_of_mindcluster():
    chips = parse_npu_exporter((FIX / "npu-exporter-mindcluster-testdata.prom").read_text(), "n1", 1.0)
    assert [c.device for c in chips] == [str(i) for i in range(8)]
    c = chips[0]
    assert c.device_model == "Ascend 910Awn"  # model_name "910Awn-Ascend-V1": <name>-<type>-<version>
    assert c.health == "OK" and c.link_status == "DOWN" and c.error_codes == []
    # the sample reports 0 MB of HBM and of DDR: no memory reading, not "0 of 0"
    assert c.memory_used_mb is None and c.memory_total_mb is None and c.pods == []


@pytest.mark.parametrize("order", ["name-first", "reversed", "shuffled-1", "shuffled-2"])
def test_npu_exporter_parsing_does_not_depend_on_family_order(order):
    text = (FIX / "npu-exporter-mindcluster-testdata.prom").read_text()
    if order == "name-first":
        other = reorder(text, lambda b: (not b[0].startswith("# HELP npu_chip_info_name "), b[0]))
    elif order == "reversed":
        other = reorder(text, lambda b: tuple(-ord(ch) for ch in b[0]))
    else:
        rng = random.Random(order)
        keys = {}
        other = reorder(text, lambda b: keys.setdefault(b[0], rng.random()))
    assert other != text
    assert parse_npu_exporter(other, "n1", 1.0) == parse_npu_exporter(text, "n1", 1.0)


def test_npu_exporter_model_from_the_name_series_alone():
    # only npu_chip_info_name carries the model (label "name"), and it comes first
    text = (FIX / "npu-exporter-mindcluster-testdata.prom").read_text()
    text = re.sub(r'model_name="[^"]*"', 'model_name=""', text)
    text = reorder(text, lambda b: (not b[0].startswith("# HELP npu_chip_info_name "), b[0]))
    assert {c.device_model for c in parse_npu_exporter(text, "n1", 1.0)} == {"Ascend 910Awn"}


def test_npu_exporter_310p_ddr_memory():
    # the testdata's DDR series (npu_chip_info_total_memory / used_memory, what 310P reports
    # instead of HBM) with readings put in: they are the memory when there is no HBM
    text = (FIX / "npu-exporter-mindcluster-testdata.prom").read_text()
    text = re.sub(r'^(npu_chip_info_total_memory\{[^}]*\}) 0', r"\1 21534", text, flags=re.M)
    text = re.sub(r'^(npu_chip_info_used_memory\{[^}]*\}) 0', r"\1 1081", text, flags=re.M)
    text = text.replace("910Awn-Ascend-V1", "310P3-Ascend-V1")
    c = parse_npu_exporter(text, "edge-1", 1.0)[3]
    assert (c.device_model, c.memory_used_mb, c.memory_total_mb) == ("Ascend 310P3", 1081, 21534)
    # and the simulator's 310P writes the DDR series, read back the same way
    node = SimulatedNode("edge-1", 2, "npu", device_model="Ascend 310P3", seed=2)
    s = node.sample(30)
    back = parse_npu_exporter(render_npu_exporter(s), "edge-1", 30)
    assert "hbm" not in render_npu_exporter(s)
    assert [(b.memory_used_mb, b.memory_total_mb) for b in back] == [(x.memory_used_mb, 21534) for x in s]
    assert back[0].device_model == "Ascend 310P3"


def test_npu_exporter_health_query_failed_is_unknown_and_multi_pod_is_no_pod():
    text = (FIX / "npu-exporter-mindcluster-testdata.prom").read_text()
    text = re.sub(r'^(npu_chip_info_health_status\{[^}]*id="1"[^}]*\}) 1', r"\1 -1", text, flags=re.M)
    text = text.replace('id="2",model_name="910Awn-Ascend-V1",namespace="",pcie_bus_info="",pod_name=""',
                        'id="2",model_name="910Awn-Ascend-V1",namespace="",pcie_bus_info="",'
                        'pod_name="not_displayed_for_multi_pod"')
    chips = parse_npu_exporter(text, "n1", 1.0)
    assert chips[1].health == "UNKNOWN" and chips[2].pods == []


# ----------------------------------------------------------------------------- one device identity
A3_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc3                 Version: 24.1.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU     Name              | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip    Phy-ID            | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0       Ascend910         | OK            | 173.7       37                0    / 0             |
| 0       0                 | 0000:9D:00.0  | 3           0    / 0          3162 / 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 0       Ascend910         | OK            | -           36                0    / 0             |
| 1       1                 | 0000:9F:00.0  | 0           0    / 0          2893 / 65536         |
+===========================+===============+====================================================+
| 1       Ascend910         | OK            | 170.2       38                0    / 0             |
| 0       2                 | 0000:99:00.0  | 5           0    / 0          3160 / 65536         |
+---------------------------+---------------+----------------------------------------------------+
| 1       Ascend910         | OK            | -           37                0    / 0             |
| 1       3                 | 0000:9B:00.0  | 0           0    / 0          2890 / 65536         |
+===========================+===============+====================================================+
"""


def test_one_identity_across_npu_smi_and_npu_exporter_a2_and_a3():
    # A2 (910B, one chip per NPU): npu-smi's NPU id is the exporter's chip id
    a2 = parse_npu_smi((Path(__file__).parent / "fixtures" / "npu-smi-info-910b4.txt").read_text(), "n", 1.0)
    assert [t.device for t in a2] == [str(i) for i in range(8)]
    # A3 (two chips per NPU): the Phy-ID column names the chip as the exporter does
    a3 = parse_npu_smi(A3_SMI, "n", 1.0)
    assert [t.device for t in a3] == ["0", "1", "2", "3"]
    assert a3[1].device_model == "Ascend910" and a3[1].bus_id == "0000:9F:00.0"
    # an A3 table without Phy-ID: "<npu>-<chip>", or the exporter's id joined by PCIe bus id
    no_phy = A3_SMI.replace("Chip    Phy-ID  ", "Chip            ")
    assert [t.device for t in parse_npu_smi(no_phy, "n", 1.0)] == ["0-0", "0-1", "1-0", "1-1"]
    node = SimulatedNode("n", 4, "npu", seed=1)
    samples = [s.model_copy(update={"bus_id": b}) for s, b in
               zip(node.sample(1.0), ["0000:9D:00.0", "0000:9F:00.0", "0000:99:00.0", "0000:9B:00.0"])]
    ids = chip_ids_from_exporter(render_npu_exporter(samples))
    assert ids == {"0000:9D:00.0": "0", "0000:9F:00.0": "1", "0000:99:00.0": "2", "0000:9B:00.0": "3"}
    assert [t.device for t in parse_npu_smi(no_phy, "n", 1.0, chip_ids=ids)] == ["0", "1", "2", "3"]


# ----------------------------------------------------------------------------- dcgm-exporter
def test_dcgm_readme_sample_blank_values_are_no_reading():
    [g] = parse_dcgm((FIX / "dcgm-exporter-readme.prom").read_text(), "n", 1.0)
    assert g.device == "0" and g.temperature_c is None and g.xid_last is None and g.ecc_double_bit_total is None


def test_dcgm_default_counters_sample():
    text = (FIX / "dcgm-exporter-default-counters.prom").read_text()
    gpus = {g.device: g for g in parse_dcgm(text, "gpu-node-7", 1.0)}
    assert sorted(gpus) == ["0", "1", "2"]
    g0, g1, g2 = gpus["0"], gpus["1"], gpus["2"]
    assert (g0.device_model, g0.driver, g0.pods, g0.bus_id) == ("H100", "550.127.05", ["llama-70b-0"],
                                                                "00000000:18:00.0")
    # ECC counters are commented out in the default counters: unknown, not zero
    assert all(g.ecc_single_bit_total is None and g.ecc_double_bit_total is None for g in gpus.values())
    assert (g1.xid_last, g0.xid_last) == (79, 0) and g1.xid_errors == []
    assert (g2.remapped_rows_uncorrectable, g2.remapped_rows_correctable, g2.row_remap_failure) == (3, 12, True)
    assert g0.memory_total_mb == 71234 + 9563 + 630  # used + free + reserved
    rng = random.Random(3)
    keys = {}
    assert parse_dcgm(reorder(text, lambda b: keys.setdefault(b[0], rng.random())), "gpu-node-7", 1.0) == \
        list(gpus.values())


def _engine():
    clock = ManualClock(T0)
    return DiagnosisEngine(build_ruleset(), clock), clock


def _feed(engine, clock, values: list[dict], start: float = T0) -> list:
    out = []
    for i, kw in enumerate(values):
        clock.set(start + i)
        out += engine.observe(sample(start + i, base=GPU, health=None, **kw))
    return out


def test_xid_last_value_gauge_change_is_an_event_and_zero_clears():
    engine, clock = _engine()
    # 0, then 79 for a long time (dcgm keeps the last value): one finding, resolved once
    # clear_after_s (3600 s for Xid 79) passed without a change, not held forever
    out = _feed(engine, clock, [{"xid_last": 0}] * 5 + [{"xid_last": 79}] * 3700)
    assert [(d.status, d.fault_mode) for d in out if d.status != "updated"] == [
        ("open", "xid_79"), ("resolved", "xid_79")]
    assert out[-1].evidence["clear_since"] == T0 + 5 + 3600
    # a new value is a new event; back to 0 (GPU reset) clears it after hold_s, long before clear_after_s
    engine, clock = _engine()
    out = _feed(engine, clock, [{"xid_last": 48}] * 10 + [{"xid_last": 0}] * 30)
    assert [(d.status, d.fault_mode) for d in out if d.status != "updated"] == [
        ("open", "xid_48"), ("resolved", "xid_48")]
    assert out[-1].evidence["resolved_at"] == T0 + 10 + 15
    # 48 then 79: two events
    engine, clock = _engine()
    out = _feed(engine, clock, [{"xid_last": 48}] * 5 + [{"xid_last": 79}] * 5)
    assert [d.fault_mode for d in out if d.status == "open"] == ["xid_48", "xid_79"]


def test_memory_rules_without_ecc_counters():
    engine, clock = _engine()
    rows = [{"remapped_rows_uncorrectable": 0, "row_remap_failure": False}] * 5 + \
           [{"remapped_rows_uncorrectable": 2, "row_remap_failure": False}] * 5 + \
           [{"remapped_rows_uncorrectable": 2, "row_remap_failure": True}] * 5
    out = _feed(engine, clock, rows)
    opened = {d.fault_mode: d for d in out if d.status == "open"}
    assert set(opened) == {"gpu_rows_remapped_uncorrectable", "gpu_row_remap_failure"}
    assert opened["gpu_rows_remapped_uncorrectable"].action == "ResetGPU"
    assert opened["gpu_row_remap_failure"].severity == "critical" and opened["gpu_row_remap_failure"].remediation
    # and from the exporter's own sample: GPU 2 reports a failed remapping
    engine, clock = _engine()
    found = []
    for g in parse_dcgm((FIX / "dcgm-exporter-default-counters.prom").read_text(), "gpu-node-7", T0):
        found += engine.observe(g)
    assert {(d.device, d.fault_mode) for d in found} == {("1", "xid_79"), ("2", "gpu_row_remap_failure")}


def test_simulated_gpu_speaks_dcgm_semantics_end_to_end():
    node = SimulatedNode("g", 2, "gpu", seed=1)
    node.inject(1, "xid", 10, 20, xid=79, reset=True)  # the GPU is reset when the fault ends
    engine, clock = _engine()
    modes = []
    for t in range(0, 60):
        clock.set(T0 + t)
        for s in parse_dcgm(render_dcgm(node.sample(t)), "g", T0 + t):
            modes += [(t, d.status, d.fault_mode) for d in engine.observe(s) if d.status != "updated"]
    assert modes == [(10, "open", "xid_79"), (30 + 15, "resolved", "xid_79")]


# ----------------------------------------------------------------------------- driver / firmware
def test_driver_and_firmware_feed_a_rule():
    assert version_key("24.1.rc2") < version_key("24.1.0") < version_key("24.1.1") < version_key("550.127.05")
    engine, clock = _engine()
    out = _feed(engine, clock, [{"driver": "520.61.05"}])
    [d] = [d for d in out if d.fault_mode == "driver_outdated"]
    assert d.severity == "warning" and "525.60.13" in d.summary and d.remediation
    engine, clock = _engine()
    assert not [d for d in _feed(engine, clock, [{"driver": "550.127.05"}]) if d.fault_mode.endswith("_outdated")]
    # npu-smi's version line is the Ascend driver; a rules file sets firmware minimums too
    text = (Path(__file__).parent / "fixtures" / "npu-smi-info-910b4.txt").read_text().replace("24.1.rc2", "22.0.rc3")
    rules = build_ruleset({"models": {"Ascend 910B*": {"versions": {"min_firmware": "7.1.0"}}}})
    engine = DiagnosisEngine(rules, ManualClock(T0))
    t = parse_npu_smi(text, "n", T0)[0].model_copy(update={"firmware": "7.0.0.5.242"})
    modes = {d.fault_mode for d in engine.observe(t)}
    assert {"driver_outdated", "firmware_outdated"} <= modes


# ----------------------------------------------------------------------------- remediation
def test_every_catalog_level_and_code_has_remediation():
    cat = build_ruleset().catalog
    levels = typing.get_args(ActionLevel)
    assert set(levels) <= set(cat.level_remediation), set(levels) - set(cat.level_remediation)
    assert all(cat.level_remediation[lv].strip() for lv in levels)
    codes = set(cat.code_levels) | set(cat.error_codes)
    assert len(codes) > 300
    missing = [c for c in codes if not cat.lookup_code(c).remediation.strip()]
    assert missing == []
    assert cat.lookup_code("0xDEADBEEF").remediation  # unknown code: its (default) level's text
    assert all(cat.lookup_xid(x).remediation.strip() for x in list(cat.xids) + [999])


async def test_collector_names_npu_smi_chips_by_the_exporters_ids(tmp_path):
    from consumers.device_collector import make_reader

    node = SimulatedNode("n", 4, "npu", seed=1)
    buses = ["0000:9D:00.0", "0000:9F:00.0", "0000:99:00.0", "0000:9B:00.0"]
    samples = [s.model_copy(update={"bus_id": b}) for s, b in zip(node.sample(1.0), buses)]
    (tmp_path / "exporter.prom").write_text(render_npu_exporter(samples))
    (tmp_path / "npu-smi.txt").write_text(A3_SMI.replace("Chip    Phy-ID  ", "Chip            "))
    read = make_reader("npu-smi", "n", str(tmp_path / "npu-smi.txt"), chip_ids_from=str(tmp_path / "exporter.prom"))
    assert [t.device for t in await read()] == ["0", "1", "2", "3"]
    read = make_reader("npu-smi", "n", str(tmp_path / "npu-smi.txt"))
    assert [t.device for t in await read()] == ["0-0", "0-1", "1-0", "1-1"]


def test_model_specific_rules_apply_to_what_the_exporter_reports():
    # the simulator writes the model as the exporter does (910B4-Ascend-V1, npu_chip_info_name first
    # among others in any order); parsed back it selects the 910B4 power limits (warning 330 W)
    node = SimulatedNode("n", 1, "npu", device_model="Ascend 910B4", seed=1)
    node.inject(0, "power_spike", 0, power_w=350)
    text = render_npu_exporter(node.sample(5))
    assert 'model_name="910B4-Ascend-V1"' in text
    text = reorder(text, lambda b: (not b[0].startswith("# HELP npu_chip_info_name "), b[0]))
    [t] = parse_npu_exporter(text, "n", T0)
    assert t.device_model == "Ascend 910B4"
    engine = DiagnosisEngine(build_ruleset(), ManualClock(T0))
    [d] = [d for d in engine.observe(t) if d.fault_mode == "over_power"]
    assert d.severity == "warning" and "330" in d.summary
