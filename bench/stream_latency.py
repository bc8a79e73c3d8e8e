"""What a router adds to a streamed answer: one simulated engine, sequential streamed completions
sent directly and through each router, TTFT and E2E (to ``[DONE]``) medians side by side.

    PYTHONPATH=. python -P bench/stream_latency.py [--requests 40] [--rounds 3] [--max-tokens 64]
        [--time-scale 8] [--peers sglang-router]

Each request is its own prompt (no prefix reuse) and waits for the previous one, so the figures
are the path's latency, not queueing. Routers: ``infernex router --no-bus`` (kv-aware) and, when
its cached venv can be made (bench/peers.py), sglang-router ``cache_aware``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402

from infernex.embedded_nats import free_port  # noqa: E402
from simulator.cluster import EngineSpec, SimCluster  # noqa: E402
from simulator.config import EngineConfig  # noqa: E402

MODEL = "m"


def _peers():
    spec = importlib.util.spec_from_file_location("bench_peers", os.path.join(ROOT, "bench", "peers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(600):
            try:
                if (await c.get(url + "/v1/models")).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered")


async def probe(url: str, args, tag: int) -> tuple[float, float, int]:
    """(TTFT p50 ms, E2E p50 ms, fewest chunks seen) over ``args.requests`` sequential requests."""
    ttft, e2e, chunks = [], [], []
    async with httpx.AsyncClient(timeout=60) as c:
        for i in range(args.requests):
            body = {"model": MODEL, "prompt": f"request {tag}-{i} " + "hello world " * 200,
                    "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}
            t0 = time.perf_counter()
            first = None
            n = 0
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if line[5:].strip() == "[DONE]":
                        break
                    n += 1
                    if first is None:
                        first = time.perf_counter()
            end = time.perf_counter()
            if first is None:
                raise RuntimeError(f"{url}: no token in the answer")
            ttft.append(first - t0)
            e2e.append(end - t0)
            chunks.append(n)
    return statistics.median(ttft) * 1e3, statistics.median(e2e) * 1e3, min(chunks)


async def main_async(args) -> None:
    cluster = SimCluster([EngineSpec(EngineConfig(engine_id="e0", served_model_name=MODEL))],
                         time_scale=args.time_scale).start()
    engine = cluster.engines[0].url
    routes: list[tuple[str, str]] = [("direct", engine)]
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--port", str(port), "--profile", "kv-aware",
             "--tokenizer", "simple", "-b", f"e0={engine}@{MODEL}"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        routes.append(("infernex kv-aware", f"http://127.0.0.1:{port}"))
        if "sglang-router" in args.peers.split(","):
            peers = _peers()
            py = peers.peer_python("sglang-router")
            if py is None:
                print("sglang-router: cannot be installed here, skipped")
            else:
                print(f"sglang-router {peers.peer_version(py, 'sglang-router')} ({py})")
                port = free_port()
                procs.append(subprocess.Popen(
                    [py, "-m", "sglang_router.launch_router", "--worker-urls", engine, "--policy", "cache_aware",
                     "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                routes.append(("sglang cache_aware", f"http://127.0.0.1:{port}"))
        for _, url in routes:
            await wait_ready(url)
        await asyncio.sleep(1.0)
        print(f"{args.requests} sequential streamed requests of {args.max_tokens} tokens per path and round, "
              f"engine time x{args.time_scale:g}; load average {os.getloadavg()[0]:.2f}")
        for rnd in range(args.rounds):
            for k, (name, url) in enumerate(routes if rnd % 2 == 0 else routes[::-1]):
                t, e, n = await probe(url, args, rnd * 100 + k)
                print(f"round {rnd + 1} {name:<20} TTFT p50 {t:6.1f} ms  E2E p50 {e:6.1f} ms  (chunks >= {n})",
                      flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--peers", default="sglang-router", help="comma-separated; empty: our router only")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
