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

``--live`` also measures that best case on the live setup: one engine process started as
bench/routing_http.py starts them (``infernex sim -n 1``, same time scale), with a KV cache large
enough to hold the whole slice, gets every request of the slice alone and in order (the next one
after the previous finished: an idle engine at each arrival, every earlier prompt cached), as text
over HTTP from the same replay client, no router. Its TTFTs add what no placement removes: the
client, HTTP, the engine's tokenizer and event loop, and this machine's scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import tempfile
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


async def live_ttfts(rows, time_scale: float) -> tuple[list[float | None], int, int]:
    """Per request, in order: its TTFT (wall s) sent alone to an idle engine holding every earlier
    prompt (None where it failed); and the prompt tokens the engine reported cached, of all."""
    from simulator.workloads.client import replay

    spec = importlib.util.spec_from_file_location("routing_http", ROOT / "bench" / "routing_http.py")
    rh = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(rh)
    distinct = len({h for r in rows for h in r.hash_ids})
    blocks = distinct * (TRACE_BLOCK // 16) * 2 + 4096  # the whole slice twice over at 16 tokens a block
    procs: list = []
    with tempfile.TemporaryDirectory(prefix="ttft-floor-") as tmp:
        try:
            await rh.start_engine_procs(1, time_scale, Path(tmp), procs, extra=("--num-gpu-blocks", str(blocks)))
            t0 = rows[0].timestamp
            res = await replay([type(r)(timestamp=r.timestamp - t0, input_length=r.input_length,
                                        output_length=1, hash_ids=r.hash_ids) for r in rows],
                               procs[0].url, model=rh.MODEL, time_scale=0.0, concurrency=1, prompt_mode="text",
                               timeout_s=300)
        finally:
            rh.stop_engine_procs(procs)
    by_id = {r.index: (r.ttft_s if r.status == "ok" else None) for r in res.requests}
    cached = sum(r.cached_tokens or 0 for r in res.requests)
    return [by_id.get(i) for i in range(len(rows))], cached, sum(r.prompt_tokens for r in res.requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"))
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--live", action="store_true", help="also send each request alone to an idle engine process")
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
    if not args.live:
        return
    live, hit, total = asyncio.run(live_ttfts(rows, args.time_scale))
    got = [(x, s) for x, s in zip(live, secs) if x is not None]
    if not got:
        raise SystemExit("live: no request was answered (see the engine's log above)")
    lx = [x for x, _ in got]
    over = [x - s for x, s in got]
    print(f"live best case ({len(got)}/{len(rows)} requests answered; each alone on one idle engine process, "
          f"over HTTP, no router; the engine served {hit / max(total, 1):.1%} of prompt tokens from cache): "
          f"TTFT p50 {pct(lx, 50):.3f}  p90 {pct(lx, 90):.3f}  p99 {pct(lx, 99):.3f}  mean {statistics.fmean(lx):.3f}")
    print(f"live minus floor per request (wall s): p50 {pct(over, 50):.3f}  p90 {pct(over, 90):.3f}  "
          f"max {max(over):.3f}")


if __name__ == "__main__":
    main()
