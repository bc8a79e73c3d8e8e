"""``infernex demo``: the one-machine showcase (see :mod:`infernex.demo`)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

# piped into a file or CI log, rich would wrap the comparison table at 80 columns
console = Console() if sys.stdout.isatty() else Console(width=160)


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)


def demo(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Mooncake-format trace (default: the shared one)"),
    requests: int = typer.Option(150, "--requests", "-n", help="requests replayed per strategy"),
    offset: Optional[int] = typer.Option(None, "--offset", help="first trace row (default: the last N rows)"),
    time_scale: float = typer.Option(4.0, "--time-scale", help="simulated time runs K x faster than wall time"),
    engines: int = typer.Option(8, "--engines", help="aggregated engines (the PD group comes on top)"),
    prefill: int = typer.Option(2, "--prefill", help="prefill engines of the PD group"),
    decode: int = typer.Option(2, "--decode", help="decode engines of the PD group"),
    strategies: list[str] = typer.Option(["round-robin", "least-load", "kv-aware", "pd-kv-aware"], "--strategy", "-s",
                                         help="strategies to compare (repeat)"),
    max_output_tokens: int = typer.Option(64, "--max-output-tokens", help="cap on generated tokens per request"),
    out: Path = typer.Option(Path("infernex-demo"), "--out", help="report directory"),
    services: bool = typer.Option(True, "--services/--no-services",
                                  help="also run the metrics and NPU collectors, diagnosis engine and SLA sink"),
    incident: bool = typer.Option(True, "--incident/--no-incident",
                                  help="end with a critical NPU fault under one engine (needs --services)"),
    pd_loop: bool = typer.Option(True, "--pd-loop/--no-pd-loop",
                                 help="then the PD sizing loop and PD-vs-aggregated goodput, in virtual time "
                                      "(needs --services: the planner reads the demo's ClickHouse)"),
) -> None:
    """Start NATS, simulated engines, KV bridges, indexer and router; replay a trace slice under
    several strategies; print a comparison and write a report (PNG + HTML)."""
    from infernex.demo import DEFAULT_TRACE, DemoConfig, run_demo, tally_warnings

    cfg = DemoConfig(trace=trace or DEFAULT_TRACE, requests=requests, offset=offset, time_scale=time_scale,
                     engines=engines, prefill=prefill, decode=decode, strategies=list(strategies),
                     max_output_tokens=max_output_tokens, out=out, services=services, incident=incident,
                     pd_loop=pd_loop)
    if not cfg.trace.is_file():
        from infernex.commands.common import fail

        fail(f"trace {cfg.trace} not found; pass --trace FILE", code=2)
    cfg.out.mkdir(parents=True, exist_ok=True)

    async def go():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # `kill -USR1 PID`: where is it waiting?
        return await run_demo(cfg, console, stop, tally)

    with tally_warnings(cfg.out / "warnings.log") as tally:
        result = asyncio.run(go())
    console.print(tally.summary(cfg.out / "warnings.log"), soft_wrap=True, highlight=False)
    if not result["results"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(demo)
