"""The planner sees the cluster: the same observation gives the same answer whatever it last
hinted (Hypothesis), profiles clamp instead of extrapolating, and it reads and sets replicas on
Kthena ``ModelServing`` roles (against kmock, with the official client) and on the simulator's
control API (a live simulated cluster grows and shrinks)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from consumers import sla_queries as Q
from consumers.planner import KubeScaler, PlannerService
from consumers.sla_store import ChdbStore, SlaConfig
from streams.clock import ManualClock
from streams.planner import (KubernetesTarget, Observation, PerformanceProfile, PlannerConfig, PoolPlanConfig,
                             PoolPlanner, ScalingPolicy, SlaTargets)

PROFILE_FILE = Path(__file__).resolve().parents[1] / "deploy" / "planner-profile.example.yaml"
PROFILE = PerformanceProfile.from_file(PROFILE_FILE)
TARGETS = SlaTargets(ttft_s=0.5, itl_s=0.03)

observations = st.builds(
    Observation, rate=st.floats(0, 80), isl=st.floats(16, 9000), osl=st.floats(1, 2000),
    ttft_s=st.none() | st.floats(1e-4, 60), itl_s=st.none() | st.floats(1e-5, 2), attainment=st.none())
hints = st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64)), max_size=8)  # (recommended, current)


def _planner() -> PoolPlanner:
    return PoolPlanner(PoolPlanConfig(pool="p", profile=PROFILE), targets=TARGETS, predictor="constant")


@settings(max_examples=150, deadline=None)
@given(history=st.lists(observations, max_size=4), obs=observations, cluster=st.integers(1, 16),
       last_a=hints, last_b=hints)
def test_same_observation_same_answer_whatever_the_last_hint(history, obs, cluster, last_a, last_b):
    """Two planners with the same observations and the same cluster, but different past hints
    (restored after a restart, or whatever they said last), recommend exactly the same."""
    out = []
    for last in (last_a, last_b):
        p = _planner()
        for h in history:
            p.observe(h)
        for role in p.scalers:
            for k, (rec, cur) in enumerate(last):
                p.scalers[role].remember(-100.0 + k, rec, cur)
        plans = p.apply(obs, {"prefill": cluster, "decode": cluster}, now=0.0)
        out.append([(pl.role, pl.inputs["recommended"], pl.inputs["p_corr"], pl.inputs["d_corr"]) for pl in plans])
    assert out[0] == out[1]
    for _, rec, p_corr, d_corr in out[0]:
        assert 0.5 <= p_corr <= 3.0 and 0.5 <= d_corr <= 3.0  # bounded
        assert rec >= 0


@settings(max_examples=200, deadline=None)
@given(itl=st.floats(1e-6, 5), ctx=st.floats(1, 20000), load=st.floats(0, 5000))
def test_profile_clamps_instead_of_extrapolating(itl, ctx, load):
    lo = min(p.throughput_tokens_per_s for p in PROFILE.decode)
    hi = max(p.throughput_tokens_per_s for p in PROFILE.decode)
    assert lo - 1e-6 <= PROFILE.decode_throughput(itl, ctx) <= hi + 1e-6
    floor = min(p.itl_s for p in PROFILE.decode)
    assert PROFILE.expected_itl(ctx, load) >= floor - 1e-9  # never towards 0 at light load


def test_light_load_does_not_push_the_itl_correction_to_its_cap():
    """The issue's case: ~0.8 req/s on 2 engines whose ITL is normal. Expected ITL at that light load
    is the profile's lightest point, so the correction stays near 1 instead of 20."""
    p = _planner()
    obs = Observation(rate=0.8, isl=15000, osl=150, ttft_s=0.3, itl_s=0.03)
    plans = {pl.role: pl for pl in p.apply(obs, {"prefill": 2, "decode": 2}, now=0.0)}
    assert plans["decode"].inputs["d_corr"] <= 1.5
    again = _planner()
    same = {pl.role: pl for pl in again.apply(obs, {"prefill": 2, "decode": 2}, now=0.0)}
    assert same["decode"].inputs["recommended"] == plans["decode"].inputs["recommended"]


def test_damping_moves_halfway_in_log_space():
    p = _planner()
    obs = Observation(rate=10, isl=512, osl=128, ttft_s=0.06 * 2.0, itl_s=None)
    p.apply(obs, {"prefill": 1, "decode": 1}, now=0.0)
    assert p.p_corr == pytest.approx(2.0 ** 0.5)  # the previous factor was 1.0, smoothing 0.5
    p.apply(Observation(rate=10, isl=512, osl=128), {"prefill": 1, "decode": 1}, now=30.0)
    assert p.p_corr == pytest.approx(2.0 ** 0.5)  # no TTFT data: kept


