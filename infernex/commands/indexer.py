"""``infernex indexer``: the cache-indexer service (see :mod:`consumers.indexer`)."""

from __future__ import annotations

import asyncio
import signal
from typing import Optional

import typer
from rich.console import Console

from infernex.commands.common import settle_gc

console = Console()
err = Console(stderr=True)


def indexer(
    ctx: typer.Context,
    http_port: Optional[int] = typer.Option(None, "--http-port", help="HTTP port (0 = free; default from settings)"),
    http_host: Optional[str] = typer.Option(None, "--http-host", help="address the HTTP API binds (default 127.0.0.1)"),
    durable: Optional[str] = typer.Option(None, "--durable", help="durable consumer name (one per instance)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="'simple' or a local tokenizer.json path, for prompt queries"),
    snapshot_every_events: Optional[int] = typer.Option(None, "--snapshot-every-events"),
    snapshot_every_s: Optional[float] = typer.Option(None, "--snapshot-every-s"),
) -> None:
    """Fold kv.events.> into the global KV-cache index and answer queries (HTTP and NATS)."""
    from prometheus_client import CollectorRegistry

    from consumers.indexer import IndexerService
    from infernex.cli import settings_of

    settings = settings_of(ctx)
    overrides = {k: v for k, v in {
        "http_port": http_port, "http_host": http_host, "durable": durable, "tokenizer": tokenizer,
        "snapshot_every_events": snapshot_every_events, "snapshot_every_s": snapshot_every_s,
    }.items() if v is not None}
    cfg = settings.indexer.model_copy(update=overrides)
    cfg = type(cfg).model_validate(cfg.model_dump())  # validate the overrides
    tok = None
    if cfg.tokenizer:
        from simulator.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(cfg.tokenizer, fast=True)  # the query path: tiktoken where it gives the same ids
        except Exception as exc:  # noqa: BLE001 - shown to the user
            err.print(f"[red]cannot load tokenizer {cfg.tokenizer!r}: {exc}[/red]")
            raise typer.Exit(2) from None

    async def run() -> None:
        from streams.topology import build_topology

        # the snapshot bucket follows topology.replicas like every stream
        topo = build_topology(settings.topology, prefix=settings.nats.subject_prefix)
        service = IndexerService(cfg, settings.nats, registry=CollectorRegistry(), tokenizer=tok, topology=topo)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.request_stop)
        await service.start()
        settle_gc()  # the restored index and start-up objects out of the cyclic GC's rescans
        where = f"http://{cfg.http_host}:{service.http_port}" if service.http_port else "no HTTP"
        print(f"indexer ready: {where} stream={service.stream} from_seq={service.applied_seq + 1} "
              f"restored_batches={service.restored_batches}", flush=True)
        try:
            await service.run_forever()
        finally:
            await service.stop()
            print("indexer stopped", flush=True)

    try:
        import uvloop  # optional: a faster event loop (nats-py and the HTTP server) when installed

        run_loop = uvloop.run
    except ImportError:
        run_loop = asyncio.run
    try:
        run_loop(run())
    except (ConnectionError, RuntimeError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.command()(indexer)
