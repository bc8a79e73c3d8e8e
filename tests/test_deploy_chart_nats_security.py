"""The chart locks NATS and the indexer API down by default: per-component NATS users with
passwords in a Secret, TLS with a generated CA, an indexer API key. Rendered with helm, checked
with kubernetes-validate, and the rendered nats.conf run by a real nats-server that lets each
component in with its own credentials and CA, and nobody without."""

from __future__ import annotations

import base64
import os
import re
import subprocess

import pytest
import yaml

from deploytools import by_kind, helm_binary, one, pod_spec, render, validate_core
from infernex.embedded_nats import find_nats_server, free_port

USERS = ["router", "indexer", "sla-sink", "planner", "diagnosis", "collector", "bridge", "streams"]


@pytest.fixture(scope="module", autouse=True)
def _helm():
    helm_binary()


def _containers(docs):
    """(workload, container) for every container of every pod template and Job."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            for c in pod_spec(doc)["containers"]:
                yield doc, c


def _env(c) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def test_every_component_gets_its_own_user_and_the_ca():
    docs = render(None)
    secret = one(docs, "Secret", "infernex-nats-auth")
    assert sorted(secret["data"]) == sorted(USERS)
    assert len({v for v in secret["data"].values()}) == len(USERS)  # one password each
    seen = set()
    for doc, c in _containers(docs):
        env = _env(c)
        if doc["metadata"]["name"] == "infernex-nats":
            continue
        if "INFERNEX_NATS__SERVERS" not in env:
            continue  # engines and other non-NATS containers
        user = env["INFERNEX_NATS__USER"]["value"]
        ref = env["INFERNEX_NATS__PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "infernex-nats-auth", "key": user}
        assert env["INFERNEX_NATS__TLS__CA_PEM"]["valueFrom"]["secretKeyRef"] == {"name": "infernex-nats-tls",
                                                                                 "key": "ca.crt"}
        seen.add(user)
    assert {"router", "indexer", "sla-sink", "diagnosis", "collector", "streams"} <= seen  # planner: off by default
    nats = one(docs, "StatefulSet", "infernex-nats")
    env = _env(pod_spec(nats)["containers"][0])
    for u in USERS:
        name = u.upper().replace("-", "_") + "_PASSWORD"
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "infernex-nats-auth", "key": u}
    tls = one(docs, "Secret", "infernex-nats-tls")
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}


def test_indexer_api_needs_a_key_and_binds_where_told():
    docs = render(None)
    cm = yaml.safe_load(one(docs, "ConfigMap", "infernex-config")["data"]["config.yaml"])
    assert cm["indexer"]["api_keys_file"] == "/etc/infernex/indexer-auth/api-keys"
    assert cm["indexer"]["max_route_ttl_s"] == 600
    dep = one(docs, "Deployment", "cache-indexer")
    c = pod_spec(dep)["containers"][0]
    assert "/etc/infernex/indexer-auth" in [m["mountPath"] for m in c["volumeMounts"]]
    vol = {v["name"]: v for v in pod_spec(dep)["volumes"]}["api-keys"]
    assert vol["secret"]["secretName"] == "infernex-indexer-api-keys"
    assert base64.b64decode(one(docs, "Secret", "infernex-indexer-api-keys")["data"]["api-keys"])
    i = c["args"].index("--http-host")
    assert c["args"][i + 1] == "0.0.0.0"


@pytest.mark.parametrize("sets", [
    (),
    ("nats.auth.enabled=false", "nats.tls.enabled=false", "cache-indexer.auth.enabled=false"),
    ("nats.auth.existingSecret=my-nats-users", "nats.tls.existingSecret=my-nats-cert",
     "cache-indexer.auth.existingSecret=my-keys", "nats.replicas=3"),
])
def test_variants_render_valid_manifests(sets):
    docs = render(None, sets=sets)
    for doc in docs:
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        if group in ("monitoring.coreos.com", "gateway.networking.k8s.io", "inference.networking.k8s.io"):
            continue
        validate_core(doc, "1.33.0")
    conf = one(docs, "ConfigMap", "infernex-nats-config")["data"]["nats.conf"]
    if not sets:
        return
    if "nats.auth.enabled=false" in sets:
        assert "authorization" not in conf and "tls {" not in conf
        assert not [d for d in by_kind(docs, "Secret") if "nats" in d["metadata"]["name"]]
        for _doc, c in _containers(docs):
            assert "INFERNEX_NATS__USER" not in _env(c)
    else:
        assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].startswith("infernex-")]
        assert conf.count("tls {") == 2  # clients, and mutual TLS between the 3 servers
        nats = one(docs, "StatefulSet", "infernex-nats")
        assert {v["name"]: v for v in pod_spec(nats)["volumes"]}["tls"]["secret"]["secretName"] == "my-nats-cert"


def test_the_rendered_nats_conf_admits_each_component_and_nobody_else(tmp_path):
    import asyncio

    from consumers import bus
    from schemas.config import NatsConfig, NatsTls

    docs = render(None)
    conf = one(docs, "ConfigMap", "infernex-nats-config")["data"]["nats.conf"]
    tls = {k: base64.b64decode(v) for k, v in one(docs, "Secret", "infernex-nats-tls")["data"].items()}
    pw = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", "infernex-nats-auth")["data"].items()}
    for name, data in tls.items():
        (tmp_path / name).write_bytes(data)
    port = free_port()
    conf = conf.replace("/etc/nats-tls", str(tmp_path)).replace("/data", str(tmp_path / "js"))
    conf = re.sub(r"(?m)^port: \d+", f"port: {port}", conf)
    conf = re.sub(r"(?m)^http_port: \d+", f"http_port: {free_port()}", conf)
    (tmp_path / "nats.conf").write_text(conf)
    env = dict(os.environ, SERVER_NAME="nats-0",
               **{u.upper().replace("-", "_") + "_PASSWORD": p for u, p in pw.items()})
    proc = subprocess.Popen([str(find_nats_server()), "-c", str(tmp_path / "nats.conf"), "-a", "127.0.0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ca = tls["ca.crt"].decode()
    svc = f"infernex-nats.{one(docs, 'Service', 'infernex-nats')['metadata']['namespace']}.svc"

    def cfg(user=None, password=None, with_tls=True):
        return NatsConfig(servers=[f"nats://127.0.0.1:{port}"], user=user, password=password, connect_timeout_s=1,
                          max_reconnect_attempts=0,
                          tls=NatsTls(ca_pem=ca, server_name=svc) if with_tls else None)

    async def check():
        import socket
        import time

        deadline = time.monotonic() + 15
        while True:  # up when the port accepts
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, \
                    "nats-server with the chart's config did not start: " + proc.stdout.read1(4000).decode()
                await asyncio.sleep(0.1)
        for user in USERS:
            nc = await bus.connect(cfg(user, pw[user]))
            await nc.jetstream().account_info()  # JetStream works for each user
            await nc.close()
        for bad in (cfg(), cfg("router", pw["indexer"]), cfg("indexer", pw["indexer"], with_tls=False)):
            with pytest.raises(ConnectionError):
                await bus.connect(bad)

    try:
        asyncio.run(check())
    finally:
        proc.kill()
        proc.wait(10)
