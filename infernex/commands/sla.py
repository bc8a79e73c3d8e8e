"""``sla-sink``, ``sla report|migrate|counts`` and ``planner``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import signal
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from infernex.commands.common import parse_duration
from infernex.settings import Settings

console = Console()
err = Console(stderr=True)

sla_app = typer.Typer(help="SLA history: report, schema migrations, row counts.", no_args_is_help=True)

def _settings(ctx: typer.Context) -> Settings:
    from infernex.cli import settings_of

    return settings_of(ctx)


@contextlib.contextmanager
def _quiet_stderr(on: bool):
    """Silence file descriptor 2 (native libraries write there directly) while ``on``."""
    if not on:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _open(settings: Settings, *, remote_ok: bool = True):
    """The SLA store; while ``sla-sink`` owns the chDB directory, queries go through it over
    NATS (``sla.query``), found by itself."""
    from consumers.sla_store import StoreError, open_store
    from infernex.commands.common import fail

    try:
        with _quiet_stderr(remote_ok and settings.sla.backend == "chdb"):  # chDB prints the lock error itself
            return open_store(settings.sla)
    except StoreError as exc:
        if not (remote_ok and settings.sla.backend == "chdb"):
            fail(str(exc))
    from consumers.sla_remote import RemoteQueryError, RemoteStore

    try:
        store = RemoteStore(settings.nats, settings.sla.database)
    except ConnectionError as exc:
        fail(f"the chDB store is locked by another process ({settings.sla.chdb_path}) and NATS is not reachable "
             f"to query through sla-sink: {exc}")
    try:
        store.ping()
    except RemoteQueryError as exc:
        store.close()
        fail(f"cannot open chDB at {settings.sla.chdb_path}: another process holds it, and {exc} (run "
             f"'infernex sla-sink' with this NATS to query through it, or stop the process holding the directory)")
    err.print(f"(querying through the running sla-sink over NATS: {settings.sla.chdb_path} is held by it)",
              highlight=False)
    return store


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _metrics_server(port: int, registry, health, host: str = "0.0.0.0") -> None:  # noqa: ANN001
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (none for port 0)."""
    if port:
        from consumers.health import serve

        await serve(health, port, host=host, registry=registry)
        err.print(f"metrics and health on http://{host}:{port}/metrics, /healthz, /readyz")


async def _sink_main(settings: Settings, with_planner: bool, metrics_port: int,
                     metrics_host: str = "0.0.0.0") -> None:
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.planner import PlannerService, nats_publisher
    from consumers.sla_sink import SlaSink
    from streams.clock import SystemClock
    from streams.topology import build_topology

    from consumers.health import Health, lag_check, nats_check, tasks_check

    store = _open(settings, remote_ok=False)
    registry = CollectorRegistry()
    health = Health("sla-sink", expect=("nats", "consumer_lag"))
    await _metrics_server(metrics_port, registry, health, metrics_host)
    nc = await bus.connect(settings.nats, name="infernex-sla-sink")
    stop = asyncio.Event()
    _stop_on_signals(stop)
    js = nc.jetstream()
    prefix = settings.nats.subject_prefix
    sink = SlaSink(js, store, settings.sla, topology=build_topology(settings.topology, prefix), prefix=prefix,
                   registry=registry)
    tasks = [asyncio.create_task(sink.run(stop), name="sla-sink")]
    if with_planner:
        from consumers.planner import follow_announcements
        from streams.backends import AnnouncedBackends

        announced = AnnouncedBackends(SystemClock())  # current replicas: what the engines announce
        await follow_announcements(js, announced, prefix=prefix, registry=registry,
                                   topology=build_topology(settings.topology, prefix))
        planner = PlannerService(store, settings.sla, clock=SystemClock(), publish=nats_publisher(js, prefix),
                                 registry=registry, kube=_kube(settings), announced=announced)
        tasks.append(asyncio.create_task(planner.run(stop), name="planner"))
    health.add("nats", nats_check(nc)).add("consumer_lag", lag_check(js, settings.sla.durable_prefix))
    from consumers.sla_remote import serve_queries

    await serve_queries(nc, store, prefix)  # `sla report` elsewhere queries through here
    health.add("tasks", tasks_check(lambda: tasks), live=True)
    err.print(f"sla-sink: {settings.sla.backend} database {settings.sla.database}; Ctrl-C to stop")
    try:
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        await nc.drain()
        store.close()
        err.print(f"sla-sink stopped; rows inserted: {sink.inserted}")


def _kube(settings: Settings):  # noqa: ANN202
    """A scale client when some pool names a Kubernetes target (in-cluster or kubeconfig)."""
    if not any(p.kubernetes for p in settings.sla.planner.pools):
        return None
    from kubernetes import config as kconfig

    from consumers.planner import KubeScaler

    try:
        kconfig.load_incluster_config()
    except kconfig.ConfigException:
        kconfig.load_kube_config()
    return KubeScaler()


