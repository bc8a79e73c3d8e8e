"""Rule files: built-in data, layering per model, user files merged over it, clear errors."""

from __future__ import annotations

import pytest
import yaml

from streams.diagnosis.rules import (
    BUILTIN_CATALOG, RulesError, Threshold, build_ruleset, load_ruleset, normalize_code,
)


def test_builtin_rules_and_catalog_load():
    rs = load_ruleset()
    assert rs.timing.hold_s > 0 and rs.timing.stale_after_s > 0
    assert len(rs.catalog.code_levels) > 300  # faultCode.json levels


@pytest.mark.parametrize("code,mode,level", [
    ("0x80E01801", "hbm_multi_bit_ecc", "RestartBusiness"),
    ("0x80E18402", "hbm_isolated_rows_limit", "SeparateNPU"),
    ("0x80CB800A", "aiv_operator_timeout", "RestartRequest"),
    ("81078603", "parameter_plane_network_fault", "NotHandle"),
    ("0x28000049", "hccs_link_degradation", "SubHealth"),
])
def test_issue_codes_are_catalogued_with_level_and_source(code, mode, level):
    entry = load_ruleset().catalog.lookup_code(code)
    assert (entry.fault_mode, entry.level) == (mode, level)
    assert entry.meaning and entry.source


def test_every_catalog_source_is_described_in_the_file():
    text = BUILTIN_CATALOG.read_text()
    data = yaml.safe_load(text)
    sources = {s for e in data["error_codes"].values() for s in e["source"]}
    for s in sources:
        assert f"#   {s}:" in text, s


@pytest.mark.parametrize("xid,level", [(48, "ResetGPU"), (63, "ResetGPU"), (64, "ResetGPU"), (79, "DrainNode"),
                                       (46, "ResetGPU")])
def test_xids(xid, level):
    assert load_ruleset().catalog.lookup_xid(xid).level == level


def test_codes_normalise():
    assert normalize_code("0x80e01801") == normalize_code("80E01801") == "80E01801"
    assert normalize_code(80818200) == "80818200"
    with pytest.raises(ValueError):
        normalize_code("0xZZ")


def test_layering_defaults_kind_glob_exact():
    rs = load_ruleset()
    b4 = rs.for_device("npu", "Ascend 910B4")
    b3 = rs.for_device("npu", "ascend 910b3")  # glob, case-insensitive
    other = rs.for_device("npu", "Ascend 999")
    h100 = rs.for_device("gpu", "H100 80GB HBM3")
    assert b4.thresholds["power_w"].warning == 330 and b3.thresholds["power_w"].warning == 380
    assert b4.thresholds["temperature_c"].critical == 95  # from the glob layer
    assert other.thresholds["power_w"].warning is None
    assert h100.ecc_double_bit.action == "ResetGPU" and b4.ecc_double_bit.action == "RestartBusiness"
    assert h100.thresholds["temperature_c"].action_critical == "DrainNode"


def test_user_file_merges_over_builtin(tmp_path):
    f = tmp_path / "site.yaml"
    f.write_text(yaml.safe_dump({
        "timing": {"hold_s": 30},
        "models": {"Ascend 910B4": {"thresholds": {"temperature_c": {"warning": 80}}}},
        "error_codes": {"0x80E01801": {"fault_mode": "uce", "level": "SeparateNPU"}},
        "xids": {"79": {"fault_mode": "gone", "level": "DrainNode", "clear_after_s": 10}},
    }))
    rs = load_ruleset([f])
    assert rs.timing.hold_s == 30 and rs.timing.stale_after_s == 15  # other keys kept
    t = rs.for_device("npu", "Ascend 910B4").thresholds["temperature_c"]
    assert (t.warning, t.critical, t.clear_margin) == (80, 95, 5)
    assert rs.catalog.lookup_code("80e01801").level == "SeparateNPU"
    assert rs.catalog.lookup_xid(79).fault_mode == "gone"
    assert rs.catalog.lookup_code("0x80E18402").level == "SeparateNPU"  # built-in entries stay


@pytest.mark.parametrize("content,words", [
    ({"defaults": {"thresholds": {"temprature_c": {"warning": 1}}}}, "temprature_c"),
    ({"defaults": {"link_down": {"action": "Reboot"}}}, "action"),
    ({"models": {"X*": {"thresholds": {"power_w": {"warning": 10, "critical": 5}}}}}, "below warning"),
    ({"timing": {"hold_s": -1}}, "hold_s"),
    ({"error_codes": {"0x80E01801": {"fault_mode": "x", "level": "Nope"}}}, "level"),
])
def test_invalid_user_rules_are_clear_errors(tmp_path, content, words):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(content))
    with pytest.raises(RulesError) as exc:
        load_ruleset([f])
    assert words in str(exc.value) and "bad.yaml" in str(exc.value)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(RulesError, match="does not exist"):
        load_ruleset([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(RulesError, match="not valid YAML"):
        load_ruleset([bad])


@pytest.mark.parametrize("prev,value,want", [
    (0, 84.9, 0), (0, 85, 1), (1, 81, 1), (1, 80, 0), (0, 95, 2), (2, 91, 2), (2, 90, 1), (2, 70, 0),
])
def test_threshold_hysteresis(prev, value, want):
    th = Threshold(warning=85, critical=95, clear_margin=5)
    assert th.level(prev, value) == want


def test_build_ruleset_with_catalog_section():
    rs = build_ruleset({"catalog": {"unknown_code_level": "SeparateNPU"}})
    assert rs.catalog.lookup_code("DEADBEEF").level == "SeparateNPU"


def test_settings_section_from_environment(monkeypatch, tmp_path):
    from infernex.settings import load_settings

    monkeypatch.setenv("INFERNEX_DIAGNOSIS__RULES_FILES", f"{tmp_path}/a.yaml, {tmp_path}/b.yaml")
    monkeypatch.setenv("INFERNEX_DIAGNOSIS__DURABLE", "diag-2")
    cfg = load_settings().diagnosis
    assert [p.name for p in cfg.rules_files] == ["a.yaml", "b.yaml"] and cfg.durable == "diag-2"
    monkeypatch.setenv("INFERNEX_DIAGNOSIS__DURABLE", "bad name")
    with pytest.raises(ValueError):
        load_settings()
