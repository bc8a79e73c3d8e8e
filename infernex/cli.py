"""The ``infernex`` command line. Commands of each area live in :mod:`infernex.commands`.

Each module there defines ``register(app: typer.Typer)``; they are found automatically so
areas can add commands without editing this file.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

import infernex
from infernex import commands as _commands
from infernex.settings import Settings, load_settings

console = Console()
err_console = Console(stderr=True)

app = typer.Typer(
    name="infernex",
    help="InferNex: event-driven control plane for LLM inference clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or $INFERNEX_CONFIG)"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING ..."),
) -> None:
    overrides = {"log_level": log_level} if log_level else {}
    try:
        settings = load_settings(config, **overrides)
    except Exception as exc:  # noqa: BLE001 - shown to the user as a clear error
        from schemas.redact import redact

        err_console.print(f"[red]invalid settings:[/red] {redact(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from schemas.redact import install_log_redaction

    install_log_redaction()  # URLs with credentials, keys and tokens never reach a log line
    if settings.log_level.upper() != "DEBUG":
        for noisy in ("httpx", "httpcore", "aiohttp.access", "matplotlib"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    ctx.obj = settings


def settings_of(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    if obj is None:
        obj = load_settings()
    return obj


@app.command()
def version() -> None:
    """Print the InferNex version."""
    console.print(f"infernex {infernex.__version__}")


def _register_all() -> None:
    for mod in pkgutil.iter_modules(_commands.__path__):
        module = importlib.import_module(f"{_commands.__name__}.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
