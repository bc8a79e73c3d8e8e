"""Kubernetes discovery: engine pods by label selector, with a watch (not polling).

Roles and groups come from labels (``openfuyao.com/pdRole`` or ``llm-d.ai/role``,
``openfuyao.com/pdGroupID``), the model from ``openfuyao.com/model`` (or the configured default).
A pod counts when it has an IP and its ``Ready`` condition is true. The official ``kubernetes``
client is synchronous, so the list+watch loop runs in a thread and hands each change to the
event loop; the watch resumes from the last resourceVersion and relists when it expired (410).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from router.config import KubernetesDiscovery
from router.state import ClusterState
from router.types import BackendState

log = logging.getLogger(__name__)

_ROLE_ALIASES = {"prefill": "prefill", "decode": "decode", "aggregated": "aggregated", "both": "aggregated",
                 "prefill-decode": "aggregated"}


def _get(obj: Any, *path: str) -> Any:
    for p in path:
        if obj is None:
            return None
        obj = obj.get(p) if isinstance(obj, dict) else getattr(obj, p, None)
    return obj


def pod_to_backend(pod: Any, cfg: KubernetesDiscovery, pool: str = "default") -> BackendState | None:
    """A pod (client object or plain dict) -> backend, or None when it is not usable yet."""
    name = _get(pod, "metadata", "name")
    labels = _get(pod, "metadata", "labels") or {}
    ip = _get(pod, "status", "pod_ip") or _get(pod, "status", "podIP")
    if not name or not ip or _get(pod, "metadata", "deletion_timestamp") or _get(pod, "metadata",
                                                                                    "deletionTimestamp"):
        return None
    conds = _get(pod, "status", "conditions") or []
    if not any(_get(c, "type") == "Ready" and str(_get(c, "status")) == "True" for c in conds):
        return None
    model = labels.get(cfg.model_label) or cfg.default_model
    if not model:
        return None
    role = "aggregated"
    for lab in cfg.role_labels:
        if lab in labels:
            role = _ROLE_ALIASES.get(labels[lab].lower(), "aggregated")
            break
    return BackendState(pod=name, url=f"http://{ip}:{cfg.port}", model=model, role=role,
                        group=labels.get(cfg.group_label), pool=pool, node=_get(pod, "spec", "node_name"),
                        source="kubernetes")


class KubeDiscovery:
    def __init__(self, cfg: KubernetesDiscovery, state: ClusterState, *, pool: str = "default", api: Any = None):
        self.cfg = cfg
        self.state = state
        self.pool = pool
        self._api = api
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = None
        self.events = 0

    def _client(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        api = await asyncio.to_thread(self._client)
        self._thread = threading.Thread(target=self._run, args=(api, loop), name="kube-discovery", daemon=True)
        self._thread.start()

    def _apply(self, kind: str, pod: Any) -> None:
        self.events += 1
        name = _get(pod, "metadata", "name")
        b = None if kind == "DELETED" else pod_to_backend(pod, self.cfg, self.pool)
        self.state.set_kube(name, b)

    def _prune(self, seen: set[str]) -> None:
        for pod in [p for p in self.state.kube_pods() if p not in seen]:
            self.state.set_kube(pod, None)

    def _run(self, api, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_pod(self.cfg.namespace, label_selector=self.cfg.label_selector)
                seen = set()
                for pod in listed.items:
                    seen.add(pod.metadata.name)
                    loop.call_soon_threadsafe(self._apply, "ADDED", pod)
                loop.call_soon_threadsafe(self._prune, seen)
                rv = listed.metadata.resource_version
                self._watch = watch.Watch()
                for ev in self._watch.stream(api.list_namespaced_pod, self.cfg.namespace,
                                             label_selector=self.cfg.label_selector, resource_version=rv,
                                             timeout_seconds=60):
                    if self._stop.is_set():
                        break
                    loop.call_soon_threadsafe(self._apply, ev["type"], ev["object"])
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("kubernetes discovery: %s; retrying", exc.reason)
                    self._stop.wait(2.0)
            except Exception as exc:  # noqa: BLE001 - keep watching; the outage is logged, not hidden
                if self._stop.is_set():
                    break
                log.warning("kubernetes discovery failed (%s); retrying", type(exc).__name__)
                self._stop.wait(2.0)

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
