"""Writes the Grafana dashboards of InferNex (``dashboards/*.json``) from the compact specs below.

Run ``python dashboards/generate.py`` after editing a spec; a test fails when the JSON files and
this script disagree. The Helm chart packages the JSON files as ConfigMaps for Grafana's sidecar.

Expressions may use ``$__rate_interval`` and the dashboard variables (``$model``, ``$pod``,
``$pool``, the ``$ttft_target`` / ``$itl_target`` text boxes); every other name must be a metric
some InferNex component, a vLLM engine or a device exporter really exports
(tests/test_dashboards_live.py checks it against a live scrape).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    description: str = ""
    width: int = 12
    thresholds: list[tuple[float, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: list[tuple[str, str, str]]  # (name, label, label_values query)
    panels: list[Panel]
    textboxes: list[tuple[str, str, str]] = field(default_factory=list)  # (name, label, default)


def q(p: float, metric: str, by: str = "", sel: str = "") -> str:
    """histogram_quantile over a Prometheus histogram's buckets."""
    keys = ", ".join(["le"] + ([by] if by else []))
    return f"histogram_quantile({p}, sum by ({keys}) (rate({metric}_bucket{sel}[{RI}])))"


def ratio(num: str, den: str, by: str) -> str:
    return f"sum by ({by}) (rate({num}[{RI}])) / sum by ({by}) (rate({den}[{RI}]))"


MODEL = '{model_name=~"$model"}'
EP = '{model_name=~"$model",pod=~"$pod"}'

