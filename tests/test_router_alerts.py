"""The router's TTFT and ITL alerts, rendered from the chart with their names and thresholds from
values, checked with ``promtool test rules`` against synthetic histograms: they fire above the
threshold and stay quiet below it; the latency histograms reach 600 s."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry

from deploytools import promtool_binary, render


def _alerts(sets=()):
    groups = [g for d in render(None, sets=tuple(sets)) if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]]
    return groups, {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_ttft_and_itl_alerts_take_names_and_thresholds_from_values():
    _, alerts = _alerts()
    assert "InferNexHighTTFT" in alerts and "InferNexHighITL" in alerts
    assert "infernex_router_ttft_seconds_bucket" in alerts["InferNexHighTTFT"]["expr"]
    assert "> 5" in alerts["InferNexHighTTFT"]["expr"] and "> 0.25" in alerts["InferNexHighITL"]["expr"]
    _, alerts = _alerts(["kube-prometheus-stack.alerts.ttft.name=SlowFirstToken",
                         "kube-prometheus-stack.alerts.ttft.seconds=2"])
    assert "SlowFirstToken" in alerts and "> 2\n" in alerts["SlowFirstToken"]["expr"]


def _series(metric: str, role: str, per_min: dict[float, int]) -> list[dict]:
    """Cumulative histogram buckets growing by ``per_min[le]`` observations every minute."""
    out, acc = [], 0
    bounds = sorted(per_min)
    for le in bounds:
        acc += per_min[le]
        out.append({"series": f'{metric}_bucket{{le="{le}",pool="default",role="{role}",strategy="kv-aware"}}',
                    "values": f"0+{acc}x20"})
    out.append({"series": f'{metric}_bucket{{le="+Inf",pool="default",role="{role}",strategy="kv-aware"}}',
                "values": f"0+{acc}x20"})
    return out


def test_promtool_fires_ttft_and_itl_alerts(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    groups, _ = _alerts()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    series = (
        # aggregated: TTFT mostly 10-20 s (slow), ITL fast; pd: TTFT fast, ITL 0.3-0.4 s (slow)
        _series("infernex_router_ttft_seconds", "aggregated", {0.5: 1, 10.0: 0, 20.0: 60, 600.0: 0})
        + _series("infernex_router_itl_seconds", "aggregated", {0.02: 60, 0.3: 0, 0.4: 0})
        + _series("infernex_router_ttft_seconds", "pd", {0.5: 60, 10.0: 0, 20.0: 0, 600.0: 0})
        + _series("infernex_router_itl_seconds", "pd", {0.02: 1, 0.3: 0, 0.4: 60})
    )
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "InferNexHighTTFT", "exp_alerts": []},  # not yet 'for' 5m
                {"eval_time": "15m", "alertname": "InferNexHighTTFT",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "pool": "default", "role": "aggregated"},
                                 "exp_annotations": {
                                     "summary": "Router P99 time to first token above 5s",
                                     "description": "TTFT in pool default (aggregated) is 19.9s over the last 5 minutes."}}]},
                {"eval_time": "15m", "alertname": "InferNexHighITL",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "pool": "default", "role": "pd"},
                                 "exp_annotations": {
                                     "summary": "Router P99 inter-token latency above 0.25s",
                                     "description": "ITL in pool default (pd) is 399ms over the last 5 minutes."}}]},
                {"eval_time": "15m", "alertname": "InferNexHighLatencyP99", "exp_alerts": []},
            ],
        }],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_router_histograms_reach_ten_minutes():
    from router.config import RouterConfig
    from router.server import RouterService

    reg = CollectorRegistry()
    svc = RouterService(RouterConfig(bus=False, records=False), registry=reg)
    svc.metrics.ttft.labels("x", "default", "aggregated").observe(400.0)
    svc.metrics.duration.labels("x").observe(590.0)
    svc.metrics.queue.labels("x", "default", "pd").observe(0.2)
    svc.metrics.itl.labels("x", "default", "pd").observe(0.05)
    assert reg.get_sample_value("infernex_router_ttft_seconds_bucket",
                                {"strategy": "x", "pool": "default", "role": "aggregated", "le": "300.0"}) == 0
    assert reg.get_sample_value("infernex_router_ttft_seconds_bucket",
                                {"strategy": "x", "pool": "default", "role": "aggregated", "le": "600.0"}) == 1
    assert reg.get_sample_value("infernex_router_request_duration_seconds_bucket", {"strategy": "x", "le": "600.0"}) == 1
    assert reg.get_sample_value("infernex_router_queue_seconds_count",
                                {"strategy": "x", "pool": "default", "role": "pd"}) == 1
    assert reg.get_sample_value("infernex_router_itl_seconds_bucket",
                                {"strategy": "x", "pool": "default", "role": "pd", "le": "0.06"}) == 1


def test_chart_wires_engine_key_secret_and_admission():
    """The engine API key comes from a Secret mounted as a file; admission values reach the settings."""
    from router.config import RouterConfig

    docs = render(None, sets=("hermes-router.engineAuth.existingSecret=engine-keys",
                              "hermes-router.admission.maxInflightPerBackend=16",
                              "hermes-router.admission.maxInflightPerKey=4"))
    conf = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    router = RouterConfig.model_validate(yaml.safe_load(conf["data"]["config.yaml"])["router"])
    assert router.admission.max_inflight_per_backend == 16 and router.admission.max_inflight_per_key == 4
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("router"))
    spec = dep["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "engine-auth")
    assert vol["secret"]["secretName"] == "engine-keys"
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "engine-auth")
    path = f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
    assert str(router.engine_api_key_file) == path
    assert "engine-auth" not in str(render(None))  # off unless a Secret is named


def test_replicas_apart_alert_fires_when_a_router_replica_hears_fewer_than_the_others(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    groups, alerts = _alerts()
    assert "InferNexRouterReplicasApart" in alerts  # two replicas by default
    assert "InferNexRouterReplicasApart" not in _alerts(["hermes-router.replicas=1"])[1]
    assert "InferNexRouterReplicasApart" not in _alerts(["global.settings.router.replica_sync=false"])[1]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))

    def peers(pod: str, values: str) -> dict:
        return {"series": f'infernex_router_sync_peers{{namespace="ai-inference",service="infernex-router",'
                          f'pod="{pod}"}}', "values": values}

    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            # both hear each other for 10 minutes, then one loses the other for 10 minutes
            "input_series": [peers("r-0", "1x10 0x10"), peers("r-1", "1x20")],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "InferNexRouterReplicasApart", "exp_alerts": []},
                {"eval_time": "13m", "alertname": "InferNexRouterReplicasApart", "exp_alerts": []},  # 'for' 5m
                {"eval_time": "18m", "alertname": "InferNexRouterReplicasApart",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "service": "infernex-router"},
                                 "exp_annotations": {
                                     "summary": "Router replicas of infernex-router do not hear each other",
                                     "description": alerts["InferNexRouterReplicasApart"]["annotations"][
                                         "description"].replace("{{ $value }}", "0")}}]},
            ],
        }],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_names_an_engine_that_reports_no_cached_tokens(tmp_path):
    """The router counts answers without prompt_tokens_details.cached_tokens per engine
    (infernex_router_answers_without_cached_tokens_total): the alert names that engine and the
    flag, and stays quiet for an engine whose answers all carry it."""
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    groups, alerts = _alerts()
    assert "InferNexEngineReportsNoCachedTokens" in alerts
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    name = "infernex_router_answers_without_cached_tokens_total"
    series = [{"series": f'{name}{{pod="engine-b",reason="no_details"}}', "values": "0+6x20"},
              {"series": f'{name}{{pod="engine-a",reason="no_details"}}', "values": "0+1x20"},  # (10: under 20)
              {"series": f'{name}{{pod="engine-a",reason="no_usage"}}', "values": "0+6x20"}]  # (another cause)
    test = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "10m", "alertname": "InferNexEngineReportsNoCachedTokens", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "pod": "engine-b"},
             "exp_annotations": {
                 "summary": "An engine's answers do not say how many prompt tokens it took from its cache",
                 "description": "engine-b answered 60 requests in 10 minutes without usage.prompt_tokens_details."
                                "cached_tokens, and none with it: its request records count 0 cached tokens and "
                                "the SLA history's "
                                "prefix hit rate reads low. Start it with --enable-prompt-tokens-details (the "
                                "chart's default; promptTokensDetails on its role)."}}]}]}]}
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
