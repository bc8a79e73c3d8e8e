"""hermes-router under a burst: N simulated engines running ``--max-num-seqs`` sequences each,
``--factor`` times their capacity sent at once through the router; every request must be answered
within its client deadline, either OK or 429/503 with ``Retry-After`` (none hangs).

    python bench/burst.py [--engines 2] [--max-num-seqs 8] [--factor 10] [--max-tokens 48]
                          [--queue-timeout 3] [--deadline 30] [--baseline DIR]

Runs the same burst with the router ``--no-bus`` (static backends with ``max_inflight``) and with
the bus (an embedded nats-server; the engines' announcements carry ``max_num_seqs``, which is
where the cap then comes from). ``--baseline DIR`` also runs a router from another source tree
(e.g. the commit before admission control) with ``--no-bus`` for comparison. Prints per run: OK,
refused (with Retry-After), other statuses, hung (client deadline hit), goodput (OK requests and
generated tokens per second over the burst) and p50/p99 latency of the OK requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MODEL = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def body(args, i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"burst request {i}: tell me about routers"}],
            "max_tokens": args.max_tokens, "ignore_eos": True}


async def wait_ok(url: str, args, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            try:
                async with s.post(url + "/v1/chat/completions", json=body(args, -1)) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not serve a request within {timeout:.0f} s")


async def burst(url: str, n: int, args) -> dict:
    out = {"ok": [], "tokens": 0, "refused": 0, "refused_no_retry_after": 0, "refused_latency": [], "other": {},
           "hung": 0}

    async def one(s, i):
        t = time.perf_counter()
        try:
            async with s.post(url + "/v1/chat/completions", json=body(args, i)) as r:
                data = await r.read()
                dt = time.perf_counter() - t
                if r.status == 200:
                    out["ok"].append(dt)
                    out["tokens"] += json.loads(data)["usage"]["completion_tokens"]
                elif r.status in (429, 503):
                    out["refused"] += 1
                    out["refused_latency"].append(dt)
                    if not r.headers.get("Retry-After"):
                        out["refused_no_retry_after"] += 1
                else:
                    out["other"][r.status] = out["other"].get(r.status, 0) + 1
        except asyncio.TimeoutError:
            out["hung"] += 1
        except aiohttp.ClientError as exc:
            key = type(exc).__name__
            out["other"][key] = out["other"].get(key, 0) + 1

    timeout = aiohttp.ClientTimeout(total=args.deadline)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, i) for i in range(n)))
        out["wall"] = time.perf_counter() - t0
    return out


def report(label: str, n: int, r: dict) -> None:
    ok = r["ok"]
    print(f"{label:<26} {n} requests at once: {len(ok)} OK, {r['refused']} refused 429/503 "
          f"({r['refused_no_retry_after']} without Retry-After), other {r['other'] or 0}, hung {r['hung']} | "
          f"wall {r['wall']:.1f} s, goodput {len(ok) / r['wall']:.1f} req/s {r['tokens'] / r['wall']:.0f} tok/s | "
          f"OK p50 {pct(ok, 50):.2f} s p99 {pct(ok, 99):.2f} s | refused max {max(r['refused_latency'] or [0]):.2f} s",
          flush=True)


def start(cmd, cwd=ROOT, env=None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def announce(nats_url: str, urls: list[str], args, stop_ev: asyncio.Event) -> None:
    """Stand-in for the engines' announcer: ``EngineAnnouncement`` with ``max_num_seqs`` every 5 s."""
    sys.path.insert(0, ROOT)
    from consumers import bus
    from schemas import EngineAnnouncement
    from schemas import subjects as S
    from schemas.config import NatsConfig

    nc = await bus.connect(NatsConfig(servers=[nats_url]))
    js = nc.jetstream()
    try:
        while not stop_ev.is_set():
            for i, u in enumerate(urls):
                a = EngineAnnouncement(pod=f"engine-{i}", url=u, model=MODEL, ts=time.time(),
                                       max_num_seqs=args.max_num_seqs)
                await bus.publish(js, S.engine_announce(a.pod), a.to_json())
            try:
                await asyncio.wait_for(stop_ev.wait(), 5)
            except asyncio.TimeoutError:
                pass
    finally:
        await nc.close()


async def run_router(label: str, urls: list[str], args, *, bus_url: str | None, cwd: str = ROOT,
                     admission: bool = True) -> None:
    port = free_port()
    conf = {"router": {"strategy": "least-load", "records": False,
                       "admission": {"queue_timeout_s": args.queue_timeout, "queue_size": 4096}}}
    if not admission:
        conf["router"].pop("admission")
    if bus_url is None:
        conf["router"]["backends"] = [{"pod": f"engine-{i}", "url": u, "model": MODEL,
                                       **({"max_inflight": args.max_num_seqs} if admission else {})}
                                      for i, u in enumerate(urls)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERNEX_")}
    if bus_url:
        env["INFERNEX_NATS__SERVERS"] = bus_url
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(conf, f)
    cmd = [PY, "-m", "infernex.cli", "--config", f.name, "router", "--port", str(port)]
    if bus_url is None:
        cmd.append("--no-bus")
    p = start(cmd, cwd=cwd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ok(url, args)
        n = args.factor * args.engines * args.max_num_seqs
        r = await burst(url, n, args)
        report(label, n, r)
        await asyncio.sleep(1.0)  # let the engines finish what the router left them
    finally:
        stop(p)
        os.unlink(f.name)


async def main_async(args) -> None:
    sim = start([PY, "-m", "infernex.cli", "sim", "-n", str(args.engines), "--max-num-seqs", str(args.max_num_seqs),
                 "--no-kv-events", "--model", MODEL, "--base-port", "0", "--time-scale", str(args.time_scale)],
                stdout=subprocess.PIPE)
    procs = [sim]
    nats = None
    try:
        urls: list[str] = []
        while len(urls) < args.engines:
            line = sim.stdout.readline()
            if not line:
                raise RuntimeError("the simulator exited")
            urls += re.findall(r"http://127\.0\.0\.1:\d+", line)
        print(f"{args.engines} simulated engines x max_num_seqs {args.max_num_seqs} = capacity "
              f"{args.engines * args.max_num_seqs}; burst {args.factor}x; max_tokens {args.max_tokens}; "
              f"router queue deadline {args.queue_timeout} s; client deadline {args.deadline} s", flush=True)
        await run_router("router --no-bus", urls, args, bus_url=None)
        sys.path.insert(0, ROOT)
        from infernex.embedded_nats import EmbeddedNats

        nats = EmbeddedNats().start()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("INFERNEX_")},
               "INFERNEX_NATS__SERVERS": nats.url}
        subprocess.run([PY, "-m", "infernex.cli", "streams", "apply"], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        stop_ev = asyncio.Event()
        ann = asyncio.create_task(announce(nats.url, urls, args, stop_ev))
        try:
            await run_router("router with bus", urls, args, bus_url=nats.url)
        finally:
            stop_ev.set()
            await ann
        if args.baseline:
            await run_router("baseline --no-bus", urls, args, bus_url=None, cwd=args.baseline, admission=False)
    finally:
        for p in procs:
            stop(p)
        if nats is not None:
            nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--factor", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--queue-timeout", type=float, default=3.0, help="the router's admission queue deadline")
    ap.add_argument("--deadline", type=float, default=30.0, help="each client's total timeout")
    ap.add_argument("--baseline", default=None, help="source tree of a router to compare (run --no-bus)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
