"""hermes-router bench: added latency over calling a backend directly, throughput with 64
concurrent clients, and the time of one routing decision.

    /work/venv/bin/python bench/router.py [--backends 64] [--requests 2000] [--concurrency 64]
        [--prompt-chars 7400] [--before-ref main] [--strategies kv-aware] [--peers sglang-router] [--stream 32]

``--router-tokenizer PATH`` has our routers tokenize with that ``tokenizer.json`` (the fake
engines do not care). ``--prompt-chars N`` sends prompts of N characters (from a pool of distinct prompts: one of 8
shared documents, 80% of the text, then a fresh question; see bench/tokenizer_speed.py) instead
of the short "hello bench"; with ``--fresh`` no flat-out request repeats a prompt (by default each
round resends the pool's first prompts, whose pieces the tokenizer memo then holds). ``--before-ref REF`` runs the same strategies a second time from the
code at git REF (extracted with ``git archive``), side by side in the same run. ``--peers`` names
peer routers to create in a cache venv (bench/peers.py) when the current interpreter lacks them.
``--stream N`` has every request streamed, the engines sending N tokens one SSE event each (as a
chat client reads an answer); without it each answer is a 2-token JSON body, which leaves the
router's own work per request most of what is measured.

Fake engines (router.testing, 64 in one process) and the router (``infernex router --no-bus``) each
run in their own process; this process is the client. Added latency = router p50/p99 minus direct
p50/p99 over the same sequential small non-streamed requests. The decision time is measured
in-process: ``Router.decide`` for kv-aware over 64 backends with an embedded KvIndex holding
prefixes on every pod (512-token prompts, the index lookup included).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import aiohttp

import importlib.util as _ilu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants (all threads), from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            parent[int(d)] = int(st[1])
    tree, grew = {pid}, True
    while grew:
        kids = {p for p, pp in parent.items() if pp in tree and p not in tree}
        tree |= kids
        grew = bool(kids)
    total = 0
    for p in tree:
        st = _stat(p)
        if st is not None:
            total += int(st[11]) + int(st[12])
    return total / os.sysconf("SC_CLK_TCK")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def wait_http(url, timeout=30.0):
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def wait_post(url, timeout=60.0):
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not serve a completion within {timeout:.0f} s")


BODY = {"model": "m", "prompt": "hello bench", "max_tokens": 2}
BODIES = [BODY]
FRESH = None  # --fresh: one counter over every flat-out request of the run, so no prompt comes twice


def _bench_module(name):
    spec = _ilu.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = _ilu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def sequential(urls, n):
    lat = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for i in range(n):
            u = urls[i % len(urls)]
            t = time.perf_counter()
            async with s.post(u + "/v1/completions", json=BODIES[i % len(BODIES)]) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.perf_counter() - t)
    return lat


async def concurrent(url, clients, total, lat: list | None = None):
    """``clients`` workers sending ``total`` requests flat out; req/s and errors. ``lat`` gets each
    request's latency (seconds)."""
    done = 0
    errors = 0

    async def worker(s):
        nonlocal done, errors
        while done + errors < total:
            done += 1
            t0 = time.perf_counter()
            body = BODIES[next(FRESH) % len(BODIES)] if FRESH is not None else BODIES[done % len(BODIES)]
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            if lat is not None:
                lat.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(clients)))
        dt = time.perf_counter() - t
    return total / dt, errors


def decision_time(backends=64, reps=3000):
    from router.core import Router, overlaps_from_index
    from router.types import BackendState, RoutingRequest
    from schemas import BlockStored, KvEventBatch
    from streams.clock import SystemClock
    from streams.kv_index import KvIndex

    rnd = random.Random(1)
    idx = KvIndex(SystemClock())
    prompts = [[rnd.randrange(16, 30000) for _ in range(512)] for _ in range(32)]
    for i in range(backends):
        p = prompts[i % len(prompts)]
        nb = rnd.randint(4, 32)
        idx.apply(KvEventBatch(pod=f"p{i}", model="m", seq=0, ts=time.time(), events=[
            BlockStored(block_hashes=list(range(1, nb + 1)), token_ids=p[:nb * 16], block_size=16)]))
    bs = [BackendState(pod=f"p{i}", url="http://x", model="m", waiting=rnd.random() * 4,
                       kv_usage=rnd.random() * 0.6, active_tokens=rnd.randint(0, 4000)) for i in range(backends)]
    out = {}
    for name in ("kv-aware", "round-robin", "dynamo-cost", "pd-kv-aware"):
        r = Router(name, seed=1)
        if name.startswith("pd-"):
            for i, b in enumerate(bs):
                b.role, b.group = ("prefill" if i % 2 == 0 else "decode"), f"g{i // 8}"
        reqs = [RoutingRequest(model="m", token_ids=p, prompt_tokens=len(p)) for p in prompts]
        ovs = [overlaps_from_index(idx, q, False) for q in reqs]
        ts, only = [], []
        for k in range(reps):
            t = time.perf_counter()
            r.decide(reqs[k % len(reqs)], bs, idx)
            t1 = time.perf_counter()
            r.decide(reqs[k % len(reqs)], bs, overlap=ovs[k % len(reqs)])
            ts.append(t1 - t)
            only.append(time.perf_counter() - t1)
        out[name] = (statistics.median(ts) * 1e6, pct(ts, 99) * 1e6, statistics.median(only) * 1e6,
                     pct(only, 99) * 1e6)
        for b in bs:
            b.role, b.group = "aggregated", None
    return out


