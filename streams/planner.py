"""The SLA planner as pure folds: load predictors, a performance profile, correction factors,
replica formulas and a Kthena-style scaling policy (stable / panic windows, tolerance,
scale-down stabilisation, bounds).

Per interval and PD pool (after Dynamo's SLA planner):

* predict next-interval request rate, input length (ISL) and output length (OSL);
* correction factors ``p_corr = actual TTFT / expected TTFT`` and ``d_corr = actual ITL /
  expected ITL`` against the pool's :class:`PerformanceProfile`;
* ``prefill = ceil(rate * ISL * min(1, p_corr) / prefill_throughput_per_replica(ISL))``;
* ``decode = ceil(rate * OSL / decode_throughput_per_replica(ITL target / d_corr, ISL + OSL / 2))``;
* the raw recommendation then goes through :class:`ReplicaScaler` (after Kthena's autoscaler,
  itself after Knative's KPA and the HPA behaviour): scale-ups take the smallest recommendation of
  the stable window, scale-downs the largest of the scale-down window, a recommendation at least
  ``panic_threshold`` x current enters panic mode (scale up at once, no scale-down until the panic
  hold has passed); changes within ``tolerance`` are ignored; ``[min_replicas, max_replicas]``.

Time comes from the caller (``now`` arguments); nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

PlanRole = Literal["prefill", "decode", "aggregated"]
PredictorName = Literal["constant", "moving_average", "holt", "kalman", "arima"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


class SlaTargets(_Model):
    ttft_s: float = Field(default=1.0, gt=0, description="time-to-first-token target")
    itl_s: float = Field(default=0.05, gt=0, description="inter-token latency target")
    e2e_s: float | None = Field(default=None, gt=0, description="end-to-end target, optional")
    attainment_goal: float = Field(default=0.95, gt=0, le=1, description="share of requests within targets")


class ScalingPolicy(_Model):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=64, ge=1)
    tolerance: float = Field(default=0.1, ge=0, lt=1, description="ignore changes within this share")
    stable_window_s: float = Field(default=60.0, ge=0, description="scale-up: min recommendation over it")
    panic_threshold: float = Field(default=1.5, gt=1, description="recommendation/current that means panic")
    panic_hold_s: float = Field(default=300.0, ge=0, description="no scale-down for this long after panic")
    scale_down_window_s: float = Field(default=300.0, ge=0, description="scale-down: max recommendation over it")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class PrefillPoint(_Model):
    isl: float = Field(gt=0)
    throughput_tokens_per_s: float = Field(gt=0, description="prompt tokens/s one replica sustains")
    ttft_s: float = Field(gt=0, description="TTFT at that ISL without queueing")


class DecodePoint(_Model):
    context_length: float = Field(gt=0)
    throughput_tokens_per_s: float = Field(gt=0, description="output tokens/s of one replica")
    itl_s: float = Field(gt=0, description="ITL at that throughput")


class PerformanceProfile(_Model):
    """Per-replica performance of one pool (from a profile file or measured with the simulator)."""

    name: str = "profile"
    prefill: list[PrefillPoint] = Field(min_length=1)
    decode: list[DecodePoint] = Field(min_length=1)

    @classmethod
    def from_file(cls, path: Path) -> "PerformanceProfile":
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"profile file {path} must hold a mapping")
        return cls.model_validate(data)

    # -- prefill ----------------------------------------------------------------------------
    def _prefill_xy(self, attr: str, isl: float) -> float:
        pts = sorted(self.prefill, key=lambda p: p.isl)
        return float(np.interp(isl, [p.isl for p in pts], [getattr(p, attr) for p in pts]))

    def prefill_throughput(self, isl: float) -> float:
        return self._prefill_xy("throughput_tokens_per_s", isl)

    def expected_ttft(self, isl: float) -> float:
        return self._prefill_xy("ttft_s", isl)

    # -- decode -----------------------------------------------------------------------------
    def _contexts(self) -> list[float]:
        return sorted({p.context_length for p in self.decode})

    def _curve(self, ctx: float) -> tuple[np.ndarray, np.ndarray]:
        pts = sorted((p for p in self.decode if p.context_length == ctx), key=lambda p: p.itl_s)
        return np.array([p.itl_s for p in pts]), np.array([p.throughput_tokens_per_s for p in pts])

    def _across_contexts(self, context: float, at_ctx) -> float:  # noqa: ANN001
        ctxs = self._contexts()
        if context <= ctxs[0]:
            return at_ctx(ctxs[0])
        if context >= ctxs[-1]:
            return at_ctx(ctxs[-1])
        hi = next(i for i, c in enumerate(ctxs) if c >= context)
        lo = hi - 1
        w = (context - ctxs[lo]) / (ctxs[hi] - ctxs[lo])
        return (1 - w) * at_ctx(ctxs[lo]) + w * at_ctx(ctxs[hi])

    def decode_throughput(self, itl_target: float, context: float) -> float:
        """Best output tokens/s per replica whose ITL stays within ``itl_target`` at ``context``."""

        def at(ctx: float) -> float:
            itl, thpt = self._curve(ctx)
            # np.interp clamps: a target tighter than the lightest measured point gets that point's
            # throughput (no extrapolation towards 0 replicas-worth of throughput), a looser one
            # the heaviest point's
            return float(np.interp(itl_target, itl, thpt))

        return self._across_contexts(context, at)

    def expected_itl(self, context: float, throughput_per_replica: float) -> float:
        """ITL one replica shows at this output throughput: the inverse of :meth:`decode_throughput`
        (found by bisection, so the two always agree); beyond the measured range ITL grows in
        proportion to the load."""
        hi = max(p.itl_s for p in self.decode)
        floor = self._across_contexts(context, lambda c: float(self._curve(c)[0][0]))
        top = self.decode_throughput(hi, context)
        if throughput_per_replica >= top:
            return hi * throughput_per_replica / top
        # below the lightest measured load ITL stays at the lightest point's: a decode step never
        # gets cheaper than one step of a nearly empty batch (no extrapolation towards 0)
        if throughput_per_replica <= self.decode_throughput(floor, context):
            return floor
        lo = floor
        for _ in range(60):
            mid = (lo + hi) / 2
            if self.decode_throughput(mid, context) < throughput_per_replica:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


class KubernetesTarget(_Model):
    """What the planner scales for one role: a Deployment's or StatefulSet's scale subresource, or
    one role of a Kthena ``ModelServing`` (``spec.template.roles[name=role_name].replicas``)."""

    kind: Literal["Deployment", "StatefulSet", "ModelServing"] = "Deployment"
    name: str = Field(min_length=1)
    namespace: str = "default"
    role_name: str | None = Field(default=None, description="ModelServing: the role's name (default: the "
                                                            "planner role, prefill/decode)")


class CorrectionConfig(_Model):
    """How far measured/expected latency may move the replica formulas, and how fast."""

    min_factor: float = Field(default=0.5, gt=0, le=1)
    max_factor: float = Field(default=3.0, ge=1)
    smoothing: float = Field(default=0.5, gt=0, le=1, description="weight of the newest interval (geometric "
                                                                  "mean with the previous factor); 1: no damping")


class PoolPlanConfig(_Model):
    pool: str = Field(min_length=1)
    roles: list[PlanRole] = Field(default_factory=lambda: ["prefill", "decode"])
    profile_file: Path | None = None
    profile: PerformanceProfile | None = None
    targets: SlaTargets | None = Field(default=None, description="overrides sla.targets for this pool")
    policy: ScalingPolicy = Field(default_factory=ScalingPolicy)
    role_policies: dict[PlanRole, ScalingPolicy] = Field(default_factory=dict)
    kubernetes: dict[PlanRole, KubernetesTarget] = Field(default_factory=dict)
    simulator: str | None = Field(default=None, description="base URL of a simulator control API "
                                                            "(simulator.control) to read and set engines per role")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="after")
    def _one_profile(self):
        if self.profile is None and self.profile_file is None:
            raise ValueError(f"pool {self.pool}: give profile or profile_file")
        if set(self.roles) & {"prefill", "decode"} and "aggregated" in self.roles:
            raise ValueError(f"pool {self.pool}: roles are either prefill/decode or aggregated")
        return self

    def load_profile(self) -> PerformanceProfile:
        return self.profile if self.profile is not None else PerformanceProfile.from_file(self.profile_file)

    def policy_for(self, role: str) -> ScalingPolicy:
        return self.role_policies.get(role, self.policy)  # type: ignore[arg-type]


class PlannerConfig(_Model):
    interval_s: float = Field(default=30.0, gt=0, description="adjustment interval")
    predictor: PredictorName = "kalman"
    predictor_options: dict[str, float] = Field(default_factory=dict)
    pools: list[PoolPlanConfig] = Field(default_factory=list)
    dry_run: bool = Field(default=True, description="publish hints only; never patch Kubernetes")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0: no /metrics server")
    warmup_intervals: int = Field(
        default=10, ge=0, le=1000,
        description="past intervals read from the SLA history at start to warm the predictors (0: start cold)")


# ---------------------------------------------------------------------------------------------
# predictors: apply(observation), predict() -> next value
# ---------------------------------------------------------------------------------------------


class ConstantPredictor:
    name = "constant"

    def __init__(self) -> None:
        self._last: float | None = None

    def apply(self, x: float) -> None:
        self._last = float(x)

    def predict(self) -> float:
        return max(0.0, self._last or 0.0)

    def dump(self) -> dict:
        return {"last": self._last}


class MovingAveragePredictor:
    name = "moving_average"

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError("moving average window must be >= 1")
        self._xs: deque[float] = deque(maxlen=int(window))

    def apply(self, x: float) -> None:
        self._xs.append(float(x))

    def predict(self) -> float:
        return max(0.0, sum(self._xs) / len(self._xs)) if self._xs else 0.0

    def dump(self) -> dict:
        return {"window": list(self._xs)}


class HoltPredictor:
    """Double exponential smoothing (level + trend); one step ahead is ``level + trend``."""

    name = "holt"

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError("holt needs 0 < alpha <= 1 and 0 <= beta <= 1")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def apply(self, x: float) -> None:
        x = float(x)
        if self._level is None:
            self._level = x
            return
        prev = self._level
        self._level = self.alpha * x + (1 - self.alpha) * (prev + self._trend)
        self._trend = self.beta * (self._level - prev) + (1 - self.beta) * self._trend

    def predict(self) -> float:
        return 0.0 if self._level is None else max(0.0, self._level + self._trend)

    def dump(self) -> dict:
        return {"level": self._level, "trend": self._trend}


class KalmanPredictor:
    """Local linear trend model: state (level, slope), ``level' = level + slope``.

    The steady-state gain depends only on the ratios ``q_level / r`` and ``q_trend / r`` (how fast
    level and slope may wander against the observation noise), not on the scale of the series.
    """

    name = "kalman"

    def __init__(self, q_level: float = 0.05, q_trend: float = 0.02, r: float = 1.0) -> None:
        if q_level < 0 or q_trend < 0 or r <= 0:
            raise ValueError("kalman needs q_level, q_trend >= 0 and r > 0")
        self._F = np.array([[1.0, 1.0], [0.0, 1.0]])
        self._H = np.array([1.0, 0.0])
        self._Q = np.diag([q_level, q_trend])
        self._R = float(r)
        self._x: np.ndarray | None = None
        self._P = np.eye(2) * 1e6

    def apply(self, z: float) -> None:
        z = float(z)
        if self._x is None:
            self._x = np.array([z, 0.0])
            self._P = np.diag([self._R, 1e6])
            return
        x = self._F @ self._x
        P = self._F @ self._P @ self._F.T + self._Q
        S = float(self._H @ P @ self._H) + self._R
        K = (P @ self._H) / S
        self._x = x + K * (z - float(self._H @ x))
        self._P = (np.eye(2) - np.outer(K, self._H)) @ P

    def predict(self) -> float:
        if self._x is None:
            return 0.0
        return max(0.0, float((self._F @ self._x)[0]))

    def dump(self) -> dict:
        return {"state": None if self._x is None else self._x.tolist(), "P": self._P.tolist()}


class ArimaPredictor:
    """ARIMA through statsmodels, refit on the last ``window`` observations at every predict.

    With fewer than ``min_points`` observations, or if the fit fails, it predicts the last value.
    ``log1p`` fits on ``log(1 + x)`` (keeps forecasts of rates positive).
    """

    name = "arima"

    def __init__(self, p: int = 1, d: int = 1, q: int = 0, window: int = 60, min_points: int = 8,
                 log1p: bool = True) -> None:
        self.order = (int(p), int(d), int(q))
        self.min_points = int(min_points)
        self.log1p = bool(log1p)
        self._xs: deque[float] = deque(maxlen=int(window))

    def apply(self, x: float) -> None:
        self._xs.append(float(x))

    def predict(self) -> float:
        if not self._xs:
            return 0.0
        if len(self._xs) < self.min_points:
            return max(0.0, self._xs[-1])
        from statsmodels.tsa.arima.model import ARIMA

        data = np.array(self._xs)
        y = np.log1p(np.maximum(data, 0)) if self.log1p else data
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fit = ARIMA(y, order=self.order).fit()
                f = float(fit.forecast(1)[0])
        except Exception as exc:  # noqa: BLE001 - a failed fit falls back, visibly
            log.warning("ARIMA fit failed (%s); predicting the last value", exc)
            return max(0.0, self._xs[-1])
        if not math.isfinite(f):
            return max(0.0, self._xs[-1])
        return max(0.0, float(np.expm1(f)) if self.log1p else f)

    def dump(self) -> dict:
        return {"window": list(self._xs)}


PREDICTORS = {
    "constant": ConstantPredictor,
    "moving_average": MovingAveragePredictor,
    "holt": HoltPredictor,
    "kalman": KalmanPredictor,
    "arima": ArimaPredictor,
}


def make_predictor(name: str, **options: float):
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; choose one of {sorted(PREDICTORS)}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"predictor {name}: bad options {options}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# replica formulas
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One adjustment interval of one pool, from the SLA history."""

    rate: float  # requests/s
    isl: float  # mean prompt tokens
    osl: float  # mean output tokens
    ttft_s: float | None = None  # mean TTFT
    itl_s: float | None = None  # mean ITL
    attainment: float | None = None


