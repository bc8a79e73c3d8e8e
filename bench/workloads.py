"""Workload figures: trace loading, prompt synthesis, generators, and how many requests per
second the replay client can drive (against the in-process fake OpenAI server, so the
figure is the client's own ceiling, not an engine's).

    /work/venv/bin/python bench/workloads.py [--trace ../shared/traces/mooncake_synthetic_trace.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

from simulator.workloads.client import build_body, replay
from simulator.workloads.generators import KINDS, generate
from simulator.workloads.synth import PromptSynthesizer
from simulator.workloads.trace import TraceRow, load_trace

DEFAULT_TRACE = Path(__file__).parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def timed(fn, *args, repeat: int = 3, **kw):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn(*args, **kw)
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--replay-requests", type=int, default=600)
    args = ap.parse_args()

    dt, rows = timed(load_trace, args.trace)
    tokens = sum(r.input_length for r in rows)
    print(f"load_trace: {len(rows)} rows in {dt * 1000:.1f} ms ({len(rows) / dt:,.0f} rows/s)")

    synth = PromptSynthesizer()
    t = time.perf_counter()
    for i, r in enumerate(rows):
        synth.token_array(r, request_key=i)
    dt = time.perf_counter() - t
    print(f"token synthesis (whole trace, default LRU cache): {len(rows) / dt:,.0f} req/s, "
          f"{tokens / dt / 1e6:.1f} M tokens/s")
    sub = rows[:300]
    t = time.perf_counter()
    for i, r in enumerate(sub):
        synth.text(r, request_key=i)
    dt = time.perf_counter() - t
    print(f"text synthesis (first 300 rows, avg {sum(r.input_length for r in sub) / len(sub):,.0f} tokens): "
          f"{len(sub) / dt:,.0f} req/s")
    t = time.perf_counter()
    for i, r in enumerate(sub):
        build_body(r, model="m", synth=synth, prompt_mode="tokens", api="completions", index=i)
    dt = time.perf_counter() - t
    print(f"request body (token ids, JSON): {len(sub) / dt:,.0f} req/s")

    for kind in KINDS:
        dt, gen = timed(generate, kind, n=10_000, seed=1, repeat=1)
        print(f"generate {kind:<13} 10,000 rows in {dt * 1000:.0f} ms")

    n = args.replay_requests
    small = [TraceRow(timestamp=0, input_length=256, output_length=16, hash_ids=[i]) for i in range(n)]
    # the fake server in its own process, so client and server do not share one GIL
    proc = subprocess.Popen([sys.executable, "-m", "simulator.workloads.testing"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        res = asyncio.run(replay(small, url, model="m", time_scale=0.0, concurrency=64, timeout_s=120))
    finally:
        proc.stdin.close()
        proc.wait(30)
    s = res.summary
    print(f"replay client ceiling vs fake server process (same 2-core machine, {n} requests x 16 streamed "
          f"tokens, concurrency 64): {s.throughput_rps:,.0f} req/s, {s.output_tokens_per_s:,.0f} chunks/s, "
          f"ok {s.ok}/{s.requests}")


if __name__ == "__main__":
    main()
