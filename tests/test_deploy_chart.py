"""The Helm chart (deploy/helm/infernex): lint, render, validate every manifest, and check that
what it renders fits together (engine args and sidecars, GIE resources, NATS, monitoring)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from deploytools import (
    CHART,
    EXAMPLE_VALUES,
    ToolMissing,
    arg_value,
    arg_values,
    by_kind,
    container,
    helm,
    helm_binary,
    one,
    pod_spec,
    render,
    selector_matches,
    validate_core,
    validate_gateway_api,
    validate_prometheus_operator,
)

ALL_VALUES = [None, *EXAMPLE_VALUES]  # None: the chart's own defaults
KUBE_VERSIONS = ["1.33.0", "1.37.0"]  # the seed's minimum and the newest kubernetes-validate knows


@pytest.fixture(scope="session", autouse=True)
def _helm_available():
    try:
        helm_binary()
    except ToolMissing as exc:
        pytest.fail(f"helm is needed for the deploy tests: {exc}")


def rendered(values: str | None) -> list[dict]:
    return render(values)


def test_helm_is_v4():
    out = helm("version", "--short").stdout
    assert out.startswith("v4."), out


@pytest.mark.parametrize("values", ALL_VALUES)
def test_helm_lint(values):
    args = ["lint", str(CHART), "--strict"]
    if values:
        args += ["-f", str(CHART / values)]
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", ALL_VALUES)
def test_every_manifest_validates(values):
    """Built-in kinds with kubernetes-validate --strict; Gateway API / GIE kinds against their
    documented structure (the Prometheus operator's kinds: the next test)."""
    import kubernetes_validate

    docs = rendered(values)
    assert docs
    checked = {"core": 0, "gateway": 0}
    for doc in docs:
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if group == "monitoring.coreos.com":
            continue
        if group in ("gateway.networking.k8s.io", "inference.networking.k8s.io"):
            validate_gateway_api(doc)
            checked["gateway"] += 1
            continue
        for version in KUBE_VERSIONS:
            try:
                validate_core(doc, version)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.fail(f"{where}: {exc.message}")
        checked["core"] += 1
    assert checked["core"] >= 15
    assert checked["gateway"] == 3


@pytest.mark.parametrize("values", ALL_VALUES)
def test_prometheus_operator_kinds_validate(values):
    """ServiceMonitor / PrometheusRule against the prometheus-operator CRD models."""
    pytest.importorskip("cloudcoil.models.prometheus_operator",
                        reason="pip install cloudcoil-models-prometheus-operator to check ServiceMonitor / "
                               "PrometheusRule against the operator's CRDs")
    docs = [d for d in rendered(values) if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
    for doc in docs:
        validate_prometheus_operator(doc)


def test_validation_catches_a_broken_manifest():
    """The validators really reject things: an unknown field in each family fails."""
    import kubernetes_validate

    docs = rendered("values-aggregated.yaml")
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    deploy["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(deploy, "1.33.0")
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    pool["spec"]["targetPorts"].append({"number": 9000})  # GIE allows exactly one
    with pytest.raises(Exception, match="too long|is too long|maxItems|non-empty|expected"):
        validate_gateway_api(pool)
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    del route["spec"]["rules"][0]["backendRefs"][0]["port"]
    with pytest.raises(Exception, match="port"):
        validate_gateway_api(route)
    pytest.importorskip("cloudcoil.models.prometheus_operator")
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    sm["spec"]["endpoints"][0]["scrapeEvery"] = "5s"
    with pytest.raises(AssertionError, match="scrapeEvery"):
        validate_prometheus_operator(sm)


def _engine_deployments(docs):
    return [d for d in by_kind(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]


def _json_arg(args: list[str], flag: str) -> dict:
    return json.loads(arg_value(args, flag))


def _env_names(c: dict) -> set[str]:
    return {e["name"] for e in c.get("env", [])}


def test_aggregated_engines():
    docs = rendered("values-aggregated.yaml")
    values = yaml.safe_load((CHART / "values-aggregated.yaml").read_text())
    svc = values["inference-backend"]["services"][0]
    engines = _engine_deployments(docs)
    assert [d["metadata"]["name"] for d in engines] == [svc["name"]]
    dep = engines[0]
    assert dep["spec"]["replicas"] == svc["aggregated"]["replicas"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["openfuyao.com/model"] == svc["openfuyao"]["model"]
    assert labels["openfuyao.com/pdRole"] == "aggregated"
    eng = container(dep, "engine")
    args = eng["args"]
    assert eng["command"] == ["vllm", "serve"]
    assert args[0] == svc["model"]["name"]
    assert arg_value(args, "--port") == str(svc["service"]["port"])
    assert arg_value(args, "--max-model-len") == str(svc["aggregated"]["maxModelLen"])
    assert "--enable-prefix-caching" in args and "--no-enable-prefix-caching" not in args
    assert "--enable-prompt-tokens-details" in args  # the records' cached tokens come from it
    assert "--kv-transfer-config" not in args
    for extra in svc["aggregated"]["extraArgs"]:
        assert extra in args
    kv = _json_arg(args, "--kv-events-config")
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    # The bridge sidecar reads exactly what the engine publishes, on localhost.
    pub_port = kv["endpoint"].rsplit(":", 1)[1]
    replay_port = kv["replay_endpoint"].rsplit(":", 1)[1]
    bridge = container(dep, "kv-bridge")
    assert bridge["args"][:2] == ["bridge", "vllm-kv"]
    assert arg_value(bridge["args"], "--endpoint") == f"tcp://127.0.0.1:{pub_port}"
    assert arg_value(bridge["args"], "--replay-endpoint") == f"tcp://127.0.0.1:{replay_port}"
    assert arg_value(bridge["args"], "--model") == svc["model"]["name"]
    assert arg_value(bridge["args"], "--pod") == "$(POD_NAME)" and "POD_NAME" in _env_names(bridge)
    collector = container(dep, "metrics-collector")
    assert arg_value(collector["args"], "--target") == f"http://127.0.0.1:{svc['service']['port']}/metrics"
    # One accelerator per tensor x data parallel rank.
    res = eng["resources"]["limits"][svc["accelerator"]["resourceName"]]
    assert res == str(svc["aggregated"]["tensorParallelSize"] * svc["aggregated"]["dataParallelSize"])


def test_pd_engines_mooncake():
    docs = rendered("values-pd-2p2d.yaml")
    values = yaml.safe_load((CHART / "values-pd-2p2d.yaml").read_text())
    svc = values["inference-backend"]["services"][0]
    pd = svc["pd"]
    engines = {d["metadata"]["name"]: d for d in _engine_deployments(docs)}
    assert set(engines) == {f"{svc['name']}-prefill", f"{svc['name']}-decode"}
    seen_ports = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        dep = engines[f"{svc['name']}-{role}"]
        cfg = pd[role]
        assert dep["spec"]["replicas"] == cfg["replicaAmount"] == 2
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["openfuyao.com/pdRole"] == role
        assert labels["openfuyao.com/pdGroupID"] == svc["openfuyao"]["pdGroupID"]
        eng = container(dep, "engine")
        args = eng["args"]
        kvt = _json_arg(args, "--kv-transfer-config")
        assert kvt["kv_connector"] == "MooncakeConnectorV1"
        assert kvt["kv_role"] == kv_role
        assert int(kvt["kv_port"]) == cfg["connectorBasePort"]
        assert kvt["engine_id"] == "$(POD_NAME)" and "POD_NAME" in _env_names(eng)
        extra = kvt["kv_connector_extra_config"]
        assert extra["use_ascend_direct"] is True
        for r in ("prefill", "decode"):
            assert extra[r] == {"tp_size": pd[r]["tensorParallelSize"], "dp_size": pd[r]["dataParallelSize"]}
        assert arg_value(args, "--tensor-parallel-size") == str(cfg["tensorParallelSize"])
        assert arg_value(args, "--max-num-batched-tokens") == str(cfg["maxNumBatchedTokens"])
        ports = {p["name"]: p["containerPort"] for p in eng["ports"]}
        assert ports["kv-connector"] == cfg["connectorBasePort"]
        seen_ports[role] = cfg["connectorBasePort"]
        assert eng["resources"]["limits"]["huawei.com/ascend-1980"] == str(cfg["tensorParallelSize"])
    assert seen_ports["prefill"] != seen_ports["decode"]
    # Decode engines must not use prefix caching with Mooncake (seed 000 FAQ 5).
    assert "--no-enable-prefix-caching" in container(engines[f"{svc['name']}-decode"], "engine")["args"]
    assert "--enable-prefix-caching" in container(engines[f"{svc['name']}-prefill"], "engine")["args"]


@pytest.mark.parametrize("values", EXAMPLE_VALUES)
def test_gateway_route_pool_fit_together(values):
    docs = rendered(values)
    gw = by_kind(docs, "Gateway")[0]
    route = by_kind(docs, "HTTPRoute")[0]
    pool = by_kind(docs, "InferencePool")[0]
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert gw["metadata"]["namespace"] == "istio-system"  # the release namespace
    # The route attaches to the gateway, which admits routes from the route's namespace.
    parent = route["spec"]["parentRefs"][0]
    assert parent["name"] == gw["metadata"]["name"] and parent["namespace"] == gw["metadata"]["namespace"]
    if route["metadata"]["namespace"] != gw["metadata"]["namespace"]:
        assert all(lst.get("allowedRoutes", {}).get("namespaces", {}).get("from") in ("All", "Selector")
                   for lst in gw["spec"]["listeners"])
    # Its backend exists with that port.
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    if backend["kind"] == "Service":
        target = services[backend["name"]]
        assert backend["port"] in [p["port"] for p in target["spec"]["ports"]]
    else:
        assert backend["name"] == pool["metadata"]["name"]
    # The pool selects engine pods, on the port they serve, and its picker is a real Service port.
    engines = _engine_deployments(docs)
    selected = [d for d in engines if selector_matches(pool["spec"]["selector"]["matchLabels"],
                                                       d["spec"]["template"]["metadata"]["labels"])]
    assert selected, "the InferencePool selects no engine pod"
    for d in selected:
        ports = [p["containerPort"] for p in container(d, "engine")["ports"]]
        assert pool["spec"]["targetPorts"][0]["number"] in ports
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["port"]["number"] in [p["port"] for p in services[picker["name"]]["spec"]["ports"]]
    assert pool["metadata"]["namespace"] == route["metadata"]["namespace"] == "ai-inference"


def _selects(service: dict, workload: dict) -> bool:
    return selector_matches(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("values", ALL_VALUES)
def test_every_service_has_pods_and_ports(values):
    docs = rendered(values)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]
    for svc in by_kind(docs, "Service"):
        backing = [w for w in workloads if _selects(svc, w)]
        assert backing, f"Service {svc['metadata']['name']} selects no workload"
        names = {p["name"] for w in backing for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                assert target in names, f"{svc['metadata']['name']}: no container port named {target}"


@pytest.mark.parametrize("values", EXAMPLE_VALUES)
def test_service_monitors_scrape_existing_ports(values):
    docs = rendered(values)
    services = by_kind(docs, "Service")
    monitors = by_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"infernex-control-plane", "infernex-engines"}
    for m in monitors:
        chosen = [s for s in services if selector_matches(m["spec"]["selector"]["matchLabels"],
                                                          s["metadata"]["labels"])]
        assert chosen, f"ServiceMonitor {m['metadata']['name']} selects no Service"
        port_names = {p["name"] for s in chosen for p in s["spec"]["ports"]}
        for ep in m["spec"]["endpoints"]:
            assert ep["port"] in port_names
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    control = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services
               if s["metadata"]["labels"].get("infernex.io/metrics") == "true"}
    # With embedded chDB the planner runs inside the SLA sink; the device collector serves
    # /metrics (and its probes) on diagnosis.collector.metricsPort.
    assert control == {"router", "indexer", "diagnosis", "sla-sink", "device-collector"}


INFERNEX_PROBE_PATHS = {"/healthz", "/readyz"}  # what consumers.health / the router / the indexer serve


@pytest.mark.parametrize("values", ALL_VALUES)
def test_every_container_has_probes_that_check_something(values):
    """Every long-running container is probed (issue 21: the sidecars had none); InferNex
    containers on /healthz and /readyz (which check NATS, lag, frames), never /metrics (which
    answers 200 whatever the state), on a declared port that the container's args serve on."""
    docs = rendered(values)
    seen = 0
    for w in docs:
        if w["kind"] not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        for c in pod_spec(w)["containers"]:
            where = f"{w['kind']}/{w['metadata']['name']} container {c['name']}"
            assert "livenessProbe" in c, f"{where}: no livenessProbe"
            if "/infernex:" not in c["image"]:
                continue
            seen += 1
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for kind in ("livenessProbe", "readinessProbe"):
                if kind not in c:
                    continue
                get = c[kind]["httpGet"]
                assert get["path"] in INFERNEX_PROBE_PATHS, f"{where}: {kind} on {get['path']}"
                assert get["port"] in ports, f"{where}: {kind} port {get['port']} is not declared"
                flags = [f for f in ("--metrics-port", "--http-port", "--port") if f in c["args"]]
                served = arg_value(c["args"], flags[0]) if flags else None
                if served is not None:
                    assert int(served) == ports[get["port"]], f"{where}: probes {ports[get['port']]}, serves {served}"
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", where
            # a start that compiles numba kernels (no compiled cache on the node) is not cut short by
            # liveness: a startup probe on the same endpoint allows minutes
            start = c["startupProbe"]
            assert start["httpGet"] == c["livenessProbe"]["httpGet"], where
            assert start["periodSeconds"] * start["failureThreshold"] >= 120, where
            if c["name"] not in ("kv-bridge", "metrics-collector"):
                # a sidecar's readiness would gate its engine on NATS; the others must be ready-checked
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", where
    assert seen >= 6


def test_nats_production_cluster(tmp_path):
    docs = rendered("values-pd-2p2d.yaml")
    sts = one(docs, "StatefulSet", "infernex-nats")
    assert sts["spec"]["replicas"] == 3
    conf = one(docs, "ConfigMap", "infernex-nats-config")["data"]["nats.conf"]
    for i in range(3):
        assert f"nats://infernex-nats-{i}.infernex-nats-headless.ai-inference.svc:6222" in conf
    # Streams are created with three replicas on a three-node cluster.
    router = one(docs, "Deployment", "infernex-router")
    env = {e["name"]: e.get("value") for e in container(router, "router")["env"]}
    assert env["INFERNEX_TOPOLOGY__REPLICAS"] == "3"
    assert env["INFERNEX_NATS__SERVERS"] == "nats://infernex-nats.ai-inference.svc:4222"
    # every stream gets a share of the JetStream store the chart gives each server
    settings = yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"])
    from schemas.config import TopologyConfig
    from streams.topology import build_topology

    topo = TopologyConfig(**settings["topology"])
    assert "max_file_store: 50Gi" in conf and topo.store_bytes == 50 * 2**30
    assert all(0 < s.max_bytes for s in build_topology(topo))
    assert sum(s.max_bytes for s in build_topology(topo)) <= 0.9 * topo.store_bytes
    # nats-server itself accepts the configuration.
    binary = _nats_server()
    path = tmp_path / "nats.conf"
    import base64

    # its users' passwords come from the environment, its certificate from the TLS Secret
    users = one(docs, "Secret", "infernex-nats-auth")["data"]
    env = {k.upper().replace("-", "_") + "_PASSWORD": base64.b64decode(v).decode() for k, v in users.items()}
    for name, data in one(docs, "Secret", "infernex-nats-tls")["data"].items():
        (tmp_path / name).write_bytes(base64.b64decode(data))
    path.write_text(conf.replace("store_dir: /data", f"store_dir: {tmp_path}").replace("/etc/nats-tls", str(tmp_path)))
    proc = subprocess.run([binary, "-c", str(path), "-t"], capture_output=True, text=True, timeout=30,
                          env={"SERVER_NAME": "infernex-nats-0", "PATH": "/usr/bin:/bin", **env})
    assert proc.returncode == 0, proc.stderr + proc.stdout


def _nats_server() -> str:
    from infernex.embedded_nats import NatsBinaryMissing, find_nats_server

    try:
        return str(find_nats_server())
    except NatsBinaryMissing as exc:
        pytest.fail(str(exc))


def test_dashboards_packaged_for_grafana_sidecar():
    from deploytools import dashboard_files

    docs = rendered("values-aggregated.yaml")
    cms = [c for c in by_kind(docs, "ConfigMap") if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    packaged = {k: v for c in cms for k, v in c["data"].items()}
    files = {p.name: p.read_text() for p in dashboard_files()}
    assert len(files) == 5
    assert set(packaged) == set(files)
    for name, text in files.items():
        assert json.loads(packaged[name]) == json.loads(text)


def test_rules_and_monitors_off_without_prometheus_operator():
    docs = render("values-aggregated.yaml", sets=["kube-prometheus-stack.enabled=false"])
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}
    assert not [c for c in by_kind(docs, "ConfigMap") if "grafana_dashboard" in c["metadata"].get("labels", {})]


@pytest.mark.parametrize("bad, message", [
    (["nats.replicas=2"], "nats/replicas"),
    (["inference-backend.services[0].name=x", "inference-backend.services[0].mode=hybrid",
      "inference-backend.services[0].model.name=m", "inference-backend.services[0].openfuyao.model=m"],
     "mode"),
    (["hermes-router.inferenceExtension.strategy=fastest"], "strategy"),
    (["hermes-router.inferencePool.targetPorts[0].number=70000"], "targetPorts"),
    (["hermes-router.inferenceExtension.pluginsConfigFile=missing.yaml"], "pluginsCustomConfig"),
    (["inference-backend.services[0].name=x", "inference-backend.services[0].mode=pd",
      "inference-backend.services[0].model.name=m", "inference-backend.services[0].openfuyao.model=m"],
     "pdGroupID"),
    (["kube-prometheus-stack.alerts.errorRatio=2"], "errorRatio"),
])
def test_bad_values_are_refused_clearly(bad, message):
    args = ["template", "x", str(CHART)]
    for s in bad:
        args += ["--set", s]
    proc = helm(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_notes_tell_how_to_call_the_router():
    proc = helm("install", "infernex", str(CHART), "-n", "istio-system", "--dry-run=client",
                "-f", str(CHART / "values-aggregated.yaml"))
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl -n ai-inference port-forward svc/infernex-router 8000:8000" in notes
    assert "/v1/chat/completions" in notes and '"model": "Qwen/Qwen3-8B"' in notes
    assert "kubectl -n istio-system get gateway inference-gateway" in notes


DP2 = ["inference-backend.services[0].name=m", "inference-backend.services[0].mode=aggregated",
       "inference-backend.services[0].model.name=org/m", "inference-backend.services[0].openfuyao.model=m",
       "inference-backend.services[0].aggregated.dataParallelSize=2"]


def test_one_kv_bridge_serves_every_data_parallel_rank():
    """vLLM adds the DP rank to the KV-event ports: one bridge process reads every rank's sockets,
    each rank under its own pod name and rank, and serves one scrape port."""
    import click
    from typer.main import get_command

    from infernex.cli import app

    docs = render(None, sets=DP2)
    dep = one(docs, "Deployment", "m")
    eng = container(dep, "engine")
    kv = json.loads(arg_value(eng["args"], "--kv-events-config"))
    pub, replay = int(kv["endpoint"].rsplit(":", 1)[1]), int(kv["replay_endpoint"].rsplit(":", 1)[1])
    bridges = [c for c in pod_spec(dep)["containers"] if c["name"].startswith("kv-bridge")]
    assert [b["name"] for b in bridges] == ["kv-bridge"]
    args = bridges[0]["args"]
    assert arg_values(args, "--endpoint") == [f"tcp://127.0.0.1:{pub + r}" for r in range(2)]
    assert arg_values(args, "--replay-endpoint") == [f"tcp://127.0.0.1:{replay + r}" for r in range(2)]
    assert arg_values(args, "--dp-rank") == ["0", "1"]
    assert arg_values(args, "--pod") == ["$(POD_NAME)-dp0", "$(POD_NAME)-dp1"]
    assert arg_values(args, "--metrics-port") == ["9106"]
    # the args parse with the real CLI, each rank's values paired in order
    root = get_command(app)
    ctx = click.Context(root, info_name="infernex")
    group = root.get_command(ctx, "bridge")
    cmd = group.get_command(click.Context(group, info_name="bridge", parent=ctx), "vllm-kv")
    parsed = cmd.make_context("vllm-kv", list(args[2:]), parent=ctx)
    assert parsed.params["endpoint"] == arg_values(args, "--endpoint") and parsed.params["dp_rank"] == [0, 1]
    engines_sm = one(docs, "ServiceMonitor", "infernex-engines")
    assert "bridge" in {e["port"] for e in engines_sm["spec"]["endpoints"]}
    assert not any(e["port"].startswith("bridge-dp") for e in engines_sm["spec"]["endpoints"])
    assert eng["resources"]["limits"]["huawei.com/ascend-1980"] == "2"


def test_overlapping_kv_ports_are_refused():
    proc = helm("template", "x", str(CHART), *[a for s in DP2 + ["inference-backend.services[0].kvEvents.replayPort=5558"]
                                               for a in ("--set", s)], check=False)
    assert proc.returncode != 0 and "overlap for dataParallelSize 2" in proc.stderr


def test_packaged_chart_carries_the_dashboards(tmp_path):
    """`helm package` follows the dashboards symlink; the archive renders the same ConfigMaps."""
    import tarfile

    helm("package", str(CHART), "-d", str(tmp_path))
    archive = next(tmp_path.glob("infernex-*.tgz"))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {f"infernex/dashboards/{p.name}" for p in __import__("deploytools").dashboard_files()} <= set(names)
    assert not [n for n in names if n.endswith(".py")]
    from deploytools import load_manifests

    docs = load_manifests(helm("template", "infernex", str(archive), "-n", "istio-system").stdout)
    assert len([c for c in by_kind(docs, "ConfigMap") if "grafana_dashboard" in c["metadata"].get("labels", {})]) == 5


def test_kv_bridges_send_digests_unless_told_to_send_token_ids():
    """By default the bridge sends block digests; ``kvEvents.tokenIds`` makes it keep vLLM's token ids
    for every rank (for a rollout where older consumers still run)."""
    for sets, want in ((DP2, False), (DP2 + ["inference-backend.services[0].kvEvents.tokenIds=true"], True)):
        dep = one(render(None, sets=sets), "Deployment", "m")
        bridges = [c for c in pod_spec(dep)["containers"] if c["name"].startswith("kv-bridge")]
        assert len(bridges) == 1 and ("--token-ids" in bridges[0]["args"]) is want
        assert len(arg_values(bridges[0]["args"], "--endpoint")) == 2


def test_the_indexer_reserves_the_blocks_set_in_the_values():
    """``cache-indexer.reserveBlocks`` reaches the indexer's settings (and, unset, is left out), and
    the service's index then sizes a model's tables for it when the model first appears."""
    from consumers.indexer_config import IndexerConfig
    from streams.clock import SystemClock
    from streams.kv_index import KvIndex

    def indexer_settings(sets=()):
        docs = render(None, sets=sets)
        return yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"])["indexer"]

    assert "reserve_blocks" not in indexer_settings()
    cfg = IndexerConfig(**indexer_settings(["cache-indexer.reserveBlocks=300000"]))
    assert cfg.reserve_blocks == 300_000
    from schemas.kv import BlockStored, KvEventBatch

    index = KvIndex(SystemClock(), reserve_blocks=cfg.reserve_blocks)
    index.apply(KvEventBatch(pod="e0", model="m", seq=0, ts=1.0, events=[  # the model's first event
        BlockStored(block_hashes=[7], token_ids=list(range(16)), block_size=16)]))
    m = index._models["m"]
    assert m.kt.shape[0] * 0.6 >= 300_000 and m.em.shape[0] * 0.6 >= 300_000


def test_engines_report_cached_tokens_unless_turned_off():
    """vLLM's usage carries prompt_tokens_details.cached_tokens only with
    --enable-prompt-tokens-details; the chart sets it on every engine role unless a role's values
    turn it off."""
    def engine_args(sets: list[str]) -> dict[str, list[str]]:
        return {d["metadata"]["name"]: container(d, "engine")["args"] for d in by_kind(render(None, sets=sets),
                                                                                   "Deployment")
                if any(c["name"] == "engine" for c in pod_spec(d)["containers"])}

    on = engine_args(DP2)
    assert list(on) == ["m"] and "--enable-prompt-tokens-details" in on["m"]
    off = engine_args(DP2 + ["inference-backend.services[0].aggregated.promptTokensDetails=false"])
    assert list(off) == ["m"] and "--enable-prompt-tokens-details" not in off["m"]