def correction_factors(obs: Observation, profile: PerformanceProfile, decode_replicas: int,
                       bounds: tuple[float, float] = (0.5, 3.0)) -> tuple[float | None, float | None]:
    """``(actual TTFT / expected TTFT, actual ITL / expected ITL)`` within ``bounds``; None where
    the interval has no data (the caller keeps its previous factor). ``decode_replicas`` is what
    the cluster runs, never what the planner last recommended."""
    lo, hi = bounds
    p_corr = d_corr = None
    if obs.ttft_s is not None and obs.isl > 0 and obs.rate > 0:
        exp = profile.expected_ttft(obs.isl)
        if exp > 0:
            p_corr = _clamp(obs.ttft_s / exp, lo, hi)
    if obs.itl_s is not None and obs.rate > 0 and decode_replicas > 0:
        per_replica = obs.rate * obs.osl / decode_replicas
        exp = profile.expected_itl(obs.isl + obs.osl / 2, per_replica)
        if exp > 0:
            d_corr = _clamp(obs.itl_s / exp, lo, hi)
    return p_corr, d_corr


def damp(prev: float, new: float | None, weight: float) -> float:
    """Geometric smoothing of a correction factor: ``prev^(1-w) * new^w`` (prev when no data)."""
    if new is None:
        return prev
    return math.exp((1 - weight) * math.log(prev) + weight * math.log(new))


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def prefill_replicas(rate: float, isl: float, p_corr: float, profile: PerformanceProfile) -> float:
    """Fractional prefill replicas (ceil it for a count)."""
    if rate <= 0 or isl <= 0:
        return 0.0
    return rate * isl * min(1.0, p_corr) / profile.prefill_throughput(isl)


