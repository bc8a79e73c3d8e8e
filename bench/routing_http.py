"""Routing quality over HTTP: our router and sglang-router on the same simulated engines, interleaved.

    PYTHONPATH=. python -P bench/routing_http.py [--trace FILE] [--skip 3000] [--requests 400]
        [--engines 8] [--time-scale 8] [--rounds 2] [-r kv-aware -r kv-aware-prefill -r sglang:cache_aware
        -r vllm:kv_aware] [--cpu-hog N]

One process hosts an embedded NATS JetStream, ``--engines`` simulated vLLM engines (their KV events
go through a KV bridge each, their /metrics through the metrics collector) and the trace client
(``simulator.workloads.client.replay``, text prompts as a user sends them, open loop at the trace's
arrival times compressed ``--time-scale`` times, the engines running that much faster). Every
router runs in its own process against the same engines: ``infernex router`` (strategy name or
YAML, KV state and load from the bus, tokenizing the text like the engines) and sglang-router
(``sglang:POLICY``; from a cache venv made by bench/peers.py) and vllm-router (``vllm:POLICY``; its
binary from the wheel, in a cache venv made by bench/vllm_router_kv.py; ``kv_aware`` subscribes to
every engine's ZMQ KV events and replay socket itself). Before each run the engines'
prefix caches are emptied; runs are interleaved, ``--rounds`` times. Reported per run: prefix
hit rate as the engines count it, request spread (max/mean finished requests per engine), TTFT
p50/p90, E2E p50 and the decode phase's p50 (E2E - TTFT per request; client side, wall seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEFAULT_TRACE = Path(ROOT).parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MODEL = "bench-model"


def _cpu_seconds(pid: int) -> float:
    """user + system CPU of a process and its waited-for children so far (0 where /proc has none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in parts[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _peers():
    return _bench_module("peers")


async def wait_ready(url: str, timeout: float = 90.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < end:
            try:
                r = await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not serve a completion within {timeout:.0f} s")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


async def main_async(args) -> None:
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.kv_bridge import BridgeConfig, KvBridge
    from consumers.metrics_collector import MetricsCollector, Target
    from infernex.embedded_nats import EmbeddedNats
    from schemas import subjects as S
    from schemas.config import NatsConfig
    from simulator.cluster import EngineSpec, SimCluster
    from simulator.config import EngineConfig
    from simulator.workloads import load_trace
    from simulator.workloads.client import replay
    from streams.topology import build_topology, stream_for_subject

    rows = load_trace(args.trace, limit=args.skip + args.requests)[args.skip:]
    t0 = rows[0].timestamp
    rows = [type(r)(timestamp=r.timestamp - t0, input_length=r.input_length,
                    output_length=min(r.output_length, args.max_output_tokens), hash_ids=r.hash_ids) for r in rows]
    routers = args.router or ["kv-aware", "kv-aware-prefill", "sglang:cache_aware"]
    vr_exe = None
    if any(r.startswith("vllm:") for r in routers):
        try:
            vr = _bench_module("vllm_router_kv")
            vr_exe = vr.router_binary(args.vllm_router_version)
            print(f"vllm-router {args.vllm_router_version} ({vr_exe})")
        except Exception as exc:  # noqa: BLE001 - no registry, no wheel: the bench goes on without it
            print(f"vllm-router: cannot install ({exc}), skipped")
            routers = [r for r in routers if not r.startswith("vllm:")]
    sg_py = None
    if any(r.startswith("sglang:") for r in routers):
        peers = _peers()
        sg_py = peers.peer_python("sglang-router")
        if sg_py is None:
            routers = [r for r in routers if not r.startswith("sglang:")]
        else:
            print(f"sglang-router {peers.peer_version(sg_py, 'sglang-router')} ({sg_py})")
    print(f"{args.trace.name} rows {args.skip}-{args.skip + len(rows)}, {args.engines} engines, time x{args.time_scale:g}, "
          f"output <= {args.max_output_tokens} tokens; load average {os.getloadavg()[0]:.2f}")
    tmp = Path(tempfile.mkdtemp(prefix="routing-http-"))
    server = EmbeddedNats(tmp / "nats")
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    cluster = None
    nc = None
    results: dict[str, list[dict]] = {r: [] for r in routers}
    hogs: list[subprocess.Popen] = []
    try:
        server.start()
        nats_cfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(nats_cfg, name="routing-bench")
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        base = dict(served_model_name=MODEL, max_model_len=262144)
        cluster = SimCluster([EngineSpec(EngineConfig(engine_id=f"e{i}", **base)) for i in range(args.engines)],
                             time_scale=args.time_scale).start()
        for h in cluster.engines:
            bcfg = BridgeConfig(endpoint=h.kv_endpoint, replay_endpoint=h.replay_endpoint, pod=h.engine_id,
                                model=MODEL, recover=False, backfill=False)
            subject = S.kv_events(MODEL, h.engine_id)
            spec = stream_for_subject(topo, subject)
            bridge = KvBridge(bcfg, nc, registry=None, stream=spec.name if spec else None)
            tasks.append(asyncio.create_task(bridge.run(stop)))
        targets = [Target(url=f"{h.url}/metrics", pod=h.engine_id, role="aggregated", model=MODEL)
                   for h in cluster.engines]
        tasks.append(asyncio.create_task(MetricsCollector(targets, js, registry=CollectorRegistry()).run(stop, 0.5)))

        def stats():
            return {h.engine_id: h.call(lambda e: (e.core.stats.requests_finished, e.core.stats.prefix_cache_hits,
                                                   e.core.stats.prefix_cache_queries)) for h in cluster.engines}

        env = dict(os.environ, PYTHONPATH=ROOT, INFERNEX_NATS__SERVERS=server.url)
        hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.cpu_hog))
        if hogs:
            print(f"{len(hogs)} CPU hog process(es) running")
        for rnd in range(args.rounds):
            order = routers if rnd % 2 == 0 else list(reversed(routers))
            for name in order:
                for h in cluster.engines:
                    h.call(lambda e: (e.core.reset_prefix_cache(), e._flush_events(e.core.take_pending_events())))
                await asyncio.sleep(1.0)  # the cleared caches reach the bus
                port = free_port()
                if name.startswith("vllm:"):  # its kv_aware policy reads the engines' own KV events (ZMQ)
                    policy = name.split(":", 1)[1]
                    cmd = [str(vr_exe), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                           "--worker-urls", *[h.url for h in cluster.engines],
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                           "--log-level", "warning"]
                    if policy == "kv_aware":  # the KV-event flags are refused with any other policy
                        cmd += ["--kv-event-block-size", str(cluster.engines[0].call(lambda e: e.core.block_size)),
                                "--kv-event-model", MODEL]
                        for h in cluster.engines:
                            cmd += ["--kv-event-source", f"{h.url}={h.kv_endpoint}", "--kv-event-replay-source",
                                    f"{h.url}={h.replay_endpoint}"]
                elif name.startswith("sglang:"):
                    cmd = [sg_py, "-m", "sglang_router.launch_router", "--worker-urls", *[h.url for h in cluster.engines],
                           "--policy", name.split(":", 1)[1], "--port", str(port),
                           "--prometheus-port", str(free_port()), "--log-level", "warn"]
                else:
                    cmd = [sys.executable, "-m", "infernex.cli", "router", "--port", str(port), "--profile", name,
                           "--tokenizer", "simple"]
                    for h in cluster.engines:
                        cmd += ["-b", f"{h.engine_id}={h.url}@{MODEL}"]
                if args.nice:
                    cmd = ["nice", "-n", str(args.nice), *cmd]
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_ready(url)
                    await asyncio.sleep(1.5)  # load state from the metrics collector
                    s0 = stats()
                    cpu0 = _cpu_seconds(proc.pid)  # start-up (imports, JIT warm-up) left out
                    t = time.monotonic()
                    res = await replay(rows, url, model=MODEL, time_scale=1.0 / args.time_scale, prompt_mode="text",
                                       timeout_s=300, stop=stop)
                    wall = time.monotonic() - t
                    s1 = stats()
                    cpu = _cpu_seconds(proc.pid) - cpu0
                finally:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                d = {p: tuple(b - a for a, b in zip(s0[p], s1[p])) for p in s1}
                done = [v[0] for v in d.values()]
                hits, queries = sum(v[1] for v in d.values()), sum(v[2] for v in d.values())
                ok = [r for r in res.requests if r.status == "ok"]
                ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
                e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
                # after the first token: the decode phase, which the requests sharing an engine slow down
                decode = [r.e2e_s - r.ttft_s for r in ok if r.e2e_s is not None and r.ttft_s is not None]
                row = {"ok": len(ok), "n": len(res.requests), "hit": hits / queries if queries else 0.0,
                       "cpu_ms_per_req": 1000 * cpu / max(len(res.requests), 1),
                       "spread": max(done) / (sum(done) / len(done)) if sum(done) else float("nan"),
                       "ttft50": pct(ttft, 50), "ttft90": pct(ttft, 90), "e2e50": pct(e2e, 50),
                       "decode50": pct(decode, 50), "wall": wall}
                results[name].append(row)
                if args.out is not None:  # every request of the run, for a closer look
                    with open(args.out, "a") as f:
                        for r in res.requests:
                            f.write(json.dumps({"router": name, "round": rnd + 1, **r.model_dump(exclude={"itl_s"})}) + "\n")
                errs = {}
                for r in res.requests:
                    if r.status != "ok":
                        k = f"{r.status} {r.http_status} {(r.error or '')[:80]}"
                        errs[k] = errs.get(k, 0) + 1
                for k, v in sorted(errs.items(), key=lambda kv: -kv[1])[:3]:
                    print(f"    {v} x {k}")
                print(f"round {rnd + 1} {name:<22} ok {row['ok']}/{row['n']}  hit {row['hit']:6.1%}  spread "
                      f"{row['spread']:.2f}  TTFT p50 {row['ttft50']:.3f}s p90 {row['ttft90']:.3f}s  E2E p50 "
                      f"{row['e2e50']:.2f}s (decode {row['decode50']:.3f}s)  router CPU {row['cpu_ms_per_req']:.2f} ms/req ({wall:.0f}s wall, load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
        print("medians over rounds:")
        for name, rs in results.items():
            if not rs:
                continue

            def med(k, rs=rs):
                return statistics.median(r[k] for r in rs)

            print(f"  {name:<22} hit {med('hit'):6.1%}  spread {med('spread'):.2f}  TTFT p50 {med('ttft50'):.3f}s "
                  f"p90 {med('ttft90'):.3f}s  E2E p50 {med('e2e50'):.2f}s (decode {med('decode50'):.3f}s)  "
                  f"router CPU {med('cpu_ms_per_req'):.2f} ms/req")
    finally:
        for h in hogs:
            h.kill()
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if nc is not None:
            await nc.close()
        if cluster is not None:
            cluster.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-router-version", default="0.1.17", help="for vllm:POLICY routers (PyPI vllm-router)")
    ap.add_argument("--cpu-hog", type=int, default=0,
                    help="processes spinning on the CPU during every run (a busy machine, the same for every router)")
    ap.add_argument("--nice", type=int, default=0,
                    help="run every router under this niceness (the engines run in this process on the same "
                         "cores: shows how much a router's own CPU slows them)")
    ap.add_argument("--out", type=Path, default=None,
                    help="append every request's result (router, round, TTFT, E2E, backend...) to this JSONL file")
    ap.add_argument("-r", "--router", action="append", default=None,
                    help="infernex strategy (name or YAML), sglang:POLICY or vllm:POLICY; repeat")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
