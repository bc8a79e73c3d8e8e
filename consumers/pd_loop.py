"""The PD sizing loop, closed on one machine: a simulated PD pool started with the wrong
prefill:decode ratio serves a load ramp; every interval its request records go into the SLA
history (chDB, the ClickHouse tables the sink writes), the planner (:class:`consumers.planner.PlannerService`)
reads them back, publishes hints (stored in ``scaling_hints``) and they resize the pool's prefill and
decode engines; current replicas come from the engines' own announcements, never from the last hint.

The pool is :class:`simulator.fleet.Fleet` in virtual time (the simulator's engine model, so an
hour of traffic takes a minute); the planner's profile is measured on the same model.

    PYTHONPATH=. python -m consumers.pd_loop [--intervals 24] [--interval 30] [--engines-max 8]

Prints one line per interval (offered load, engines per role, attainment, the hints) and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from consumers import sla_queries as Q
from consumers.planner import PlannerService
from consumers.sla_store import ChdbStore, SlaConfig
from schemas import EngineAnnouncement, RequestRecord, ScalingHint
from simulator.config import EngineConfig
from simulator.fleet import Fleet, Outcome, measure_profile, poisson_workload
from streams.backends import AnnouncedBackends
from streams.clock import ManualClock
from streams.planner import PlannerConfig, PoolPlanConfig, ScalingPolicy, SlaTargets

POOL = "pd-loop"


@dataclass
class Interval:
    k: int
    rate: float
    engines: dict[str, int]
    requests: int
    attainment: float | None
    hints: dict[str, int] = field(default_factory=dict)


@dataclass
class LoopReport:
    intervals: list[Interval]
    hint_rows: int
    record_rows: int

    def table(self) -> str:
        lines = [f"{'k':>3} {'rate':>5} {'P':>2} {'D':>2} {'req':>4} {'attain':>7}  hints (P, D)"]
        for i in self.intervals:
            att = "-" if i.attainment is None else f"{i.attainment:6.1%}"
            lines.append(f"{i.k:3d} {i.rate:5.1f} {i.engines.get('prefill', 0):2d} {i.engines.get('decode', 0):2d} "
                         f"{i.requests:4d} {att:>7}  {i.hints.get('prefill', '-')}, {i.hints.get('decode', '-')}  "
                         + "#" * int(round((i.attainment or 0) * 20)))
        return "\n".join(lines)


def _record(rid: str, o: Outcome, epoch: float, now: float) -> bytes:
    """A finished request's record; one still in flight at ``now`` is recorded with its wait so far as
    TTFT (a lower bound: the router's view of it), and replaced by its final record when it finishes
    (``request_records`` keeps the last row per request id)."""
    ttft = o.ttft if o.ttft is not None else now - o.arrival
    return RequestRecord(
        request_id=rid, ts=epoch + o.arrival, pool=POOL, role="pd", model="sim", served_stage="pd",
        prompt_tokens=o.prompt_tokens, output_tokens=o.tokens, ttft_s=ttft, itl_s=o.tpot, tpot_s=o.tpot,
        prefill_ttft_s=None if o.prefill_done is None else o.prefill_done - o.arrival,
        kv_transfer_s=None if o.prefill_done is None or o.first_token is None else o.first_token - o.prefill_done,
        e2e_s=None if o.last_token is None else o.last_token - o.arrival,
    ).model_dump_json().encode()


def ramp(k: int, n: int, low: float, high: float) -> float:
    """Quiet, a ramp up over the middle half, then high."""
    a, b = n // 4, 3 * n // 4
    if k < a:
        return low
    if k >= b:
        return high
    return low + (high - low) * (k - a) / max(b - a, 1)


async def run_loop(store: ChdbStore, *, intervals: int = 24, interval_s: float = 30.0, start: tuple[int, int] = (1, 3),
                   low: float = 1.0, high: float = 6.0, isl: tuple[int, int] = (6000, 10000),
                   osl: tuple[int, int] = (100, 300), targets: SlaTargets = SlaTargets(ttft_s=2.0, itl_s=0.025),
                   engines_max: int = 8, cfg: EngineConfig | None = None, seed: int = 7,
                   log=print) -> LoopReport:  # noqa: ANN001
    cfg = cfg or EngineConfig(model_profile="llama-3.1-8b", hardware="h100", max_num_batched_tokens=2048,
                              enable_prefix_caching=False, emit_kv_events=False)
    profile = measure_profile(cfg, [2048, 8192, 16384], [4096, 8192, 16384], [1, 4, 8, 16, 32, 64])
    policy = ScalingPolicy(min_replicas=1, max_replicas=engines_max, tolerance=0.1, stable_window_s=2 * interval_s,
                           panic_threshold=1.5, panic_hold_s=4 * interval_s, scale_down_window_s=4 * interval_s)
    sla = SlaConfig(targets=targets, planner=PlannerConfig(
        interval_s=interval_s, predictor="holt", warmup_intervals=0,
        # the planner plans for 80 % of the SLA targets: headroom, as an operator would set it
        pools=[PoolPlanConfig(pool=POOL, profile=profile, policy=policy,
                              targets=SlaTargets(ttft_s=0.8 * targets.ttft_s, itl_s=0.8 * targets.itl_s))]))
    epoch = float(int(time.time()) - intervals * interval_s - 60)
    clock = ManualClock(epoch)
    announced = AnnouncedBackends(clock)
    hint_rows = 0

    async def publish(h: ScalingHint) -> None:  # what the SLA sink stores from autoscale.hints.*
        nonlocal hint_rows
        row = h.model_dump()
        row["inputs"] = json.dumps(h.inputs, sort_keys=True)
        store.insert_json_each_row("scaling_hints", [json.dumps(row).encode()])
        hint_rows += 1

    planner = PlannerService(store, sla, clock=clock, publish=publish, announced=announced)
    fleet = Fleet(cfg, "pd", prefill=start[0], decode=start[1])
    out: list[Interval] = []
    written: set[str] = set()  # final records written
    recorded: set[str] = set()  # every request id with a record (final or in flight)
    next_id = 0
    for k in range(intervals):
        t0, t1 = k * interval_s, (k + 1) * interval_s
        rate = ramp(k, intervals, low, high)
        arr = [type(a)(a.t + t0, a.prompt_tokens, a.output_tokens)
               for a in poisson_workload(rate, interval_s, isl, osl, seed=seed * 1000 + k)]
        fleet.submit(arr, first_id=next_id)
        ids = [f"r{next_id + i}" for i in range(len(arr))]
        next_id += len(arr)
        engines = fleet.counts()
        fleet.run_until(t1)
        fresh = [(rid, o) for rid, o in fleet.outcomes.items() if rid not in written and (o.done or rid in ids)]
        if fresh:
            store.insert_json_each_row("request_records", [_record(rid, o, epoch, t1) for rid, o in fresh])
            written.update(rid for rid, o in fresh if o.done)
            recorded.update(rid for rid, _ in fresh)
        mine = [fleet.outcomes[r] for r in ids]
        att = (sum(1 for o in mine if o.done and o.ttft <= targets.ttft_s and (o.tpot or 0) <= targets.itl_s)
               / len(mine)) if mine else None
        # the engines announce themselves (what runs now), then the planner reads the history
        clock.set(epoch + t1)
        for role, n in fleet.counts().items():
            for i in range(engines_max):
                announced.apply(EngineAnnouncement(pod=f"{role}-{i}", url=f"sim://{role}-{i}", model="sim", role=role,
                                                   pool=POOL, ts=clock.now(), state="up" if i < n else "down"))
        hints = {h.role: h.desired for h in await planner.tick()}
        for role, n in hints.items():
            fleet.scale(role, n)
        iv = Interval(k, rate, engines, len(mine), att, hints)
        out.append(iv)
        if log:
            log(LoopReport([iv], 0, 0).table().splitlines()[-1])
    return LoopReport(out, hint_rows, len(recorded))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", type=int, default=24)
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--engines-max", type=int, default=8)
    ap.add_argument("--low", type=float, default=1.0)
    ap.add_argument("--high", type=float, default=6.0)
    ap.add_argument("--chdb", type=Path, default=None, help="chDB directory (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = ChdbStore(args.chdb or Path(tmp) / "chdb", "infernex")
        Q.migrate(store)
        try:
            print(f"{'k':>3} {'rate':>5} {'P':>2} {'D':>2} {'req':>4} {'attain':>7}  hints (P, D)")
            rep = asyncio.run(run_loop(store, intervals=args.intervals, interval_s=args.interval,
                                       engines_max=args.engines_max, low=args.low, high=args.high))
            counts = Q.table_counts(store)
        finally:
            store.close()
    first, last = rep.intervals[: len(rep.intervals) // 4], rep.intervals[-len(rep.intervals) // 4:]
    avg = lambda xs: sum(i.attainment or 0 for i in xs) / max(len(xs), 1)  # noqa: E731
    print(f"ClickHouse: {counts['request_records']} request records, {counts['scaling_hints']} scaling hints")
    print(f"attainment: first quarter {avg(first):.1%}, last quarter {avg(last):.1%}; engines at the end "
          f"{rep.intervals[-1].hints}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