def decode_replicas(rate: float, isl: float, osl: float, itl_target: float, d_corr: float,
                    profile: PerformanceProfile) -> float:
    if rate <= 0 or osl <= 0:
        return 0.0
    thpt = profile.decode_throughput(itl_target / max(d_corr, 1e-9), isl + osl / 2)
    return rate * osl / thpt


def _ceil(x: float) -> int:
    # 3.0000000001 from float noise is 3, not 4
    return int(math.ceil(x - 1e-9))


# ---------------------------------------------------------------------------------------------
# Kthena-style scaler
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleDecision:
    current: int
    recommended: int
    desired: int
    mode: Literal["stable", "panic"]
    reason: str


@dataclass
class ReplicaScaler:
    """Turns raw recommendations into a desired replica count without flapping."""

    policy: ScalingPolicy
    _history: deque = field(default_factory=deque)  # (t, recommendation)
    _panic_until: float = float("-inf")
    _started: tuple[float, int] | None = None

    def apply(self, recommended: int, current: int, now: float) -> ScaleDecision:
        p = self.policy
        rec = max(0, int(recommended))
        if self._started is None:
            # a fresh scaler treats the running count as recommended: no scale-down before the window
            self._started = (now, int(current))
        self._history.append((now, rec))
        horizon = max(p.stable_window_s, p.scale_down_window_s)
        while self._history and self._history[0][0] < now - horizon:
            self._history.popleft()

        def window(seconds: float, with_start: bool = False) -> list[int]:
            recs = [r for t, r in self._history if t >= now - seconds]
            if with_start and self._started[0] >= now - seconds:
                recs.append(self._started[1])
            return recs

        reasons = []
        if current > 0 and rec >= current * p.panic_threshold or (current == 0 and rec > 0):
            if now >= self._panic_until:
                reasons.append(f"panic: {rec} >= {p.panic_threshold:g} x {current}")
            self._panic_until = now + p.panic_hold_s
        panic = now < self._panic_until

        if panic:
            desired = max(current, rec)
            if desired == current:
                reasons.append(f"panic hold: no scale-down until +{self._panic_until - now:.0f}s")
            else:
                reasons.append("panic: scale up now")
        elif rec > current:
            desired = max(current, min(window(p.stable_window_s)))
            reasons.append(f"stable: scale up to min over {p.stable_window_s:g}s")
        elif rec < current:
            desired = min(current, max(window(p.scale_down_window_s, with_start=True)))
            reasons.append(f"stable: scale down to max over {p.scale_down_window_s:g}s")
        else:
            desired = current
            reasons.append("steady")

        if desired != current and current > 0 and abs(desired - current) / current <= p.tolerance:
            reasons.append(f"within tolerance {p.tolerance:.0%}")
            desired = current
        bounded = min(p.max_replicas, max(p.min_replicas, desired))
        if bounded != desired:
            reasons.append(f"bounded to [{p.min_replicas}, {p.max_replicas}]")
        return ScaleDecision(current, rec, bounded, "panic" if panic else "stable", "; ".join(reasons))

    def remember(self, t: float, recommended: int, current: int) -> None:
        """Restore one past recommendation (from published hints) after a restart, oldest first."""
        if self._started is None:
            self._started = (float(t), int(current))
        self._history.append((float(t), max(0, int(recommended))))

    def dump(self) -> dict:
        return {"history": list(self._history), "panic_until": self._panic_until}


