"""The ClickHouse SLA dashboard (dashboards/clickhouse/): current with its generator, shaped as the
Grafana ClickHouse datasource plugin reads targets, and every query runs on chDB (with the plugin's
macros and the dashboard variables expanded as Grafana would) and returns the expected figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumers import sla_queries as Q
from consumers.sla_store import ChdbStore

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "dashboards" / "clickhouse" / "infernex-sla-stages.json"


def test_generated_file_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "dashboards" / "clickhouse_sla.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_targets_follow_the_plugin_json_model():
    b = json.loads(BOARD.read_text())
    variables = {v["name"] for v in b["templating"]["list"]}
    assert {"datasource", "database", "pool", "ttft_target", "itl_target"} <= variables
    for p in b["panels"]:
        assert p["datasource"] == {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["editorType"] == "sql" and t["format"] in (0, 1) and t["rawSql"]
            assert t["queryType"] == ("table" if t["format"] == 1 else "timeseries")
            for var in re.findall(r"\$\{(\w+)(?::\w+)?\}", t["rawSql"]):
                assert var in variables, var


def expand(sql: str, since: float, until: float) -> str:
    """What Grafana and the plugin make of the macros and variables (pool 'pool-a', 60 s interval),
    in the plugin's documented forms: ``$__timeFilter_ms`` in milliseconds (DateTime64),
    ``$__timeFilter`` in seconds (DateTime)."""
    ms = lambda t: int(t * 1000)  # noqa: E731
    sql = re.sub(r"\$__timeFilter_ms\((\w+)\)",
                 lambda m: f"{m.group(1)} >= fromUnixTimestamp64Milli({ms(since)}) AND "
                           f"{m.group(1)} <= fromUnixTimestamp64Milli({ms(until)})", sql)
    sql = re.sub(r"\$__timeFilter\((\w+)\)",
                 lambda m: f"{m.group(1)} >= toDateTime({int(since)}) AND {m.group(1)} <= toDateTime({int(until)})", sql)
    sql = re.sub(r"\$__timeInterval\((\w+)\)", lambda m: f"toStartOfInterval({m.group(1)}, INTERVAL 60 second)", sql)
    return (sql.replace("${database}", "infernex").replace("${pool:singlequote}", "'pool-a'")
            .replace("${ttft_target}", "1.0").replace("${itl_target}", "0.05"))


def test_datetime64_columns_are_filtered_in_milliseconds():
    """Every time filter is ``$__timeFilter_ms``: the SLA tables' time columns are DateTime64, and a
    seconds (DateTime) bound on them skips rows on ClickHouse 26.9 (tests/test_sla_store.py)."""
    b = json.loads(BOARD.read_text())
    sqls = [t["rawSql"] for p in b["panels"] for t in p["targets"]]
    assert all("$__timeFilter_ms(" in q for q in sqls)
    assert not any(re.search(r"\$__timeFilter\(", q) for q in sqls)


@pytest.fixture
def store(tmp_path):
    s = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(s)
    now = float(int(time.time()))
    minute = (now - 300) // 60 * 60  # every record inside one minute: per-minute panels see all three stages
    rows = []
    for i in range(60):
        stage = ("pd", "decode", "aggregated")[i % 3]
        rows.append(json.dumps({
            "request_id": f"r{i}", "ts": minute + i * 0.5, "pool": "pool-a", "role": "aggregated" if stage == "aggregated"
            else "pd", "model": "m", "served_stage": stage, "prompt_tokens": 1000, "output_tokens": 11,
            "ttft_s": 0.6, "prefill_ttft_s": 0.4 if stage == "pd" else None,
            "kv_transfer_s": 0.05 if stage == "pd" else None, "tpot_s": 0.08 if stage == "aggregated" else 0.03,
            "e2e_s": 1.0, "status": "ok"}).encode())
    s.insert_json_each_row("request_records", rows)
    s.insert_json_each_row("scaling_hints", [json.dumps({
        "pool": "pool-a", "role": r, "ts": now - 100, "current": 1, "desired": d, "reason": "", "predictor": "x",
        "mode": "stable", "inputs": "{}"}).encode() for r, d in (("prefill", 3), ("decode", 1))])
    yield s, now
    s.close()


def test_every_query_runs_and_reads_the_stages(store):
    s, now = store
    b = json.loads(BOARD.read_text())
    results = {}
    for p in b["panels"]:
        for t in p["targets"]:
            results[p["title"]] = s.rows(expand(t["rawSql"], now - 3600, now + 60))
    summary = {r["stage"]: r for r in results["Per-stage summary"]}
    assert set(summary) == {"pd", "decode", "aggregated"} and summary["pd"]["requests"] == 20
    assert summary["pd"]["prefill_ttft_p90"] == pytest.approx(0.4)
    assert summary["pd"]["kv_transfer_p90"] == pytest.approx(0.05)
    assert summary["aggregated"]["attainment"] == 0.0 and summary["decode"]["attainment"] == 1.0
    tpot = results["TPOT p90 by serving stage"]
    assert tpot and all(r["aggregated"] == pytest.approx(0.08) and r["pd"] == pytest.approx(0.03) for r in tpot)
    att = results["SLA attainment by serving stage (TTFT and TPOT within target)"]
    assert sum(1 for r in att if r["aggregated"] == 0.0) == len(att)
    replicas = results["Replicas per role: planner desired vs current"]
    assert replicas[0]["prefill_desired"] == 3 and replicas[0]["decode_current"] == 1
    assert results["KV transfer p50 / p90 (PD)"][0]["p90"] == pytest.approx(0.05)
