"""``infernex demo``: the whole control plane on one machine, and the proof that prefix-aware
routing beats naive routing.

Starts embedded NATS with the topology, simulated vLLM engines (aggregated ones plus an xPyD
group), one KV bridge per engine (ZMQ -> JetStream), the indexer and the hermes-router; then,
for each strategy, clears every engine's prefix cache, starts a router with that strategy,
replays a slice of a Mooncake-format trace through it over plain OpenAI HTTP, and collects
the client's measurements, the router's request records (overlap chosen vs best) and the
engines' busy time. Everything it started is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

log = logging.getLogger(__name__)

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "simulator" / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"
MODEL = "sim-model"
POOL = "demo"


@dataclass
class DemoConfig:
    trace: Path = DEFAULT_TRACE
    requests: int = 150
    offset: int | None = None  # default: the last ``requests`` rows (the trace's prefix reuse grows over time)
    time_scale: float = 4.0
    engines: int = 8  # aggregated engines; the PD group comes on top
    prefill: int = 2
    decode: int = 2
    strategies: list[str] = field(default_factory=lambda: ["round-robin", "least-load", "kv-aware", "pd-kv-aware"])
    hardware: str = "h100"
    model_profile: str = "llama-3.1-8b"
    num_gpu_blocks: int | None = 12000
    max_output_tokens: int = 64
    out: Path = Path("infernex-demo")
    concurrency: int = 64


async def _wait(cond, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


async def _bounded(aw, what: str, timeout: float = 10.0, cancel: list | None = None) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        log.warning("%s did not stop within %.0fs; cancelling", what, timeout)
        for t in cancel or []:
            t.cancel()
    except Exception as exc:  # noqa: BLE001 - shutting down; report and go on
        log.warning("%s stopped with an error: %s", what, exc)


async def run_demo(cfg: DemoConfig, console: Console | None = None, stop: asyncio.Event | None = None) -> dict:
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.indexer import IndexerConfig, IndexerService
    from consumers.kv_bridge import BridgeConfig, KvBridge
    from infernex.embedded_nats import EmbeddedNats
    from infernex.report import StrategyResult, rich_table, write_report
    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend
    from schemas import RequestRecord, decode_event
    from schemas import subjects as S
    from schemas.config import NatsConfig
    from simulator.cluster import EngineSpec, SimCluster
    from simulator.config import EngineConfig
    from simulator.workloads import load_trace
    from simulator.workloads.client import replay
    from simulator.workloads.metrics import summarize
    from streams.topology import build_topology, stream_for_subject

    console = console or Console()
    stop = stop or asyncio.Event()
    t_start = time.monotonic()
    rows_all = load_trace(cfg.trace)
    offset = max(0, len(rows_all) - cfg.requests) if cfg.offset is None else cfg.offset
    rows = rows_all[offset:offset + cfg.requests]
    if rows:
        t0 = rows[0].timestamp
        rows = [type(r)(timestamp=r.timestamp - t0, input_length=r.input_length,
                        output_length=min(r.output_length, cfg.max_output_tokens), hash_ids=r.hash_ids)
                for r in rows]
    console.print(f"[bold]InferNex demo[/bold]: {len(rows)} requests of {cfg.trace.name} (rows {offset}..{offset + len(rows) - 1}),"
                  f" arrivals {cfg.time_scale:g}x faster than recorded")

    cfg.out.mkdir(parents=True, exist_ok=True)
    store = cfg.out / "nats"
    shutil.rmtree(store, ignore_errors=True)
    server = EmbeddedNats(store)
    cluster = None
    tasks: list[asyncio.Task] = []
    bridges_stop = asyncio.Event()
    nc = None
    indexer = None
    results: list[StrategyResult] = []
    try:
        server.start()
        nats_cfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(nats_cfg, name="infernex-demo")
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        console.print(f"  NATS JetStream at {server.url}, {len(topo)} streams")

        base = dict(served_model_name=MODEL, hardware=cfg.hardware, model_profile=cfg.model_profile,
                    num_gpu_blocks=cfg.num_gpu_blocks, max_model_len=262144)
        specs = [EngineSpec(EngineConfig(engine_id=f"agg-{i}", role="aggregated", **base)) for i in range(cfg.engines)]
        specs += [EngineSpec(EngineConfig(engine_id=f"prefill-{i}", role="prefill", **base)) for i in range(cfg.prefill)]
        specs += [EngineSpec(EngineConfig(engine_id=f"decode-{i}", role="decode", **base)) for i in range(cfg.decode)]
        cluster = SimCluster(specs, time_scale=cfg.time_scale).start()
        roles = {h.engine_id: h.engine_id.split("-")[0].replace("agg", "aggregated") for h in cluster.engines}
        console.print(f"  {len(cluster)} simulated engines ({cfg.engines} aggregated, {cfg.prefill}P{cfg.decode}D), "
                      f"{cfg.hardware} x {cfg.model_profile}")

        registry = CollectorRegistry()
        for h in cluster.engines:
            bcfg = BridgeConfig(endpoint=h.kv_endpoint, replay_endpoint=h.replay_endpoint, pod=h.engine_id,
                                model=MODEL, recover=False, backfill=False)
            subject = S.kv_events(MODEL, h.engine_id)
            spec = stream_for_subject(topo, subject)
            bridge = KvBridge(bcfg, nc, registry=None, stream=spec.name if spec else None)
            tasks.append(asyncio.create_task(bridge.run(bridges_stop)))
        indexer = IndexerService(IndexerConfig(http_port=0, snapshot_on_stop=False), nats_cfg, registry=registry)
        await indexer.start()
        console.print(f"  {len(cluster)} KV bridges, indexer (HTTP :{indexer.http_port})")

        records: list[RequestRecord] = []

        async def on_record(msg) -> None:
            try:
                records.append(decode_event(RequestRecord, msg.data))
            except Exception:  # noqa: BLE001 - the demo only counts what it can read
                pass

        rec_sub = await nc.subscribe(S.router_requests(POOL), cb=on_record)
        backends = [StaticBackend(pod=h.engine_id, url=h.url, model=MODEL,
                                  role=roles[h.engine_id], group="g0" if roles[h.engine_id] != "aggregated" else None)
                    for h in cluster.engines]

        for strategy in cfg.strategies:
            if stop.is_set():
                break
            # a fair start: every engine's prefix cache empty, and the index has seen it
            for h in cluster.engines:
                h.call(lambda e: (e.core.reset_prefix_cache(), e._flush_events(e.core.take_pending_events())))
            await _wait(lambda: sum(sum(i.blocks.values()) for i in indexer.index.pods().values()) == 0, 30,
                        "the index to see the cleared caches")
            def engine_stats():
                return {h.engine_id: h.call(lambda e: (e.core.stats.busy_time, e.core.stats.prefix_cache_hits,
                                                       e.core.stats.prefix_cache_queries)) for h in cluster.engines}

            stats0 = engine_stats()
            rcfg = RouterConfig(pool=POOL, strategy=strategy, port=0, backends=backends, seed=0,
                                read_timeout_s=120)
            app = RouterApp(rcfg, nats_cfg, registry=CollectorRegistry())
            url = await app.start(port=0)
            n_before = len(records)
            console.print(f"  [cyan]{strategy}[/cyan]: router at {url}, replaying ...")
            t = time.monotonic()
            res = await replay(rows, url, model=MODEL, time_scale=1.0 / cfg.time_scale,
                               concurrency=cfg.concurrency, stop=stop, timeout_s=120)
            await _bounded(app.stop(drain=True), "router", timeout=45)
            await _wait(lambda: len(records) - n_before >= len(rows) or stop.is_set(), 10, "request records")
            mine = records[n_before:]
            best = sum(r.best_overlap_blocks for r in mine)
            chosen = sum(r.chosen_overlap_blocks for r in mine)
            stats1 = engine_stats()
            delta = {p: tuple(b - a for a, b in zip(stats0[p], stats1[p])) for p in stats1}
            used = [d[0] for d in delta.values() if d[0] > 0]
            spread = max(used) / (sum(used) / len(used)) if used else None
            # prefix-cache hit rate as the engines count it; decode engines of a PD group are left
            # out, since the KV they pulled from the prefill engine counts as "cached" there
            hits = sum(d[1] for p, d in delta.items() if roles[p] != "decode")
            queries = sum(d[2] for p, d in delta.items() if roles[p] != "decode")
            summary = summarize(res.requests)
            results.append(StrategyResult(strategy, summary, chosen / best if best else None, spread,
                                          {"wall_s": time.monotonic() - t, "records": len(mine)},
                                          engine_hit_rate=hits / queries if queries else None))
            res.write(cfg.out / f"replay-{strategy}.json")
            console.print(f"    {summary.ok}/{summary.requests} ok in {time.monotonic() - t:.1f}s, "
                          f"prefix cache hit rate {results[-1].hit_rate or 0:.1%}")
        await rec_sub.unsubscribe()
        title = (f"InferNex demo: {len(rows)} requests of {cfg.trace.name}, {cfg.engines} aggregated engines + "
                 f"{cfg.prefill}P{cfg.decode}D ({cfg.hardware}, {cfg.model_profile}), time x{cfg.time_scale:g}")
        if results:
            console.print(rich_table(results, title))
            paths = write_report(results, cfg.out, title=title, notes=[
                f"latencies are wall-clock; the simulated engines run {cfg.time_scale:g}x faster than the "
                f"{cfg.hardware} profile, and trace arrivals are compressed by the same factor",
                "load spread = max/mean engine busy time over the engines the strategy used",
                "hit rate = prefix-cache hits / lookups counted by the engines (prefill side for PD)",
                "overlap chosen/best = cached prefix blocks on the chosen backend / best any backend had",
            ])
            console.print(f"report: {paths['html']} and {paths['png']}  ({time.monotonic() - t_start:.0f}s)")
        return {"results": results, "out": str(cfg.out)}
    finally:
        # every step bounded: a stuck component must not keep the demo (or CI) from exiting
        bridges_stop.set()
        if indexer is not None:
            await _bounded(indexer.stop(), "indexer")
        await _bounded(asyncio.gather(*tasks, return_exceptions=True), "KV bridges", cancel=tasks)
        if nc is not None:
            await _bounded(nc.close(), "NATS client")
        if cluster is not None:
            cluster.stop()
        server.stop()
