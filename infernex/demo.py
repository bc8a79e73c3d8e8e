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
import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
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
    # the live run's engine-metrics scrape (wall seconds); the virtual-time run gives the router the
    # engines' load as that scrape does (every metrics_interval_s x time_scale of trace time)
    metrics_interval_s: float = 1.0
    out: Path = Path("infernex-demo")
    concurrency: int = 64
    # the rest of the control plane: engine-metrics and device collectors, the diagnosis engine and
    # the SLA sink (embedded ClickHouse); then an incident: a critical NPU fault under one engine
    services: bool = True
    incident: bool = True
    incident_requests: int = 40
    # PD strategies run on the xPyD group alone; replay them at the same load per engine as the
    # aggregated strategies (arrivals stretched by aggregated / PD engines), not 2x-4x overloaded
    pd_same_load_per_engine: bool = True
    # the PD sizing loop (needs services: it runs on the demo's ClickHouse): a PD pool started 1P3D
    # under a load ramp, resized by the planner's hints; then PD (planner split) against aggregated
    # goodput on the same engines, long prompts; both in virtual time
    pd_loop: bool = True
    pd_loop_intervals: int = 16
    pd_loop_interval_s: float = 30.0
    goodput_engines: int = 4
    goodput_rates: tuple[float, ...] = (5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0)
    goodput_seconds: float = 40.0
    goodput_seeds: int = 3  # arrival sequences per rate, averaged (one draw near the knee passes or fails by luck)



# ---------------------------------------------------------------------------- validity of a live run

MAX_START_LAG_S = 0.5  # the replay client may fall this far behind the trace's schedule
MAX_STEAL = 0.05  # share of CPU time the hypervisor took from this machine
MAX_RECORD_LOSS = 0.02  # request records missing (router -> NATS -> the demo), as a share of requests
MAX_ENGINE_LATE = 0.10  # the simulated engines' outputs late on average, as a share of the run's TTFT p50


def cpu_times() -> tuple[float, float] | None:
    """``(steal, total)`` jiffies of all CPUs from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [float(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
    return vals[7] if len(vals) > 7 else 0.0, sum(vals)


@dataclass
class RunConditions:
    """What the machine and the client did during one strategy's live run."""

    requests: int
    max_start_lag_s: float | None
    steal: float | None  # share of CPU time stolen over the run
    load: float  # 1-minute load average at the end
    cores: int
    records_unique: int
    records_duplicate: int
    engine_late_s: float | None = None  # how late (wall s) the engines sent a step's outputs, on average
    ttft_p50_s: float | None = None

    def problems(self) -> list[str]:
        """Why this run's figures cannot be trusted, each with by how much; empty if valid."""
        out = []
        lag = self.max_start_lag_s or 0.0
        if lag > MAX_START_LAG_S:
            out.append(f"the replay client fell {lag:.2f} s behind schedule (limit {MAX_START_LAG_S:g} s, "
                       f"{lag / MAX_START_LAG_S:.1f}x over): the machine was too busy to send on time")
        if self.steal is not None and self.steal > MAX_STEAL:
            out.append(f"the hypervisor stole {self.steal:.0%} of CPU time (limit {MAX_STEAL:.0%})")
        late, ttft = self.engine_late_s, self.ttft_p50_s
        if late is not None and ttft and late > MAX_ENGINE_LATE * ttft:
            out.append(f"the simulated engines sent their outputs {late * 1e3:.1f} ms after their model on average, "
                       f"{late / ttft:.0%} of TTFT p50 (limit {MAX_ENGINE_LATE:.0%}): the machine, not the model, set "
                       f"the latencies")
        missing = self.requests - self.records_unique
        if self.requests and missing / self.requests > MAX_RECORD_LOSS:
            out.append(f"{missing} of {self.requests} request records missing ({missing / self.requests:.0%}, "
                       f"limit {MAX_RECORD_LOSS:.0%})")
        return out

    def as_dict(self) -> dict:
        return {**self.__dict__, "problems": self.problems()}


def verdict(conditions: dict[str, RunConditions]) -> tuple[str, bool]:
    """One plain sentence on the live run, and whether it is invalid."""
    bad = {s: c.problems() for s, c in conditions.items() if c.problems()}
    loads = [c.load for c in conditions.values()]
    cores = next(iter(conditions.values())).cores if conditions else 0
    ctx = f"load average up to {max(loads):.1f} on {cores} cores" if loads else ""
    if not bad:
        return f"Live run valid: every strategy replayed on schedule, with its records ({ctx}).", False
    detail = "; ".join(f"{s}: {', '.join(p)}" for s, p in bad.items())
    return (f"Live run NOT valid, its latencies say more about this machine than about routing ({ctx}). "
            f"{detail}. The virtual-time comparison below does not depend on the machine.", True)


