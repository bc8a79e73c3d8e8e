"""``infernex planner``: every interval, read the SLA history, run each pool's
:class:`streams.planner.PoolPlanner`, publish a :class:`schemas.ScalingHint` to
``autoscale.hints.<pool>.<role>``, export ``infernex_desired_replicas{pool,role}`` (for KEDA/HPA),
and, when a Kubernetes target is configured, patch the Deployment's or
StatefulSet's ``scale`` subresource (in dry-run, the default, with ``dryRun=All``: validated by the
API server, not applied).

Current replicas come from the scale subresource when a target is configured, otherwise from the
last desired count (dry-run assumes hints are applied), starting at the policy's minimum.

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
from streams.clock import Clock
from streams.planner import KubernetesTarget, Observation, PerformanceProfile, PoolPlanner, RolePlan

log = logging.getLogger(__name__)

Publish = Callable[[ScalingHint], Awaitable[None]]


class KubeScaler:
    """Reads and patches ``apps/v1`` scale subresources (blocking client; call from a thread)."""

    def __init__(self, api_client: Any = None):
        from kubernetes import client

        self.apps = client.AppsV1Api(api_client)

    def get(self, target: KubernetesTarget) -> int:
        if target.kind == "Deployment":
            scale = self.apps.read_namespaced_deployment_scale(target.name, target.namespace)
        else:
            scale = self.apps.read_namespaced_stateful_set_scale(target.name, target.namespace)
        return int(scale.spec.replicas or 0)

    def set(self, target: KubernetesTarget, replicas: int, *, dry_run: bool = False) -> int:
        body = {"spec": {"replicas": int(replicas)}}
        kw = {"dry_run": "All"} if dry_run else {}
        if target.kind == "Deployment":
            scale = self.apps.patch_namespaced_deployment_scale(target.name, target.namespace, body, **kw)
        else:
            scale = self.apps.patch_namespaced_stateful_set_scale(target.name, target.namespace, body, **kw)
        return int(scale.spec.replicas or 0)


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
                 profiles: dict[str, PerformanceProfile] | None = None):
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
        self.current: dict[tuple[str, str], int] = {}
        self.desired_gauge = Gauge("infernex_desired_replicas", "Replicas the planner recommends",
                                   ["pool", "role"], registry=registry)
        self.current_gauge = Gauge("infernex_current_replicas", "Replicas the planner saw",
                                   ["pool", "role"], registry=registry)
        self.errors = Counter("infernex_planner_errors_total", "Planner ticks or patches that failed",
                              ["stage"], registry=registry)
        self.hints: list[ScalingHint] = []

    async def _current(self, pool: str, role: str) -> int:
        pc = self.planners[pool].cfg
        target = pc.kubernetes.get(role)  # type: ignore[call-overload]
        last = self.current.get((pool, role), pc.policy_for(role).min_replicas)
        if target is not None and self.kube is not None:
            try:
                n = await asyncio.to_thread(self.kube.get, target)
            except Exception as exc:  # noqa: BLE001 - counted; plan from the last count we saw
                self.errors.labels("read").inc()
                log.error("reading %s %s/%s scale failed: %s; using %d", target.kind, target.namespace,
                          target.name, exc, last)
                return last
            self.current[(pool, role)] = n
            return n
        return last

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
        hint = ScalingHint(pool=plan.pool, role=plan.role, ts=now, current=plan.current, desired=plan.desired,
                           reason=plan.reason, predictor=plan.predictor, mode=plan.mode, inputs=plan.inputs)
        self.desired_gauge.labels(plan.pool, plan.role).set(plan.desired)
        self.current_gauge.labels(plan.pool, plan.role).set(plan.current)
        target = self.planners[plan.pool].cfg.kubernetes.get(plan.role)
        if target is not None and self.kube is not None and plan.desired != plan.current:
            try:
                await asyncio.to_thread(self.kube.set, target, plan.desired, dry_run=self.pcfg.dry_run)
                log.info("%s %s/%s scale %d -> %d%s", target.kind, target.namespace, target.name,
                         plan.current, plan.desired, " (dry-run)" if self.pcfg.dry_run else "")
            except Exception as exc:  # noqa: BLE001 - the hint is still published; counted and logged
                self.errors.labels("patch").inc()
                log.error("patching %s %s/%s failed: %s", target.kind, target.namespace, target.name, exc)
        if target is None or self.kube is None:
            self.current[(plan.pool, plan.role)] = plan.desired
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
            self.current[(h["pool"], h["role"])] = h["desired"]
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
