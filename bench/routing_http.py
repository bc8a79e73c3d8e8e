"""Routing quality over HTTP: our router and sglang-router on the same simulated engines, interleaved.

    PYTHONPATH=. python -P bench/routing_http.py [--trace FILE] [--skip 3000] [--requests 400]
        [--engines 8] [--time-scale 8] [--rounds 2] [-r kv-aware -r kv-aware-prefill -r sglang:cache_aware
        -r vllm:kv_aware] [--cpu-hog N] [--engines-in-process]

``--engines`` simulated vLLM engines run one OS process each (``infernex sim -n 1``, as a real
deployment runs one vLLM API server per engine), each with its own HTTP, ZMQ KV-event and replay
ports. The bench process hosts an embedded NATS JetStream, a KV bridge per engine, the metrics
collector (the engines' /metrics) and the trace client (``simulator.workloads.client.replay``,
text prompts as a user sends them, open loop at the trace's arrival times compressed
``--time-scale`` times, the engines running that much faster). ``--engines-in-process`` runs all
engines on one asyncio loop in the bench process instead (``SimCluster``, the older layout, for
comparison): there the engines, the client and the bridges share one GIL, which adds to every
router's latencies and, under load, makes vllm-router's cache_aware (which renders each request
on every worker within 1 s) give up its prefix tree on most requests.

Every router runs in its own process against the same engines: ``infernex router`` (strategy
name or YAML, KV state and load from the bus, tokenizing the text like the engines),
sglang-router (``sglang:POLICY``; from a cache venv made by bench/peers.py) and vllm-router
(``vllm:POLICY``; its binary from the wheel, in a cache venv made by bench/vllm_router_kv.py;
``kv_aware`` subscribes to every engine's ZMQ KV events and replay socket itself). Before the
first run every engine serves a few requests of the rows just before the slice (so the router
that runs first does not pay the engines' first requests). Before each run the KV stream is purged and the engines' prefix
caches are emptied (``POST /reset_prefix_cache``, which also publishes
the cleared cache as a KV event), so each router reads the engines' KV events from an empty
stream; runs are interleaved, ``--rounds`` times. Reported per run:
prefix hit rate as the engines count it (``vllm:prefix_cache_hits/queries`` on their /metrics),
request spread (max/mean ``vllm:request_success`` per engine), TTFT p50/p90, E2E p50 and the
decode phase's p50 (E2E - TTFT per request; client side, wall seconds), and each run's mean TTFT
three ways: at the client, as our router measured it (its ``infernex_router_ttft_seconds``), and as
the engines did (vLLM's ``time_to_first_token_seconds``, from a request's arrival at the engine), so
the time a request spends outside the engines is seen apart from the engines' own.
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
from dataclasses import dataclass
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


def _cpu_wait_seconds(pid: int) -> float:
    """Seconds the process's threads have been runnable but waiting for a CPU so far (the run-queue
    wait in /proc/PID/task/*/schedstat; 0 where the kernel keeps none). A router on the engines'
    cores loses this to them: every request it holds waits as long."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # (a thread that ended meanwhile)
    return total / 1e9


_USED_PORTS: set[int] = set()


def _engines_cpu(procs: list) -> float:
    """CPU seconds the engine processes (``--engines-in-process``: none) have used so far: with every
    process of the bench on the same cores, work a placement makes the engines do (a decode step
    costs the simulator about as much for one request as for a batch) slows all of them."""
    return sum(_cpu_seconds(e.proc.pid) for e in procs)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair: bool = False) -> int:
    """A free local port not handed out before by this bench (``pair``: the next one is free too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        taken = {port, port + 1} if pair else {port}
        if taken & _USED_PORTS or (pair and (port >= 65535 or not _bindable(port + 1))):
            continue
        _USED_PORTS.update(taken)
        return port


MAX_MODEL_LEN = 262144
COUNTERS = ("vllm:request_success_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:num_preemptions_total",
            # the simulator's own: modelled step time, model time lost between steps, outputs' lateness
            "infernex_sim_step_seconds_total", "infernex_sim_lost_seconds_total", "infernex_sim_late_seconds_sum",
            "infernex_sim_late_seconds_count",
            # the engines' own TTFT (vLLM's: from the request's arrival at the engine), in model seconds
            "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")
LATE_WARN = 0.10  # the engines' outputs late by this share of TTFT p50 on average: not a valid comparison
try:  # a child (engine, router, hog) gets SIGTERM when the bench dies without its finally (SIGKILL)
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.prctl  # noqa: B018 - Linux only
except (OSError, AttributeError):
    _LIBC = None


def _die_with_parent() -> None:
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class EngineProc:
    """One simulated engine in its own process (``infernex sim -n 1``), as one vLLM API server."""

    engine_id: str  # the pod name the bench gives it (the engine itself calls itself <engine_id>-0)
    url: str
    kv_endpoint: str
    replay_endpoint: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""


async def start_engine_procs(n: int, time_scale: float, logdir: Path, out: list[EngineProc],
                             timeout: float = 120.0, extra: tuple[str, ...] = ()) -> None:
    """Start ``n`` engine processes (appended to ``out`` as they start, for the caller to stop) and
    wait until each answers /health. Settings come from the defaults only, as the in-process
    layout's ``EngineConfig(engine_id, served_model_name, max_model_len)`` (no INFERNEX_* variables),
    plus ``extra`` arguments to ``infernex sim``."""
    import httpx

    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERNEX_")}
    env["PYTHONPATH"] = ROOT
    for i in range(n):
        port, kv = free_port(), free_port(pair=True)  # replay socket on kv + 1
        log = logdir / f"engine-e{i}.log"
        cmd = [sys.executable, "-m", "infernex.cli", "--log-level", "WARNING", "sim", "-n", "1",
               "--engine-prefix", f"e{i}", "--host", "127.0.0.1", "--base-port", str(port),
               "--kv-events-port-base", str(kv), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--time-scale", repr(float(time_scale)), *extra]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=f, preexec_fn=_die_with_parent if _LIBC is not None else None)
        out.append(EngineProc(f"e{i}", f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv}",
                              f"tcp://127.0.0.1:{kv + 1}", proc, log))

    async def healthy(e: EngineProc, c: httpx.AsyncClient) -> None:
        end = time.monotonic() + timeout
        while True:
            if e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.engine_id} exited ({e.proc.returncode}): {e.log_tail()}")
            try:
                if (await c.get(e.url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"engine {e.engine_id} not healthy within {timeout:.0f} s: {e.log_tail()}")
            await asyncio.sleep(0.3)

    async with httpx.AsyncClient(timeout=2) as c:
        await asyncio.gather(*(healthy(e, c) for e in out))


def stop_engine_procs(procs: list[EngineProc], grace: float = 15.0) -> None:
    """SIGTERM every engine process, then SIGKILL the ones still running after ``grace`` seconds."""
    for e in procs:
        if e.proc.poll() is None:
            try:
                e.proc.send_signal(signal.SIGTERM)
            except OSError:
                pass
    end = time.monotonic() + grace
    for e in procs:
        try:
            e.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            e.proc.kill()
            e.proc.wait()


async def _scrape(client, url: str):  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]


async def engine_counters(client, engines) -> dict[str, tuple[float, ...]]:  # noqa: ANN001
    """Per engine (pod): requests finished, prefix-cache hit tokens, prefix-cache queried tokens, preemptions,
    then the simulator's modelled and lost seconds and its steps' lateness (:data:`COUNTERS`)."""
    async def one(e):  # noqa: ANN001, ANN202
        samples = await _scrape(client, e.url)
        return e.engine_id, tuple(sum(s.value for s in samples if s.name == k) for k in COUNTERS)

    return dict(await asyncio.gather(*(one(e) for e in engines)))


async def _router_stats(client, urls: list[str]) -> tuple[float, float, float, float]:  # noqa: ANN001
    """Our routers' own figures since they started: mean TTFT (``infernex_router_ttft_seconds``, from
    a request's arrival at the router to the first token it passed on), mean event-loop lag and the
    share of the loop's wake-ups more than 10 ms late (``infernex_router_event_loop_lag_seconds``),
    and the mean of the router's own time before a request reaches an engine
    (``infernex_router_dispatch_seconds``); NaN where a router does not say."""
    nan = float("nan")
    got = {"infernex_router_ttft_seconds_sum": 0.0, "infernex_router_ttft_seconds_count": 0.0,
           "infernex_router_event_loop_lag_seconds_sum": 0.0, "infernex_router_event_loop_lag_seconds_count": 0.0,
           "infernex_router_dispatch_seconds_sum": 0.0, "infernex_router_dispatch_seconds_count": 0.0}
    late = 0.0
    for url in urls:
        try:
            samples = await _scrape(client, url)
        except Exception:  # noqa: BLE001 - a diagnostic only
            return nan, nan, nan, nan
        for x in samples:
            if x.name in got:
                got[x.name] += x.value
            elif x.name == "infernex_router_event_loop_lag_seconds_bucket" and x.labels.get("le") == "0.01":
                late -= x.value
    n_ttft, n_lag = got["infernex_router_ttft_seconds_count"], got["infernex_router_event_loop_lag_seconds_count"]
    n_disp = got["infernex_router_dispatch_seconds_count"]
    return (got["infernex_router_ttft_seconds_sum"] / n_ttft if n_ttft else nan,
            got["infernex_router_event_loop_lag_seconds_sum"] / n_lag if n_lag else nan,
            (n_lag + late) / n_lag if n_lag else nan,
            got["infernex_router_dispatch_seconds_sum"] / n_disp if n_disp else nan)


async def engine_block_size(client, engine) -> int:  # noqa: ANN001
    for s in await _scrape(client, engine.url):
        if s.name == "vllm:cache_config_info" and "block_size" in s.labels:
            return int(s.labels["block_size"])
    raise RuntimeError(f"{engine.url}/metrics has no vllm:cache_config_info")


async def reset_prefix_caches(client, engines) -> None:  # noqa: ANN001
    """vLLM's ``POST /reset_prefix_cache`` on every engine (the simulator publishes AllBlocksCleared);
    refused (409) while KV blocks are in use: retried a few seconds."""
    async def one(e):  # noqa: ANN001, ANN202
        for _ in range(50):
            r = await client.post(e.url + "/reset_prefix_cache")
            if r.status_code == 200:
                return
            if r.status_code != 409:
                r.raise_for_status()
            await asyncio.sleep(0.1)
        print(f"    {e.engine_id}: prefix cache reset refused (KV blocks in use), run starts warm")

    await asyncio.gather(*(one(e) for e in engines))


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _peers():
    return _bench_module("peers")


async def wait_ready(url: str, timeout: float = 90.0, ready_path: str | None = None) -> None:
    """Until the router serves a completion and, with ``ready_path``, says it is ready there (ours:
    its KV index has read the KV stream's backlog, which grows with every run of the bench)."""
    import httpx

    end = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        served = False
        while time.monotonic() < end:
            try:
                if not served:
                    r = await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1})
                    served = r.status_code == 200
                if served and (ready_path is None or (await c.get(url + ready_path)).status_code == 200):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not serve a completion within {timeout:.0f} s")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


async def main_async(args) -> None:
    import httpx
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
    from simulator.workloads.trace import trace_stats
    from streams.topology import build_topology, stream_for_subject

    loaded = load_trace(args.trace, limit=args.skip + args.requests)
    rows = loaded[args.skip:]
    # the engines' warm-up: rows just before the slice (the slice's own first rows when it starts the trace)
    warm_rows = [type(r)(timestamp=0.0, input_length=r.input_length, output_length=4, hash_ids=r.hash_ids)
                 for r in (loaded[max(0, args.skip - 4 * args.engines):args.skip] or rows[:4 * args.engines])]
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
    layout = "in one process, the bench's" if args.engines_in_process else "one process each"
    ideal = trace_stats(rows)["ideal_prefix_hit_rate"]  # (what one engine with an unbounded cache would hit)
    print(f"{args.trace.name} rows {args.skip}-{args.skip + len(rows)}, {args.engines} engines (engines: {layout}), "
          f"time x{args.time_scale:g}, output <= {args.max_output_tokens} tokens, the slice's hit ceiling "
          f"{ideal:.1%}; load average {os.getloadavg()[0]:.2f}")
    # SIGTERM: cancel this task, so the finally below stops every process this bench started
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    tmp = Path(tempfile.mkdtemp(prefix="routing-http-"))
    server = EmbeddedNats(tmp / "nats")
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    cluster = None
    engine_procs: list[EngineProc] = []
    ctl = httpx.AsyncClient(timeout=10)  # the bench's own calls to the engines (reset, counters)
    nc = None
    results: dict[str, list[dict]] = {r: [] for r in routers}
    served: dict[str, list[tuple[str | None, int, int]]] = {}  # our routers: (request id, cached, prompt tokens)
    hogs: list[subprocess.Popen] = []
    try:
        server.start()
        nats_cfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(nats_cfg, name="routing-bench")
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        if args.engines_in_process:
            base = dict(served_model_name=MODEL, max_model_len=MAX_MODEL_LEN)
            cluster = SimCluster([EngineSpec(EngineConfig(engine_id=f"e{i}", **base)) for i in range(args.engines)],
                                 time_scale=args.time_scale).start()
            engines = list(cluster.engines)
        else:
            t_start = time.monotonic()
            await start_engine_procs(args.engines, args.time_scale, tmp, engine_procs)
            engines = engine_procs
            print(f"{len(engines)} engine processes up in {time.monotonic() - t_start:.1f}s")
        for h in engines:
            bcfg = BridgeConfig(endpoint=h.kv_endpoint, replay_endpoint=h.replay_endpoint, pod=h.engine_id,
                                model=MODEL, recover=False, backfill=False)
            subject = S.kv_events(MODEL, h.engine_id)
            spec = stream_for_subject(topo, subject)
            bridge = KvBridge(bcfg, nc, registry=None, stream=spec.name if spec else None)
            tasks.append(asyncio.create_task(bridge.run(stop)))
        targets = [Target(url=f"{h.url}/metrics", pod=h.engine_id, role="aggregated", model=MODEL)
                   for h in engines]
        tasks.append(asyncio.create_task(MetricsCollector(targets, js, registry=CollectorRegistry()).run(stop, 0.5)))
        block_size = await engine_block_size(ctl, engines[0])
        kv_stream = stream_for_subject(topo, S.kv_events(MODEL, engines[0].engine_id)).name

        env = dict(os.environ, PYTHONPATH=ROOT, INFERNEX_NATS__SERVERS=server.url)
        trees = {ref: _peers().extract_ref(ref) for ref in {r.split("+")[0].partition("@")[2] for r in routers
                                                   if not r.startswith(("sglang:", "vllm:"))} if ref}
        hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=_die_with_parent if _LIBC is not None else None)
                    for _ in range(args.cpu_hog))
        if hogs:
            print(f"{len(hogs)} CPU hog process(es) running")
        # Every engine serves a few requests before the first router's run (then the caches are
        # emptied): the router that goes first in round 1 does not pay the engines' first requests.
        n = len(engines)
        t_warm = time.monotonic()
        warm = await asyncio.gather(*(replay(warm_rows[i::n], h.url, model=MODEL, time_scale=0.0, concurrency=2,
                                             prompt_mode="text", timeout_s=120) for i, h in enumerate(engines)))
        print(f"engines warmed up: {sum(r.status == 'ok' for w in warm for r in w.requests)}/{len(warm_rows)} "
              f"requests in {time.monotonic() - t_warm:.1f}s")
        for rnd in range(args.rounds):
            order = routers if rnd % 2 == 0 else list(reversed(routers))
            for name in order:
                # every router starts from an empty KV stream: the engines' caches are emptied next (and
                # say so), so earlier runs' events would only be a backlog to read, longer each run (a
                # router that does not wait for it serves meanwhile from a past state)
                await js.purge_stream(kv_stream)
                await reset_prefix_caches(ctl, engines)
                await asyncio.sleep(1.0)  # the cleared caches reach the bus
                spec, *assigns = name.split("+")  # NAME[@REF][+ENV=VALUE...]: our router with these settings
                port = free_port()
                ports = [port]
                if name == "direct":  # no router: the client sends the requests to the engines in turn
                    cmds = []
                elif name.startswith("vllm:"):  # its kv_aware policy reads the engines' own KV events (ZMQ)
                    policy = name.split(":", 1)[1]
                    cmd = [str(vr_exe), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                           "--worker-urls", *[h.url for h in engines],
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                           "--log-level", "warning"]
                    if policy == "kv_aware":  # the KV-event flags are refused with any other policy
                        cmd += ["--kv-event-block-size", str(block_size),
                                "--kv-event-model", MODEL]
                        for h in engines:
                            cmd += ["--kv-event-source", f"{h.url}={h.kv_endpoint}", "--kv-event-replay-source",
                                    f"{h.url}={h.replay_endpoint}"]
                    cmds = [cmd]
                elif name.startswith("sglang:"):
                    cmds = [[sg_py, "-m", "sglang_router.launch_router", "--worker-urls", *[h.url for h in engines],
                             "--policy", name.split(":", 1)[1], "--port", str(port),
                             "--prometheus-port", str(free_port()), "--log-level", "warn"]]
                else:
                    strategy, _, ref = spec.partition("@")  # NAME@REF: the router from git REF's code
                    ports = [port] + [free_port() for _ in range(args.replicas - 1)]
                    cmds = []
                    for pt in ports:  # --replicas: as many router processes, the client alternating between them
                        cmd = [sys.executable, "-m", "infernex.cli", "router", "--port", str(pt), "--profile",
                               strategy, "--tokenizer", "simple"]
                        for h in engines:
                            cmd += ["-b", f"{h.engine_id}={h.url}@{MODEL}"]
                        cmds.append(cmd)
                tree = trees.get(spec.partition("@")[2], ROOT) if not name.startswith(("sglang:", "vllm:")) else ROOT
                penv = dict(env, PYTHONPATH=tree, **dict(a.split("=", 1) for a in assigns))
                procs = [subprocess.Popen(["nice", "-n", str(args.nice), *cmd] if args.nice else cmd, cwd=tree,
                                          env=penv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent if _LIBC is not None else None)
                         for cmd in cmds]
                try:
                    urls = [f"http://127.0.0.1:{pt}" for pt in ports] if cmds else [h.url for h in engines]
                    ours = bool(cmds) and not name.startswith(("sglang:", "vllm:"))
                    t_ready = time.monotonic()
                    for url in urls if procs else ():  # (direct: no router to wait for; a warm-up
                        # completion would only add to the engines' caches)
                        await wait_ready(url, ready_path="/ready" if ours else None)
                    ready_s = time.monotonic() - t_ready
                    await asyncio.sleep(0.5)  # load state from the metrics collector
                    c_idle, t_idle = sum(_cpu_seconds(pr.pid) for pr in procs), time.monotonic()
                    await asyncio.sleep(1.0)  # (and the router's CPU with no request: its background work)
                    idle = (sum(_cpu_seconds(pr.pid) for pr in procs) - c_idle) / (time.monotonic() - t_idle)
                    s0 = await engine_counters(ctl, engines)
                    cpu0 = sum(_cpu_seconds(pr.pid) for pr in procs)  # start-up (imports, JIT warm-up) left out
                    wait0 = sum(_cpu_wait_seconds(pr.pid) for pr in procs)
                    ecpu0 = _engines_cpu(engine_procs)
                    t = time.monotonic()
                    res = await replay(rows, urls, model=MODEL, time_scale=1.0 / args.time_scale, prompt_mode="text",
                                       timeout_s=300, stop=stop)
                    wall = time.monotonic() - t
                    s1 = await engine_counters(ctl, engines)
                    router_ttft, loop_lag, loop_late, dispatch = (await _router_stats(ctl, urls) if ours
                                                                  else (float("nan"),) * 4)
                    cpu = sum(_cpu_seconds(pr.pid) for pr in procs) - cpu0
                    cpu_wait = sum(_cpu_wait_seconds(pr.pid) for pr in procs) - wait0
                    ecpu = _engines_cpu(engine_procs) - ecpu0
                finally:
                    for pr in procs:
                        pr.send_signal(signal.SIGTERM)
                    for pr in procs:
                        try:
                            pr.wait(timeout=20)
                        except subprocess.TimeoutExpired:
                            pr.kill()
                d = {p: tuple(b - a for a, b in zip(s0[p], s1[p])) for p in s1}
                done = [v[0] for v in d.values()]
                hits, queries = sum(v[1] for v in d.values()), sum(v[2] for v in d.values())
                preempted = sum(v[3] for v in d.values())
                modelled = sum(v[4] for v in d.values())  # how closely the engines kept to their model
                lost = sum(v[5] for v in d.values()) / modelled if modelled else 0.0
                steps = sum(v[7] for v in d.values())  # a step's outputs' mean lateness, in real seconds
                late = sum(v[6] for v in d.values()) / steps / args.time_scale if steps else 0.0
                firsts = sum(v[9] for v in d.values())  # the engines' TTFT, in real seconds
                engine_ttft = sum(v[8] for v in d.values()) / firsts / args.time_scale if firsts else float("nan")
                ok = [r for r in res.requests if r.status == "ok"]
                ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
                e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
                # after the first token: the decode phase, which the requests sharing an engine slow down
                decode = [r.e2e_s - r.ttft_s for r in ok if r.e2e_s is not None and r.ttft_s is not None]
                row = {"ok": len(ok), "n": len(res.requests), "hit": hits / queries if queries else 0.0,
                       "cpu_ms_per_req": 1000 * cpu / max(len(res.requests), 1), "idle_ms_per_s": 1000 * idle,
                       "cpu_wait_ms_per_req": 1000 * cpu_wait / max(len(res.requests), 1),
                       "engine_cpu_ms_per_req": 1000 * ecpu / max(len(res.requests), 1), "preempted": preempted,
                       "late": late, "lost": lost,
                       "spread": max(done) / (sum(done) / len(done)) if sum(done) else float("nan"),
                       "ttft50": pct(ttft, 50), "ttft90": pct(ttft, 90), "e2e50": pct(e2e, 50),
                       "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"), "engine_ttft_mean": engine_ttft,
                       "router_ttft_mean": router_ttft, "router_dispatch_mean": dispatch,
                       "decode50": pct(decode, 50), "wall": wall, "ready_s": ready_s}
                results[name].append(row)
                if ours:  # for the router's view of the engines' caches against their reports (at the end)
                    served.setdefault(name, []).extend(
                        (r.request_id, r.cached_tokens or 0, r.prompt_tokens) for r in res.requests if r.status == "ok")
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
                      f"{row['e2e50']:.3f}s (decode {row['decode50']:.3f}s)  router CPU {row['cpu_ms_per_req']:.2f} ms/req (waited {row['cpu_wait_ms_per_req']:.1f} ms/req for one, all threads), idle {row['idle_ms_per_s']:.0f} ms/s, engines' CPU {row['engine_cpu_ms_per_req']:.1f} ms/req, {row['preempted']:.0f} preempted, engines' outputs {late * 1e3:.2f} ms late, {lost:.1%} of model time lost ({wall:.0f}s wall, ready in {ready_s:.1f}s, load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
                at_router = "" if router_ttft != router_ttft else f", {router_ttft:.3f}s as the router measured it"
                if dispatch == dispatch:
                    at_router += f" (of it {dispatch * 1e3:.2f} ms its own work before the engine had the request)"
                lag = "" if loop_lag != loop_lag else (f"; the router's event loop {loop_lag * 1e3:.1f} ms late on average, "
                                                       f"{loop_late:.0%} of its wake-ups over 10 ms late")
                print(f"    TTFT mean {row['ttft_mean']:.3f}s at the client{at_router}, {row['engine_ttft_mean']:.3f}s as the "
                      f"engines measured it (from the request's arrival there): "
                      f"{1e3 * (row['ttft_mean'] - row['engine_ttft_mean']):.1f} ms outside the engines{lag}", flush=True)
                if late > LATE_WARN * row["ttft50"]:
                    print(f"    not valid as a routing comparison: the simulated engines sent their outputs {late * 1e3:.1f} ms "
                          f"after their model on average, {late / row['ttft50']:.0%} of TTFT p50 (this machine's CPU set "
                          f"those latencies, not the model)")
        if args.keep_decisions is not None or served:  # our routers' decision records (each with what it read)
            from bench.router_feed import read_stream, save

            decisions = await read_stream(js, stream_for_subject(topo, S.router_decisions("default")).name)
            if args.keep_decisions is not None:
                print(f"{save(args.keep_decisions, decisions)} decision records written to {args.keep_decisions}")
            _print_views(decisions, served)
        if args.keep_kv is not None:
            from bench.router_feed import dump_stream

            print(f"{await dump_stream(js, kv_stream, args.keep_kv)} KV messages written to {args.keep_kv}")
        print("medians over rounds:")
        for name, rs in results.items():
            if not rs:
                continue

            def med(k, rs=rs):
                return statistics.median(r[k] for r in rs)

            print(f"  {name:<22} hit {med('hit'):6.1%}  spread {med('spread'):.2f}  TTFT p50 {med('ttft50'):.3f}s "
                  f"p90 {med('ttft90'):.3f}s  E2E p50 {med('e2e50'):.3f}s (decode {med('decode50'):.3f}s)  "
                  f"router CPU {med('cpu_ms_per_req'):.2f} ms/req (waited {med('cpu_wait_ms_per_req'):.1f} for one), idle {med('idle_ms_per_s'):.0f} ms/s, "
                  f"engines' CPU {med('engine_cpu_ms_per_req'):.1f} ms/req, engines' outputs {med('late') * 1e3:.2f} ms late, "
                  f"TTFT mean {med('ttft_mean'):.3f}s (the engines' own {med('engine_ttft_mean'):.3f}s)")
    finally:
        try:
            for h in hogs:
                h.kill()
                h.wait()
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await ctl.aclose()
            if nc is not None:
                await nc.close()
        finally:
            try:
                if cluster is not None:
                    cluster.stop()
            finally:
                stop_engine_procs(engine_procs)
                server.stop()
                shutil.rmtree(tmp, ignore_errors=True)


def _print_views(records, served: dict[str, list[tuple[str | None, int, int]]]) -> None:
    """Per router of ours, what each decision read of the engine it picked (the blocks its index held
    or predicted there: the decision record's overlap) against what that engine then reported cached
    for the request (``usage.prompt_tokens_details.cached_tokens``): tokens seen but not there
    (a prediction or an eviction the index missed) and there but not seen."""
    decisions = {}
    for m in records:
        d = json.loads(m.data)
        if d.get("stage") == "aggregated" and d.get("picked"):
            decisions[d["request_id"]] = d
    print("the router's view of the picked engine's cache against the engine's own report (all rounds):")
    for name, rows in served.items():
        n = seen = cached = phantom = missed = 0
        for rid, got, prompt in rows:
            d = decisions.get(rid)
            if d is None:
                continue
            bs = (d.get("inputs") or {}).get("block_size") or 0
            ov = next((c["overlap_blocks"] for c in d["candidates"] if c["pod"] == d["picked"]), 0) * bs
            ov = min(ov, max(prompt - 1, 0))  # (an engine reuses at most all but the prompt's last token)
            n += 1
            seen += ov
            cached += got
            phantom += max(0, ov - got)
            missed += max(0, got - ov)
        if n:
            print(f"  {name:<22} {n} requests: seen cached {seen:,} tokens, engines reported {cached:,}; "
                  f"seen but not there {phantom:,} ({phantom / max(seen, 1):.1%}), there but not seen {missed:,}")


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
                    help="run every router under this niceness (the engines share the same cores: shows how "
                         "much a router's own CPU slows them)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="run each of our routers as this many processes (replicas of one pool, sharing their "
                         "load over the bus unless +INFERNEX_ROUTER__REPLICA_SYNC=false); the client sends "
                         "the requests to them in turn; router CPU is their sum")
    ap.add_argument("--engines-in-process", action="store_true",
                    help="run all engines on one asyncio loop in the bench process (SimCluster, with the client, "
                         "KV bridges and collector) instead of one process per engine: the older layout")
    ap.add_argument("--keep-kv", type=Path, default=None,
                    help="at the end, write every message of the KV stream (the last run's) to this file (bench/router_feed.py)")
    ap.add_argument("--keep-decisions", type=Path, default=None,
                    help="at the end, write our routers' decision records (router.decisions: candidates, scores, "
                         "the overlap and load each decision read) of every run to this file (msgpack, as --keep-kv)")
    ap.add_argument("--out", type=Path, default=None,
                    help="append every request's result (router, round, TTFT, E2E, backend...) to this JSONL file")
    ap.add_argument("-r", "--router", action="append", default=None,
                    help="infernex strategy (name or YAML; NAME@REF runs it from git REF's code, extracted "
                         "with git archive, in the same interleaved rounds; +ENV=VALUE sets a setting, e.g. "
                         "kv-aware+INFERNEX_ROUTER__RECORDS=false), sglang:POLICY, vllm:POLICY, or direct (no router: the "
                         "client sends to the engines in turn, the baseline for the time outside the engines); repeat")
    try:
        asyncio.run(main_async(ap.parse_args()))
    except asyncio.CancelledError:  # SIGTERM: the engines and routers are stopped by then
        print("stopped (SIGTERM)", file=sys.stderr)
        sys.exit(143)


if __name__ == "__main__":
    main()