# ---------------------------------------------------------------------------- warnings, counted

class WarningTally(logging.Filter):
    """Counts WARNING+ log records by kind and keeps them off the console (they go to a file):
    a demo prints its story, then one summary line of what went wrong along the way."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if getattr(record, "_infernex_tallied", False):  # the filter sits on every console handler
            return False
        record._infernex_tallied = True
        kind = re.sub(r"\d+(\.\d+)?", "N", record.getMessage())
        kind = re.sub(r"(nats://|tcp://|https?://)\S+", "URL", kind)[:90]
        self.kinds[f"{record.name}: {kind}"] += 1
        return False

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def summary(self, where: Path | None = None, top: int = 3) -> str:
        if not self.total:
            return "no warnings during the run"
        most = "; ".join(f"{n}x {k}" for k, n in self.kinds.most_common(top))
        rest = len(self.kinds) - min(top, len(self.kinds))
        return (f"{self.total} warnings of {len(self.kinds)} kinds during the run"
                + (f" (all in {where})" if where else "") + f": {most}" + (f"; {rest} more kinds" if rest else ""))


@contextlib.contextmanager
def tally_warnings(log_file: Path):
    """Within: WARNING+ records go to ``log_file`` and are counted, not shown on the console."""
    root = logging.getLogger()
    tally = WarningTally()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(log_file, mode="w")
    fh.setLevel(logging.WARNING)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers = list(root.handlers)
    for h in handlers:
        h.addFilter(tally)
    root.addHandler(fh)
    lastresort, logging.lastResort = logging.lastResort, None
    if not handlers:  # no console handler: keep WARNINGs off stderr all the same
        quiet = logging.NullHandler()
        root.addHandler(quiet)
    try:
        yield tally
    finally:
        for h in handlers:
            h.removeFilter(tally)
        root.removeHandler(fh)
        fh.close()
        if not handlers:
            root.removeHandler(quiet)
        logging.lastResort = lastresort


# ---------------------------------------------------------------------------- virtual time

def pd_arrival_stretch(cfg: "DemoConfig") -> float:
    """How many times slower a PD strategy's arrivals come than the trace's (live and in virtual
    time alike): with ``pd_same_load_per_engine`` its xPyD group gets the load per engine the
    aggregated engines get, not the whole load on fewer engines."""
    pd_engines = cfg.prefill + cfg.decode
    if not (cfg.pd_same_load_per_engine and pd_engines and cfg.engines):
        return 1.0
    return max(1.0, cfg.engines / pd_engines)


def virtual_comparison(rows, cfg: "DemoConfig") -> list:
    """The same rows and strategies through the router's real strategy code over the simulator's
    engine model in virtual time (:mod:`simulator.whatif`): deterministic, whatever the machine. The
    router reads the engines' load as the live run's metrics scrape gives it, not exact at every
    decision (exact load flattered kv-aware's E2E by a quarter: bench/RESULTS.md, session 10). A PD
    strategy's arrivals are stretched as in the live run (:func:`pd_arrival_stretch`)."""
    from infernex.report import StrategyResult
    from simulator.whatif import Fleet, simulate

    fleet = Fleet(aggregated=cfg.engines, pd_groups=1 if cfg.prefill and cfg.decode else 0,
                  prefill_per_group=cfg.prefill, decode_per_group=cfg.decode, hardware=cfg.hardware,
                  model_profile=cfg.model_profile, num_gpu_blocks=cfg.num_gpu_blocks)
    out = []
    for strategy in cfg.strategies:
        if strategy.startswith("pd-") and not fleet.pd_groups:
            continue
        stretch = pd_arrival_stretch(cfg) if strategy.startswith("pd-") else 1.0
        r = simulate(rows, strategy, fleet, time_scale=1.0 / stretch, seed=0, max_output_tokens=cfg.max_output_tokens,
                     metrics_interval_s=cfg.metrics_interval_s * cfg.time_scale)
        out.append(StrategyResult(strategy, r.summary(), r.overlap_share, r.busy_spread,
                                  {"virtual_s": r.virtual_s, "rejected": r.rejected, "arrival_stretch": stretch},
                                  engine_hit_rate=r.engine_hit_rate))
    return out


def headline(results: list, base: str = "round-robin", best: str = "kv-aware") -> dict | None:
    """``base`` TTFT p50 / ``best`` TTFT p50 (how many times faster the first token comes)."""
    by = {r.strategy: r for r in results}
    a, b = by.get(base), by.get(best)
    if a is None or b is None or not a.summary.ttft_p50_s or not b.summary.ttft_p50_s:
        return None
    return {"base": base, "best": best, "base_ttft_p50_s": a.summary.ttft_p50_s,
            "best_ttft_p50_s": b.summary.ttft_p50_s, "ratio": a.summary.ttft_p50_s / b.summary.ttft_p50_s,
            "base_hit_rate": a.hit_rate, "best_hit_rate": b.hit_rate}


async def _wait(cond, timeout: float, what: str, interval: float = 0.05, *, required: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(interval)
    if required:
        raise TimeoutError(f"timed out waiting for {what}")
    log.warning("timed out waiting for %s; going on with what arrived", what)
    return False


async def _bounded(aw, what: str, timeout: float = 10.0, cancel: list | None = None) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        log.warning("%s did not stop within %.0fs; cancelling", what, timeout)
        for t in cancel or []:
            t.cancel()
    except Exception as exc:  # noqa: BLE001 - shutting down; report and go on
        log.warning("%s stopped with an error: %s", what, exc)


async def run_demo(cfg: DemoConfig, console: Console | None = None, stop: asyncio.Event | None = None,
                   tally: WarningTally | None = None) -> dict:
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

    from consumers.device_collector import DeviceCollector, make_reader
    from consumers.diagnosis import DiagnosisService
    from consumers.metrics_collector import MetricsCollector, Target
    from consumers.sla_sink import SlaSink
    from consumers.sla_store import SlaConfig, open_store
    from schemas import Diagnosis
    from simulator.devices import SimulatedNode
    from streams.diagnosis.rules import DiagnosisConfig

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
    diagnosis = None
    sla_store = None
    sink_task = None
    windows: dict[str, tuple[float, float]] = {}
    findings: list = []
    incident: dict = {}
    results: list[StrategyResult] = []
    conditions: dict[str, RunConditions] = {}
    timelines: dict[str, list] = {}
    sla_targets = None
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

        node = None
        if cfg.services:
            # engine metrics -> the router's load state; device telemetry -> diagnosis -> health;
            # request records and metrics -> ClickHouse (chDB, under the report directory)
            targets = [Target(url=f"{h.url}/metrics", pod=h.engine_id, role=roles[h.engine_id], model=MODEL) for h in cluster.engines]
            collector = MetricsCollector(targets, js, registry=CollectorRegistry())
            tasks.append(asyncio.create_task(collector.run(bridges_stop, cfg.metrics_interval_s)))
            node = SimulatedNode("demo-node", len(cluster.engines), "npu", seed=0,
                                 pods={str(i): [h.engine_id] for i, h in enumerate(cluster.engines)})
            devices = DeviceCollector(make_reader("sim", node.node, sim_node=node), js, node=node.node, source="sim",
                                      registry=CollectorRegistry())
            tasks.append(asyncio.create_task(devices.run(bridges_stop, 1.0)))
            diagnosis = DiagnosisService(nats_cfg, DiagnosisConfig(start="all", adopt_window_s=0),
                                         registry=CollectorRegistry())
            await diagnosis.start()

            async def on_finding(msg) -> None:
                try:
                    findings.append(decode_event(Diagnosis, msg.data))
                except Exception:  # noqa: BLE001 - the demo only lists what it can read
                    pass

            await nc.subscribe(S.ALL_DIAGNOSIS, cb=on_finding)
            chdb_dir = cfg.out / "chdb"
            shutil.rmtree(chdb_dir, ignore_errors=True)
            sla_cfg = SlaConfig(chdb_path=chdb_dir, flush_interval_s=0.5)
            sla_targets = sla_cfg.targets
            sla_store = open_store(sla_cfg)
            sink = SlaSink(js, sla_store, sla_cfg, topology=topo, registry=CollectorRegistry())
            sink_task = asyncio.create_task(sink.run(bridges_stop))
            console.print("  engine-metrics and NPU telemetry collectors, diagnosis engine, SLA sink "
                          f"(chDB at {chdb_dir})")

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

        pd_engines = cfg.prefill + cfg.decode
        pd_stretch = pd_arrival_stretch(cfg)
        for strategy in cfg.strategies:
            if stop.is_set():
                break
            stretch = pd_stretch if strategy.startswith("pd-") else 1.0
            # a fair start: every engine's prefix cache empty, and the index has seen it
            for h in cluster.engines:
                h.call(lambda e: (e.core.reset_prefix_cache(), e._flush_events(e.core.take_pending_events())))
            await _wait(lambda: sum(sum(i.blocks.values()) for i in indexer.index.pods().values()) == 0, 30,
                        "the index to see the cleared caches")
            def engine_stats():  # (busy time, prefix hits, prefix queries, late virtual s, busy steps)
                return {h.engine_id: h.call(lambda e: (e.core.stats.busy_time, e.core.stats.prefix_cache_hits,
                                                       e.core.stats.prefix_cache_queries, e.timeline.late_s,
                                                       e.timeline.steps)) for h in cluster.engines}

            stats0 = engine_stats()
            rcfg = RouterConfig(pool=POOL, strategy=strategy, port=0, backends=backends, seed=0,
                                read_timeout_s=120)
            app = RouterApp(rcfg, nats_cfg, registry=CollectorRegistry())
            url = await app.start(port=0)
            n_before = len(records)
            console.print(f"  [cyan]{strategy}[/cyan]: router at {url}, replaying"
                          + (f" (arrivals {stretch:g}x slower for the {pd_engines} PD engines)" if stretch > 1 else "")
                          + " ...")
            t = time.monotonic()
            t_wall = time.time()
            cpu0 = cpu_times()
            res = await replay(rows, url, model=MODEL, time_scale=stretch / cfg.time_scale,
                               concurrency=cfg.concurrency, stop=stop, timeout_s=120)
            await _bounded(app.stop(drain=True), "router", timeout=45)
            # records are published off the request path (bounded buffer): count what arrived
            await _wait(lambda: len(records) - n_before >= len(rows) or stop.is_set(), 15, "request records",
                        required=False)
            mine = records[n_before:]
            cpu1 = cpu_times()
            unique = len({r.request_id for r in mine})
            steal = ((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]) if cpu0 and cpu1 and cpu1[1] > cpu0[1] else None)
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
                                          {"wall_s": time.monotonic() - t, "records": unique, "arrival_stretch": stretch},
                                          engine_hit_rate=hits / queries if queries else None))
            late_steps = sum(d[4] for d in delta.values())
            conditions[strategy] = RunConditions(
                requests=len(rows), max_start_lag_s=summary.max_start_lag_s, steal=steal, load=os.getloadavg()[0],
                cores=os.cpu_count() or 1, records_unique=unique, records_duplicate=len(mine) - unique,
                engine_late_s=(sum(d[3] for d in delta.values()) / late_steps / cfg.time_scale
                               if late_steps else None),
                ttft_p50_s=summary.ttft_p50_s)
            res.write(cfg.out / f"replay-{strategy}.json")
            timelines[strategy] = res.requests
            windows[strategy] = (t_wall, time.time())
            late = conditions[strategy].problems()
            console.print(f"    {summary.ok}/{summary.requests} ok in {time.monotonic() - t:.1f}s, "
                          f"prefix cache hit rate {results[-1].hit_rate or 0:.1%}"
                          + (f" [red](not valid: {late[0].split(':')[0]})[/red]" if late else ""))
        if cfg.services and cfg.incident and node is not None and results and not stop.is_set():
            incident = await _incident(cfg, cluster, node, rows, backends, nats_cfg, findings, records, console)
        await rec_sub.unsubscribe()
        pd_loop = None
        if cfg.pd_loop and sla_store is not None and not stop.is_set():
            pd_loop = await _pd_loop(cfg, sla_store, console)
        sla_rows, tables = [], {}
        if sla_store is not None and windows:
            from consumers import sla_queries

            sla_rows = await _sla_table(sla_store, windows, len(records), console, sla_targets)
            tables = await asyncio.to_thread(sla_queries.table_counts, sla_store)
            console.print("ClickHouse rows: " + ", ".join(f"{k} {v}" for k, v in tables.items()))
        if findings:
            _print_findings(findings, console)
        title = (f"InferNex demo: {len(rows)} requests of {cfg.trace.name}, {cfg.engines} aggregated engines + "
                 f"{cfg.prefill}P{cfg.decode}D ({cfg.hardware}, {cfg.model_profile}), time x{cfg.time_scale:g}")
        live_verdict, virtual, head, agreement = None, [], None, None
        if results:
            console.print(rich_table(results, "Live run: wall clock, over HTTP (" + title.split(": ", 1)[1] + ")"))
            live_verdict = verdict(conditions)
            console.print(("[red]" if live_verdict[1] else "[green]") + live_verdict[0]
                          + ("[/red]" if live_verdict[1] else "[/green]"), soft_wrap=True)
            virtual = await asyncio.to_thread(virtual_comparison, rows, cfg)
            console.print(rich_table(virtual, "Virtual time: the router's strategy code over the engine model "
                                              "(deterministic; the headline)"))
            head = headline(virtual)
            agreement = _agreement(cfg.out / "headline.json", head)
            if head:
                console.print(f"[bold]Headline[/bold] (virtual time): {head['best']} gives the first token "
                              f"{head['ratio']:.2f}x sooner than {head['base']} at the median "
                              f"({head['best_ttft_p50_s'] * 1000:.0f} ms vs {head['base_ttft_p50_s'] * 1000:.0f} ms). "
                              + (agreement["text"] if agreement else ""), soft_wrap=True)
            warn_line = tally.summary(cfg.out / "warnings.log") if tally is not None else None
            verdicts = ([live_verdict] if live_verdict else []) + (
                [(f"Headline (virtual time, deterministic): {head['best']} TTFT p50 {head['ratio']:.2f}x lower than "
                  f"{head['base']} ({head['best_ttft_p50_s'] * 1000:.0f} ms vs {head['base_ttft_p50_s'] * 1000:.0f} ms). "
                  + (agreement["text"] if agreement else ""), False)] if head else [])
            sections = _sections(sla_rows, incident, findings, sla_targets)
            images = []
            if pd_loop is not None:
                sections += pd_loop["sections"]
                verdicts += pd_loop["verdicts"]
                images.append(("pd-loop.png", "The PD sizing loop: load, engines per role and SLA attainment over "
                                              "virtual time (planner hints read from ClickHouse)", pd_loop["png"]))
            if virtual:
                from infernex.report import COLUMNS

                sections.insert(0, ("Virtual time: the router's strategy code over the simulator's engine model "
                                    "(same rows, deterministic)", [n for n, _ in COLUMNS],
                                    [[fn(r) for _, fn in COLUMNS] for r in virtual]))
            if conditions:
                sections.insert(1 if virtual else 0, (
                    "Live run conditions (validity)", ["strategy", "max start lag s", "CPU steal", "load avg",
                                                       "records / requests", "duplicates", "problems"],
                    [[s_, f"{c.max_start_lag_s or 0:.2f}", "-" if c.steal is None else f"{c.steal:.1%}",
                      f"{c.load:.1f} / {c.cores} cores", f"{c.records_unique}/{c.requests}", str(c.records_duplicate),
                      "; ".join(c.problems()) or "none"] for s_, c in conditions.items()]))
            from infernex.report import plot_timeline

            timeline = await asyncio.to_thread(plot_timeline, timelines, lag_limit_s=MAX_START_LAG_S)
            paths = write_report(results, cfg.out, title="Live run: " + title, sections=sections, verdicts=verdicts,
                                 images=[("timeline.png", "The live run over time: TTFT and client lag per strategy",
                                          timeline), *images],
                                 notes=[
                f"latencies are wall-clock; the simulated engines run {cfg.time_scale:g}x faster than the "
                f"{cfg.hardware} profile, and trace arrivals are compressed by the same factor",
                f"a live run is valid when the client sends within {MAX_START_LAG_S:g} s of schedule, CPU steal "
                f"stays under {MAX_STEAL:.0%} and at most {MAX_RECORD_LOSS:.0%} of request records are missing",
            ] + ([f"PD strategies use the {cfg.prefill}P{cfg.decode}D group alone ({pd_engines} engines against "
                  f"{cfg.engines} aggregated), so they replay the same rows with arrivals {pd_stretch:g}x slower: "
                  f"the same load per engine"] if pd_stretch > 1 and any(x.startswith("pd-") for x in cfg.strategies)
                 else []) + ([warn_line] if warn_line else []))
            (cfg.out / "control-plane.json").write_text(json.dumps({
                "sla": sla_rows, "tables": tables, "incident": incident,
                "pd_loop": None if pd_loop is None else pd_loop["data"],
                "findings": [f.model_dump(mode="json") for f in findings]}, indent=2, default=str))
            (cfg.out / "validity.json").write_text(json.dumps({
                "valid": not live_verdict[1], "verdict": live_verdict[0],
                "strategies": {k: c.as_dict() for k, c in conditions.items()},
                "warnings": dict(tally.kinds) if tally is not None else {}}, indent=2))
            if head:
                (cfg.out / "headline.json").write_text(json.dumps({**head, "previous": agreement}, indent=2))
            console.print(f"report: {paths['html']} and {paths['png']}  ({time.monotonic() - t_start:.0f}s)")
        return {"results": results, "out": str(cfg.out), "sla": sla_rows, "incident": incident,
                "pd_loop": None if pd_loop is None else pd_loop["data"], "tables": tables,
                "findings": findings, "virtual": virtual, "headline": head,
                "valid": None if live_verdict is None else not live_verdict[1]}
    finally:
        # every step bounded: a stuck component must not keep the demo (or CI) from exiting
        bridges_stop.set()
        if indexer is not None:
            await _bounded(indexer.stop(), "indexer")
        if diagnosis is not None:
            await _bounded(diagnosis.stop(), "diagnosis engine")
        if sink_task is not None:
            await _bounded(sink_task, "SLA sink", cancel=[sink_task])
        await _bounded(asyncio.gather(*tasks, return_exceptions=True), "KV bridges", cancel=tasks)
        if nc is not None:
            await _bounded(nc.close(), "NATS client")
        if cluster is not None:
            cluster.stop()
        if sla_store is not None:
            sla_store.close()
        server.stop()


