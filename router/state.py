"""The router's view of the cluster: backends from every discovery source, with load, health,
circuit-breaker and in-flight bookkeeping folded into persistent ``BackendState`` objects.

Single-threaded (asyncio): the request path reads :meth:`ClusterState.snapshot`, event handlers
call ``apply_*``. No locks, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from router.config import RouterConfig, StaticBackend
from router.resilience import CircuitBreakers
from router.types import BackendState
from schemas.announce import EngineAnnouncement
from schemas.device import DeviceTelemetry
from schemas.diagnosis import Diagnosis
from schemas.metrics import EngineMetrics
from streams.backends import AnnouncedBackends
from streams.clock import Clock, SystemClock
from streams.health import PodHealthView
from streams.load import LoadState


def backend_from_static(b: StaticBackend, pool: str) -> BackendState:
    return BackendState(pod=b.pod, url=b.url.rstrip("/"), model=b.model, role=b.role, group=b.group, pool=pool,
                        loras=frozenset(b.loras), node=b.node, source="static", max_inflight=b.max_inflight)


class ClusterState:
    def __init__(self, cfg: RouterConfig | None = None, *, clock: Clock | None = None,
                 breakers: CircuitBreakers | None = None):
        cfg = cfg or RouterConfig()
        self.pool = cfg.pool
        self.clock = clock or SystemClock()
        self.breakers = breakers or CircuitBreakers(cfg.breaker_failures, cfg.breaker_cooldown_s, self.clock)
        self.load = LoadState(self.clock, cfg.metrics_stale_s)
        self.health = PodHealthView()
        self.announced = AnnouncedBackends(self.clock)
        self._static = {b.pod: backend_from_static(b, cfg.pool) for b in cfg.backends}
        self._kube: dict[str, BackendState] = {}
        self._devices: dict[tuple[str, str], DeviceTelemetry] = {}
        self._stale_s = cfg.metrics_stale_s
        self._backends: dict[str, BackendState] = {}
        self._list: list[BackendState] = []
        self._lora_base: dict[str, str] = {}  # LoRA adapter -> base model
        self._marked = False  # some circuit_open flag may be set
        # the other replicas' own load per pod (router.replica_sync), included in each backend's
        # inflight / active_tokens / pending_prefill_tokens beside this replica's own
        self._peer: dict[str, list[int]] = {}
        self.on_own_change: Callable[[], None] | None = None  # called when this replica's own counts change
        # called with (backend, change of its in-flight count) when another replica's count changes
        self.on_peer_change: Callable[[BackendState, int], None] | None = None
        # changes whenever a backend's load or health fields may have changed (Router.decide's load_epoch)
        self.epoch = 0
        self.refresh()

    # -- discovery sources ------------------------------------------------------------
    def add_static(self, b: BackendState) -> None:
        self._static[b.pod] = b
        self.refresh()

    def set_kube(self, pod: str, b: BackendState | None) -> None:
        if b is None:
            self._kube.pop(pod, None)
        else:
            self._kube[pod] = b
        self.refresh()

    def kube_pods(self) -> list[str]:
        return list(self._kube)

    def apply_announcement(self, a: EngineAnnouncement) -> None:
        self.announced.apply(a)
        self.health.apply(a)
        self.refresh()

    # -- load and health --------------------------------------------------------------
    def apply_metrics(self, m: EngineMetrics) -> None:
        if self.load.apply(m):
            b = self._backends.get(m.pod)
            if b is not None:
                self._set_load(b)
                self.epoch += 1

    def apply_device(self, t: DeviceTelemetry) -> None:
        """Device utilisation and memory feed the health score's cpu and mem terms."""
        key = (t.node, t.device)
        old = self._devices.get(key)
        if old is not None and old.ts > t.ts:
            return
        self._devices[key] = t
        self.epoch += 1
        for b in self._list:
            if b.pod in t.pods or (b.node == t.node and t.device in self._placement(b.pod)):
                self._set_device(b)

    def _placement(self, pod: str) -> frozenset[str]:
        for a in self.announced.alive():
            if a.pod == pod:
                return frozenset(a.devices)
        return frozenset()

    def _set_device(self, b: BackendState) -> None:
        now = self.clock.now()
        devs = self._placement(b.pod)
        util = mem = None
        for (node, dev), t in self._devices.items():
            if now - t.ts > self._stale_s:
                continue
            if b.pod in t.pods or (node == b.node and dev in devs):
                if t.utilization_pct is not None:
                    u = t.utilization_pct / 100.0
                    util = u if util is None else max(util, u)
                if t.memory_used_mb is not None and t.memory_total_mb:
                    m = t.memory_used_mb / t.memory_total_mb
                    mem = m if mem is None else max(mem, m)
        b.cpu_util, b.mem_util = util, mem

    def apply_diagnosis(self, d: Diagnosis) -> None:
        self.health.apply(d)
        self.epoch += 1
        for b in self._list:
            b.health = self.health.status(b.pod)[0]

    def _set_load(self, b: BackendState) -> None:
        ld = self.load.get(b.pod)
        if ld is None:
            b.waiting = b.running = b.kv_usage = 0.0
            b.num_gpu_blocks = None
        else:
            b.waiting, b.running, b.kv_usage, b.num_gpu_blocks = ld.waiting, ld.running, ld.kv_usage, ld.num_gpu_blocks

    def refresh(self) -> None:
        """Rebuild the backend set from all sources (keeping each pod's object and counters)."""
        merged: dict[str, BackendState] = {}
        for a in self.announced.alive():
            if a.pool != self.pool:
                continue
            merged[a.pod] = BackendState(pod=a.pod, url=a.url.rstrip("/"), model=a.model, role=a.role,
                                         group=a.group, pool=a.pool, node=a.node, draining=a.state == "draining",
                                         source="bus", max_num_seqs=a.max_num_seqs)
        merged.update(self._kube)
        merged.update(self._static)
        out: dict[str, BackendState] = {}
        for pod, new in merged.items():
            old = self._backends.get(pod)
            if old is not None:
                for f in ("url", "model", "role", "group", "pool", "loras", "node", "draining", "source",
                          "max_inflight", "max_num_seqs"):
                    setattr(old, f, getattr(new, f))
                new = old
            else:
                peer = self._peer.get(pod)
                if peer is not None:  # a pod the other replicas already have requests on
                    new.inflight, new.active_tokens, new.pending_prefill_tokens = peer
            self._set_load(new)
            if self._devices:
                self._set_device(new)
            new.health = self.health.status(pod)[0]
            out[pod] = new
        self._backends = out
        self._list = list(out.values())
        self._lora_base = {a: b.model for b in self._list for a in b.loras if a != b.model}
        self.epoch += 1

    def lora_base(self, model: str) -> str | None:
        """The base model of a LoRA adapter some backend serves (None for a base model)."""
        return self._lora_base.get(model) if self._lora_base else None

    def snapshot(self) -> list[BackendState]:
        br = self.breakers
        if br.active:
            for b in self._list:
                b.circuit_open = br.is_open(b.pod)
                b.circuit_until = br.open_until(b.pod) if b.circuit_open else 0.0
            self._marked = True
        elif self._marked:  # every breaker closed since the last snapshot: clear the flags once
            for b in self._list:
                b.circuit_open = False
                b.circuit_until = 0.0
            self._marked = False
        return self._list

    def get(self, pod: str) -> BackendState | None:
        return self._backends.get(pod)

    # -- the router's own bookkeeping ---------------------------------------------------
    def started(self, b: BackendState, prompt_tokens: int, prefill_tokens: int) -> None:
        b.inflight += 1
        b.active_tokens += prompt_tokens
        b.pending_prefill_tokens += prefill_tokens
        if self.on_own_change is not None:
            self.on_own_change()

    def first_token(self, b: BackendState, prefill_tokens: int) -> None:
        b.pending_prefill_tokens = max(0, b.pending_prefill_tokens - prefill_tokens)
        if self.on_own_change is not None:
            self.on_own_change()

    def finished(self, b: BackendState, prompt_tokens: int, prefill_tokens_left: int) -> None:
        b.inflight = max(0, b.inflight - 1)
        b.active_tokens = max(0, b.active_tokens - prompt_tokens)
        b.pending_prefill_tokens = max(0, b.pending_prefill_tokens - prefill_tokens_left)
        if self.on_own_change is not None:
            self.on_own_change()

    # -- the other replicas' load (router.replica_sync) ---------------------------------
    def add_peer_load(self, pod: str, inflight: int, active_tokens: int, pending_prefill_tokens: int) -> None:
        """Add another replica's change of its own load on ``pod`` (negative to take it away)."""
        peer = self._peer.setdefault(pod, [0, 0, 0])
        peer[0] += inflight
        peer[1] += active_tokens
        peer[2] += pending_prefill_tokens
        b = self._backends.get(pod)
        if b is not None:
            b.inflight = max(0, b.inflight + inflight)
            b.active_tokens = max(0, b.active_tokens + active_tokens)
            b.pending_prefill_tokens = max(0, b.pending_prefill_tokens + pending_prefill_tokens)
            if inflight and self.on_peer_change is not None:
                self.on_peer_change(b, inflight)
        if peer == [0, 0, 0]:
            del self._peer[pod]

    def peer_load(self, pod: str) -> tuple[int, int, int]:
        """The other replicas' share of ``pod``'s counts: (in flight, prompt tokens, not yet prefilled)."""
        q = self._peer.get(pod)
        return (q[0], q[1], q[2]) if q is not None else (0, 0, 0)

    def own_load(self) -> dict[str, tuple[int, int, int]]:
        """This replica's own load per pod (what it tells the other replicas): every pod where it
        has requests in flight, without the other replicas' share."""
        out = {}
        peers = self._peer
        for b in self._list:
            i, a, p = b.inflight, b.active_tokens, b.pending_prefill_tokens
            if not (i or a or p):
                continue
            q = peers.get(b.pod)
            if q is not None:
                i, a, p = max(0, i - q[0]), max(0, a - q[1]), max(0, p - q[2])
                if not (i or a or p):
                    continue
            out[b.pod] = (i, a, p)
        return out