def sla_sink(
    ctx: typer.Context,
    planner: bool = typer.Option(False, "--planner", help="also run the planner in this process (shares chDB)"),
    metrics_port: int = typer.Option(0, "--metrics-port", help="serve Prometheus metrics on this port"),
    metrics_host: str = typer.Option("0.0.0.0", "--metrics-host", help="address the metrics port binds"),
) -> None:
    """Consume request records, engine metrics, diagnoses and hints into the SLA store."""
    settings = _settings(ctx)
    try:
        asyncio.run(_sink_main(settings, planner, metrics_port, metrics_host))
    except ConnectionError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


def _fmt_ms(v) -> str:  # noqa: ANN001
    return "-" if v is None else f"{v * 1000:.0f}"


def _fmt_fine_ms(v) -> str:  # noqa: ANN001
    """As :func:`_fmt_ms`, a decimal below 10 ms (the router's own time is usually under one)."""
    return "-" if v is None else (f"{v * 1000:.1f}" if v < 0.01 else f"{v * 1000:.0f}")


@sla_app.command("report")
def report(
    ctx: typer.Context,
    since: str = typer.Option("1h", "--since", help="window length back from now, e.g. 15m, 1h, 2d"),
    pool: Optional[str] = typer.Option(None, "--pool"),
    by_minute: bool = typer.Option(False, "--by-minute", help="one row per pool, role and minute"),
    approx: bool = typer.Option(False, "--approx", help="t-digest percentiles instead of exact"),
    rollup: bool = typer.Option(False, "--rollup", help="from the per-minute rollup: fast over days, "
                                "whole minutes, t-digest percentiles, attainment as of the rollup"),
    as_json: bool = typer.Option(False, "--json"),
    stages: bool = typer.Option(False, "--stages", help="per serving stage: prefill (PD prefill pods), decode "
                                "(PD decode pods, KV transfer), aggregated; TTFT, TPOT and attainment each"),
) -> None:
    """SLA figures (TTFT/ITL/e2e percentiles, throughput, errors, prefix hits, attainment)."""
    from consumers import sla_queries

    settings = _settings(ctx)
    seconds = parse_duration(since)
    now = time.time()
    store = _open(settings)
    if stages:
        try:
            rows = sla_queries.sla_stages(store, now - seconds, now, targets=settings.sla.targets, pool=pool,
                                          exact=not approx)
        finally:
            store.close()
        _print_stages(rows, since, settings.sla.targets, as_json)
        return
    try:
        t = settings.sla.targets
        if rollup and by_minute:
            raise typer.BadParameter("--rollup and --by-minute do not combine; the rollup is per minute already")
        if rollup:
            rows = sla_queries.sla_summary_rollup(store, now - seconds, now, pool=pool)
        elif by_minute:
            rows = sla_queries.sla_by_minute(store, now - seconds, now, targets=t, pool=pool, exact=not approx)
        else:
            rows = sla_queries.sla_summary(store, now - seconds, now, targets=t, pool=pool, exact=not approx)
    finally:
        store.close()
    if as_json:
        console.print_json(json.dumps(rows))
        return
    title = (f"SLA over the last {since} (targets: TTFT {t.ttft_s * 1000:.0f} ms, ITL {t.itl_s * 1000:.0f} ms"
             + (f", e2e {t.e2e_s:g} s" if t.e2e_s else "") + f", goal {t.attainment_goal:.0%})")
    table = Table(title=title)
    cols = ["pool", "role"] + (["minute"] if by_minute else []) + [
        "req", "req/s", "tok/s", "err %", "prefix hit %", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
        "e2e p50/p90/p99 ms", "attain %"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("pool", "role", "minute") else "right")
    for r in rows:
        cells = [r["pool"], r["role"]]
        if by_minute:
            cells.append(time.strftime("%H:%M", time.gmtime(r["minute"])))
        att = r["attainment"] or 0.0
        colour = "green" if att >= t.attainment_goal else "red"
        cells += [
            str(r["requests"]), f"{r['req_per_s']:.2f}", f"{r['tokens_per_s']:.0f}",
            f"{(r['error_rate'] or 0) * 100:.1f}", f"{(r['prefix_hit_rate'] or 0) * 100:.1f}",
            "/".join(_fmt_ms(r[f"ttft_p{q}"]) for q in (50, 90, 99)),
            "/".join(_fmt_ms(r[f"itl_p{q}"]) for q in (50, 90, 99)),
            "/".join(_fmt_ms(r[f"e2e_p{q}"]) for q in (50, 90, 99)),
            f"[{colour}]{att * 100:.1f}[/{colour}]",
        ]
        table.add_row(*cells)
    if not rows:
        console.print(f"no request records in the last {since}")
        return
    console.print(table)


