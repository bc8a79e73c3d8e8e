"""``infernex router``: run hermes-router (OpenAI-compatible, strategy plugins, PD proxy)."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True)
log = logging.getLogger("infernex.router")


def _parse_backend(spec: str):
    """``pod=url@model[:role[:group]]``, e.g. ``p0=http://127.0.0.1:8001@m:prefill:g1``."""
    from router.config import StaticBackend

    try:
        pod, rest = spec.split("=", 1)
        url, _, tail = rest.partition("@")
        model, *more = tail.split(":") if tail else [""]
        return StaticBackend(pod=pod, url=url, model=model, role=more[0] if more else "aggregated",
                             group=more[1] if len(more) > 1 else None)
    except ValueError as exc:
        from schemas.redact import redact

        raise typer.BadParameter(redact(f"backend {spec!r}: expected pod=url@model[:role[:group]] ({exc})")) from None


def router_cmd(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (section 'router:')"),
    host: Optional[str] = typer.Option(None, "--host"),
    port: Optional[int] = typer.Option(None, "--port", help="0 picks a free port"),
    epp_port: Optional[int] = typer.Option(None, "--epp-port",
                                           help="also serve the GIE endpoint picker (Envoy ext_proc gRPC) here"),
    profile: Optional[str] = typer.Option(None, "--profile", "--strategy",
                                          help="built-in strategy (kv-aware, round-robin, ...) or a YAML file"),
    backend: list[str] = typer.Option([], "--backend", "-b", help="static backend pod=url@model[:role[:group]]"),
    pool: Optional[str] = typer.Option(None, "--pool"),
    selector: Optional[str] = typer.Option(None, "--selector", help="label selector of the engine pods (Kubernetes)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="'simple' or a tokenizer.json path"),
    no_bus: bool = typer.Option(False, "--no-bus", help="no NATS: static backends only, no records"),
    list_strategies: bool = typer.Option(False, "--list-strategies", help="print the built-in strategies"),
) -> None:
    """Run the router until SIGTERM/Ctrl-C, then drain in-flight requests and exit."""
    from infernex.cli import settings_of
    from infernex.settings import load_settings
    from router.profiles import builtin_names, load_strategy

    if list_strategies:
        for n in builtin_names():
            console.print(f"{n:<18} {load_strategy(n).description}")
        return
    try:
        settings = load_settings(config) if config else settings_of(ctx)
    except ValueError as exc:  # SettingsError: one line naming the file and key
        from infernex.commands.common import fail

        fail(f"invalid settings: {exc}", code=2)
    cfg = settings.router
    upd: dict = {}
    if host is not None:
        upd["host"] = host
    if port is not None:
        upd["port"] = port
    if epp_port is not None:
        upd["epp_port"] = epp_port
    if profile is not None:
        upd["strategy"] = profile
    if pool is not None:
        upd["pool"] = pool
    if selector is not None:
        upd["kubernetes"] = cfg.kubernetes.model_copy(update={"label_selector": selector})
    if tokenizer is not None:
        upd["tokenizer"] = tokenizer
    if no_bus:
        upd["bus"] = False
    if backend:
        upd["backends"] = list(cfg.backends) + [_parse_backend(b) for b in backend]
    cfg = cfg.model_copy(update=upd)
    try:
        load_strategy(cfg.strategy)
        cfg.load_api_keys()
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    try:
        import uvloop  # optional: a faster event loop when installed

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    from infernex.commands.common import busy_port, fail, nats_error, port_in_use

    if port_in_use(cfg.host, cfg.port):
        fail(busy_port("cannot start the router", cfg.host, cfg.port))
    try:
        run(_serve(cfg, settings.nats))
    except ConnectionError as exc:
        fail(nats_error(exc) + "; or use --no-bus to run without NATS")
    except OSError as exc:  # the port was taken between the check and the bind
        if exc.errno == errno.EADDRINUSE:
            fail(busy_port("cannot start the router", cfg.host, cfg.port))
        fail(f"cannot start the router on {cfg.host}:{cfg.port}: {exc.strerror or exc}")


async def _serve(cfg, nats_cfg) -> None:
    from router.app import RouterApp

    app = RouterApp(cfg, nats_cfg if cfg.bus else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        url = await app.start()
    except BaseException:
        await app.stop(drain=False)
        raise
    from infernex.commands.common import settle_gc

    settle_gc()
    console.print(f"[green]hermes-router[/green] on {url}  strategy={cfg.strategy} pool={cfg.pool} "
                  f"backends={len(app.state.snapshot())} bus={'on' if cfg.bus else 'off'}"
                  + (f" epp=grpc://{cfg.host}:{app.epp.port}" if app.epp else ""), highlight=False)
    await stop.wait()
    console.print(f"draining {app.service.inflight} in-flight request(s) ...")
    drained = await app.stop(drain=True)
    console.print("stopped." if drained else "[yellow]stopped; drain timed out[/yellow]")


def register(app: typer.Typer) -> None:
    app.command("router")(router_cmd)
