"""The chart's PD engines per KV connector: the kv-transfer-config each connector's engine reads,
the ports its side channel needs, the router's matching ``router.pd`` settings, and one KV-event
stream name per data-parallel rank."""

from __future__ import annotations

import json

import pytest
import yaml

from deploytools import arg_value, arg_values, by_kind, container, helm, one, render, CHART

PD = "values-pd-2p2d.yaml"
SVC = "inference-backend.services[0]"


def _engines(docs):
    return {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"}


def _settings(docs) -> dict:
    return yaml.safe_load(next(cm["data"]["config.yaml"] for cm in by_kind(docs, "ConfigMap")
                               if "config.yaml" in (cm.get("data") or {})))


@pytest.mark.parametrize("conn,name,router_conn", [("mooncake-ascend", "MooncakeConnectorV1", "mooncake_ascend"),
                                                   ("mooncake", "MooncakeConnector", "mooncake"),
                                                   ("nixl", "NixlConnector", "nixl")])
def test_each_connector_renders_what_its_engine_reads(conn, name, router_conn):
    docs = render(PD, sets=[f"{SVC}.pd.connector={conn}"])
    engines = _engines(docs)
    for role, kv_role, port in (("prefill", "kv_producer", 28000), ("decode", "kv_consumer", 28100)):
        eng = container(next(d for n, d in engines.items() if n.endswith(role)), "engine")
        kvt = json.loads(arg_value(eng["args"], "--kv-transfer-config"))
        assert kvt["kv_connector"] == name
        # current vllm-ascend registers MooncakeConnectorV1 by name; the old module path is gone
        assert "kv_connector_module_path" not in kvt
        assert kvt["engine_id"] == "$(POD_NAME)"
        assert kvt["kv_role"] == ("kv_both" if conn == "nixl" else kv_role)
        env = {e["name"]: e.get("value") for e in eng["env"]}
        if conn == "mooncake-ascend":
            assert int(kvt["kv_port"]) == port and kvt["kv_connector_extra_config"]["prefill"]["dp_size"] == 1
        else:
            assert "kv_port" not in kvt and "kv_connector_extra_config" not in kvt
        if conn == "mooncake":
            assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(port)
        if conn == "nixl":
            assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
    pd = _settings(docs)["router"]["pd"]
    assert pd["connector"] == router_conn
    if conn == "mooncake":
        assert pd["bootstrap_port"] == 28000


def test_the_removed_module_path_is_dropped_and_noted():
    sets = [f"{SVC}.pd.kvTransferConfig.kv_connector_module_path=vllm_ascend.distributed.mooncake_connector"]
    proc = helm("template", "x", str(CHART), "-f", str(CHART / PD), "--set", sets[0], check=False)
    assert proc.returncode == 0, proc.stderr
    assert "vllm_ascend.distributed.mooncake_connector" not in proc.stdout
    notes = helm("install", "x", str(CHART), "-f", str(CHART / PD), "--set", sets[0], "--dry-run=client",
                 check=False)
    assert "kv_connector_module_path" in notes.stdout


def test_data_parallel_ranks_publish_under_their_own_names():
    docs = render(None, sets=[f"{SVC}.name=m", f"{SVC}.mode=aggregated", f"{SVC}.model.name=org/m",
                              f"{SVC}.openfuyao.model=m", f"{SVC}.aggregated.dataParallelSize=2"])
    dep = one(docs, "Deployment", "m")
    pods = [arg_values(c["args"], "--pod") for c in dep["spec"]["template"]["spec"]["containers"]
            if c["name"].startswith("kv-bridge")]
    assert pods == [["$(POD_NAME)-dp0", "$(POD_NAME)-dp1"]]  # one bridge process, each rank its own name
    single = render(None, sets=[f"{SVC}.name=m", f"{SVC}.mode=aggregated", f"{SVC}.model.name=org/m",
                                f"{SVC}.openfuyao.model=m"])
    dep = one(single, "Deployment", "m")
    assert arg_value(container(dep, "kv-bridge")["args"], "--pod") == "$(POD_NAME)"