ROUTER = Dashboard(
    uid="infernex-router",
    title="InferNex / Router overview",
    description="hermes-router: request rate, latency, errors, strategy mix, regret, picks and rejections.",
    variables=[],
    panels=[
        Panel("Requests per second by outcome", [
            (f"sum by (status) (rate(infernex_router_requests_total[{RI}]))", "{{status}}")],
            unit="reqps"),
        Panel("End-to-end latency", [
            (q(0.5, "infernex_router_request_duration_seconds"), "p50"),
            (q(0.88, "infernex_router_request_duration_seconds"), "p88"),
            (q(0.99, "infernex_router_request_duration_seconds"), "p99")],
            unit="s"),
        Panel("Error ratio", [
            (f'(sum(rate(infernex_router_requests_total{{status="error"}}[{RI}])) or vector(0))'
             f" / sum(rate(infernex_router_requests_total[{RI}]))", "errors")],
            unit="percentunit"),
        Panel("Time to first token through the router", [
            (q(0.5, "infernex_router_ttft_seconds"), "p50"),
            (q(0.99, "infernex_router_ttft_seconds"), "p99")], unit="s"),
        Panel("Strategy mix (requests per second)", [
            (f"sum by (strategy) (rate(infernex_router_requests_total[{RI}]))", "{{strategy}}")],
            unit="reqps"),
        Panel("Picks per backend", [
            (f"sum by (pod, stage) (rate(infernex_router_picks_total[{RI}]))", "{{pod}} {{stage}}")],
            unit="ops", description="How the strategy spreads work; prefill and decode picks for PD."),
        Panel("Routing regret (cached blocks left on the table)", [
            (q(0.5, "infernex_router_regret_blocks"), "p50"),
            (q(0.99, "infernex_router_regret_blocks"), "p99")], unit="short",
            description="Best cached prefix any backend had minus the chosen backend's, per request."),
        Panel("Share of the best available overlap chosen", [
            (f'sum(rate(infernex_router_overlap_blocks_total{{kind="chosen"}}[{RI}]))'
             f' / sum(rate(infernex_router_overlap_blocks_total{{kind="best"}}[{RI}]))', "chosen / best")],
            unit="percentunit"),
        Panel("Decision latency", [
            (q(0.5, "infernex_router_decision_seconds"), "p50"),
            (q(0.99, "infernex_router_decision_seconds"), "p99")], unit="s"),
        Panel("Router's own time before the engine", [
            (q(0.5, "infernex_router_dispatch_seconds"), "p50"),
            (q(0.99, "infernex_router_dispatch_seconds"), "p99")], unit="s",
            description="From a request's body read to its first send to an engine: parsing, tokenizing, the "
                        "decision and its record. The admission queue's wait is apart (queue panel)."),
        Panel("Event loop lag", [
            (q(0.5, "infernex_router_event_loop_lag_seconds"), "p50"),
            (q(0.99, "infernex_router_event_loop_lag_seconds"), "p99")], unit="s",
            description="How late the router's event loop wakes a 50 ms timer: latency every request and "
                        "stream event waits meanwhile (work holding the loop, or a replica short of CPU)."),
        Panel("In-flight requests", [("sum(infernex_router_inflight_requests)", "in flight")]),
        Panel("Rejected requests by reason", [
            (f"sum by (reason) (rate(infernex_router_rejected_total[{RI}]))", "{{reason}}")], unit="reqps",
            description="busy: every backend over its KV/queue threshold (503 + Retry-After)."),
        Panel("Retries and migrations", [
            (f"sum by (reason) (rate(infernex_router_retries_total[{RI}]))", "retry {{reason}}"),
            (f"sum(rate(infernex_router_migrations_total[{RI}]))", "migrations")], unit="ops"),
        Panel("Records published and dropped", [
            (f"sum by (kind) (rate(infernex_router_records_published_total[{RI}]))", "published {{kind}}"),
            (f"sum by (kind) (rate(infernex_router_records_dropped_total[{RI}]))", "dropped {{kind}}")],
            unit="ops", description="Dropped: the bounded publish buffer was full; requests never wait for the bus."),
        Panel("Router replicas sharing their load", [
            ("max(infernex_router_sync_peers)", "other replicas heard (max over replicas)"),
            (f"sum by (direction) (rate(infernex_router_sync_messages_total[{RI}]))", "messages {{direction}}"),
            (f"sum(rate(infernex_router_sync_expired_total[{RI}]))", "replicas gone silent"),
            (f"sum by (direction) (rate(infernex_router_sync_route_ends_total[{RI}]))", "route ends {{direction}}")],
            description="Each replica tells the others of its pool its own in-flight requests per engine "
                        "(router.sync.<pool>); with N replicas, each should hear N-1. A replica gone silent "
                        "is forgotten after router.replica_sync_expire_s. Route ends (router.sync.<pool>.ends): "
                        "the routes of finished or failed requests, which the others stop counting as the "
                        "engine's predicted blocks."),
        Panel("Answers without cached-token counts", [
            (f"sum by (pod, reason) (rate(infernex_router_answers_without_cached_tokens_total[{RI}]))",
             "{{pod}} {{reason}}")],
            unit="reqps",
            description="Answers that did not say how many prompt tokens came from the engine's cache, so their "
                        "records count 0. no_details: the engine runs without --enable-prompt-tokens-details. "
                        "no_usage: streams through the endpoint picker whose clients did not ask for usage."),
    ],
)

