"""Routing quality on a Mooncake-format trace: our strategies over the same simulated engines.

    PYTHONPATH=. python -P bench/routing_quality.py [--trace FILE] [--skip 3000] [--limit 800]
        [--engines 8] [--time-scale 1] [-p kv-aware -p round-robin ...] [--kv-model fine]

Each strategy (built-in name or strategy YAML) replays the same trace slice through the router's
own decision code onto simulated vLLM engines (``simulator.whatif``: the engines' scheduler and
prefix cache, in virtual time, the router seeing their queues, KV usage and exact cached blocks
as the engines' KV events would give them). Reported per strategy:

* hit rate: prompt tokens served from the prefix cache / prompt tokens;
* overlap chosen/best: cached blocks on the chosen engine / most cached blocks on any engine;
* spread: max / mean requests per engine (1.0 = perfectly even);
* busy spread: max / mean engine busy time;
* TTFT p50/p90 and E2E p50/p90 in virtual seconds.

Any trace in the Mooncake format works (``--trace``); the default is the public synthetic trace
under /work/shared/traces. Virtual time: the figures do not depend on this machine's load (a
router's own CPU cost is measured by bench/router.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


def quality(res) -> dict:
    rows = [r for r in res.rows if r.status == "ok"]
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens or 0 for r in rows)
    per = Counter(r.backend for r in rows)
    n_eng = len(res.busy)
    counts = [per.get(p, 0) for p in res.busy]
    mean = sum(counts) / n_eng if n_eng else 0
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    e2e = [r.e2e_s for r in rows if r.e2e_s is not None]
    return {"ok": len(rows), "errors": len(res.rows) - len(rows), "hit": cached / prompt if prompt else 0.0,
            "overlap": res.overlap_share, "spread": max(counts) / mean if mean else float("nan"),
            "busy_spread": res.busy_spread, "ttft50": pct(ttft, 50), "ttft90": pct(ttft, 90),
            "e2e50": pct(e2e, 50), "e2e90": pct(e2e, 90)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--limit", type=int, default=800)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrivals at timestamp / K (K > 1: busier)")
    ap.add_argument("--kv-model", choices=("coarse", "fine"), default="coarse")
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--max-output-tokens", type=int, default=None)
    ap.add_argument("--metrics-interval", type=float, default=0.0,
                    help="virtual seconds between scrapes of the engines' load (0: exact at every decision)")
    ap.add_argument("-p", "--profile", action="append", default=None)
    args = ap.parse_args()
    from simulator.whatif import Fleet, simulate
    from simulator.workloads import load_trace

    profiles = args.profile or ["round-robin", "least-load", "dynamo-cost", "kv-aware"]
    rows = load_trace(args.trace, limit=args.skip + args.limit)[args.skip:]
    if not rows:
        n = len(load_trace(args.trace))
        sys.exit(f"{args.trace.name} has {n} requests, so --skip {args.skip} leaves none: pass a --skip below {n}")
    fleet = Fleet(aggregated=args.engines, kv_model=args.kv_model, num_gpu_blocks=args.num_gpu_blocks)
    from simulator.workloads.trace import trace_stats

    ideal = trace_stats(rows)["ideal_prefix_hit_rate"]  # (what one engine with an unbounded cache would hit)
    print(f"trace {args.trace.name}: requests {args.skip}-{args.skip + len(rows)}, {args.engines} engines, "
          f"time scale {args.time_scale}, {args.kv_model} KV model, hit ceiling {ideal:.1%}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'strategy':<22} {'hit':>6} {'ovl':>6} {'spread':>6} {'busy':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'E2E p50':>8} {'E2E p90':>8} {'err':>4}")
    for prof in profiles:
        q = quality(simulate(rows, prof, fleet, time_scale=args.time_scale, max_output_tokens=args.max_output_tokens,
                             metrics_interval_s=args.metrics_interval))
        ovl = f"{q['overlap']:.3f}" if q["overlap"] is not None else "-"
        print(f"{Path(prof).stem:<22} {q['hit']:6.1%} {ovl:>6} {q['spread']:6.2f} {q['busy_spread'] or 0:6.2f} "
              f"{q['ttft50']:9.3f} {q['ttft90']:9.3f} {q['e2e50']:8.2f} {q['e2e90']:8.2f} {q['errors']:4d}")


if __name__ == "__main__":
    main()
