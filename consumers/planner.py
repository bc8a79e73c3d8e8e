"""``infernex planner``: every interval, read the SLA history, run each pool's
:class:`streams.planner.PoolPlanner`, publish a :class:`schemas.ScalingHint` to
``autoscale.hints.<pool>.<role>``, export ``infernex_desired_replicas{pool,role}`` (for KEDA/HPA),
and, when a Kubernetes target is configured, patch the Deployment's or
StatefulSet's ``scale`` subresource (in dry-run, the default, with ``dryRun=All``: validated by the
API server, not applied).

Current replicas are what the cluster runs, never the planner's own last output: the scale target
when one is configured (a Deployment's or StatefulSet's scale subresource, a Kthena ``ModelServing``
role's ``replicas``, or a simulator's control API), else the engines alive on the bus
(``engine.announce.*``) for that pool and role; with neither, the role policy's ``min_replicas`` as a
fixed assumption (said in every hint's reason).

A restarted planner is not cold: :meth:`PlannerService.warm_up` reads the last intervals back from
the SLA history (predictors) and the hints it published (scaler windows, last desired counts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from consumers import sla_queries
from consumers.sla_store import SlaConfig, SlaStore
from schemas import ScalingHint
from schemas import subjects as S
from streams.backends import AnnouncedBackends
from streams.clock import Clock
from streams.planner import KubernetesTarget, Observation, PerformanceProfile, PoolPlanner, RolePlan

log = logging.getLogger(__name__)

Publish = Callable[[ScalingHint], Awaitable[None]]


MODELSERVING = ("workload.serving.volcano.sh", "v1alpha1", "modelservings")  # Kthena


class KubeScaler:
    """Reads and patches ``apps/v1`` scale subresources and Kthena ``ModelServing`` role replicas
    (``spec.template.roles[i].replicas``, by a JSON patch that first tests the role's name);
    blocking client, call from a thread."""

    def __init__(self, api_client: Any = None):
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def _role_index(self, target: KubernetesTarget, role: str | None) -> tuple[int, str, int]:
        name = target.role_name or role
        obj = self.custom.get_namespaced_custom_object(*MODELSERVING[:2], target.namespace, MODELSERVING[2],
                                                       target.name)
        roles = ((obj.get("spec") or {}).get("template") or {}).get("roles") or []
        for i, r in enumerate(roles):
            if r.get("name") == name:
                return i, name, int(r.get("replicas", 1))
        raise LookupError(f"ModelServing {target.namespace}/{target.name} has no role {name!r} "
                          f"(roles: {', '.join(str(r.get('name')) for r in roles) or 'none'})")

    def get(self, target: KubernetesTarget, role: str | None = None) -> int:
        if target.kind == "ModelServing":
            return self._role_index(target, role)[2]
        if target.kind == "Deployment":
            scale = self.apps.read_namespaced_deployment_scale(target.name, target.namespace)
        else:
            scale = self.apps.read_namespaced_stateful_set_scale(target.name, target.namespace)
        return int(scale.spec.replicas or 0)

    def set(self, target: KubernetesTarget, replicas: int, *, dry_run: bool = False, role: str | None = None) -> int:
        kw = {"dry_run": "All"} if dry_run else {}
        if target.kind == "ModelServing":
            i, name, _ = self._role_index(target, role)
            patch = [{"op": "test", "path": f"/spec/template/roles/{i}/name", "value": name},
                     {"op": "replace", "path": f"/spec/template/roles/{i}/replicas", "value": int(replicas)}]
            obj = self.custom.patch_namespaced_custom_object(*MODELSERVING[:2], target.namespace, MODELSERVING[2],
                                                             target.name, patch, _content_type="application/json-patch+json",
                                                             **kw)
            return int(obj["spec"]["template"]["roles"][i].get("replicas", replicas))
        body = {"spec": {"replicas": int(replicas)}}
        if target.kind == "Deployment":
            scale = self.apps.patch_namespaced_deployment_scale(target.name, target.namespace, body, **kw)
        else:
            scale = self.apps.patch_namespaced_stateful_set_scale(target.name, target.namespace, body, **kw)
        return int(scale.spec.replicas or 0)


class SimulatorScaler:
    """The simulator's control API (:mod:`simulator.control`) as a scale target (blocking; thread)."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s

    def get(self, base_url: str, role: str) -> int:
        import httpx

        r = httpx.get(f"{base_url.rstrip('/')}/control/replicas/{role}", timeout=self.timeout_s)
        r.raise_for_status()
        return int(r.json()["replicas"])

    def set(self, base_url: str, role: str, replicas: int, *, dry_run: bool = False) -> int:
        import httpx

        r = httpx.put(f"{base_url.rstrip('/')}/control/replicas/{role}", json={"replicas": int(replicas)},
                      params={"dryRun": "All"} if dry_run else None, timeout=self.timeout_s)
        r.raise_for_status()
        return int(r.json()["replicas"])


def announced_replicas(announced: AnnouncedBackends, pool: str, role: str) -> int | None:
    """Engines of ``pool`` in ``role`` alive on the bus; None when the pool never announced any."""
    alive = [a for a in announced.alive() if a.pool == pool]
    if not alive and not any(a.pool == pool for a in announced.dump()):
        return None
    return sum(1 for a in alive if a.role == role and a.state == "up")


def nats_publisher(js, prefix: str | None) -> Publish:  # noqa: ANN001
    from consumers import bus

    async def publish(hint: ScalingHint) -> None:
        subject = S.with_prefix(prefix, S.autoscale_hints(hint.pool, hint.role))
        await bus.publish(js, subject, hint.to_json(), msg_id=f"{hint.pool}:{hint.role}:{hint.ts:.3f}")

    return publish


def observation(rows: list[dict[str, Any]], interval_s: float) -> Observation:
    """One pool's interval from :func:`consumers.sla_queries.sla_summary` rows (any record roles)."""
    n = sum(r["requests"] for r in rows)
    if n == 0:
        return Observation(rate=0.0, isl=0.0, osl=0.0)

    def wavg(key: str) -> float | None:
        vals = [(r[key], r["requests"]) for r in rows if r.get(key) is not None]
        w = sum(c for _, c in vals)
        return sum(v * c for v, c in vals) / w if w else None

    return Observation(rate=n / interval_s, isl=wavg("isl") or 0.0, osl=wavg("osl") or 0.0,
                       ttft_s=wavg("ttft_mean"), itl_s=wavg("itl_mean"), attainment=wavg("attainment"))


class PlannerService:
    def __init__(self, store: SlaStore, cfg: SlaConfig, *, clock: Clock, publish: Publish | None = None,
                 registry: CollectorRegistry | None = None, kube: KubeScaler | None = None,
                 profiles: dict[str, PerformanceProfile] | None = None,
                 announced: AnnouncedBackends | None = None, simulator: SimulatorScaler | None = None):
        self.store = store
        self.cfg = cfg
        self.pcfg = cfg.planner
        self.clock = clock
        self.publish = publish
        self.kube = kube
        self.planners = {
            p.pool: PoolPlanner(p, targets=cfg.targets, predictor=self.pcfg.predictor,
                                predictor_options=self.pcfg.predictor_options, interval_s=self.pcfg.interval_s,
                                profile=(profiles or {}).get(p.pool))
            for p in self.pcfg.pools
        }
        self.announced = announced
        self.sim = simulator or SimulatorScaler()
        self.current: dict[tuple[str, str], int] = {}  # the last count read from the cluster
        self.current_source: dict[tuple[str, str], str] = {}
        self._assumed_warned: set[tuple[str, str]] = set()
        self.desired_gauge = Gauge("infernex_desired_replicas", "Replicas the planner recommends",
                                   ["pool", "role"], registry=registry)
        self.current_gauge = Gauge("infernex_current_replicas", "Replicas the planner saw",
                                   ["pool", "role"], registry=registry)
        self.errors = Counter("infernex_planner_errors_total", "Planner ticks or patches that failed",
                              ["stage"], registry=registry)
        self.hints: list[ScalingHint] = []

    async def _current(self, pool: str, role: str) -> int:
        """What the cluster runs for (pool, role); see the module docstring for the sources."""
        pc = self.planners[pool].cfg
        key = (pool, role)
        target = pc.kubernetes.get(role)  # type: ignore[call-overload]
        assumed = pc.policy_for(role).min_replicas
        try:
            if target is not None and self.kube is not None:
                n, src = await asyncio.to_thread(self.kube.get, target, role), target.kind
            elif pc.simulator:
                n, src = await asyncio.to_thread(self.sim.get, pc.simulator, role), "simulator"
            else:
                n = announced_replicas(self.announced, pool, role) if self.announced is not None else None
                src = "announcements"
                if n is None:
                    if key not in self._assumed_warned:
                        self._assumed_warned.add(key)
                        log.warning("pool %s role %s: no scale target and no engine announcements; assuming "
                                    "%d replicas", pool, role, assumed)
                    self.current_source[key] = "assumed"
                    return assumed
        except Exception as exc:  # noqa: BLE001 - counted; plan from the last count the cluster gave
            self.errors.labels("read").inc()
            last = self.current.get(key, assumed)
            log.error("reading the replicas of %s/%s failed: %s; using %d", pool, role, exc, last)
            self.current_source[key] = "last-read"
            return last
        self.current[key] = n
        self.current_source[key] = src
        return n

    async def tick(self) -> list[ScalingHint]:
        now = self.clock.now()
        interval = self.pcfg.interval_s
        rows = await asyncio.to_thread(sla_queries.sla_summary, self.store, now - interval, now,
                                       targets=self.cfg.targets)
        out = []
        for pool, planner in self.planners.items():
            obs = observation([r for r in rows if r["pool"] == pool], interval)
            current = {role: await self._current(pool, role) for role in planner.cfg.roles}
            for plan in planner.apply(obs, current, now):
                out.append(await self._emit(plan, now))
        self.hints.extend(out)
        return out

    async def _emit(self, plan: RolePlan, now: float) -> ScalingHint:
        src = self.current_source.get((plan.pool, plan.role), "?")
        hint = ScalingHint(pool=plan.pool, role=plan.role, ts=now, current=plan.current, desired=plan.desired,
                           reason=f"{plan.reason}; current {plan.current} from {src}", predictor=plan.predictor,
                           mode=plan.mode, inputs=plan.inputs)
        self.desired_gauge.labels(plan.pool, plan.role).set(plan.desired)
        self.current_gauge.labels(plan.pool, plan.role).set(plan.current)
        pc = self.planners[plan.pool].cfg
        target = pc.kubernetes.get(plan.role)
        if target is not None and self.kube is not None and plan.desired != plan.current:
            try:
                await asyncio.to_thread(self.kube.set, target, plan.desired, dry_run=self.pcfg.dry_run,
                                        role=plan.role)
                log.info("%s %s/%s %s scale %d -> %d%s", target.kind, target.namespace, target.name, plan.role,
                         plan.current, plan.desired, " (dry-run)" if self.pcfg.dry_run else "")
            except Exception as exc:  # noqa: BLE001 - the hint is still published; counted and logged
                self.errors.labels("patch").inc()
                log.error("patching %s %s/%s failed: %s", target.kind, target.namespace, target.name, exc)
        elif target is None and pc.simulator and plan.desired != plan.current:
            try:
                await asyncio.to_thread(self.sim.set, pc.simulator, plan.role, plan.desired,
                                        dry_run=self.pcfg.dry_run)
            except Exception as exc:  # noqa: BLE001 - as above
                self.errors.labels("patch").inc()
                log.error("scaling the simulator's %s engines failed: %s", plan.role, exc)
        if self.publish is not None:
            await self.publish(hint)
        return hint

    async def warm_up(self) -> int:
        """Rebuild what a restart lost from the SLA history: feed the predictors the last
        ``warmup_intervals`` intervals, and give each scaler its recent recommendations and each
        role its last desired count from the published hints. Returns the intervals read."""
        n = self.pcfg.warmup_intervals
        if n <= 0 or not self.planners:
            return 0
        now = self.clock.now()
        interval = self.pcfg.interval_s
        for k in range(n, 0, -1):
            since, until = now - k * interval, now - (k - 1) * interval
            rows = await asyncio.to_thread(sla_queries.sla_summary, self.store, since, until,
                                           targets=self.cfg.targets)
            for pool, planner in self.planners.items():
                planner.observe(observation([r for r in rows if r["pool"] == pool], interval))
        horizon = max((self.planners[p].cfg.policy_for(r).scale_down_window_s for p in self.planners
                       for r in self.planners[p].cfg.roles), default=0.0)
        hints = await asyncio.to_thread(sla_queries.recent_hints, self.store, now - max(horizon, n * interval))
        for h in hints:  # ordered by pool, role, ts
            planner = self.planners.get(h["pool"])
            if planner is None or h["role"] not in planner.scalers:
                continue
            rec = h["inputs"].get("recommended", h["desired"])
            planner.scalers[h["role"]].remember(h["ts"], int(rec), h["current"])
        log.info("planner warmed up from %d past intervals and %d hints", n, len(hints))
        return n

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.warm_up()
        except Exception as exc:  # noqa: BLE001 - start cold rather than not at all
            self.errors.labels("warmup").inc()
            log.error("planner warm-up from the SLA history failed: %s; starting cold", exc)
        while not stop.is_set():
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - one failed tick must not end the planner
                self.errors.labels("tick").inc()
                log.error("planner tick failed: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.pcfg.interval_s)
            except asyncio.TimeoutError:
                pass


async def follow_announcements(js, announced: AnnouncedBackends, *, prefix: str | None = None,  # noqa: ANN001
                               topology=None, registry: CollectorRegistry | None = None):  # noqa: ANN001
    """Keep ``announced`` up to date from ``engine.announce.*`` (last message per engine, then
    live); an announcement that does not decode goes to the dead-letter subject. Returns the
    subscription (unsubscribe to stop)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from consumers import bus
    from consumers.bus import DeadLetters
    from schemas import EngineAnnouncement, ValidationFailure
    from streams.topology import build_topology, stream_for_subject

    full = S.with_prefix(prefix, S.ALL_ENGINE_ANNOUNCE)
    spec = stream_for_subject(topology or build_topology(None, prefix), full)
    dead = DeadLetters(js, consumer="planner-announcements", registry=registry, prefix=prefix)
    stream = spec.logical if spec else "engine_announce"

    async def cb(msg) -> None:  # noqa: ANN001
        try:
            announced.apply(EngineAnnouncement.from_json(msg.data))
        except ValidationFailure as exc:
            subj = msg.subject[len(prefix) + 1:] if prefix else msg.subject
            try:
                await dead.send(stream, subj, msg.data, str(exc))
            except Exception as e:  # noqa: BLE001 - the feed must keep going
                log.warning("dead letter publish failed: %s", type(e).__name__)

    return await bus.while_unanswered(lambda: js.subscribe(
        full, cb=cb, ordered_consumer=True, stream=spec.name if spec else None,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)), f"subscribe to {full}")