async def _incident(cfg: DemoConfig, cluster, node, rows, backends, nats_cfg, findings, records, console) -> dict:
    """A critical NPU fault under one engine: the diagnosis engine names it with a remediation,
    the router's health state marks the pod critical, and kv-aware routing stops sending it work."""
    from prometheus_client import CollectorRegistry

    from router.app import RouterApp
    from router.config import RouterConfig
    from simulator.workloads.client import replay

    victim = cluster.engines[0].engine_id
    device = next(d for d, pods in node.pods.items() if victim in pods)
    console.print(f"  [bold]incident[/bold]: NPU {node.node}/{device} under {victim} reports error code 0x80E01801 ...")
    t0 = time.time()
    node.inject(device, "error_code", start=t0, code="0x80E01801")
    n0 = len(findings)
    await _wait(lambda: any(f.status != "resolved" and victim in f.pods for f in findings[n0:]), 30,
                "a diagnosis naming the faulty pod")
    detected = time.time() - t0
    finding = next(f for f in findings[n0:] if victim in f.pods)
    console.print(f"    diagnosis after {detected:.1f}s: {finding.severity} {finding.fault_mode} — "
                  f"{finding.summary}; remediation: {finding.remediation}")
    app = RouterApp(RouterConfig(pool=POOL, strategy="kv-aware", port=0, backends=backends, seed=0, read_timeout_s=120),
                    nats_cfg, registry=CollectorRegistry())
    url = await app.start(port=0)
    try:
        await _wait(lambda: (app.state.get(victim) is not None and app.state.get(victim).health == "critical"), 30,
                    "the router to mark the pod critical")
        n_before = len(records)
        # the requests the faulty engine served best: the rows it had cached at the end of the runs
        sample = rows[: cfg.incident_requests]
        t = time.monotonic()
        res = await replay(sample, url, model=MODEL, time_scale=1.0 / cfg.time_scale,
                           concurrency=cfg.concurrency, timeout_s=120)
    finally:
        await _bounded(app.stop(drain=True), "router", timeout=45)
    await _wait(lambda: len(records) - n_before >= len(sample), 15, "request records", required=False)
    mine = records[n_before:]
    sent = sum(1 for r in mine if victim in r.pods)
    ok = sum(1 for r in res.requests if r.status == "ok")
    console.print(f"    kv-aware during the fault: {ok}/{len(sample)} ok in {time.monotonic() - t:.1f}s, "
                  f"{sent} sent to {victim}")
    return {"pod": victim, "device": device, "fault": "error_code 0x80E01801", "finding": finding.finding_id,
            "severity": finding.severity, "remediation": finding.remediation,
            "detected_after_s": round(detected, 2), "requests": len(sample), "ok": ok,
            "sent_to_faulty_pod": sent}