# ---------------------------------------------------------------------------------------------
# one pool
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolePlan:
    pool: str
    role: PlanRole
    current: int
    desired: int
    mode: Literal["stable", "panic"]
    reason: str
    predictor: str
    inputs: dict[str, float]


class PoolPlanner:
    """Fold of one pool: ``apply(observation, current replicas per role, now) -> [RolePlan]``."""

    def __init__(self, cfg: PoolPlanConfig, *, targets: SlaTargets, predictor: str = "kalman",
                 predictor_options: dict[str, float] | None = None, interval_s: float = 30.0,
                 profile: PerformanceProfile | None = None):
        self.cfg = cfg
        self.targets = cfg.targets or targets
        self.profile = profile or cfg.load_profile()
        self.predictor_name = predictor
        opts = dict(predictor_options or {})
        self._pred = {k: make_predictor(predictor, **opts) for k in ("rate", "isl", "osl")}
        self.interval_s = interval_s
        self.scalers = {r: ReplicaScaler(cfg.policy_for(r)) for r in cfg.roles}
        self._last_isl = 0.0
        self._last_osl = 0.0
        self.p_corr = 1.0  # damped correction factors (state of the fold, fed by observations only)
        self.d_corr = 1.0

    def observe(self, obs: Observation) -> None:
        """Feed one interval to the predictors without planning (also used to warm them up)."""
        self._pred["rate"].apply(obs.rate)
        # lengths are only meaningful when requests arrived; keep the last known otherwise
        if obs.rate > 0:
            self._last_isl, self._last_osl = obs.isl, obs.osl
        self._pred["isl"].apply(self._last_isl)
        self._pred["osl"].apply(self._last_osl)

    def predicted(self) -> dict[str, float]:
        return {k: p.predict() for k, p in self._pred.items()}

    def apply(self, obs: Observation, current: dict[str, int], now: float) -> list[RolePlan]:
        self.observe(obs)
        rate = self._pred["rate"].predict()
        isl = self._pred["isl"].predict()
        osl = self._pred["osl"].predict()

        n_decode = current.get("decode", current.get("aggregated", 0))
        c = self.cfg.correction
        raw_p, raw_d = correction_factors(obs, self.profile, n_decode, (c.min_factor, c.max_factor))
        self.p_corr = p_corr = damp(self.p_corr, raw_p, c.smoothing)
        self.d_corr = d_corr = damp(self.d_corr, raw_d, c.smoothing)
        pre = prefill_replicas(rate, isl, p_corr, self.profile)
        dec = decode_replicas(rate, isl, osl, self.targets.itl_s, d_corr, self.profile)
        raw = {"prefill": _ceil(pre), "decode": _ceil(dec), "aggregated": _ceil(pre + dec)}

        inputs = {
            "observed_rate": obs.rate, "observed_isl": obs.isl, "observed_osl": obs.osl,
            "predicted_rate": rate, "predicted_isl": isl, "predicted_osl": osl,
            "p_corr": p_corr, "d_corr": d_corr,
            "prefill_replicas_exact": pre, "decode_replicas_exact": dec,
        }
        if obs.ttft_s is not None:
            inputs["observed_ttft_s"] = obs.ttft_s
        if obs.itl_s is not None:
            inputs["observed_itl_s"] = obs.itl_s
        if obs.attainment is not None:
            inputs["attainment"] = obs.attainment

        plans = []
        for role in self.cfg.roles:
            cur = int(current.get(role, 0))
            d = self.scalers[role].apply(raw[role], cur, now)
            why = (f"rate {obs.rate:.2f}->{rate:.2f} req/s, isl {isl:.0f}, osl {osl:.0f}, "
                   f"p_corr {p_corr:.2f}, d_corr {d_corr:.2f}: {role} needs {raw[role]}; {d.reason}")
            plans.append(RolePlan(self.cfg.pool, role, cur, d.desired, d.mode, why, self.predictor_name,
                                  dict(inputs, recommended=float(raw[role]))))
        return plans
