"""``infernex diagnose check`` / ``explain``: rule files validated with clear errors, codes explained."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infernex.cli import app

runner = CliRunner()


def test_explain_ascend_code_and_xid():
    res = runner.invoke(app, ["diagnose", "explain", "0x80e18402"])
    assert res.exit_code == 0, res.output
    assert "hbm_isolated_rows_limit" in res.output and "SeparateNPU" in res.output
    res = runner.invoke(app, ["diagnose", "explain", "xid:79"])
    assert res.exit_code == 0 and "DrainNode" in res.output and "nvidia-xid" in res.output
    res = runner.invoke(app, ["diagnose", "explain", "xid:abc"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["diagnose", "explain", "0xZZ"])
    assert res.exit_code == 2 and "hexadecimal" in res.output


def test_check_prints_effective_rules_and_rejects_bad_files(tmp_path):
    good = tmp_path / "site.yaml"
    good.write_text("models:\n  'Ascend 910B4':\n    thresholds:\n      temperature_c: {warning: 70}\n")
    res = runner.invoke(app, ["diagnose", "check", str(good), "--model", "Ascend 910B4"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output[res.output.index("{"):])
    assert body["thresholds"]["temperature_c"]["warning"] == 70
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {link_down: {for_s: -3}}\n")
    res = runner.invoke(app, ["diagnose", "check", str(bad)])
    assert res.exit_code == 2 and "for_s" in res.output
