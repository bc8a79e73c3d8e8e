"""Dashboards (dashboards/*.json) and alert rules: generated files are current, the JSON is well
formed for Grafana, and every PromQL expression passes ``promtool check rules``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from deploytools import (
    DASHBOARDS,
    EXAMPLE_VALUES,
    dashboard_promql,
    dashboard_files,
    grafana_to_promql,
    metric_names,
    promtool_binary,
    render,
)

ISSUE_DASHBOARDS = {"infernex-router", "infernex-engines", "infernex-kv-index", "infernex-devices", "infernex-sla"}


def _dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in dashboard_files()}


def test_generated_dashboards_are_current():
    proc = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_json_shape():
    boards = _dashboards()
    assert set(boards) == ISSUE_DASHBOARDS
    uids = [b["uid"] for b in boards.values()]
    assert len(set(uids)) == len(uids)
    for name, b in boards.items():
        assert b["uid"] == name and b["title"].startswith("InferNex / ")
        variables = {v["name"]: v for v in b["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        ids = [p["id"] for p in b["panels"]]
        assert len(set(ids)) == len(ids)
        cells = set()
        for p in b["panels"]:
            assert p["targets"], f"{name}: panel {p['title']} has no query"
            assert p["datasource"]["uid"] == "${datasource}"
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{name}: panel {p['title']} overlaps another"
                    cells.add((x, y))
            # Variables used in queries are defined on the dashboard.
            for t in p["targets"]:
                for var in re.findall(r"\$(\w+)", t["expr"]):
                    assert var.startswith("__") or var in variables, f"{name}: ${var} undefined"


def test_issue_topics_are_on_the_dashboards():
    """Each dashboard shows what issue 10 lists for it."""
    text = {k: json.dumps(v) for k, v in _dashboards().items()}
    wanted = {
        "infernex-router": ["infernex_router_requests_total", "0.99", "0.88", "strategy", "error"],
        "infernex-engines": ["vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total"],
        "infernex-kv-index": ["lag", "dead_letters", "snapshot_age"],
        "infernex-devices": ["temperature", "power", "hbm", "ecc", "infernex_diagnosis_open_findings"],
        "infernex-sla": ["time_to_first_token", "inter_token_latency", "infernex_desired_replicas", "target"],
    }
    for board, needles in wanted.items():
        for needle in needles:
            assert needle.lower() in text[board].lower(), f"{board} lacks {needle}"


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~".*"}[1m])))') == {"vllm:time_to_first_token_seconds_bucket"}
    assert metric_names('sum(rate(a_total{code=~"5.."}[5m])) / sum(rate(a_total[5m])) > 0.01') == {"a_total"}
    assert metric_names("npu_chip_info_hbm_used_memory / npu_chip_info_hbm_total_memory") == {
        "npu_chip_info_hbm_used_memory", "npu_chip_info_hbm_total_memory"}
    assert metric_names('up{namespace="x"} == 0 and on (job) foo offset 5m') == {"up", "foo"}
    assert grafana_to_promql('rate(x{pod=~"$pod"}[$__rate_interval])') == 'rate(x{pod=~".*"}[1m])'


def _rule_files(tmp_path) -> dict:
    """One rule file per example values file (its rendered PrometheusRule) and one with every
    dashboard query as a recording rule; returns path -> number of rules."""
    files = {}
    for values in EXAMPLE_VALUES:
        groups = [g for doc in render(values) if doc["kind"] == "PrometheusRule" for g in doc["spec"]["groups"]]
        path = tmp_path / f"alerts-{values}"
        path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        files[path] = sum(len(g["rules"]) for g in groups)
    rules = []
    for board, b in _dashboards().items():
        for i, (title, expr) in enumerate(dashboard_promql(b)):
            rules.append({"record": f"infernex_dashboard_check:{board.replace('-', '_')}_{i}",
                          "expr": expr, "labels": {"panel": title}})
    path = tmp_path / "dashboards.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, sort_keys=False))
    files[path] = len(rules)
    return files


def test_promtool_checks_every_expression(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    files = _rule_files(tmp_path)
    assert sum(files.values()) > 60
    proc = subprocess.run([promtool, "check", "rules", *map(str, files)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path, n in files.items():
        assert f"Checking {path}\n  SUCCESS: {n} rules found" in proc.stdout, proc.stdout + proc.stderr


def test_promtool_rejects_a_broken_expression(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"record": "x:y", "expr": "sum by (le (rate(foo[5m]))"}]}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def test_alerts_cover_seed_001_and_health():
    docs = render("values-pd-2p2d.yaml")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for name in ("InferNexHighLatencyP88", "InferNexHighLatencyP99", "InferNexHighErrorRate",
                 "InferNexLowCacheHitRate", "InferNexLowNPUUtilisation", "InferNexCriticalDiagnosisOpen",
                 "InferNexKVEventLag"):
        assert name in alerts
    assert "histogram_quantile(0.88" in alerts["InferNexHighLatencyP88"]["expr"]
    # Thresholds come from values (the PD example tightens the latency targets).
    assert alerts["InferNexHighLatencyP88"]["expr"].strip().endswith("> 0.2")
    assert alerts["InferNexHighLatencyP99"]["expr"].strip().endswith("> 1")
    assert 'severity="critical"' in alerts["InferNexCriticalDiagnosisOpen"]["expr"]
    for r in alerts.values():
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