ENGINES = Dashboard(
    uid="infernex-engines",
    title="InferNex / Engines and KV cache",
    description="vLLM engines: KV cache usage, queues, prefix cache hit rate, token throughput, latency.",
    variables=[("model", "Model", "label_values(vllm:num_requests_running, model_name)"),
               ("pod", "Pod", 'label_values(vllm:num_requests_running{model_name=~"$model"}, pod)')],
    panels=[
        Panel("KV cache usage per pod", [(f"vllm:kv_cache_usage_perc{EP}", "{{pod}}")], unit="percentunit"),
        Panel("Prefix cache hit rate per pod", [
            (f"sum by (pod) (rate(vllm:prefix_cache_hits_total{EP}[{RI}]))"
             f" / sum by (pod) (rate(vllm:prefix_cache_queries_total{EP}[{RI}]))", "{{pod}}")],
            unit="percentunit"),
        Panel("Requests running", [(f"vllm:num_requests_running{EP}", "{{pod}}")]),
        Panel("Requests waiting (queue)", [(f"vllm:num_requests_waiting{EP}", "{{pod}}")]),
        Panel("Token throughput", [
            (f"sum by (model_name) (rate(vllm:prompt_tokens_total{MODEL}[{RI}]))", "prompt {{model_name}}"),
            (f"sum by (model_name) (rate(vllm:generation_tokens_total{MODEL}[{RI}]))", "generation {{model_name}}")],
            unit="tps"),
        Panel("Time to first token", [
            (q(0.5, "vllm:time_to_first_token_seconds", "model_name", MODEL), "p50 {{model_name}}"),
            (q(0.99, "vllm:time_to_first_token_seconds", "model_name", MODEL), "p99 {{model_name}}")],
            unit="s"),
        Panel("Inter-token latency", [
            (q(0.5, "vllm:inter_token_latency_seconds", "model_name", MODEL), "p50 {{model_name}}"),
            (q(0.99, "vllm:inter_token_latency_seconds", "model_name", MODEL), "p99 {{model_name}}")],
            unit="s"),
        Panel("Queue time", [(q(0.99, "vllm:request_queue_time_seconds", "pod", EP), "p99 {{pod}}")], unit="s"),
        Panel("End-to-end latency (engine)", [
            (q(0.99, "vllm:e2e_request_latency_seconds", "model_name", MODEL), "p99 {{model_name}}")],
            unit="s"),
        Panel("Finished requests by reason", [
            (f"sum by (finished_reason) (rate(vllm:request_success_total{MODEL}[{RI}]))", "{{finished_reason}}")],
            unit="reqps"),
        Panel("KV cache size (blocks)", [
            ('max by (pod, block_size, num_gpu_blocks) (vllm:cache_config_info{pod=~"$pod"})',
             "{{pod}} blocks={{num_gpu_blocks}} size={{block_size}}")], kind="stat"),
        Panel("Preemptions", [(f"sum by (pod) (rate(vllm:num_preemptions_total{EP}[{RI}]))", "{{pod}}")],
              unit="ops"),
    ],
)

KV_INDEX = Dashboard(
    uid="infernex-kv-index",
    title="InferNex / KV index and event pipeline",
    description="KV events from the engines' bridges through JetStream into the cache-indexer.",
    variables=[],
    panels=[
        Panel("KV event throughput", [
            (f"sum(rate(infernex_kv_bridge_frames_total[{RI}]))", "bridge frames in/s"),
            (f"sum(rate(infernex_kv_bridge_published_total[{RI}]))", "bridge batches acked/s"),
            (f"sum(rate(infernex_indexer_batches_total[{RI}]))", "indexer batches/s"),
            (f"sum(rate(infernex_indexer_events_total[{RI}]))", "indexer events/s"),
            (f"sum by (path) (rate(infernex_indexer_kv_messages_total[{RI}]))", "indexer messages/s read as {{path}}")],
            unit="ops"),
        Panel("Blocks applied per second", [
            (f"sum by (op) (rate(infernex_indexer_blocks_total[{RI}]))", "{{op}}")], unit="ops"),
        Panel("Apply lag (engine to index)", [
            (q(0.5, "infernex_indexer_apply_lag_seconds"), "p50"),
            (q(0.99, "infernex_indexer_apply_lag_seconds"), "p99")], unit="s"),
        Panel("Bridge publish latency (ZMQ to JetStream ack)", [
            (q(0.99, "infernex_kv_bridge_publish_latency_seconds", "pod"), "p99 {{pod}}")], unit="s"),
        Panel("Blocks per pod", [("sum by (pod) (infernex_indexer_pod_blocks)", "{{pod}}")]),
        Panel("Bridge queue depth", [("sum by (pod) (infernex_kv_bridge_queue_depth)", "{{pod}}")]),
        Panel("Anomalies and sequence gaps", [
            (f"sum by (kind) (rate(infernex_indexer_anomalies_total[{RI}]))", "indexer {{kind}}"),
            (f"sum by (outcome) (rate(infernex_kv_bridge_gaps_total[{RI}]))", "bridge gap {{outcome}}"),
            (f"sum(rate(infernex_kv_bridge_engine_restarts_total[{RI}]))", "engine restarts")],
            unit="ops", description="Unknown parents, stale or duplicate batches (counted, never corrupting)."),
        Panel("Dead letters", [
            (f"sum by (consumer, reason) (rate(infernex_dead_letters_total[{RI}]))", "{{consumer}} {{reason}}")],
            unit="ops"),
        Panel("Snapshot age", [("max(infernex_indexer_snapshot_age_seconds)", "age")], unit="s"),
        Panel("Index query latency", [
            (q(0.5, "infernex_indexer_query_seconds", "via"), "p50 {{via}}"),
            (q(0.99, "infernex_indexer_query_seconds", "via"), "p99 {{via}}")], unit="s"),
    ],
)

