"""The planner service: hints on the bus (real nats-server), the desired-replicas gauge, and the
scale patch through the ``kubernetes`` client against kmock's emulated API server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from consumers import sla_queries as Q
from consumers.planner import KubeScaler, PlannerService, nats_publisher
from consumers.sla_store import ChdbStore, SlaConfig
from schemas import ScalingHint
from schemas import subjects as S
from streams.clock import ManualClock
from streams.planner import KubernetesTarget, PlannerConfig, PoolPlanConfig, ScalingPolicy

PROFILE_FILE = Path(__file__).resolve().parents[1] / "deploy" / "planner-profile.example.yaml"


@pytest.fixture
def store(tmp_path):
    s = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(s)
    yield s
    s.close()


def _load(store, start: float, seconds: float, rate: float) -> None:
    n = int(rate * seconds)
    store.insert_json_each_row("request_records", [json.dumps({
        "request_id": f"r{start}-{i}", "ts": start + seconds * i / n, "pool": "pool-a", "role": "pd", "model": "m",
        "prompt_tokens": 512, "output_tokens": 128, "ttft_s": 0.08, "itl_s": 0.02, "e2e_s": 2.6,
    }).encode() for i in range(n)])


def _cfg(dry_run=True, kubernetes=None) -> SlaConfig:
    pool = PoolPlanConfig(pool="pool-a", profile_file=PROFILE_FILE, kubernetes=kubernetes or {},
                          policy=ScalingPolicy(min_replicas=1, max_replicas=8))
    return SlaConfig(planner=PlannerConfig(interval_s=30, predictor="constant", pools=[pool], dry_run=dry_run))


async def test_hints_are_published_and_exported(store, nc, topology, prefix):
    js = nc.jetstream()
    clock = ManualClock(float(int(time.time()) - 600))
    _load(store, clock.now(), 30, 25)
    clock.advance(30)
    registry = CollectorRegistry()
    planner = PlannerService(store, _cfg(), clock=clock, publish=nats_publisher(js, prefix), registry=registry)
    sub = await js.subscribe(S.with_prefix(prefix, S.ALL_AUTOSCALE_HINTS), deliver_policy="all")
    hints = await planner.tick()
    got = {}
    for _ in hints:
        msg = await sub.next_msg(timeout=10)
        h = ScalingHint.from_json(msg.data)
        assert msg.subject == S.with_prefix(prefix, S.autoscale_hints("pool-a", h.role))
        got[h.role] = h
    await sub.unsubscribe()
    assert set(got) == {"prefill", "decode"}
    assert got["prefill"].desired == 2  # ceil(25 * 512 / 10000)
    assert got["decode"].desired > 1 and got["decode"].current == 1
    assert got["decode"].inputs["observed_rate"] == pytest.approx(25)
    for role, h in got.items():
        assert registry.get_sample_value("infernex_desired_replicas", {"pool": "pool-a", "role": role}) == h.desired
    # an empty interval: nothing crashes, and with no scale target and no engine announcements the
    # current count stays the stated assumption (min_replicas), never the planner's last output
    clock.advance(30)
    again = {h.role: h for h in await planner.tick()}
    assert again["decode"].current == 1 and "from assumed" in again["decode"].reason
    assert again["decode"].desired == 1


async def test_scale_subresource_is_patched_through_kubernetes_client(store, kmock):
    kubernetes = pytest.importorskip("kubernetes")
    import kmock as km

    def reset():
        kmock.objects["apps/v1/deployments", "llm", "pool-a-prefill"] = {"spec": {"replicas": 1}}
        kmock.objects["apps/v1/statefulsets", "llm", "pool-a-decode"] = {"spec": {"replicas": 1}}

    reset()
    conf = kubernetes.client.Configuration(host=str(kmock.url).rstrip("/"))
    api = kubernetes.client.ApiClient(conf)
    scaler = KubeScaler(api)
    targets = {"prefill": KubernetesTarget(kind="Deployment", name="pool-a-prefill", namespace="llm"),
               "decode": KubernetesTarget(kind="StatefulSet", name="pool-a-decode", namespace="llm")}

    def patches():
        return [(r.url.path, dict(r.params), r.data) for r in kmock if r.method == km.method.PATCH]

    clock = ManualClock(float(int(time.time()) - 600))
    _load(store, clock.now(), 30, 25)
    clock.advance(30)

    # dry-run: the API server is asked with dryRun=All (kmock does not emulate dry-run, so reset after)
    planner = PlannerService(store, _cfg(dry_run=True, kubernetes=targets), clock=clock,
                             registry=CollectorRegistry(), kube=scaler)
    hints = {h.role: h for h in await planner.tick()}
    assert hints["prefill"].current == 1 and hints["prefill"].desired == 2
    dry = patches()
    assert {p[0] for p in dry} == {"/apis/apps/v1/namespaces/llm/deployments/pool-a-prefill/scale",
                                   "/apis/apps/v1/namespaces/llm/statefulsets/pool-a-decode/scale"}
    assert all(p[1] == {"dryRun": "All"} for p in dry)
    reset()

    # applied: the scale subresources now hold the hints, and the next round reads them back
    planner = PlannerService(store, _cfg(dry_run=False, kubernetes=targets), clock=clock,
                             registry=CollectorRegistry(), kube=scaler)
    hints = {h.role: h for h in await planner.tick()}
    applied = patches()[len(dry):]
    assert len(applied) == 2 and all(p[1] == {} for p in applied)
    assert sorted(p[2]["spec"]["replicas"] for p in applied) == sorted(h.desired for h in hints.values())
    for role, target in targets.items():
        assert await asyncio.to_thread(scaler.get, target) == hints[role].desired
    assert hints["decode"].desired > 1
    clock.advance(30)
    _load(store, clock.now() - 30, 30, 25)
    nxt = {h.role: h for h in await planner.tick()}
    assert nxt["decode"].current == hints["decode"].desired
    assert len(patches()) == len(dry) + 2  # same load, same counts: no new patch
    api.close()


async def test_a_restarted_planner_warms_up_from_the_sla_history(store):
    now = float(int(time.time()) - 60)
    for k, rate in ((3, 10), (2, 20), (1, 40)):
        _load(store, now - 30 * k, 30, rate)
    cfg = _cfg()
    role = cfg.planner.pools[0].roles[0]
    store.insert_json_each_row("scaling_hints", [json.dumps({
        "pool": "pool-a", "role": role, "ts": now - 20, "current": 3, "desired": 5, "reason": "before restart",
        "predictor": "constant", "mode": "stable", "inputs": json.dumps({"recommended": 6.0}),
    }).encode()])

    cold = PlannerService(store, cfg.model_copy(update={"planner": cfg.planner.model_copy(
        update={"warmup_intervals": 0})}), clock=ManualClock(now))
    assert await cold.warm_up() == 0
    assert cold.planners["pool-a"].predicted()["rate"] == 0.0
    assert await cold._current("pool-a", role) == 1  # the policy's minimum

    warm = PlannerService(store, cfg.model_copy(update={"planner": cfg.planner.model_copy(
        update={"warmup_intervals": 3})}), clock=ManualClock(now))
    assert await warm.warm_up() == 3
    # the constant predictor forecasts the last interval it saw: the newest one before the restart
    assert warm.planners["pool-a"].predicted()["rate"] == pytest.approx(40.0)
    assert warm.planners["pool-a"].predicted()["isl"] == pytest.approx(512.0)
    # the last hint (desired 5) is the planner's own output, not what runs: current stays unknown
    assert await warm._current("pool-a", role) == 1 and warm.current_source[("pool-a", role)] == "assumed"
    assert list(warm.planners["pool-a"].scalers[role]._history) == [(now - 20, 6)]