async def _pd_loop(cfg: DemoConfig, store, console) -> dict:
    """The PD sizing loop on the demo's own ClickHouse, then PD vs aggregated goodput; both in virtual
    time (:mod:`consumers.pd_loop`, :mod:`simulator.goodput`). Returns report sections, verdicts,
    the plot and the data."""
    from consumers.pd_loop import POOL as LOOP_POOL
    from consumers.pd_loop import run_loop
    from infernex.report import plot_pd_loop
    from simulator.goodput import compare
    from streams.planner import SlaTargets

    targets = SlaTargets(ttft_s=2.0, itl_s=0.025)
    n, dt = cfg.pd_loop_intervals, cfg.pd_loop_interval_s
    console.print(f"  [bold]PD sizing loop[/bold] (virtual time): pool {LOOP_POOL!r} starts 1P3D, load ramps 1 -> 6 req/s "
                  f"of 6k-10k-token prompts over {n} intervals of {dt:g} s; the planner reads the SLA history from "
                  "ClickHouse and its hints resize prefill and decode")
    rep = await asyncio.to_thread(lambda: asyncio.run(run_loop(
        store, intervals=n, interval_s=dt, targets=targets, log=None)))  # the report shows every interval
    hints = int(store.rows(f"SELECT count() AS n FROM {store.database}.scaling_hints "
                          f"WHERE pool = '{LOOP_POOL}'")[0]["n"])
    ivs = rep.intervals
    q = max(1, len(ivs) // 4)

    def avg(xs) -> float:
        vals = [i.attainment for i in xs if i.attainment is not None]
        return sum(vals) / len(vals) if vals else 0.0

    first, last = avg(ivs[:q]), avg(ivs[-q:])
    low = min(ivs, key=lambda i: i.attainment if i.attainment is not None else 1.0)
    start, end = ivs[0].engines, {**ivs[-1].engines, **ivs[-1].hints}
    recovered = last >= 0.8
    text = (f"PD sizing loop (virtual time): attainment {first:.0%} in the first quarter, down to "
            f"{low.attainment or 0:.0%} at {low.k * dt / 60:g} min as the ramp starved prefill, {last:.0%} in the "
            f"last quarter; the planner resized the pool {start.get('prefill', 0)}P{start.get('decode', 0)}D -> "
            f"{end.get('prefill', 0)}P{end.get('decode', 0)}D with {hints} hints written to ClickHouse.")
    if hints == 0 or not recovered:
        text = ("PD sizing loop NOT converged: " + ("no scaling hints reached ClickHouse; " if hints == 0 else "")
                + (f"last-quarter attainment {last:.0%} is below 80%; " if not recovered else "") + text)
    console.print(("    " if hints and recovered else "    [red]") + text + ("" if hints and recovered else "[/red]"),
                  soft_wrap=True)
    console.print(f"  [bold]goodput[/bold]: PD (planner split) vs aggregated on {cfg.goodput_engines} engines, "
                  f"rates {', '.join(f'{r:g}' for r in cfg.goodput_rates)} req/s ...")
    gp = await asyncio.to_thread(compare, cfg.goodput_engines, list(cfg.goodput_rates), seconds=cfg.goodput_seconds,
                                 ttft_s=targets.ttft_s, tpot_s=targets.itl_s, seeds=cfg.goodput_seeds)
    console.print("    " + gp.summary(), soft_wrap=True)
    loop_rows = [[f"{i.k * dt / 60:g}", f"{i.rate:.1f}", str(i.engines.get("prefill", 0)),
                  str(i.engines.get("decode", 0)), str(i.requests),
                  "-" if i.attainment is None else f"{i.attainment:.1%}",
                  f"{i.hints.get('prefill', '-')}P{i.hints.get('decode', '-')}D"] for i in ivs]
    sections = [
        (f"PD sizing loop (virtual time, pool {LOOP_POOL}, SLA TTFT <= {targets.ttft_s:g} s and TPOT <= "
         f"{targets.itl_s * 1000:g} ms)", ["minute", "load req/s", "prefill", "decode", "requests", "attainment",
                                            "planner hint"], loop_rows),
        (f"Goodput, PD (planner split) vs aggregated on the same {gp.engines} engines (virtual time, ISL "
         f"U{gp.isl}, OSL U{gp.osl}, {gp.seconds:g} s per rate, mean of {cfg.goodput_seeds} arrival sequences): "
         f"{gp.summary()}",
         ["rate req/s", "aggregated goodput (attainment)", "PD split", "PD goodput (attainment)", "PD / aggregated"],
         gp.rows()),
    ]
    png = await asyncio.to_thread(plot_pd_loop, ivs, interval_s=dt, attainment_goal=0.9)
    data = {"intervals": [{"k": i.k, "rate": i.rate, "engines": i.engines, "requests": i.requests,
                           "attainment": i.attainment, "hints": i.hints} for i in ivs],
            "scaling_hints": hints, "records": rep.record_rows, "converged": bool(hints and recovered),
            "goodput": {"engines": gp.engines, "aggregated_req_s": gp.sustained("aggregated"),
                        "pd_req_s": gp.sustained("pd"), "ratio": gp.ratio, "lower_bound": gp.saturated,
                        "points": [p.__dict__ for p in gp.points]}}
    return {"sections": sections, "verdicts": [(text, not (hints and recovered)), (gp.summary(), False)],
            "png": png, "data": data}


async def _sla_table(store, windows: dict[str, tuple[float, float]], n_records: int, console,
                     targets=None) -> list[dict]:
    """Per-strategy SLA summary read back from ClickHouse (the same SQL the dashboards use)."""
    from rich.table import Table

    from consumers import sla_queries

    def count() -> int:
        return int(store.rows(f"SELECT count() AS n FROM {store.database}.request_records")[0]["n"])

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and await asyncio.to_thread(count) < n_records:
        await asyncio.sleep(0.25)
    table = Table(title=_sla_heading(targets))
    for col in SLA_COLUMNS:
        table.add_column(col, justify="right" if col != "strategy" else "left")
    out = []
    for strategy, (since, until) in windows.items():
        rows = await asyncio.to_thread(sla_queries.sla_summary, store, since, until, pool=POOL, targets=targets)
        n = sum(r["requests"] for r in rows)
        if not n:
            continue

        def wavg(key: str) -> float | None:
            vals = [(r[key], r["requests"]) for r in rows if r.get(key) is not None]
            w = sum(c for _, c in vals)
            return sum(v * c for v, c in vals) / w if w else None

        row = {"strategy": strategy, "requests": n, "ttft_p50_s": wavg("ttft_p50"), "ttft_p90_s": wavg("ttft_p90"),
               "prefix_hit_rate": wavg("prefix_hit_rate"), "attainment": wavg("attainment")}
        out.append(row)
        table.add_row(*_sla_cells(row))
    console.print(table)
    return out


SLA_COLUMNS = ["strategy", "requests", "TTFT p50 ms (router)", "TTFT p90 ms (router)",
               "cached/prompt tokens (router)", "SLA attainment"]


def _sla_heading(targets) -> str:
    t = targets
    goal = (f"; target TTFT <= {t.ttft_s * 1000:.0f} ms and ITL <= {t.itl_s * 1000:.0f} ms, attainment = share "
            f"of requests within both (goal {t.attainment_goal:.0%})") if t is not None else ""
    return ("SLA history read back from ClickHouse: router-measured (request arrival at the router to first "
            f"token from the backend), per strategy window{goal}")


def _agreement(path: Path, head: dict | None) -> dict | None:
    """Compare this run's headline with the previous run's (``headline.json`` in the same out dir)."""
    if head is None or not path.is_file():
        return None
    try:
        prev = json.loads(path.read_text())
        ratio = float(prev["ratio"])
    except (ValueError, KeyError, TypeError):
        return None
    diff = abs(head["ratio"] - ratio) / ratio if ratio else None
    if diff is None:
        return None
    return {"previous_ratio": ratio, "difference": diff,
            "text": f"Previous run: {ratio:.2f}x, {diff:.1%} apart ({'agree' if diff <= 0.10 else 'DISAGREE'} "
                    "within 10%)."}


def _sla_cells(row: dict) -> list[str]:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    return [row["strategy"], str(row["requests"]), ms(row["ttft_p50_s"]), ms(row["ttft_p90_s"]),
            pct(row["prefix_hit_rate"]), pct(row["attainment"])]


def _latest(findings: list) -> dict:
    """The newest revision of each finding (the bus carries every update)."""
    return {f.finding_id: f for f in findings}


def _print_findings(findings, console) -> None:
    latest = _latest(findings)
    console.print(f"diagnosis findings: {len(latest)}")
    for f in latest.values():
        console.print(f"  {f.status:8} {f.severity:8} {f.node}/{f.device} {f.fault_mode}: {f.summary}"
                      f" (pods {', '.join(f.pods) or '-'})")


def _sections(sla_rows: list[dict], incident: dict, findings: list, targets=None) -> list:
    """The control-plane part of the report: SLA history from ClickHouse, the incident, findings."""
    out = []
    if sla_rows:
        out.append((_sla_heading(targets), SLA_COLUMNS, [_sla_cells(r) for r in sla_rows]))
    if incident:
        out.append(("Incident: a critical NPU fault under one engine", ["what", "value"],
                    [[k.replace("_", " "), str(v)] for k, v in incident.items()]))
    latest = _latest(findings)
    if latest:
        out.append(("Diagnosis findings", ["status", "severity", "device", "fault", "pods", "remediation"],
                    [[f.status, f.severity, f"{f.node}/{f.device}", f.fault_mode, ", ".join(f.pods), f.remediation]
                     for f in latest.values()]))
    return out