DEVICES = Dashboard(
    uid="infernex-devices",
    title="InferNex / Device health",
    description="NPU (npu-exporter) and GPU (DCGM) telemetry and the diagnosis engine's open findings.",
    variables=[],
    panels=[
        Panel("Open diagnoses by severity", [
            ("sum by (severity) (infernex_diagnosis_open_findings)", "{{severity}}")],
            kind="stat", width=8, thresholds=[(0, "green"), (1, "red")]),
        Panel("Devices by health", [("sum by (status) (infernex_diagnosis_devices)", "{{status}}")],
              kind="stat", width=8),
        Panel("Findings published", [
            ("sum by (fault_mode, status) (increase(infernex_diagnosis_findings_published_total[1h]))",
             "{{fault_mode}} {{status}}")], kind="stat", width=8),
        Panel("NPU temperature", [("npu_chip_info_temperature", "{{node}} npu{{id}}")], unit="celsius"),
        Panel("NPU power", [("npu_chip_info_power", "{{node}} npu{{id}}")], unit="watt"),
        Panel("NPU HBM used", [
            ("npu_chip_info_hbm_used_memory / npu_chip_info_hbm_total_memory", "{{node}} npu{{id}}")],
            unit="percentunit"),
        Panel("NPU HBM ECC errors", [
            ("npu_chip_info_hbm_ecc_single_bit_error_cnt", "single-bit {{node}} npu{{id}}"),
            ("npu_chip_info_hbm_ecc_double_bit_error_cnt", "double-bit {{node}} npu{{id}}")]),
        Panel("NPU utilisation", [("npu_chip_info_utilization", "{{node}} npu{{id}}")], unit="percent"),
        Panel("NPU health and links (1 = OK)", [
            ("npu_chip_info_health_status", "health {{node}} npu{{id}}"),
            ("npu_chip_info_link_status", "link {{node}} npu{{id}}")]),
        Panel("NPU error code", [("npu_chip_info_error_code", "{{node}} npu{{id}}")], kind="stat"),
        Panel("GPU temperature", [("DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} gpu{{gpu}}")], unit="celsius"),
        Panel("GPU power", [("DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} gpu{{gpu}}")], unit="watt"),
        Panel("GPU memory used", [
            ("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)", "{{Hostname}} gpu{{gpu}}")],
            unit="percentunit"),
        # dcgm-exporter's default counters leave the ECC totals out; remapped rows are there
        Panel("GPU memory row remaps and XID errors", [
            ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "uncorrectable remaps {{Hostname}} gpu{{gpu}}"),
            ("DCGM_FI_DEV_XID_ERRORS", "last XID {{Hostname}} gpu{{gpu}}")]),
        Panel("Telemetry to finding latency", [
            (q(0.99, "infernex_diagnosis_latency_seconds"), "p99")], unit="s"),
        Panel("Telemetry consumed", [
            (f"sum by (result) (rate(infernex_diagnosis_telemetry_total[{RI}]))", "{{result}}")], unit="ops"),
    ],
)

