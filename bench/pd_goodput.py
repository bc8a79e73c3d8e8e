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
from simulator.fleet import measure_profile
from simulator.goodput import compare


def _rates(spec: str) -> list[float]:
    """``4,5,6`` or ``4:9:0.25`` (start:stop:step, stop included)."""
    if ":" in spec:
        a, b, step = (float(x) for x in spec.split(":"))
        n = int(round((b - a) / step))
        return [round(a + i * step, 6) for i in range(n + 1)]
    return [float(r) for r in spec.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rates", default="4,5,6,7,8,9", help="a list, or start:stop:step")
    ap.add_argument("--isl", default="6000,10000")
    ap.add_argument("--osl", default="100,300")
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tpot", type=float, default=0.025)
    ap.add_argument("--goal", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=1, help="arrival sequences per rate (figures are their means)")
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
    print(f"workload: Poisson, {args.seconds:g} s per rate x {args.seeds} arrival sequences, ISL U{isl}, OSL U{osl}; SLA: TTFT <= {args.ttft:g} s "
          f"and TPOT <= {args.tpot * 1000:g} ms; {args.engines} engines both ways")
    print(f"{'rate':>5} | {'aggregated':>30} | {'PD (planner split)':>38} | ratio")

    def line(p) -> None:
        ga, gp = p.goodput["aggregated"], p.goodput["pd"]
        print(f"{p.rate:5.2f} | {ga:5.2f} req/s ({p.attainment['aggregated']:6.1%}) TPOT90 "
              f"{(p.tpot_p90['aggregated'] or 0) * 1000:5.1f} ms | {p.split[0]}P{p.split[1]}D {gp:5.2f} req/s "
              f"({p.attainment['pd']:6.1%}) TPOT90 {(p.tpot_p90['pd'] or 0) * 1000:5.1f} ms TTFT90 "
              f"{p.ttft_p90['pd'] or 0:5.2f} s | {gp / ga if ga else float('inf'):4.2f}x", flush=True)

    res = compare(args.engines, _rates(args.rates), seconds=args.seconds, isl=isl, osl=osl, ttft_s=args.ttft,
                  tpot_s=args.tpot, goal=args.goal, cfg=cfg, profile=prof, seeds=args.seeds,
                  progress=line)
    print(res.summary())
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
