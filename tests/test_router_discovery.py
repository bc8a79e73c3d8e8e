"""Kubernetes discovery: pod -> backend mapping (table-driven) and the list+watch loop against
the ``kmock`` Kubernetes emulator with the official client."""

from __future__ import annotations

import pytest

from router.config import KubernetesDiscovery, RouterConfig
from router.discovery import KubeDiscovery, pod_to_backend
from router.state import ClusterState
from router.testing import wait_for

CFG = KubernetesDiscovery(enabled=True, namespace="ai", port=8000)


def pod(name, labels=None, ip="10.0.0.5", ready=True, deleting=False):
    meta = {"name": name, "namespace": "ai", "labels": labels if labels is not None else {"openfuyao.com/model": "m"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [{"name": "c", "image": "x"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@pytest.mark.parametrize("p,expect", [
    (pod("a"), ("a", "http://10.0.0.5:8000", "m", "aggregated", None)),
    (pod("p", {"openfuyao.com/model": "m", "openfuyao.com/pdRole": "prefill", "openfuyao.com/pdGroupID": "g1"}),
     ("p", "http://10.0.0.5:8000", "m", "prefill", "g1")),
    (pod("d", {"openfuyao.com/model": "m", "llm-d.ai/role": "decode"}), ("d", "http://10.0.0.5:8000", "m", "decode", None)),
    (pod("x", {"openfuyao.com/model": "m", "llm-d.ai/role": "both"}), ("x", "http://10.0.0.5:8000", "m", "aggregated", None)),
    (pod("noip", ip=None), None),
    (pod("notready", ready=False), None),
    (pod("going", deleting=True), None),
    (pod("nomodel", {}), None),
])
def test_pod_to_backend(p, expect):
    b = pod_to_backend(p, CFG)
    assert (None if b is None else (b.pod, b.url, b.model, b.role, b.group)) == expect


async def test_watch_adds_and_removes_pods(kmock):
    from kubernetes import client

    conf = client.Configuration(host=str(kmock.url).rstrip("/"))
    api = client.CoreV1Api(client.ApiClient(conf))
    res = ("v1", "pods")
    kmock.objects[res, "ai", "e1"] = pod("e1", {"openfuyao.com/model": "m", "openfuyao.com/pdRole": "decode",
                                                "openfuyao.com/pdGroupID": "g7"})
    state = ClusterState(RouterConfig(bus=False))
    disc = KubeDiscovery(CFG, state, api=api)
    await disc.start()
    try:
        assert await wait_for(lambda: state.get("e1") is not None, timeout=15)
        b = state.get("e1")
        assert (b.role, b.group, b.source) == ("decode", "g7", "kubernetes")
        await __import__("asyncio").to_thread(api.create_namespaced_pod, "ai", pod("e2", ip="10.0.0.6"))
        assert await wait_for(lambda: state.get("e2") is not None, timeout=15)
        assert state.get("e2").url == "http://10.0.0.6:8000"
        await __import__("asyncio").to_thread(api.delete_namespaced_pod, "e1", "ai")
        assert await wait_for(lambda: state.get("e1") is None, timeout=15)
        assert [x.pod for x in state.snapshot()] == ["e2"]
    finally:
        await disc.stop()