# -- scale targets ------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(s)
    yield s
    s.close()


def _load(store, start: float, seconds: float, rate: float, isl: int = 512) -> None:
    n = int(rate * seconds)
    store.insert_json_each_row("request_records", [json.dumps({
        "request_id": f"r{start}-{i}", "ts": start + seconds * i / n, "pool": "pool-a", "role": "pd", "model": "m",
        "prompt_tokens": isl, "output_tokens": 128, "ttft_s": 0.08, "itl_s": 0.02, "e2e_s": 2.6,
    }).encode() for i in range(n)])


def _cfg(dry_run: bool, **pool_kw) -> SlaConfig:
    pool = PoolPlanConfig(pool="pool-a", profile_file=PROFILE_FILE,
                          policy=ScalingPolicy(min_replicas=1, max_replicas=8), **pool_kw)
    return SlaConfig(planner=PlannerConfig(interval_s=30, predictor="constant", pools=[pool], dry_run=dry_run))


MS = "workload.serving.volcano.sh/v1alpha1/modelservings"


async def test_kthena_modelserving_roles_are_read_and_patched(store, kmock):
    kubernetes = pytest.importorskip("kubernetes")
    import kmock as km

    def reset():  # the shape of Kthena's examples/model-serving/gpu-pd-disaggregation.yaml
        kmock.objects[MS, "llm", "qwen"] = {
            "apiVersion": "workload.serving.volcano.sh/v1alpha1", "kind": "ModelServing",
            "metadata": {"name": "qwen", "namespace": "llm"},
            "spec": {"replicas": 1, "template": {"roles": [
                {"name": "prefill", "replicas": 1, "workerReplicas": 0, "entryTemplate": {"spec": {}}},
                {"name": "decode", "replicas": 1, "workerReplicas": 0, "entryTemplate": {"spec": {}}}]}}}

    reset()
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(kmock.url).rstrip("/")))
    scaler = KubeScaler(api)
    targets = {r: KubernetesTarget(kind="ModelServing", name="qwen", namespace="llm") for r in ("prefill", "decode")}
    clock = ManualClock(float(int(time.time()) - 600))
    _load(store, clock.now(), 30, 25)
    clock.advance(30)

    def patches():
        return [(r.url.path, dict(r.params), r.data, r.headers.get("Content-Type"))
                for r in kmock if r.method == km.method.PATCH]

    planner = PlannerService(store, _cfg(False, kubernetes=targets), clock=clock, registry=CollectorRegistry(),
                             kube=scaler)
    hints = {h.role: h for h in await planner.tick()}
    assert hints["prefill"].current == 1 and hints["prefill"].desired == 2
    assert "from ModelServing" in hints["prefill"].reason
    ps = patches()
    assert {p[0] for p in ps} == {"/apis/workload.serving.volcano.sh/v1alpha1/namespaces/llm/modelservings/qwen"}
    assert all(p[3].startswith("application/json-patch+json") for p in ps)
    prefill_patch = next(p[2] for p in ps if p[2][0]["value"] == "prefill")
    assert prefill_patch == [{"op": "test", "path": "/spec/template/roles/0/name", "value": "prefill"},
                             {"op": "replace", "path": "/spec/template/roles/0/replicas", "value": 2}]
    for role in ("prefill", "decode"):
        assert await asyncio.to_thread(scaler.get, targets[role], role) == hints[role].desired
    obj = kmock.objects[MS, "llm", "qwen"]
    assert obj["spec"]["template"]["roles"][0]["entryTemplate"] == {"spec": {}}  # only replicas changed
    # the next round reads the roles back: current is what runs now
    clock.advance(30)
    _load(store, clock.now() - 30, 30, 25)
    nxt = {h.role: h for h in await planner.tick()}
    assert nxt["prefill"].current == hints["prefill"].desired
    # a role the ModelServing lacks is a clear, counted read error, not a silent zero
    bad = PlannerService(store, _cfg(True, kubernetes={"prefill": KubernetesTarget(
        kind="ModelServing", name="qwen", namespace="llm", role_name="prefiller")}, roles=["prefill"]),
        clock=clock, registry=CollectorRegistry(), kube=scaler)
    await bad.tick()
    assert bad.errors.labels("read")._value.get() == 1
    api.close()


