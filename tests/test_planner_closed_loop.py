"""The planner in a closed loop over recorded synthetic load (a ramp and a burst): request records
go into chDB, the planner reads them back through the SLA queries every interval, and the replicas
it asks for decide the latencies of the next interval's records.

Checked: hints rise before SLA attainment would drop without scaling, attainment holds while the
planner scales, hints fall after the load falls, and they do not flap.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.planner import PlannerService
from schemas.announce import EngineAnnouncement
from streams.backends import AnnouncedBackends
from consumers.sla_store import ChdbStore, SlaConfig
from consumers import sla_queries as Q
from streams.clock import ManualClock
from streams.planner import PerformanceProfile, PlannerConfig, PoolPlanConfig, ScalingPolicy, SlaTargets

PROFILE = PerformanceProfile.from_file(Path(__file__).resolve().parents[1] / "deploy" / "planner-profile.example.yaml")
INTERVAL = 30.0
ISL, OSL = 512, 128
SLA = SlaTargets(ttft_s=0.5, itl_s=0.03, attainment_goal=0.95)  # what attainment is measured against
PLAN = SlaTargets(ttft_s=0.4, itl_s=0.024)  # what the planner plans for: headroom below the SLA

# the "real" cluster: prefill saturates 30 % above the profile's rate, decode ITL is 10 % worse
PREFILL_SATURATION = 1.3 * PROFILE.prefill_throughput(ISL)
ITL_FACTOR = 1.10


def load_shape() -> list[float]:
    steady = [4.0] * 10
    ramp = list(np.linspace(4, 20, 30))
    burst = [40.0] * 4
    after = [20.0] * 12
    low = [4.0] * 44
    return steady + ramp + burst + after + low


PHASES = {"ramp_start": 10, "burst_start": 40, "burst_end": 44, "drop": 56}


def latencies(rate: float, prefill: int, decode: int, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    rho = rate * ISL / (max(prefill, 1) * PREFILL_SATURATION)
    base_ttft = PROFILE.expected_ttft(ISL) / (1 - rho) if rho < 0.98 else 10.0
    ttft = base_ttft * rng.lognormal(0, 0.3, n)
    per_replica = rate * OSL / max(decode, 1)
    itl = ITL_FACTOR * PROFILE.expected_itl(ISL + OSL / 2, per_replica) * rng.lognormal(0, 0.05, n)
    return ttft, itl


def attainment(ttft: np.ndarray, itl: np.ndarray) -> float:
    return float(np.mean((ttft <= SLA.ttft_s) & (itl <= SLA.itl_s)))


def announce(announced: AnnouncedBackends, replicas: dict[str, int], now: float) -> None:
    """Engines up to each role's count announce themselves; the rest (scaled away) say down."""
    for role, n in replicas.items():
        for i in range(16):
            announced.apply(EngineAnnouncement(pod=f"{role}-{i}", url=f"http://{role}-{i}", model="m", role=role,
                                               pool="pool-a", ts=now, state="up" if i < n else "down"))


@pytest.fixture
def store(tmp_path):
    s = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(s)
    yield s
    s.close()


async def test_hints_lead_the_ramp_hold_the_sla_and_do_not_flap(store):
    policy = ScalingPolicy(min_replicas=1, max_replicas=16, tolerance=0.1, stable_window_s=60,
                           panic_threshold=1.5, panic_hold_s=300, scale_down_window_s=300)
    cfg = SlaConfig(targets=SLA, planner=PlannerConfig(
        interval_s=INTERVAL, predictor="kalman",
        pools=[PoolPlanConfig(pool="pool-a", profile=PROFILE, targets=PLAN, policy=policy)]))
    t0 = float(int(time.time()) - 4000)
    clock = ManualClock(t0)
    announced = AnnouncedBackends(clock)  # the cluster tells the planner what runs
    planner = PlannerService(store, cfg, clock=clock, announced=announced)
    rng = np.random.default_rng(42)

    shape = load_shape()
    replicas = {"prefill": 1, "decode": 1}
    desired = {"prefill": [], "decode": []}
    closed, baseline, measured = [], [], []
    for k, rate in enumerate(shape):
        n = int(round(rate * INTERVAL))
        ttft, itl = latencies(rate, replicas["prefill"], replicas["decode"], n, rng)
        closed.append(attainment(ttft, itl))
        baseline.append(attainment(*latencies(rate, 1, 1, n, rng)))  # nobody scales
        start = clock.now()
        rows = [json.dumps({
            "request_id": f"r{k}-{i}", "ts": start + INTERVAL * i / n, "pool": "pool-a", "role": "pd",
            "model": "m", "prompt_tokens": ISL, "output_tokens": OSL, "ttft_s": float(ttft[i]),
            "itl_s": float(itl[i]), "e2e_s": float(ttft[i] + itl[i] * OSL), "status": "ok",
        }).encode() for i in range(n)]
        store.insert_json_each_row("request_records", rows)
        clock.advance(INTERVAL)
        announce(announced, replicas, clock.now())
        hints = {h.role: h for h in await planner.tick()}
        measured.append(hints["decode"].inputs["attainment"])
        for role in replicas:
            assert hints[role].current == replicas[role]
            replicas[role] = hints[role].desired  # applied for the next interval
            desired[role].append(hints[role].desired)

    # the SLA queries saw what was generated
    assert measured == pytest.approx(closed, abs=1e-9)

    goal = SLA.attainment_goal
    first_drop = next(k for k, a in enumerate(baseline) if a < goal)
    assert PHASES["ramp_start"] < first_drop < PHASES["burst_start"], baseline
    for role in ("prefill", "decode"):
        d = desired[role]
        assert d[: PHASES["ramp_start"]] == [1] * PHASES["ramp_start"], (role, d)  # steady: no change
    first_rise = min(next((k for k, v in enumerate(desired[r]) if v > 1), 10**9) for r in desired)
    assert first_rise < first_drop, (first_rise, first_drop, desired)

    # with the planner, the SLA holds except right when the burst hits
    misses = [k for k, a in enumerate(closed) if a < goal]
    assert set(misses) <= {PHASES["burst_start"], PHASES["burst_start"] + 1}, (misses, closed)
    assert sum(a < goal for a in baseline) > 20

    # hints fall after the load falls, back to the quiet level, and never before
    for role in ("prefill", "decode"):
        d = desired[role]
        peak = max(d)
        assert peak > 1
        first_fall = next(k for k in range(1, len(d)) if d[k] < d[k - 1])
        assert first_fall > PHASES["burst_end"], (role, d)
        assert d[-1] == 1, (role, d)
        # no flapping: one way up, then one way down
        changes = [np.sign(b - a) for a, b in zip(d, d[1:]) if b != a]
        reversals = sum(1 for a, b in zip(changes, changes[1:]) if a != b)
        assert reversals <= 1, (role, d)
    assert max(desired["decode"]) >= 4