async def main_async(args):
    eng = subprocess.Popen([PY, "-m", "router.testing", str(args.backends), str(args.stream or 2)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs = [eng]
    try:
        urls = eng.stdout.readline().split()
        assert len(urls) == args.backends
        await wait_http(urls[0] + "/health")
        contenders = []
        trees = [("", ROOT)]
        if args.baseline:  # the same router from another source tree, same run
            trees.append((" before", os.path.abspath(args.baseline)))
        if args.before_ref:
            trees.append((f" @{args.before_ref}", _bench_module("peers").extract_ref(args.before_ref)))
        for spec in args.strategies.split(","):
            strategy, *assigns = spec.split("+")  # NAME[+ENV=VALUE...]: our router with these settings
            env = dict(a.split("=", 1) for a in assigns)
            for tag, tree in trees:
                port = free_port()
                cmd = [PY, "-m", "infernex.cli", "router", "--no-bus", "--port", str(port), "--profile", strategy]
                if args.router_tokenizer:
                    cmd += ["--tokenizer", os.path.abspath(args.router_tokenizer)]
                for i, u in enumerate(urls):
                    cmd += ["-b", f"fake-{i}={u}@m"]
                contenders.append((f"infernex {spec}{tag}", cmd, port, tree, env))
        peers = [p for p in args.peers.split(",") if p]
        for mod, label in (("sglang_router", "sglang-router"), ("vllm_router", "vllm-router")):
            py = PY if importlib.util.find_spec(mod) is not None else None
            if py is None and label in peers:
                py = _bench_module("peers").peer_python(label)
            if py is None:
                print(f"{label}: not installed (optional), skipped")
                continue
            print(f"{label} {_bench_module('peers').peer_version(py, label)} ({py})")
            for policy in args.peer_policies.split(","):
                port = free_port()
                cmd = [py, "-m", f"{mod}.launch_router", "--worker-urls", *urls, "--policy", policy,
                       "--port", str(port), "--prometheus-port", str(free_port()),
                       "--log-level", "warn" if mod == "sglang_router" else "warning"]
                contenders.append((f"{label} {policy}", cmd, port, ROOT, {}))
        live = []
        for label, cmd, port, tree, extra in contenders:
            env = dict(os.environ, PYTHONPATH=tree, **extra)
            rp = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(rp)
            rurl = f"http://127.0.0.1:{port}"
            try:
                await wait_post(rurl)
            except RuntimeError as exc:
                print(f"{label}: {exc}")
                rp.kill()
                continue
            live.append((label, rurl, rp.pid))
        # Interleaved: each round sends one request directly and one through every router, so all
        # of them see the same machine load (this machine is shared).
        targets = [("direct", None)] + [(label, rurl) for label, rurl, _ in live]
        lat = {name: [] for name, _ in targets}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for rnd in range(args.requests + 100):
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for name, u in order:
                    u = u or urls[rnd % len(urls)]
                    t = time.perf_counter()
                    async with s.post(u + "/v1/completions", json=BODIES[rnd % len(BODIES)]) as r:
                        await r.read()
                        assert r.status == 200, (name, r.status)
                    if rnd >= 100:  # warm-up rounds not counted
                        lat[name].append(time.perf_counter() - t)
        d50, d99 = pct(lat["direct"], 50), pct(lat["direct"], 99)
        print(f"direct: p50 {d50 * 1e3:.3f} ms  p99 {d99 * 1e3:.3f} ms  ({args.requests} sequential requests, "
              f"interleaved with the routers)")
        rows = {label: [] for label, _, _ in live}
        for rep in range(args.rounds):  # interleaved rounds: each router flat out in turn, medians
            for label, rurl, pid in (live if rep % 2 == 0 else live[::-1]):
                c0 = cpu_seconds(pid)
                clat: list[float] = []
                rps, errs = await concurrent(rurl, args.concurrency, args.requests, clat)
                rows[label].append((rps, errs, (cpu_seconds(pid) - c0) / args.requests * 1e6, pct(clat, 99)))
        for label, rurl, pid in live:
            r50, r99 = pct(lat[label], 50), pct(lat[label], 99)
            runs = sorted(rows[label])
            rps, errs, cpu_us, _ = runs[len(runs) // 2]
            p99c = sorted(x[3] for x in rows[label])[len(runs) // 2]
            spread = f" [{', '.join(f'{x[0]:,.0f}' for x in rows[label])}]" if args.rounds > 1 else ""
            print(f"{label:<26} p50 {r50 * 1e3:.3f} ms  p99 {r99 * 1e3:.3f} ms | added p50 "
                  f"{(r50 - d50) * 1e3:.3f} ms  p99 {(r99 - d99) * 1e3:.3f} ms | {args.concurrency} clients: "
                  f"{rps:,.0f} req/s{spread} ({errs} errors), p99 {p99c * 1e3:.2f} ms, router CPU {cpu_us:.0f} us/req")
        drps, _ = await concurrent(urls[0], args.concurrency, args.requests)
        print(f"direct to one backend, {args.concurrency} clients: {drps:,.0f} req/s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--prompt-chars", type=int, default=0, help="prompts of this many characters (0: short)")
    ap.add_argument("--prompt-pool", type=int, default=4000, help="distinct prompts with --prompt-chars")
    ap.add_argument("--fresh", action="store_true",
                    help="flat-out requests never repeat a prompt (each question new to every router, as in "
                         "production) instead of each round resending the pool's first prompts; sizes the pool to fit")
    ap.add_argument("--strategies", default="round-robin,kv-aware",
                    help="our routers, comma-separated: NAME[+ENV=VALUE...] (a strategy and settings, e.g. "
                         "kv-aware+INFERNEX_ROUTER__TOKENIZE_THREADS=0)")
    ap.add_argument("--before-ref", default=None, help="also run the strategies from this git ref")
    ap.add_argument("--peers", default="", help="peer routers to install in a cache venv, e.g. sglang-router")
    ap.add_argument("--peer-policies", default="round_robin,cache_aware")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved throughput rounds (median)")
    ap.add_argument("--router-tokenizer", default=None,
                    help="our routers tokenize with this tokenizer.json (or its folder) instead of the toy one, "
                         "e.g. tests/fixtures/tokenize")
    ap.add_argument("--stream", type=int, default=0,
                    help="stream the answers, this many tokens each (one event per token; 0: a 2-token JSON answer)")
    ap.add_argument("--baseline", default=None,
                    help="source tree of an earlier version: its router runs in the same rounds ('before ...')")
    args = ap.parse_args()
    if args.fresh:
        global FRESH
        import itertools

        FRESH = itertools.count(args.requests + 100)  # after the prompts of the sequential requests
        n_routers = len(args.strategies.split(",")) * (2 if args.before_ref or args.baseline else 1) + 4
        args.prompt_pool = max(args.prompt_pool, (args.requests + 100) + (args.rounds + 1) * n_routers * args.requests)
    if args.prompt_chars:
        prompts = _bench_module("tokenizer_speed").make_prompts(args.prompt_pool, args.prompt_chars)
        BODIES[:] = [{"model": "m", "prompt": p, "max_tokens": 2} for p in prompts]
    if args.stream:  # streamed answers of that many tokens (one SSE event each, as an engine sends them)
        for b in BODIES:
            b.update(stream=True, max_tokens=args.stream)
    if args.prompt_chars:
        print(f"prompts: {len(BODIES)} distinct of {args.prompt_chars} chars")
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for name, (p50, p99, o50, o99) in ({} if args.fresh else decision_time(args.backends)).items():
        print(f"decide {name:<12} over {args.backends} backends: with index lookup p50 {p50:.1f} us "
              f"p99 {p99:.1f} us | decision alone p50 {o50:.1f} us  p99 {o99:.1f} us")
    if not args.skip_http:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