async def test_simulator_control_api_is_a_scale_target(store):
    from simulator.cluster import EngineSpec, SimCluster
    from simulator.config import EngineConfig
    from simulator.control import SimControl

    def cfg(eid, role):
        return EngineConfig(engine_id=eid, served_model_name="m", role=role, num_gpu_blocks=256)

    cluster = await asyncio.to_thread(lambda: SimCluster([EngineSpec(cfg("p-0", "prefill"), kv_events=False),
                                                          EngineSpec(cfg("d-0", "decode"), kv_events=False)],
                                                         time_scale=20).start())
    control = SimControl(cluster)
    changes = []
    control.listeners.append(lambda added, removed: changes.append(([a["engine_id"] for a in added],
                                                                    [r["engine_id"] for r in removed])))
    try:
        url = await asyncio.to_thread(cluster.run, control.start())
        clock = ManualClock(float(int(time.time()) - 600))
        _load(store, clock.now(), 30, 25, isl=4096)  # prefill-heavy: 25 x 4096 tokens/s
        clock.advance(30)
        planner = PlannerService(store, _cfg(False, simulator=url), clock=clock, registry=CollectorRegistry())
        hints = {h.role: h for h in await planner.tick()}
        assert hints["prefill"].current == 1 and "from simulator" in hints["prefill"].reason
        assert hints["prefill"].desired > 1
        roles = await asyncio.to_thread(lambda: cluster.run(asyncio.sleep(0, control.replicas())))
        assert roles["prefill"] == hints["prefill"].desired and roles["decode"] == hints["decode"].desired
        added = [e for a, _ in changes for e in a]
        assert len(added) == hints["prefill"].desired - 1 + hints["decode"].desired - 1
        # the new engines serve
        import httpx
        eng = next(e for e in cluster.engines if e.engine_id == added[0])
        r = await asyncio.to_thread(httpx.post, eng.url + "/v1/completions",
                                    json={"model": "m", "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        # load gone: after the scale-down window it shrinks; here the API directly
        out = await asyncio.to_thread(lambda: httpx.put(url + "/control/replicas/prefill", json={"replicas": 1},
                                                        timeout=30).json())
        assert out["replicas"] == 1 and len(out["removed"]) == hints["prefill"].desired - 1
        bad = await asyncio.to_thread(lambda: httpx.put(url + "/control/replicas/prefill", json={"replicas": -1},
                                                        timeout=30))
        assert bad.status_code == 400 and "replicas" in bad.json()["error"]["message"]
        clock.advance(30)
        nxt = {h.role: h for h in await planner.tick()}
        assert nxt["prefill"].current == 1  # read back from the simulator, not the last hint
    finally:
        await asyncio.to_thread(cluster.run, control.stop())
        await asyncio.to_thread(cluster.stop)


async def test_current_replicas_follow_engine_announcements_on_the_bus(nc, topology, prefix):
    """Real nats-server: engines announce themselves; the planner counts the live ones per pool and
    role; a malformed announcement is dead-lettered and the feed goes on."""
    from consumers.planner import announced_replicas, follow_announcements
    from consumers import bus
    from router.testing import wait_for
    from schemas import EngineAnnouncement
    from schemas import subjects as S
    from streams.backends import AnnouncedBackends

    js = nc.jetstream()
    announced = AnnouncedBackends()
    reg = CollectorRegistry()
    sub = await follow_announcements(js, announced, prefix=prefix, topology=topology, registry=reg)
    try:
        now = time.time()
        for pod, role, state in (("p0", "prefill", "up"), ("p1", "prefill", "up"), ("d0", "decode", "up"),
                                 ("d1", "decode", "down"), ("x0", "decode", "up")):
            a = EngineAnnouncement(pod=pod, url=f"http://{pod}", model="m", role=role, ts=now, state=state,
                                   pool="pool-b" if pod == "x0" else "pool-a")
            await bus.publish(js, S.with_prefix(prefix, S.engine_announce(pod)), a.to_json())
        await bus.publish(js, S.with_prefix(prefix, S.engine_announce("bad")), b'{"pod": 3}')
        assert await wait_for(lambda: len(announced.dump()) == 5, timeout=10)
        assert announced_replicas(announced, "pool-a", "prefill") == 2
        assert announced_replicas(announced, "pool-a", "decode") == 1  # d1 said down
        assert announced_replicas(announced, "pool-c", "decode") is None  # never seen: unknown, not 0
        assert await wait_for(lambda: (reg.get_sample_value("infernex_dead_letters_total", {
            "stream": next(s.logical for s in topology if "announce" in s.logical or any(
                "announce" in x for x in s.subjects)), "consumer": "planner-announcements",
            "reason": "invalid"}) or 0) == 1, timeout=10)
    finally:
        await sub.unsubscribe()