SLA = Dashboard(
    uid="infernex-sla",
    title="InferNex / SLA and autoscaling",
    description="TTFT and inter-token latency against targets; desired versus current replicas.",
    variables=[("pool", "Pool", "label_values(infernex_desired_replicas, pool)")],
    textboxes=[("ttft_target", "TTFT target (s)", "1"), ("itl_target", "ITL target (s)", "0.05")],
    panels=[
        Panel("TTFT percentiles vs target", [
            (q(0.5, "vllm:time_to_first_token_seconds"), "p50"),
            (q(0.9, "vllm:time_to_first_token_seconds"), "p90"),
            (q(0.99, "vllm:time_to_first_token_seconds"), "p99"),
            ("vector($ttft_target)", "target")],
            unit="s"),
        Panel("Inter-token latency percentiles vs target", [
            (q(0.5, "vllm:inter_token_latency_seconds"), "p50"),
            (q(0.9, "vllm:inter_token_latency_seconds"), "p90"),
            (q(0.99, "vllm:inter_token_latency_seconds"), "p99"),
            ("vector($itl_target)", "target")],
            unit="s"),
        Panel("TTFT attainment (share of requests within target, engine histogram)", [
            (f'sum(rate(vllm:time_to_first_token_seconds_bucket{{le="1.0"}}[{RI}]))'
             f" / sum(rate(vllm:time_to_first_token_seconds_count[{RI}]))", "within 1 s")],
            unit="percentunit"),
        Panel("Desired vs current replicas", [
            ('infernex_desired_replicas{pool=~"$pool"}', "desired {{pool}}/{{role}}"),
            ('infernex_current_replicas{pool=~"$pool"}', "current {{pool}}/{{role}}")]),
        Panel("Planner errors", [
            ("sum by (stage) (increase(infernex_planner_errors_total[1h]))", "{{stage}}")], kind="stat"),
        Panel("Rows stored by the SLA sink", [
            (f"sum by (table) (rate(infernex_sla_sink_rows_total[{RI}]))", "{{table}}")], unit="ops"),
        Panel("SLA sink insert time", [
            (q(0.99, "infernex_sla_sink_flush_seconds", "table"), "p99 {{table}}")], unit="s"),
        Panel("Request rate (router)", [
            (f"sum by (strategy) (rate(infernex_router_requests_total[{RI}]))", "{{strategy}}")], unit="reqps"),
    ],
)

DASHBOARDS = [ROUTER, ENGINES, KV_INDEX, DEVICES, SLA]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    steps = [{"color": c, "value": (None if i == 0 else v)} for i, (v, c) in enumerate(panel.thresholds)]
    out = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": panel.unit,
                         "thresholds": {"mode": "absolute",
                                        "steps": steps or [{"color": "green", "value": None}]}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}} if panel.kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none"},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }
    if panel.description:
        out["description"] = panel.description
    return out


def render(d: Dashboard) -> dict:
    variables = [{
        "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [],
    }]
    for name, label, query in d.variables:
        variables.append({
            "name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0,
            "options": [], "regex": "",
        })
    for name, label, default in d.textboxes:
        variables.append({
            "name": name, "label": label, "type": "textbox", "query": default, "hide": 0,
            "current": {"selected": False, "text": default, "value": default},
            "options": [{"selected": True, "text": default, "value": default}],
        })
    panels, x, y = [], 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(_panel_json(p, i, x, y))
        x += p.width
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["infernex"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [{"title": "InferNex", "type": "dashboards", "tags": ["infernex"], "asDropdown": True}],
        "templating": {"list": variables},
        "panels": panels,
    }


def file_name(d: Dashboard) -> str:
    return d.uid + ".json"


def dump(d: Dashboard) -> str:
    return json.dumps(render(d), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for d in DASHBOARDS:
        path = HERE / file_name(d)
        text = dump(d)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("stale dashboards (run python dashboards/generate.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
