"""Commands of the producers: ``bridge vllm-kv``, ``collect metrics``, ``collect devices``,
``sim-devices``."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from typing import Optional

import typer
from rich.console import Console

from infernex.commands.common import run_async as _run, settle_gc

err = Console(stderr=True)
out = Console()
log = logging.getLogger(__name__)

bridge_app = typer.Typer(help="Bridges from engines onto JetStream.", no_args_is_help=True)
collect_app = typer.Typer(help="Collectors: engine metrics and device telemetry onto JetStream.",
                          no_args_is_help=True)


def _settings(ctx: typer.Context):
    from infernex.cli import settings_of

    return settings_of(ctx)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_health(port: Optional[int], registry, health, host: str = "0.0.0.0") -> None:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``--metrics-host:--metrics-port`` (nothing without a port)."""
    if port is not None:
        from consumers.health import serve

        await serve(health, port, host=host, registry=registry)
        out.print(f"metrics and health on http://{host}:{port}/metrics, /healthz, /readyz")


def _per_engine(values: list, n: int, flag: str, default, *, one_for_all: bool = False) -> list:  # noqa: ANN001
    """A repeatable option's values for ``n`` engines: one each (in ``--endpoint`` order), one for
    all (with ``one_for_all``), or none (``default`` for all, or a usage error when ``default`` is ``...``)."""
    if len(values) == n:
        return list(values)
    if len(values) == 1 and one_for_all:
        return list(values) * n
    if not values and default is not ...:
        return [default] * n
    raise typer.BadParameter(f"give one {flag} per --endpoint ({n} endpoints, {len(values)} {flag})",
                             param_hint=flag)


@bridge_app.command("vllm-kv")
def bridge_vllm_kv(
    ctx: typer.Context,
    endpoint: list[str] = typer.Option(..., "--endpoint", metavar="URL",
                                       help="vLLM KV-event PUB endpoint, tcp://HOST:PORT; repeat to bridge several "
                                            "engines (e.g. a pod's data-parallel ranks) in this one process"),
    pod: list[str] = typer.Option(..., "--pod", metavar="NAME", help="pod (engine) name: one per --endpoint, in order"),
    model: list[str] = typer.Option(..., "--model", metavar="NAME", help="served model name: one for all, or one per --endpoint"),
    replay_endpoint: list[str] = typer.Option([], "--replay-endpoint", metavar="URL",
                                              help="vLLM replay ROUTER endpoint: none, or one per --endpoint"),
    dp_rank: list[int] = typer.Option([], "--dp-rank", min=0, metavar="RANK",
                                      help="data-parallel rank if the engine sends none (default 0): none, or one "
                                           "per --endpoint (each rank has its own sequence and --pod name)"),
    topic: list[str] = typer.Option([""], "--topic", metavar="TOPIC", help="ZMQ topic to subscribe to ('' = all): one for all, "
                                                          "or one per --endpoint"),
    max_inflight: int = typer.Option(256, "--max-inflight", min=1, help="unacknowledged publishes allowed, per engine"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port",
                                               help="serve /metrics, /healthz and /readyz here"),
    metrics_host: str = typer.Option("0.0.0.0", "--metrics-host", help="address the metrics port binds"),
    max_frame_age: Optional[float] = typer.Option(None, "--max-frame-age", min=0,
                                                  help="not ready when no KV frame came for this many seconds "
                                                       "(default: the age is only reported; idle engines are quiet)"),
    encoding: str = typer.Option("binary", "--encoding",
                                 help="KV batches on the bus: binary (packed arrays, "
                                      "application/vnd.infernex.kv+msgpack) or json (the schema's JSON)"),
    group_max: int = typer.Option(128, "--group-max", min=1,
                                  help="binary: batches ready at once go out as one group message of at most "
                                       "this many (1 = a message per batch)"),
    group_wait: float = typer.Option(0.002, "--group-wait", min=0, max=1,
                                     help="binary: while frames arrive faster than one per this many seconds, "
                                          "wait up to this long for a fuller group (0 = never wait)"),
    token_ids: bool = typer.Option(False, "--token-ids",
                                   help="binary: send vLLM's token ids instead of each block's digest (4 bytes "
                                        "per token instead of 8 per block; for consumers older than digests)"),
) -> None:
    """Subscribe to vLLM KV-event streams and publish their batches to JetStream (a message per batch,
    or per group of batches that were ready at once). Several engines in one process share its
    fixed costs: about a third less CPU a block than a process each (bench/RESULTS.md, session 30)."""
    from prometheus_client import CollectorRegistry

    from consumers.health import Health
    from consumers.kv_bridge import BridgeConfig, run_bridges

    if encoding not in ("binary", "json"):
        raise typer.BadParameter("give binary or json", param_hint="--encoding")
    for ep in endpoint:
        if not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise typer.BadParameter(f"endpoint must look like tcp://HOST:PORT, not {ep!r}", param_hint="--endpoint")
    n = len(endpoint)
    pods = _per_engine(pod, n, "--pod", ...)
    if len(set(pods)) != n:
        raise typer.BadParameter("each --endpoint needs its own --pod name (two engines' batches under one "
                                 "name would collide)", param_hint="--pod")
    models = _per_engine(model, n, "--model", ..., one_for_all=True)
    replays = _per_engine(replay_endpoint, n, "--replay-endpoint", None)
    ranks = _per_engine(dp_rank, n, "--dp-rank", 0)
    topics = _per_engine(topic, n, "--topic", "", one_for_all=True)
    settings = _settings(ctx)
    registry = CollectorRegistry()
    health = Health(f"kv-bridge {pods[0]}" + (f" (+{n - 1} engines)" if n > 1 else ""))
    cfgs = [BridgeConfig(endpoint=endpoint[i], replay_endpoint=replays[i], pod=pods[i], model=models[i],
                         topic=topics[i], dp_rank=ranks[i], max_inflight=max_inflight, encoding=encoding,
                         group_max=group_max, group_wait_s=group_wait, digests=not token_ids) for i in range(n)]

    async def go():
        await _serve_health(metrics_port, registry, health, metrics_host)
        from consumers import kv_transcode, kv_wire_compiled

        kv_wire_compiled.warm_up()  # the kernels first (numba's dispatchers are start-up objects too)
        kv_transcode.warm_up()
        settle_gc()
        for cfg, stats in zip(cfgs, await run_bridges(cfgs, settings.nats, registry=registry, stop=_stop_event(),
                                                      health=health, max_frame_age_s=max_frame_age)):
            out.print(f"bridge {cfg.pod} stopped: {stats.frames} frames, {stats.published} batches published, "
                      f"{stats.gaps_filled} gaps filled, {stats.gaps_lost} lost, {stats.restarts} restarts, "
                      f"{stats.dead_letters} dead letters")

    for i in range(n):
        out.print(f"bridging {endpoint[i]} (pod {pods[i]}, model {models[i]}, {encoding})"
                  + ("; Ctrl-C stops" if i == n - 1 else ""))
    _run(go(), fast=True)


