"""Planner folds, table-tested: predictors, profile interpolation, formulas, the scaler."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from streams.planner import (
    Observation,
    PerformanceProfile,
    PoolPlanConfig,
    PoolPlanner,
    ReplicaScaler,
    ScalingPolicy,
    SlaTargets,
    correction_factors,
    decode_replicas,
    make_predictor,
    prefill_replicas,
)

PROFILE_FILE = Path(__file__).resolve().parents[1] / "deploy" / "planner-profile.example.yaml"


@pytest.fixture(scope="module")
def profile() -> PerformanceProfile:
    return PerformanceProfile.from_file(PROFILE_FILE)


def _feed(name, series, **opts):
    p = make_predictor(name, **opts)
    for x in series:
        p.apply(x)
    return p.predict()


LINEAR = [10 + 2 * i for i in range(30)]  # next: 70
rng = np.random.default_rng(7)
NOISY_LINEAR = [10 + 2 * i + float(rng.normal(0, 0.3)) for i in range(40)]  # next: ~90


@pytest.mark.parametrize(
    "name, opts, series, expected, rel",
    [
        ("constant", {}, [1, 2, 3], 3, 0),
        ("constant", {}, [], 0, 0),
        ("moving_average", {"window": 3}, [1, 2, 3, 4], 3, 0),
        ("moving_average", {"window": 10}, [5, 5, 5], 5, 0),
        ("holt", {"alpha": 1.0, "beta": 1.0}, [2, 4, 6, 8], 10, 1e-12),
        ("holt", {}, [7] * 20, 7, 1e-9),
        ("holt", {}, LINEAR, 70, 0.02),
        ("kalman", {}, [7] * 20, 7, 1e-6),
        ("kalman", {}, LINEAR, 70, 0.01),
        ("kalman", {}, [1000 * x for x in LINEAR], 70_000, 0.01),  # scale-free
        ("kalman", {}, NOISY_LINEAR, 90, 0.03),
        ("arima", {"log1p": False}, NOISY_LINEAR, 90, 0.03),
        ("arima", {}, [3, 4], 4, 0),  # too few points: last value
        ("arima", {"p": 1, "d": 0, "q": 0}, [5] * 3 + [5.1, 4.9] * 10, 5, 0.05),
    ],
)
def test_predictors(name, opts, series, expected, rel):
    assert _feed(name, series, **opts) == pytest.approx(expected, rel=rel, abs=1e-9)


@pytest.mark.parametrize("name", ["constant", "moving_average", "holt", "kalman", "arima"])
def test_predictions_are_never_negative(name):
    assert _feed(name, [50, 30, 10, 2, 0, 0, 0, 0, 0, 0]) >= 0


def test_trend_predictors_lead_a_ramp_constant_lags():
    ramp = [float(i) for i in range(1, 21)]
    assert _feed("kalman", ramp) > ramp[-1]
    assert _feed("holt", ramp) > ramp[-1]
    assert _feed("constant", ramp) == ramp[-1]
    assert _feed("moving_average", ramp) < ramp[-1]


def test_unknown_predictor_or_option():
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("prophet")
    with pytest.raises(ValueError, match="bad options"):
        make_predictor("holt", gamma=0.3)


def test_profile_interpolation(profile):
    assert profile.prefill_throughput(512) == 10000
    assert profile.prefill_throughput(1280) == pytest.approx(9500)
    assert profile.expected_ttft(128) == pytest.approx(0.03)
    assert profile.decode_throughput(0.03, 512) == pytest.approx(1600)
    # halfway between the 512 and 2048 curves
    mid = profile.decode_throughput(0.025, 1280)
    assert mid == pytest.approx(0.5 * profile.decode_throughput(0.025, 512) + 0.5 * 700)
    # tighter than measured: clamped to the lightest point (no extrapolation towards 0)
    assert profile.decode_throughput(0.0075, 512) == pytest.approx(400)
    assert profile.decode_throughput(0.0001, 512) == pytest.approx(400)
    # expected_itl is the inverse of decode_throughput within the measured curves
    for ctx in (512, 1000, 2048, 5000, 9000):
        floor = profile.expected_itl(ctx, 0.0)
        assert floor >= min(p.itl_s for p in profile.decode)
        for itl in (0.02, 0.03, 0.045):
            if itl >= floor:
                assert profile.expected_itl(ctx, profile.decode_throughput(itl, ctx)) == pytest.approx(itl, rel=1e-6)
        # below the lightest measured load ITL stays at the lightest point's, never towards 0
        assert profile.expected_itl(ctx, 1.0) == pytest.approx(floor)
    # beyond the heaviest measured point ITL grows with the load
    top = profile.decode_throughput(0.09, 512)
    assert profile.expected_itl(512, 2 * top) == pytest.approx(0.18)


@pytest.mark.parametrize(
    "rate, isl, p_corr, expected",
    [(10, 512, 1.0, 0.512), (10, 512, 3.0, 0.512), (10, 512, 0.5, 0.256), (0, 512, 1.0, 0.0), (100, 2048, 1.0, 100 * 2048 / 9000)],
)
def test_prefill_formula(profile, rate, isl, p_corr, expected):
    assert prefill_replicas(rate, isl, p_corr, profile) == pytest.approx(expected)


def test_decode_formula_tightens_with_correction(profile):
    base = decode_replicas(20, 512, 128, 0.03, 1.0, profile)
    ctx = 512 + 64
    assert base == pytest.approx(20 * 128 / profile.decode_throughput(0.03, ctx))
    worse = decode_replicas(20, 512, 128, 0.03, 1.5, profile)  # ITL 50% worse than the profile says
    assert worse == pytest.approx(20 * 128 / profile.decode_throughput(0.02, ctx))
    assert worse > base


def test_correction_factors(profile):
    obs = Observation(rate=10, isl=512, osl=128, ttft_s=0.12, itl_s=None)
    p, d = correction_factors(obs, profile, decode_replicas=2)
    assert p == pytest.approx(0.12 / 0.06)
    assert d is None  # no ITL data: the planner keeps its previous factor
    per_replica = 10 * 128 / 2
    exp_itl = profile.expected_itl(512 + 64, per_replica)
    _, d = correction_factors(Observation(rate=10, isl=512, osl=128, itl_s=2 * exp_itl), profile, 2)
    assert d == pytest.approx(2.0)
    # bounded: a wild measurement moves the formulas at most by the bounds
    p, d = correction_factors(Observation(rate=10, isl=512, osl=128, ttft_s=100.0, itl_s=1e-6), profile, 2)
    assert (p, d) == (3.0, 0.5)


POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, tolerance=0.1, stable_window_s=60, panic_threshold=1.5,
                       panic_hold_s=120, scale_down_window_s=180)


@pytest.mark.parametrize(
    "steps, expected",
    [
        # (t, recommended, current) -> desired after the last step
        ([(0, 5, 5)], (5, "stable")),
        ([(0, 11, 10)], (10, "stable")),  # within tolerance
        ([(0, 6, 5), (30, 7, 5)], (6, "stable")),  # scale up to the min of the stable window
        ([(0, 6, 5), (100, 7, 5)], (7, "stable")),  # older recommendations left the window
        ([(0, 8, 4)], (8, "panic")),  # 2x: panic scales up at once
        ([(0, 8, 4), (60, 2, 8)], (8, "panic")),  # panic hold: no scale-down
        ([(0, 8, 4), (60, 2, 8), (150, 2, 8)], (8, "stable")),  # hold over, 8 still in the scale-down window
        ([(0, 8, 4), (60, 2, 8), (200, 2, 8), (250, 2, 8)], (2, "stable")),
        ([(0, 40, 8)], (10, "panic")),  # max bound
        ([(0, 0, 3), (10, 0, 3)], (3, "stable")),  # a fresh scaler counts the running 3 as recommended
        ([(0, 0, 3), (200, 0, 3)], (1, "stable")),  # ... until the scale-down window passed; min bound
        ([(0, 4, 0)], (4, "panic")),  # from zero
    ],
)
def test_scaler(steps, expected):
    s = ReplicaScaler(POLICY)
    for t, rec, cur in steps:
        d = s.apply(rec, cur, float(t))
    assert (d.desired, d.mode) == expected, d.reason


def test_scaler_scale_down_follows_window_max():
    s = ReplicaScaler(POLICY)
    seq = [(0, 9), (30, 6), (60, 5), (90, 4)]
    out = [s.apply(rec, 9, float(t)).desired for t, rec in seq]
    assert out == [9, 9, 9, 9]  # 9 stays the max of the last 180 s
    assert s.apply(4, 9, 200.0).desired == 6  # 9 left the window, 6 is the max now


def test_pool_planner_end_to_end(profile):
    cfg = PoolPlanConfig(pool="p", profile=profile, policy=POLICY)
    planner = PoolPlanner(cfg, targets=SlaTargets(itl_s=0.03), predictor="constant")
    plans = planner.apply(Observation(rate=20, isl=512, osl=128, ttft_s=0.06, itl_s=0.02), {"prefill": 1, "decode": 1}, 0.0)
    by_role = {p.role: p for p in plans}
    assert by_role["prefill"].inputs["recommended"] == math.ceil(20 * 512 / 10000)
    assert by_role["decode"].desired >= 2 and by_role["decode"].mode == "panic"
    assert "needs" in by_role["decode"].reason and by_role["decode"].predictor == "constant"


def test_pool_config_validation(profile):
    with pytest.raises(ValueError, match="give profile or profile_file"):
        PoolPlanConfig(pool="p")
    with pytest.raises(ValueError, match="either prefill/decode or aggregated"):
        PoolPlanConfig(pool="p", profile=profile, roles=["prefill", "aggregated"])
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=5, max_replicas=2)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=1, max_value=120), st.integers(min_value=0, max_value=100)),
                min_size=1, max_size=60),
       st.integers(min_value=0, max_value=20))
def test_scaler_invariants(steps, start):
    """Desired stays in bounds; never below the running count while panic holds; the scaler fed
    its own output never moves on a constant recommendation once settled."""
    s = ReplicaScaler(POLICY)
    t, current = 0.0, start
    for dt, rec in steps:
        t += dt
        d = s.apply(rec, current, t)
        assert POLICY.min_replicas <= d.desired <= POLICY.max_replicas
        if d.mode == "panic":
            assert d.desired >= min(current, POLICY.max_replicas)
        current = d.desired
    # settle: a constant recommendation long enough leads to it (bounded) and then stays
    rec = steps[-1][1]
    for _ in range(20):
        t += 60
        current = s.apply(rec, current, t).desired
    settled = current
    for _ in range(10):
        t += 60
        assert s.apply(rec, current, t).desired == settled
    target = min(POLICY.max_replicas, max(POLICY.min_replicas, rec))
    assert abs(settled - target) <= max(1, int(POLICY.tolerance * settled))