def _print_stages(rows: list[dict], since: str, t, as_json: bool) -> None:  # noqa: ANN001
    if as_json:
        console.print_json(json.dumps(rows))
        return
    if not rows:
        console.print(f"no request records in the last {since}")
        return
    table = Table(title=f"SLA per stage over the last {since} (TTFT {t.ttft_s * 1000:.0f} ms, "
                        f"TPOT vs ITL {t.itl_s * 1000:.0f} ms)")
    for c in ("pool", "stage", "req", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "KV transfer p50/p90/p99 ms",
              "router p50/p90/p99 ms", "queue p50/p90/p99 ms", "TTFT ok %", "TPOT ok %"):
        table.add_column(c, justify="left" if c in ("pool", "stage") else "right")
    for r in rows:
        table.add_row(r["pool"], r["stage"], str(r["requests"]),
                      *("/".join((_fmt_fine_ms if n in ("router", "queue") else _fmt_ms)(r[f"{n}_p{q}"])
                                 for q in (50, 90, 99)) for n in ("ttft", "tpot", "kv", "router", "queue")),
                      f"{(r['ttft_attainment'] or 0) * 100:.1f}", f"{(r['tpot_attainment'] or 0) * 100:.1f}")
    console.print(table)


@sla_app.command("migrate")
def migrate(ctx: typer.Context) -> None:
    """Bring the SLA store's schema up to date (idempotent)."""
    from consumers import sla_queries
    from consumers.sla_store import open_store

    settings = _settings(ctx)
    store = _open_raw(settings, open_store)
    try:
        applied = sla_queries.migrate(store, ttl_days=settings.sla.ttl_days,
                                      raw_metrics_ttl_days=settings.sla.raw_metrics_ttl_days)
        console.print(f"applied: {applied or 'nothing'}; schema version {sla_queries.schema_version(store)}")
    finally:
        store.close()


def _open_raw(settings: Settings, open_store):  # noqa: ANN001, ANN202
    from consumers.sla_store import StoreError

    try:
        return open_store(settings.sla, migrate=False)
    except StoreError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


@sla_app.command("rollup")
def rollup_cmd(
    ctx: typer.Context,
    since: str = typer.Option("1d", "--since", help="rebuild the minutes of this window back from now"),
) -> None:
    """Rebuild the per-minute rollup from the records (after changing targets, or to repair)."""
    from consumers import sla_queries

    settings = _settings(ctx)
    now = time.time()
    store = _open(settings, remote_ok=False)
    try:
        t = time.perf_counter()
        sla_queries.refresh_minutes(store, now - parse_duration(since), now, targets=settings.sla.targets)
        console.print(f"rollup rebuilt for the last {since} in {time.perf_counter() - t:.1f} s")
    finally:
        store.close()


@sla_app.command("counts")
def counts(ctx: typer.Context) -> None:
    """Exact (deduplicated) row counts per table."""
    from consumers import sla_queries

    store = _open(_settings(ctx))
    try:
        console.print_json(json.dumps(sla_queries.table_counts(store)))
    finally:
        store.close()


async def _planner_main(settings: Settings, once: bool, metrics_port: int,
                        metrics_host: str = "0.0.0.0") -> None:
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.planner import PlannerService, nats_publisher
    from streams.clock import SystemClock

    if not settings.sla.planner.pools:
        err.print("[red]no pools to plan: set sla.planner.pools in the settings file[/red]")
        raise typer.Exit(2)
    from consumers.health import Health, nats_check

    store = _open(settings, remote_ok=False)
    registry = CollectorRegistry()
    nc = await bus.connect(settings.nats, name="infernex-planner")
    try:
        from consumers.planner import follow_announcements
        from streams.backends import AnnouncedBackends
        from streams.topology import build_topology

        announced = AnnouncedBackends(SystemClock())  # current replicas: what the engines announce
        prefix = settings.nats.subject_prefix
        await follow_announcements(nc.jetstream(), announced, prefix=prefix, registry=registry,
                                   topology=build_topology(settings.topology, prefix))
        if once:
            await asyncio.sleep(1.0)  # the last announcement of every engine arrives first
        planner = PlannerService(store, settings.sla, clock=SystemClock(),
                                 publish=nats_publisher(nc.jetstream(), prefix),
                                 registry=registry, kube=_kube(settings), announced=announced)
        if once:
            for h in await planner.tick():
                console.print(f"{h.pool}/{h.role}: {h.current} -> {h.desired} ({h.mode}) {h.reason}")
            return
        health = Health("planner").add("nats", nats_check(nc))
        await _metrics_server(metrics_port or settings.sla.planner.metrics_port, registry, health, metrics_host)
        stop = asyncio.Event()
        _stop_on_signals(stop)
        await planner.run(stop)
    finally:
        await nc.drain()
        store.close()


def planner(
    ctx: typer.Context,
    once: bool = typer.Option(False, "--once", help="one planning round, print the hints, exit"),
    metrics_port: int = typer.Option(0, "--metrics-port", help="serve infernex_desired_replicas here"),
    metrics_host: str = typer.Option("0.0.0.0", "--metrics-host", help="address the metrics port binds"),
) -> None:
    """Publish replica hints for each PD pool from the SLA history (dry-run unless sla.planner.dry_run=false).

    With chDB the sink owns the data directory; run ``sla-sink --planner`` instead, or use a
    ClickHouse server backend.
    """
    settings = _settings(ctx)
    try:
        asyncio.run(_planner_main(settings, once, metrics_port, metrics_host))
    except ConnectionError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.add_typer(sla_app, name="sla")
    app.command("sla-sink")(sla_sink)
    app.command("planner")(planner)
