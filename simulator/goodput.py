"""Goodput of PD (planner-sized) against aggregated serving on the same engines.

On the simulator's engine model in virtual time (:mod:`simulator.fleet`): the same Poisson workload
is served by N aggregated engines and by the same N engines split into prefill and decode by the
planner's formulas (:func:`simulator.fleet.plan_split`, from a profile measured on that engine
model). Goodput = requests/s that met both SLA targets (TTFT and TPOT). The figure the PD
literature reports (DistServe's "goodput") is the highest rate a setup sustains with the attainment
goal; here that is the highest rate up to which every rate of the grid met the goal, so a finer
grid gives a finer answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.config import EngineConfig
from simulator.fleet import measure_profile, plan_split, poisson_workload, run_fleet


@dataclass(frozen=True)
class GoodputPoint:
    rate: float
    split: tuple[int, int]  # (prefill, decode) the planner chose for this rate
    goodput: dict[str, float]  # setup -> requests/s within the SLA
    attainment: dict[str, float]  # setup -> share of requests within the SLA
    tpot_p90: dict[str, float | None]
    ttft_p90: dict[str, float | None]


@dataclass
class GoodputComparison:
    engines: int
    ttft_s: float
    tpot_s: float
    goal: float
    isl: tuple[int, int]
    osl: tuple[int, int]
    seconds: float
    points: list[GoodputPoint] = field(default_factory=list)

    def sustained(self, setup: str) -> float:
        """The highest rate up to which every rate of the grid met the attainment goal (0: none)."""
        best = 0.0
        for p in sorted(self.points, key=lambda p: p.rate):
            if p.attainment[setup] < self.goal:
                break
            best = p.rate
        return best

    @property
    def ratio(self) -> float | None:
        """PD's sustained rate over aggregated's (None when aggregated sustains no rate of the grid)."""
        a = self.sustained("aggregated")
        return self.sustained("pd") / a if a else None

    @property
    def saturated(self) -> bool:
        """The grid's top rate was still sustained by PD: the ratio is a lower bound."""
        return bool(self.points) and self.sustained("pd") == max(p.rate for p in self.points)

    def rows(self) -> list[list[str]]:
        out = []
        for p in self.points:
            ga, gp = p.goodput["aggregated"], p.goodput["pd"]
            out.append([f"{p.rate:g}", f"{ga:.2f} ({p.attainment['aggregated']:.0%})",
                        f"{p.split[0]}P{p.split[1]}D", f"{gp:.2f} ({p.attainment['pd']:.0%})",
                        f"{gp / ga:.2f}x" if ga else "-"])
        return out

    def summary(self) -> str:
        a, p = self.sustained("aggregated"), self.sustained("pd")
        r = self.ratio
        return (f"highest rate held at >= {self.goal:.0%} of requests within TTFT <= {self.ttft_s:g} s and TPOT <= "
                f"{self.tpot_s * 1000:g} ms on {self.engines} engines: aggregated {a:g} req/s, PD {p:g} req/s"
                + (f" -> {r:.2f}x" if r else "") + (" (PD still held the top rate: a lower bound)" if self.saturated
                                                    else ""))


def compare(engines: int, rates: list[float], *, seconds: float = 40.0, isl: tuple[int, int] = (6000, 10000),
            osl: tuple[int, int] = (100, 300), ttft_s: float = 2.0, tpot_s: float = 0.025, goal: float = 0.9,
            cfg: EngineConfig | None = None, profile=None, seed: int = 0, seeds: int = 1,
            progress=None) -> GoodputComparison:  # noqa: ANN001
    """Both setups at every rate, the same arrivals for both (seeded per rate). ``seeds`` > 1: each
    rate is run with that many independent arrival sequences and the figures are their means (one
    Poisson draw near a knee can pass or fail by luck)."""
    cfg = cfg or EngineConfig(model_profile="llama-3.1-8b", hardware="h100", max_num_batched_tokens=2048,
                              enable_prefix_caching=False, emit_kv_events=False)
    if profile is None:
        profile = measure_profile(cfg, [2048, 8192, 16384], [4096, 8192, 16384], [1, 4, 8, 16, 32, 64])
    out = GoodputComparison(engines, ttft_s, tpot_s, goal, isl, osl, seconds)
    mean_isl, mean_osl = sum(isl) / 2, sum(osl) / 2
    def mean(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    for rate in rates:
        p, d = plan_split(engines, rate, mean_isl, mean_osl, tpot_s, profile)
        runs: dict[str, list] = {"aggregated": [], "pd": []}
        for j in range(seeds):
            arr = poisson_workload(rate, seconds, isl, osl, seed=seed + int(rate * 100) + 100_003 * j)
            runs["aggregated"].append(run_fleet(arr, cfg, mode="aggregated", engines=engines))
            runs["pd"].append(run_fleet(arr, cfg, mode="pd", prefill=p, decode=d))
        pt = GoodputPoint(rate, (p, d), {k: mean([r.goodput(ttft_s, tpot_s) for r in rs]) for k, rs in runs.items()},
                          {k: mean([r.attainment(ttft_s, tpot_s) for r in rs]) for k, rs in runs.items()},
                          {k: mean([r.quantile("tpot", 0.9) for r in rs]) for k, rs in runs.items()},
                          {k: mean([r.quantile("ttft", 0.9) for r in rs]) for k, rs in runs.items()})
        out.points.append(pt)
        if progress is not None:
            progress(pt)
    return out