def _pair_targets(targets: list[str], pods: list[str]) -> list:
    from consumers.metrics_collector import Target

    if not targets:
        raise typer.BadParameter("give at least one --target URL", param_hint="--target")
    if len(pods) != len(targets):
        raise typer.BadParameter(f"give one --pod per --target ({len(targets)} targets, {len(pods)} pods)",
                                 param_hint="--pod")
    return [Target(url=u if u.endswith("/metrics") else u.rstrip("/") + "/metrics", pod=p)
            for u, p in zip(targets, pods)]


@collect_app.command("metrics")
def collect_metrics(
    ctx: typer.Context,
    target: list[str] = typer.Option([], "--target", help="engine base URL or /metrics URL (repeatable)"),
    pod: list[str] = typer.Option([], "--pod", help="pod name of each --target, in order"),
    interval: float = typer.Option(5.0, "--interval", min=0.1, help="seconds between scrapes"),
    once: bool = typer.Option(False, "--once", help="scrape once, print the status, exit"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="serve /metrics, /healthz and /readyz here"),
    metrics_host: str = typer.Option("0.0.0.0", "--metrics-host", help="address the metrics port binds"),
) -> None:
    """Scrape vLLM /metrics and publish engine metric snapshots."""
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.metrics_collector import MetricsCollector

    from consumers.health import Check, Health, nats_check

    targets = _pair_targets(target, pod)
    settings = _settings(ctx)
    registry = CollectorRegistry()
    health = Health("metrics-collector")

    async def go():
        if not once:
            await _serve_health(metrics_port, registry, health, metrics_host)
        nc = await bus.connect(settings.nats, name="infernex-metrics-collector")
        try:
            col = MetricsCollector(targets, nc.jetstream(), subject_prefix=settings.nats.subject_prefix,
                                   registry=registry)
            health.add("nats", nats_check(nc)).add("scrapes", lambda: Check(True, {
                url: ("up" if st.up else f"down: {st.last_error}") for url, st in col.status.items()}))
            if once:
                snaps = await col.scrape_once()
            else:
                await col.run(_stop_event(), interval)
                snaps = []
            return col.status, snaps
        finally:
            await nc.drain()

    status, snaps = _run(go())
    for url, st in status.items():
        state = "[green]up[/green]" if st.up else f"[red]down[/red] ({st.last_error})"
        out.print(f"{url}: {state}, {st.snapshots} snapshots")
    if once and not any(st.up for st in status.values()):
        raise typer.Exit(1)


