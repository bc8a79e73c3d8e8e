"""The chart in EPP mode and with InferNex's own values (seed 000): a values file written from the
seed renders in both modes and every manifest validates (kubernetes-validate --strict, the GIE
kinds against their schemas); the seed's keys take effect with the seed's meaning; each model
service with its own router block gets its own router, strategy and InferencePool; each
InferencePool's endpointPickerRef is the router's ext_proc port (appProtocol http2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploytools import (
    ToolMissing,
    by_kind,
    container,
    helm,
    helm_binary,
    one,
    render,
    selector_matches,
    validate_core,
    validate_gateway_api,
)

from router.profiles import load_strategy_file

SEED = str(Path(__file__).parent / "fixtures" / "chart" / "values-seed-000.yaml")
MODES = ["proxy", "epp"]
KUBE_VERSIONS = ["1.33.0", "1.37.0"]


@pytest.fixture(scope="module", autouse=True)
def _helm_available():
    try:
        helm_binary()
    except ToolMissing as exc:
        pytest.fail(f"helm is needed for the deploy tests: {exc}")


def seed(mode: str, *sets: str) -> list[dict]:
    return render(SEED, sets=(f"hermes-router.mode={mode}", *sets))


def args_of(doc: dict, name: str) -> list[str]:
    return container(doc, name)["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def engine_pods(docs: list[dict]) -> list[dict]:
    return [d for d in by_kind(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]


@pytest.mark.parametrize("mode", MODES)
def test_seed_values_render_and_validate(mode):
    import kubernetes_validate

    docs = seed(mode)
    core = gateway = 0
    for doc in docs:
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        if group == "monitoring.coreos.com":
            continue
        if group in ("gateway.networking.k8s.io", "inference.networking.k8s.io"):
            validate_gateway_api(doc)
            gateway += 1
            continue
        for v in KUBE_VERSIONS:
            try:
                validate_core(doc, v)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {v}: {exc.message} at {list(exc.path)}")
        core += 1
    assert core >= 20
    assert gateway == 5  # the Gateway, two InferencePools, two HTTPRoutes
    lint = helm("lint", str(Path(SEED).parents[3] / "deploy" / "helm" / "infernex"), "--strict", "-f", SEED,
                "--set", f"hermes-router.mode={mode}", check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("mode", MODES)
def test_every_pool_points_at_its_routers_ext_proc_port(mode):
    docs = seed(mode)
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    routers = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")
               if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "router"}
    pools = by_kind(docs, "InferencePool")
    assert sorted(p["metadata"]["name"] for p in pools) == ["vllm-qwen-qwen3-8b", "vllm-qwen-qwen3-8b-qwen3-32b-pd"]
    for pool in pools:
        ref = pool["spec"]["endpointPickerRef"]
        svc = services[ref["name"]]
        port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
        assert port["name"] == "grpc-ext-proc" and port["appProtocol"] == "http2"  # gRPC, h2c
        # the Service's port reaches a router container that serves the picker there
        router = next(d for d in routers.values()
                      if selector_matches(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"]))
        c = container(router, "router")
        assert {"name": "grpc-ext-proc", "containerPort": ref["port"]["number"]} in c["ports"]
        assert flag(c["args"], "--epp-port") == str(ref["port"]["number"])
        assert flag(c["args"], "--pool") == pool["metadata"]["name"]


def test_modes_choose_the_route_backend():
    for mode, kind in (("proxy", "Service"), ("epp", "InferencePool")):
        routes = by_kind(seed(mode), "HTTPRoute")
        assert len(routes) == 2
        assert {r["spec"]["rules"][0]["backendRefs"][0]["kind"] for r in routes} == {kind}
    # the legacy switch still works: backend.kind InferencePool means EPP mode
    routes = by_kind(render(SEED, sets=("hermes-router.httpRoute.backend.kind=InferencePool",)), "HTTPRoute")
    assert {r["spec"]["rules"][0]["backendRefs"][0]["kind"] for r in routes} == {"InferencePool"}


def test_each_service_has_its_own_router_strategy_and_pool():
    docs = seed("epp")
    pools = {p["metadata"]["name"]: p for p in by_kind(docs, "InferencePool")}
    engines = engine_pods(docs)
    by_pool = {name: sorted(d["metadata"]["name"] for d in engines
                            if selector_matches(p["spec"]["selector"]["matchLabels"],
                                                d["spec"]["template"]["metadata"]["labels"]))
               for name, p in pools.items()}
    assert by_pool == {"vllm-qwen-qwen3-8b": ["qwen3-8b"],
                       "vllm-qwen-qwen3-8b-qwen3-32b-pd": ["qwen3-32b-pd-decode", "qwen3-32b-pd-prefill"]}
    shared = one(docs, "Deployment", "infernex-router")
    pd = one(docs, "Deployment", "infernex-router-qwen3-32b-pd")
    assert flag(args_of(shared, "router"), "--profile") == "/etc/infernex/profiles/kv-aware.yaml"
    assert flag(args_of(pd, "router"), "--profile") == "/etc/infernex/profiles/pd-kv-aware.yaml"
    # each router discovers only its own pool's engines
    for dep, pool in ((shared, "vllm-qwen-qwen3-8b"), (pd, "vllm-qwen-qwen3-8b-qwen3-32b-pd")):
        sel = dict(kv.split("=") for kv in flag(args_of(dep, "router"), "--selector").split(","))
        hit = sorted(d["metadata"]["name"] for d in engines
                     if selector_matches(sel, d["spec"]["template"]["metadata"]["labels"]))
        assert hit == by_pool[pool]
    # the PD route is matched on the model name GIE's body-based routing puts in a header
    route = one(docs, "HTTPRoute", "infernex-router-qwen3-32b-pd")
    assert route["spec"]["rules"][0]["matches"][0]["headers"] == [
        {"type": "Exact", "name": "X-Gateway-Model-Name", "value": "Qwen/Qwen3-32B"}]


def test_the_rendered_llmd_profiles_load_as_strategies(tmp_path):
    docs = seed("epp")
    cm = one(docs, "ConfigMap", "infernex-router-profiles")
    kinds = {}
    for fname, text in cm["data"].items():
        p = tmp_path / fname
        p.write_text(text)
        st = load_strategy_file(p)
        kinds[fname] = st.pd
    assert kinds == {"kv-aware.yaml": False, "pd-kv-aware.yaml": True}


def test_seed_keys_take_effect():
    docs = seed("epp")
    router = one(docs, "Deployment", "infernex-router")
    c = container(router, "router")
    # hermes-router.inferenceExtension.image.hub/name + hermes-router.image.tag/pullPolicy
    assert c["image"] == "cr.openfuyao.cn/openfuyao/hermes-router:v0.20.0" and c["imagePullPolicy"] == "IfNotPresent"
    # hardware-diagnosis / hardware-monitor images.core
    diag = one(docs, "Deployment", "infernex-diagnosis")
    assert container(diag, "diagnosis")["image"] == "cr.openfuyao.cn/openfuyao/hardware-diagnosis:v0.20.0"
    assert container(diag, "diagnosis")["imagePullPolicy"] == "Always"
    collector = one(docs, "DaemonSet", "infernex-device-collector")
    assert container(collector, "collector")["image"] == "cr.openfuyao.cn/openfuyao/hardware-monitor:v0.20.0"
    # cache-indexer.app.serviceDiscovery.labelSelector: the backends the (shared) router discovers
    assert flag(c["args"], "--selector").startswith("inference-backend=true,openfuyao.com/engine=vllm,")
    # hardware-monitor-diagnosis.enabled: false turns both monitoring and diagnosis off
    off = seed("epp", "hardware-monitor-diagnosis.enabled=false")
    assert not [d for d in off if d["metadata"]["name"] in ("infernex-diagnosis", "infernex-device-collector")]


def test_pd_proxy_server_is_the_decode_sidecar_in_epp_mode():
    docs = seed("epp")
    dec = one(docs, "Deployment", "qwen3-32b-pd-decode")
    side = container(dec, "pd-sidecar")
    engine = container(dec, "engine")
    # the sidecar holds the pool's target port (pd.proxyServer.port); the engine moved to +100
    assert side["ports"] == [{"name": "http", "containerPort": 8000}]
    assert flag(engine["args"], "--port") == "8100"
    assert flag(side["args"], "--decode") == "http://127.0.0.1:8100"
    assert {p["containerPort"] for p in engine["ports"]} >= {8100}
    # prefill pods and aggregated pods have no sidecar; in proxy mode nobody has one
    for name in ("qwen3-32b-pd-prefill", "qwen3-8b"):
        assert "pd-sidecar" not in [c["name"] for c in one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]]
    proxy = one(seed("proxy"), "Deployment", "qwen3-32b-pd-decode")
    assert [c["name"] for c in proxy["spec"]["template"]["spec"]["containers"]].count("pd-sidecar") == 0
    # a proxy port the pool does not target would bypass the sidecar: refused with the reason
    bad = helm("template", "x", str(Path(SEED).parents[3] / "deploy" / "helm" / "infernex"), "-f", SEED,
               "--set", "hermes-router.mode=epp", "--set", "inference-backend.services[1].pd.proxyServer.port=8200",
               check=False)
    assert bad.returncode != 0 and "pd.proxyServer.port (8200) must be the InferencePool's target port" in bad.stderr
