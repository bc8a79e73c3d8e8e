"""The lowest TTFT any router could give each request of a trace slice, and its percentiles.

    python -P bench/ttft_floor.py [--trace ../shared/traces/mooncake_synthetic_trace.jsonl]
        [--skip 3000] [--requests 400] [--time-scale 8]

For each request of the slice (in arrival order, caches empty at the start, as bench/routing_http.py
runs it) the floor assumes the best case on every count:

- the most cache a router could find: every leading trace block (512 tokens) that any earlier
  request of the slice carried is cached, as on one engine with an unbounded cache (at most all
  but one prompt token, as vLLM reuses);
- an idle engine: the uncached rest is prefilled alone, in chunks of ``max_num_batched_tokens``,
  each step timed by the simulator's own roofline (``EngineCore.step_time``, default
  ``EngineConfig``: the engines bench/routing_http.py starts), divided by ``--time-scale``;
- no HTTP, tokenizer, router or queueing time.

Every request's TTFT under any router is at least its floor, so every percentile of the measured
TTFTs is at least the same percentile of the floors: the p90 floor bounds what a TTFT p90 goal can
ask of a router on this slice.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from simulator.config import EngineConfig
from simulator.engine_core import EngineCore, Request
from simulator.workloads import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE_BLOCK = 512


def prefill_seconds(core: EngineCore, cached: int, total: int) -> float:
    """Virtual seconds to prefill tokens ``cached..total`` alone on an idle engine, chunk by chunk."""
    chunk = core.config.max_num_batched_tokens
    req = Request(request_id="floor", prompt=None, max_tokens=1, arrival=0.0, keys=[], out_seed=0)
    t = 0.0
    done = cached
    while done < total:
        n = min(chunk, total - done)
        req.num_computed = done
        t += core.step_time([(req, n)])
        done += n
    return t


def floors(rows, core: EngineCore) -> list[tuple[float, int, int]]:
    """Per request, in order: (floor in virtual seconds, prompt tokens, best-case cached tokens)."""
    seen: set[int] = set()
    out = []
    for r in rows:
        lead = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            lead += 1
        cached = min(lead * TRACE_BLOCK, max(r.input_length - 1, 0))
        seen.update(r.hash_ids)
        out.append((prefill_seconds(core, cached, r.input_length), r.input_length, cached))
    return out


def pct(xs: list[float], p: float) -> float:
    """The percentile as bench/routing_http.py takes it."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"))
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--time-scale", type=float, default=8.0)
    args = ap.parse_args()
    rows = load_trace(args.trace, limit=args.skip + args.requests)[args.skip:]
    core = EngineCore(EngineConfig(engine_id="floor", max_model_len=262144))
    fl = floors(rows, core)
    secs = [f / args.time_scale for f, _, _ in fl]
    tokens = sum(n for _, n, _ in fl)
    cached = sum(c for _, _, c in fl)
    print(f"{Path(args.trace).name} rows {args.skip}-{args.skip + len(rows)}, time x{args.time_scale:g}: "
          f"best-case cache {cached / tokens:.1%} of prompt tokens")
    print(f"TTFT floor (wall s): p50 {pct(secs, 50):.3f}  p90 {pct(secs, 90):.3f}  p99 {pct(secs, 99):.3f}  "
          f"mean {statistics.fmean(secs):.3f}")
    i90 = sorted(range(len(secs)), key=secs.__getitem__)[min(len(secs) - 1, int(len(secs) * 0.9))]
    f, n, c = fl[i90]
    print(f"the p90 request: {n} prompt tokens, {c} cacheable at best, prefill alone {f:.3f} s virtual")


if __name__ == "__main__":
    main()
