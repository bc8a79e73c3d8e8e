"""Router CPU per streamed request: our routers against sglang-router on the same fake engines.

    python -P bench/router_stream.py [--tokens 64] [--gap-ms 2] [--requests 400] [--concurrency 16]
        [--strategies round-robin,kv-aware,kv-aware@REF] [--rounds 2]

Four fake engines (router.testing.FakeEngine, in this process with the client) stream ``--tokens``
tokens per request, one SSE event every ``--gap-ms`` (as an engine sends one token per step, so each
event reaches the router on its own), short prompts. Each router runs in its own process
(``infernex router --no-bus``; sglang-router ``cache_aware`` from bench/peers.py's cache venv);
rounds are interleaved and each router's CPU (user + system, from /proc) is divided by the
requests it served. It isolates what relaying a stream costs a router, apart from its decision
and from any bus traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def load(url: str, n: int, conc: int, tokens: int) -> None:
    body = {"model": "m", "prompt": "hello " * 50, "max_tokens": tokens, "stream": True}
    sent = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < n:
            sent += 1
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, r.status
                async for _ in r.content.iter_any():
                    pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(conc)))


async def main_async(args) -> None:
    from router.testing import FakeEngine

    br = _bench("router")
    peers = _bench("peers")
    engines = [await FakeEngine(f"fake-{i}", tokens=args.tokens, delay_s=args.gap_ms / 1000).start() for i in range(4)]
    urls = [e.url for e in engines]
    contenders = []
    for spec in args.strategies.split(","):
        strategy, _, ref = spec.partition("@")  # NAME@REF: the router from git REF's code
        port = br.free_port()
        cmd = [sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--port", str(port), "--profile", strategy]
        for i, u in enumerate(urls):
            cmd += ["-b", f"fake-{i}={u}@m"]
        contenders.append((f"infernex {spec}", cmd, port, peers.extract_ref(ref) if ref else ROOT))
    sg = peers.peer_python("sglang-router")
    if sg is not None:
        port = br.free_port()
        contenders.append((f"sglang-router {peers.peer_version(sg, 'sglang-router')} cache_aware",
                           [sg, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", "cache_aware",
                            "--port", str(port), "--prometheus-port", str(br.free_port()), "--log-level", "warn"],
                           port, ROOT))
    procs = []
    try:
        live = []
        for label, cmd, port, tree in contenders:
            p = subprocess.Popen(cmd, cwd=tree, env=dict(os.environ, PYTHONPATH=tree), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            await br.wait_post(url)
            live.append((label, p, url))
        print(f"{args.tokens} tokens per request, one event every {args.gap_ms:g} ms; {args.requests} requests, "
              f"{args.concurrency} at a time; load average {os.getloadavg()[0]:.2f}")
        cpu = {label: [] for label, _, _ in live}
        for rnd in range(args.rounds):
            for label, p, url in (live if rnd % 2 == 0 else live[::-1]):
                await load(url, 50, 8, args.tokens)  # warm
                c0, t = br.cpu_seconds(p.pid), time.perf_counter()
                await load(url, args.requests, args.concurrency, args.tokens)
                us = (br.cpu_seconds(p.pid) - c0) / args.requests * 1e6
                cpu[label].append(us)
                print(f"round {rnd + 1} {label:<34} router CPU {us:6.0f} us/request ({time.perf_counter() - t:.1f} s)",
                      flush=True)
        for label, xs in cpu.items():
            xs = sorted(xs)
            print(f"median {label:<34} {xs[len(xs) // 2]:6.0f} us/request")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for e in engines:
            await e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--strategies", default="round-robin,kv-aware")
    ap.add_argument("--rounds", type=int, default=2)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
