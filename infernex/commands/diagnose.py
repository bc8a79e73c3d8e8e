"""``infernex diagnose``: the diagnosis service; ``diagnose check`` / ``diagnose explain`` for rule files
and the error-code catalog."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from streams.diagnosis.rules import RulesError, load_ruleset

console = Console()
err = Console(stderr=True)

diagnose_app = typer.Typer(help="Device diagnosis: telemetry -> findings (fault mode, severity, action).",
                           invoke_without_command=True)

RULES_OPT = typer.Option(None, "--rules", "-r", help="rule file merged over the built-in rules (repeatable)")


def _settings(ctx: typer.Context):
    from infernex.cli import settings_of

    return settings_of(ctx)


def _rules(files: list[Path]):
    try:
        return load_ruleset(files)
    except RulesError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@diagnose_app.callback()
def diagnose(
    ctx: typer.Context,
    rules: Optional[list[Path]] = RULES_OPT,
    metrics_port: Optional[int] = typer.Option(None, "--metrics-port", help="serve Prometheus /metrics here"),
    metrics_host: Optional[str] = typer.Option(None, "--metrics-host", help="address the metrics port binds"),
    durable: Optional[str] = typer.Option(None, "--durable", help="durable consumer name"),
    from_start: bool = typer.Option(False, "--from-start", help="a new durable reads the stored telemetry too"),
) -> None:
    """Run the diagnosis service: consume device.telemetry.>, publish diagnosis.<node>.<device>."""
    if ctx.invoked_subcommand is not None:
        return
    settings = _settings(ctx)
    update = {}
    if rules:
        update["rules_files"] = [*settings.diagnosis.rules_files, *rules]
    if metrics_port is not None:
        update["metrics_port"] = metrics_port
    if metrics_host is not None:
        update["metrics_host"] = metrics_host
    if durable:
        update["durable"] = durable
    if from_start:
        update["start"] = "all"
    cfg = settings.diagnosis.model_copy(update=update)
    ruleset = _rules(cfg.rules_files)

    async def run() -> None:
        from prometheus_client import CollectorRegistry

        from consumers.diagnosis import DiagnosisService
        from consumers.health import Health, lag_check, nats_check, serve, tasks_check
        from streams.topology import build_topology

        registry = CollectorRegistry()
        health = Health("diagnose", expect=("nats", "consumer_lag"))
        if cfg.metrics_port is not None:
            await serve(health, cfg.metrics_port, host=cfg.metrics_host, registry=registry)
            console.print(f"metrics and health on http://{cfg.metrics_host}:{cfg.metrics_port}"
                          "/metrics, /healthz, /readyz")
        svc = DiagnosisService(settings.nats, cfg, rules=ruleset, registry=registry,
                               topology=build_topology(settings.topology, settings.nats.subject_prefix))
        await svc.start()
        health.add("nats", nats_check(svc.nc)).add("consumer_lag", lag_check(svc.js, cfg.durable))
        console.print(f"[green]diagnosing[/green] {len(ruleset.models)} model rule sets, "
                      f"{len(ruleset.catalog.code_levels) + len(ruleset.catalog.error_codes)} Ascend codes, "
                      f"{len(ruleset.catalog.xids)} Xids; durable {cfg.durable}. Ctrl-C to stop.")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.create_task(svc.wait(), name="diagnosis")
        health.add("tasks", tasks_check(lambda: [waiter]), live=True)
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            await svc.stop()
            waiter.cancel()
        console.print(f"stopped; {svc.published} finding message(s) published.")

    try:
        asyncio.run(run())
    except (ConnectionError, RuntimeError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


@diagnose_app.command("check")
def check(
    rules: Optional[list[Path]] = typer.Argument(None, help="rule files to validate (merged in order)"),
    kind: str = typer.Option("npu", "--kind", help="npu or gpu"),
    model: Optional[str] = typer.Option(None, "--model", help="show the effective rules for this device model"),
) -> None:
    """Validate rule files against the built-in ones and print the effective rules for a device model."""
    rs = _rules(list(rules or []))
    dr = rs.for_device(kind, model)
    console.print(f"[green]ok[/green]: layers {['defaults', f'kinds.{kind}', *rs.match_models(model)]}")
    console.print_json(json.dumps({"timing": rs.timing.model_dump(), **dr.model_dump(mode="json")}))


@diagnose_app.command("explain")
def explain(
    code: str = typer.Argument(..., help="Ascend error code (0x80E01801) or xid:<n> (xid:79)"),
    rules: Optional[list[Path]] = RULES_OPT,
) -> None:
    """What an error code or Xid means, its severity and the suggested action."""
    cat = _rules(list(rules or [])).catalog
    if code.lower().startswith("xid:"):
        try:
            entry = cat.lookup_xid(int(code[4:]))
        except ValueError:
            err.print(f"[red]{code!r}: an Xid is a number, e.g. xid:79[/red]")
            raise typer.Exit(2) from None
        source = ["nvidia-xid"]
    else:
        try:
            entry = cat.lookup_code(code)
        except ValueError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        source = entry.source
    table = Table(show_header=False)
    for k, v in (("code", code), ("fault mode", entry.fault_mode), ("meaning", entry.meaning),
                 ("action level", entry.level), ("severity", cat.severity_of(entry.level, entry.severity)),
                 ("remediation", entry.remediation or "-"), ("source", ", ".join(source) or "-")):
        table.add_row(k, str(v))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(diagnose_app, name="diagnose")
