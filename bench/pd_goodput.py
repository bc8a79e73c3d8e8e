"""Goodput of PD (planner-sized) against aggregated serving on the same engines, long prompts.

One run, side by side, on the simulator's engine model in virtual time (:mod:`simulator.fleet`):
the same Poisson workload (long prompts, short answers) is served by N aggregated engines and by
the same N engines split into prefill and decode by the planner's formulas (:mod:`streams.planner`)
from a profile measured on that engine model. Goodput = requests/s that met both SLA targets
(TTFT and TPOT, i.e. mean inter-token latency). Reported: goodput at each offered rate, and the
highest rate each setup sustains with >= the attainment goal (the usual "goodput" of the PD
literature, e.g. DistServe).

    PYTHONPATH=. python bench/pd_goodput.py [--engines 4] [--seconds 40] [--rates 5,6,7,8,9]
"""

from __future__ import annotations

import argparse
import time

from simulator.config import EngineConfig
from simulator.fleet import measure_profile, plan_split, poisson_workload, run_fleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rates", default="4,5,6,7,8,9")
    ap.add_argument("--isl", default="6000,10000")
    ap.add_argument("--osl", default="100,300")
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tpot", type=float, default=0.025)
    ap.add_argument("--goal", type=float, default=0.9)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (chunked prefill budget)")
    args = ap.parse_args()
    isl = tuple(int(x) for x in args.isl.split(","))
    osl = tuple(int(x) for x in args.osl.split(","))
    cfg = EngineConfig(model_profile=args.model, hardware=args.hardware, max_num_batched_tokens=args.budget,
                       enable_prefix_caching=False, emit_kv_events=False)
    t0 = time.perf_counter()
    prof = measure_profile(cfg, [2048, 8192, 16384], [4096, 8192, 16384], [1, 4, 8, 16, 32, 64])
    print(f"engine: {args.model} on {args.hardware}, chunked-prefill budget {args.budget} tokens, "
          f"KV link {cfg.hw.kv_link_gb_s:g} GB/s; profile measured in {time.perf_counter() - t0:.1f} s")
    print(f"workload: Poisson, {args.seconds:g} s per rate, ISL U{isl}, OSL U{osl}; SLA: TTFT <= {args.ttft:g} s "
          f"and TPOT <= {args.tpot * 1000:g} ms; {args.engines} engines both ways")
    print(f"{'rate':>5} | {'aggregated':>30} | {'PD (planner split)':>38} | ratio")
    best = {"aggregated": 0.0, "pd": 0.0}
    holding = {"aggregated": True, "pd": True}  # every rate so far met the goal
    mean_isl, mean_osl = sum(isl) / 2, sum(osl) / 2
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        arr = poisson_workload(rate, args.seconds, isl, osl, seed=int(rate * 100))
        p, d = plan_split(args.engines, rate, mean_isl, mean_osl, args.tpot, prof)
        agg = run_fleet(arr, cfg, mode="aggregated", engines=args.engines)
        pd = run_fleet(arr, cfg, mode="pd", prefill=p, decode=d)
        ga, gp = agg.goodput(args.ttft, args.tpot), pd.goodput(args.ttft, args.tpot)
        aa, ap_ = agg.attainment(args.ttft, args.tpot), pd.attainment(args.ttft, args.tpot)
        for k, att in (("aggregated", aa), ("pd", ap_)):
            holding[k] = holding[k] and att >= args.goal
            if holding[k]:
                best[k] = rate
        rows.append((rate, ga, gp))
        print(f"{rate:5.1f} | {ga:5.2f} req/s ({aa:6.1%}) TPOT90 {agg.quantile('tpot', .9) * 1000:5.1f} ms | "
              f"{p}P{d}D {gp:5.2f} req/s ({ap_:6.1%}) TPOT90 {pd.quantile('tpot', .9) * 1000:5.1f} ms "
              f"TTFT90 {pd.quantile('ttft', .9):5.2f} s | {gp / ga if ga else float('inf'):4.2f}x", flush=True)
    print(f"highest rate up to which every rate had >= {args.goal:.0%} attainment: aggregated {best['aggregated']:g} req/s, "
          f"PD {best['pd']:g} req/s -> {best['pd'] / best['aggregated'] if best['aggregated'] else float('inf'):.2f}x")
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
