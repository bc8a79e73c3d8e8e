"""Writes ``dashboards/clickhouse/infernex-sla-stages.json``: SLA per serving stage and the
planner's replicas, read straight from the SLA history in ClickHouse through Grafana's ClickHouse
datasource plugin (``grafana-clickhouse-datasource``: targets with ``editorType: sql``,
``rawSql``, ``format`` 0 = time series / 1 = table, and the plugin's ``$__timeFilter_ms`` /
``$__timeInterval`` macros). The time columns are ``DateTime64``, so the filter is the ``_ms`` one:
``$__timeFilter`` bounds them with ``DateTime`` seconds, which ClickHouse 26.9 mis-prunes (rows of a
part that starts in the last second before the bound are skipped; consumers/sla_queries.py).

Run ``python dashboards/clickhouse_sla.py`` after editing; ``--check`` fails when the JSON is stale.
tests/test_dashboards_clickhouse.py runs every query against chDB with the macros expanded.
Kept apart from the Prometheus dashboards (``dashboards/*.json``): it needs the ClickHouse plugin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "clickhouse" / "infernex-sla-stages.json"
DS = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
TS, TABLE = 0, 1
DB = "${database}"
POOL = "pool IN (${pool:singlequote})"
WHERE = f"$__timeFilter_ms(ts) AND {POOL}"


def target(sql: str, fmt: int = TS, ref: str = "A") -> dict:
    return {"refId": ref, "datasource": DS, "editorType": "sql", "format": fmt,
            "queryType": "timeseries" if fmt == TS else "table", "rawSql": " ".join(sql.split())}


def per_stage(expr: str, col: str) -> str:
    """One column per served stage of ``quantileIf`` / ``avgIf`` style ``expr`` (``{c}`` = condition)."""
    cols = ", ".join(f"{expr.format(v=col, c=f'served_stage = {s!r}')} AS {s}" for s in ("pd", "decode", "aggregated"))
    return (f"SELECT $__timeInterval(ts) AS time, {cols} FROM {DB}.request_records FINAL "
            f"WHERE {WHERE} GROUP BY time ORDER BY time")


PANELS = [
    ("Client TTFT p90 by serving stage", "s", target(per_stage("quantileIf(0.9)({v}, {c})", "ttft_s")),
     "Time to first token as the client saw it: PD (prefill pod then decode pod), a PD decode pod alone "
     "(prefill skipped), aggregated engines."),
    ("Prefill-stage TTFT p50 / p90 (PD prefill pods)", "s", target(
        f"SELECT $__timeInterval(ts) AS time, quantile(0.5)(prefill_ttft_s) AS p50, "
        f"quantile(0.9)(prefill_ttft_s) AS p90 FROM {DB}.request_records FINAL "
        f"WHERE {WHERE} AND served_stage = 'pd' GROUP BY time ORDER BY time"),
     "The prefill request's own time to its single token: what the prefill pool delivers."),
    ("TPOT p90 by serving stage", "s", target(per_stage("quantileIf(0.9)({v}, {c})", "tpot_s")),
     "Time per output token after the first. Aggregated engines mix prefill chunks into decode steps, so "
     "long prompts stretch everyone's TPOT there; PD decode pods do not prefill."),
    ("KV transfer p50 / p90 (PD)", "s", target(
        f"SELECT $__timeInterval(ts) AS time, quantile(0.5)(kv_transfer_s) AS p50, "
        f"quantile(0.9)(kv_transfer_s) AS p90 FROM {DB}.request_records FINAL "
        f"WHERE {WHERE} AND served_stage = 'pd' GROUP BY time ORDER BY time"),
     "From the prefill's answer to the decode's first token: the KV pull plus one decode step."),
    ("The router's share of TTFT: its own time and its queue's wait (p90)", "s", target(
        f"SELECT $__timeInterval(ts) AS time, quantile(0.9)(ttft_s) AS ttft_p90, quantile(0.9)(router_s) AS "
        f"router_p90, quantile(0.9)(queue_s) AS queue_p90 FROM {DB}.request_records FINAL "
        f"WHERE {WHERE} GROUP BY time ORDER BY time"),
     "Client TTFT beside what the router added before an engine had the request: its own work (parsing, "
     "tokenizing, the decision) and the admission queue's wait for a backend slot."),
    ("SLA attainment by serving stage (TTFT and TPOT within target)", "percentunit", target(per_stage(
        "countIf(status = 'ok' AND ifNull(ttft_s, 0) <= ${{ttft_target}} AND ifNull({v}, 0) <= ${{itl_target}} AND {c})"
        " / greatest(countIf({c}), 1)", "tpot_s")),
     "Share of requests meeting both targets, per stage."),
    ("Replicas per role: planner desired vs current", "short", target(
        f"SELECT $__timeInterval(ts) AS time, "
        + ", ".join(f"maxIf({k}, role = '{r}') AS {r}_{k}" for r in ("prefill", "decode", "aggregated")
                    for k in ("desired", "current"))
        + f" FROM {DB}.scaling_hints FINAL WHERE {WHERE} GROUP BY time ORDER BY time"),
     "The planner's hints (autoscale.hints.<pool>.<role>) as stored: what it asked for and what ran."),
]

SUMMARY = target(
    f"SELECT pool, served_stage AS stage, count() AS requests, quantile(0.5)(ttft_s) AS ttft_p50, "
    f"quantile(0.9)(ttft_s) AS ttft_p90, quantile(0.9)(prefill_ttft_s) AS prefill_ttft_p90, "
    f"quantile(0.9)(tpot_s) AS tpot_p90, quantile(0.9)(kv_transfer_s) AS kv_transfer_p90, "
    f"quantile(0.9)(router_s) AS router_p90, quantile(0.9)(queue_s) AS queue_p90, "
    f"countIf(status = 'ok' AND ifNull(ttft_s, 0) <= ${{ttft_target}} AND ifNull(tpot_s, 0) <= ${{itl_target}}) "
    f"/ count() AS attainment FROM {DB}.request_records FINAL WHERE {WHERE} GROUP BY pool, stage "
    f"ORDER BY pool, stage", fmt=TABLE)


def _panel(pid: int, title: str, unit: str, tgt: dict, desc: str, x: int, y: int, w: int = 12, h: int = 8,
           kind: str = "timeseries") -> dict:
    return {"id": pid, "type": kind, "title": title, "description": desc, "datasource": DS, "targets": [tgt],
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}


def render() -> dict:
    panels = [_panel(1, "Per-stage summary", "short", SUMMARY, "One row per pool and serving stage.", 0, 0, w=24,
                     kind="table")]
    for i, (title, unit, tgt, desc) in enumerate(PANELS):
        panels.append(_panel(i + 2, title, unit, tgt, desc, 12 * (i % 2), 8 + 8 * (i // 2)))
    var = {"type": "datasource", "name": "datasource", "label": "ClickHouse", "query": "grafana-clickhouse-datasource"}
    return {
        "uid": "infernex-sla-stages", "title": "InferNex / SLA per stage (ClickHouse)",
        "description": "SLA history per serving stage (prefill, decode, aggregated) and planner replicas, from "
                       "ClickHouse.", "tags": ["infernex", "clickhouse"], "schemaVersion": 39, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "panels": panels,
        "templating": {"list": [
            var,
            {"type": "textbox", "name": "database", "label": "database", "query": "infernex",
             "current": {"text": "infernex", "value": "infernex"}},
            {"type": "query", "name": "pool", "label": "pool", "datasource": DS, "multi": True, "includeAll": True,
             "definition": "SELECT DISTINCT pool FROM ${database}.request_records",
             "query": "SELECT DISTINCT pool FROM ${database}.request_records", "refresh": 2},
            {"type": "textbox", "name": "ttft_target", "label": "TTFT target (s)", "query": "1.0",
             "current": {"text": "1.0", "value": "1.0"}},
            {"type": "textbox", "name": "itl_target", "label": "ITL/TPOT target (s)", "query": "0.05",
             "current": {"text": "0.05", "value": "0.05"}},
        ]},
    }


def dump() -> str:
    return json.dumps(render(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = dump()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python dashboards/clickhouse_sla.py")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