@collect_app.command("devices")
def collect_devices(
    ctx: typer.Context,
    source: str = typer.Option(..., "--source", help="npu-smi | npu-exporter | dcgm | sim"),
    node: str = typer.Option(..., "--node", help="node name"),
    url: Optional[str] = typer.Option(None, "--url", help="exporter /metrics URL, or a URL/file with npu-smi output"),
    interval: float = typer.Option(10.0, "--interval", min=0.1),
    once: bool = typer.Option(False, "--once", help="read once, print the samples, exit"),
    sim_devices: int = typer.Option(8, "--sim-devices", min=1, help="(sim) devices on the node"),
    sim_kind: str = typer.Option("npu", "--sim-kind", help="(sim) npu or gpu"),
    seed: int = typer.Option(0, "--seed", help="(sim) random seed"),
    fault: list[str] = typer.Option([], "--fault", help="(sim) DEVICE:KIND@START[+DURATION], seconds from now"),
    chip_ids_from: Optional[str] = typer.Option(None, "--chip-ids-from", help="(npu-smi) the node's npu-exporter "
                                                "/metrics URL or file: name chips by its ids (A3)"),
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="serve /metrics, /healthz and /readyz here"),
    metrics_host: str = typer.Option("0.0.0.0", "--metrics-host", help="address the metrics port binds"),
) -> None:
    """Read device telemetry in its real format and publish it."""
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.device_collector import DeviceCollector, make_reader

    sim = _sim_node(node, sim_devices, sim_kind, seed, fault) if source == "sim" else None
    try:
        reader = make_reader(source, node, url, sim_node=sim, chip_ids_from=chip_ids_from)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from consumers.health import Check, Health, nats_check

    settings = _settings(ctx)
    registry = CollectorRegistry()
    health = Health(f"device-collector {node}")

    async def go():
        if not once:
            await _serve_health(metrics_port, registry, health, metrics_host)
        nc = await bus.connect(settings.nats, name="infernex-device-collector")
        try:
            col = DeviceCollector(reader, nc.jetstream(), node=node, source=source,
                                  subject_prefix=settings.nats.subject_prefix, registry=registry)
            health.add("nats", nats_check(nc)).add(
                "telemetry", lambda: Check(True, {"last_error": col.last_error} if col.last_error else {}))
            if once:
                return col, await col.collect_once()
            await col.run(_stop_event(), interval)
            return col, []
        finally:
            await nc.drain()

    col, samples = _run(go())
    for s in samples:
        print(json.dumps(s.model_dump(mode="json", exclude_none=True)), flush=True)
    if col.last_error:
        err.print(f"[red]{col.last_error}[/red]")
        raise typer.Exit(1)


_FAULT = re.compile(r"^(\d+):([a-z_]+)@(\d+(?:\.\d+)?)(?:\+(\d+(?:\.\d+)?))?$")


def _sim_node(node: str, devices: int, kind: str, seed: int, faults: list[str], t0: float | None = None):
    import time

    from simulator.devices import SimulatedNode

    try:
        sim = SimulatedNode(node, devices, kind, seed=seed)  # type: ignore[arg-type]
        start = time.time() if t0 is None else t0
        for f in faults:
            m = _FAULT.match(f)
            if not m:
                raise ValueError(f"fault {f!r} must look like 0:over_temperature@30+60")
            dev, kindname, at, dur = m.groups()
            sim.inject(dev, kindname, start + float(at), float(dur) if dur else None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return sim


def sim_devices(
    node: list[str] = typer.Option(["node-0"], "--node", help="node name (repeatable)"),
    devices: int = typer.Option(8, "--devices", min=1),
    kind: str = typer.Option("npu", "--kind", help="npu or gpu"),
    seed: int = typer.Option(0, "--seed"),
    fault: list[str] = typer.Option([], "--fault", help="DEVICE:KIND@START[+DURATION] (first node), seconds from now"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(9400, "--port"),
) -> None:
    """Serve simulated NPU/GPU telemetry: /metrics (npu-exporter or DCGM), /npu-smi, /telemetry."""
    import uvicorn

    from simulator.devices import make_app

    nodes = [_sim_node(n, devices, kind, seed + i, fault if i == 0 else []) for i, n in enumerate(node)]
    out.print(f"simulated {kind} nodes {', '.join(node)} on http://{host}:{port}/metrics")
    uvicorn.run(make_app(nodes), host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.add_typer(bridge_app, name="bridge")
    app.add_typer(collect_app, name="collect")
    app.command("sim-devices")(sim_devices)
