"""Every metric the dashboards and alerts query is really exported: a short local run of the
services (simulated vLLM engines, router, cache-indexer, KV bridge, metrics and device
collectors, simulated npu-exporter / DCGM, diagnosis, SLA sink with the planner) on a real NATS,
scraped by a real Prometheus. A dashboard that queries a metric no component exports fails here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import pytest
import yaml

from deploytools import (
    EXAMPLE_VALUES,
    dashboard_files,
    dashboard_promql,
    metric_names,
    prometheus_binary,
    render,
)
from deploytools.live import Processes, Prometheus, free_port, free_port_block, http_ok, wait_for

MODEL = "live-model"
POOL = "live-pool"

# Counters that only get samples when something goes wrong. For these the run checks that a
# running component declares them (HELP/TYPE in its scrape); every other metric must have data.
FAULT_ONLY = {
    "infernex_router_records_dropped_total": "the router's bounded record buffer overflowed",
    "infernex_router_retries_total": "a backend failed and the request was re-sent",
    "infernex_router_migrations_total": "a backend died mid-stream",
    "infernex_router_rejected_total": "a request was refused (auth, rate, busy, no backend)",
    "infernex_kv_bridge_gaps_total": "a ZMQ sequence gap was seen",
    "infernex_kv_bridge_engine_restarts_total": "an engine restarted",
    "infernex_indexer_anomalies_total": "an unknown parent, duplicate or stale batch arrived",
    "infernex_planner_errors_total": "a planning round or a scale patch failed",
    "infernex_diagnosis_findings_published_total": "a device fault was diagnosed",
}

PROFILE = {
    "name": "live",
    "prefill": [{"isl": 128, "throughput_tokens_per_s": 5000, "ttft_s": 0.05},
                {"isl": 2048, "throughput_tokens_per_s": 4000, "ttft_s": 0.5}],
    "decode": [{"context_length": 512, "itl_s": 0.02, "throughput_tokens_per_s": 500},
               {"context_length": 512, "itl_s": 0.05, "throughput_tokens_per_s": 1500}],
}


def _wanted_metrics() -> dict[str, set[str]]:
    """metric name -> where it is used (dashboard panel or alert)."""
    wanted: dict[str, set[str]] = {}
    for path in dashboard_files():
        board = json.loads(path.read_text())
        for title, expr in dashboard_promql(board):
            for m in metric_names(expr):
                wanted.setdefault(m, set()).add(f"{board['uid']}: {title}")
    for doc in render(EXAMPLE_VALUES[0]):
        if doc["kind"] == "PrometheusRule":
            for g in doc["spec"]["groups"]:
                for r in g["rules"]:
                    for m in metric_names(r["expr"]):
                        wanted.setdefault(m, set()).add(f"alert {r['alert']}")
    return wanted


def _alert_groups() -> list[dict]:
    return [g for doc in render(EXAMPLE_VALUES[0]) if doc["kind"] == "PrometheusRule" for g in doc["spec"]["groups"]]


async def _publish_garbage(url: str, subject: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish(subject, b"\xff not an event", headers={"Nats-Msg-Id": "garbage-1"})
    finally:
        await nc.close()


async def _delete_streams(url: str, prefix: str) -> None:
    import nats

    from streams.topology import build_topology

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for spec in build_topology(prefix=prefix):
            try:
                await js.delete_stream(spec.name)
            except Exception:  # noqa: BLE001 - a stream the run never created
                pass
    finally:
        await nc.close()


def test_every_dashboard_and_alert_metric_has_data(nats_server, prefix, tmp_path):
    prom_bin = prometheus_binary()
    if prom_bin is None:
        pytest.skip("prometheus not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    wanted = _wanted_metrics()
    assert len(wanted) > 30

    engine_base = free_port_block(2)
    kv_base = free_port_block(4)
    ports = {name: free_port() for name in
             ("router", "indexer", "bridge", "collector", "npu", "gpu", "diagnosis", "sla")}
    config = {
        "router": {"pool": POOL, "strategy": "kv-aware", "tokenizer": "simple"},
        "indexer": {"http_host": "127.0.0.1"},
        "diagnosis": {"metrics_host": "127.0.0.1", "metrics_port": ports["diagnosis"], "tick_s": 0.5},
        "sla": {"backend": "chdb", "chdb_path": str(tmp_path / "chdb"), "flush_interval_s": 0.5,
                "planner": {"interval_s": 1, "dry_run": True,
                            "pools": [{"pool": POOL, "roles": ["aggregated"], "profile": PROFILE}]}},
    }
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERNEX_")}
    env.update({"INFERNEX_CONFIG": str(cfg_path), "INFERNEX_NATS__SERVERS": nats_server.url,
                "INFERNEX_NATS__SUBJECT_PREFIX": prefix, "INFERNEX_DATA_DIR": str(tmp_path / "data"),
                "INFERNEX_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"})
    procs = Processes(tmp_path, env)
    engines = [f"engine-{i}" for i in range(2)]
    engine_urls = [f"http://127.0.0.1:{engine_base + i}" for i in range(2)]
    try:
        procs.infernex("streams", "streams", "apply")
        wait_for(lambda: procs.procs["streams"].poll() is not None, 60, "infernex streams apply")
        assert procs.procs.pop("streams").returncode == 0, procs.log("streams")

        procs.infernex("sim", "sim", "--engines", "2", "--base-port", str(engine_base), "--model", MODEL,
                       "--kv-events-port-base", str(kv_base), "--time-scale", "20", "--block-size", "16")
        procs.infernex("npu", "sim-devices", "--node", "node-0", "--devices", "2", "--port", str(ports["npu"]))
        procs.infernex("gpu", "sim-devices", "--node", "node-1", "--devices", "2", "--kind", "gpu",
                       "--port", str(ports["gpu"]))
        procs.infernex("indexer", "indexer", "--http-port", str(ports["indexer"]))
        procs.infernex("diagnose", "diagnose")
        procs.infernex("sla", "sla-sink", "--metrics-port", str(ports["sla"]), "--planner")
        procs.infernex("bridge", "bridge", "vllm-kv", "--endpoint", f"tcp://127.0.0.1:{kv_base}",
                       "--replay-endpoint", f"tcp://127.0.0.1:{kv_base + 1}", "--pod", engines[0],
                       "--model", MODEL, "--metrics-port", str(ports["bridge"]))
        procs.infernex("collector", "collect", "metrics", *[a for u, p in zip(engine_urls, engines)
                                                             for a in ("--target", u, "--pod", p)],
                       "--interval", "1", "--metrics-port", str(ports["collector"]))
        procs.infernex("devices-npu", "collect", "devices", "--source", "npu-exporter", "--node", "node-0",
                       "--url", f"http://127.0.0.1:{ports['npu']}/metrics", "--interval", "1")
        procs.infernex("devices-gpu", "collect", "devices", "--source", "dcgm", "--node", "node-1",
                       "--url", f"http://127.0.0.1:{ports['gpu']}/metrics", "--interval", "1")
        backends = [a for p, u in zip(engines, engine_urls) for a in ("--backend", f"{p}={u}@{MODEL}")]
        procs.infernex("router", "router", "--host", "127.0.0.1", "--port", str(ports["router"]), *backends)

        targets = {
            "engines": [(u.removeprefix("http://"), {"pod": p, "role": "aggregated", "node": "node-0"})
                        for u, p in zip(engine_urls, engines)],
            "router": [(f"127.0.0.1:{ports['router']}", {})],
            "indexer": [(f"127.0.0.1:{ports['indexer']}", {})],
            "kv-bridge": [(f"127.0.0.1:{ports['bridge']}", {"pod": engines[0]})],
            "metrics-collector": [(f"127.0.0.1:{ports['collector']}", {})],
            "npu-exporter": [(f"127.0.0.1:{ports['npu']}", {"node": "node-0"})],
            "dcgm-exporter": [(f"127.0.0.1:{ports['gpu']}", {"node": "node-1"})],
            "diagnosis": [(f"127.0.0.1:{ports['diagnosis']}", {})],
            "sla-sink": [(f"127.0.0.1:{ports['sla']}", {})],
        }
        for job, tl in targets.items():
            for addr, _ in tl:
                wait_for(lambda a=addr: http_ok(f"http://{a}/metrics"), 90, f"{job} /metrics at {addr}",
                         on_tick=procs.check_alive)

        rules_path = tmp_path / "alerts.yaml"
        rules_path.write_text(yaml.safe_dump({"groups": _alert_groups()}))
        prom_cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(rules_path)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [addr], "labels": {**labels, "namespace": "ai-inference"}}
                                                     for addr, labels in tl]}
                for job, tl in targets.items()
            ],
        }
        prom_path = tmp_path / "prometheus.yml"
        prom_path.write_text(yaml.safe_dump(prom_cfg))
        prom = Prometheus(prom_bin, procs, tmp_path)
        prom.start(prom_path)
        wait_for(prom.ready, 60, "prometheus ready", on_tick=procs.check_alive)

        router = f"http://127.0.0.1:{ports['router']}"
        sent = {"n": 0}
        client = httpx.Client(timeout=30)

        def traffic() -> None:
            procs.check_alive()
            # Prefix-sharing requests: prefix cache hits, KV events, router and engine histograms.
            for i in range(3):
                body = {"model": MODEL, "max_tokens": 8, "stream": sent["n"] % 2 == 1,
                        "messages": [{"role": "user", "content": "shared system prompt " * 20 + f"question {sent['n']}"}]}
                try:
                    r = client.post(f"{router}/v1/chat/completions", json=body)
                    if not body["stream"]:
                        assert r.status_code == 200, r.text
                except httpx.HTTPError:
                    pass
                sent["n"] += 1
            # kv-aware keeps a shared prefix on the engine it chose first, which may not be the one
            # with a KV bridge here: that engine gets a request of its own, so the indexer has blocks
            body = {"model": MODEL, "max_tokens": 2, "prompt": "bridged engine prompt " * 20}
            try:
                client.post(f"{engine_urls[0]}/v1/completions", json=body)
            except httpx.HTTPError:
                pass

        def index_query() -> None:
            try:
                client.post(f"http://127.0.0.1:{ports['indexer']}/v1/index/query",
                            json={"model": MODEL, "token_ids": list(range(1, 65))})
            except httpx.HTTPError:
                pass

        def tick() -> None:
            traffic()
            index_query()

        # A malformed KV event: the indexer dead-letters it (infernex_dead_letters_total).
        asyncio.run(_publish_garbage(nats_server.url, f"{prefix}.kv.events.{MODEL}.{engines[1]}"))

        def all_present() -> bool:
            return all(prom.has_series(m) if m not in FAULT_ONLY else prom.declared(m) for m in wanted)

        try:
            wait_for(all_present, 75, "every dashboard / alert metric to have data", on_tick=tick, interval=1)
        except AssertionError:
            missing = {m: sorted(wanted[m]) for m in wanted
                       if not (prom.has_series(m) if m not in FAULT_ONLY else prom.declared(m))}
            down = [(t["labels"]["job"], t.get("lastError")) for t in prom.targets() if t["health"] != "up"]
            pytest.fail(f"{len(missing)} metric(s) queried but exported by no running component "
                        f"(targets down: {down}):\n" + "\n".join(f"  {m}: {w}" for m, w in sorted(missing.items())))
        assert sent["n"] > 0
        # The check can fail: a name no component exports is neither declared nor has data.
        assert not prom.declared("infernex_no_such_metric_total")
        assert not prom.has_series("infernex_no_such_metric_total")
        fault_only_with_data = sorted(m for m in FAULT_ONLY if m in wanted and prom.has_series(m))

        # Every dashboard expression evaluates, and the panels the run exercises return data.
        empty = []
        for path in dashboard_files():
            board = json.loads(path.read_text())
            for title, expr in dashboard_promql(board):
                if not prom.query(expr)["result"]:
                    empty.append(f"{board['uid']}: {title}: {expr}")
        # Every template variable finds values: label_values(selector, label).
        for path in dashboard_files():
            board = json.loads(path.read_text())
            for var in board["templating"]["list"]:
                if var.get("type") != "query":
                    continue
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
                assert m, var["definition"]
                selector = m.group(1).replace("$model", ".*").replace("$pod", ".*")
                res = prom.query(f"count by ({m.group(2)}) ({selector})")["result"]
                assert [r for r in res if r["metric"].get(m.group(2))], \
                    f"{board['uid']}: variable ${var['name']} finds no values: {var['definition']}"
        # Every alert rule loads and evaluates without error.
        wait_for(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in prom.rules()), 30,
                 "alert rules evaluated")
        bad = [(r["name"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"]
        assert not bad, bad
        # Report, not fail: a panel can be legitimately empty in a short clean run (no errors,
        # no findings); the metric itself exists (checked above).
        print(f"{len(empty)} panel queries without data in this run:\n" + "\n".join(empty))
        print(f"fault-only metrics that had data anyway: {fault_only_with_data}")
        client.close()
    finally:
        procs.stop()
        asyncio.run(_delete_streams(nats_server.url, prefix))
