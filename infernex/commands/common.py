"""Helpers shared by the command modules (no commands of its own): one-line errors,
the one duration parser, port checks."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from datetime import datetime, timezone

import typer
from rich.console import Console

err = Console(stderr=True, highlight=False, soft_wrap=True)

NATS_HINT = ("is it running? start one with 'infernex up', or point at yours with "
             "INFERNEX_NATS__SERVERS=nats://HOST:4222 or nats.servers in the settings file")


def fail(message: str, *, code: int = 1):
    """Print ``error: message`` as one line on stderr and exit with ``code`` (no traceback)."""
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def nats_error(exc: BaseException) -> str:
    """The one line for an unreachable NATS: the address, the reason, and what to do."""
    text = str(exc).rstrip().rstrip(":") or type(exc).__name__
    return f"{text} ({NATS_HINT})"


def settle_gc() -> None:
    """For a long-running service once it has started: collect, then move every object alive now
    (imports, settings, compiled kernels' dispatchers, the restored index) out of the cyclic
    collector's scans, and collect the young generation less often. Without it, the collections
    that the hot path's allocations trigger rescan those ~150k start-up objects each time (measured
    in bench/ingest_path.py: 0.17-0.30 s of collector time in the indexer over one run; 0.006 s
    after). The process is ours; an application embedding these services decides for itself."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 1000)


def fast_loop_runner():
    """``uvloop.run`` when uvloop is installed (a faster event loop for the hot services: the KV
    bridge, the indexer), else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def run_async(coro, *, value_errors: bool = False, fast: bool = False):
    """Run ``coro`` (on uvloop with ``fast``, when installed); an unreachable NATS is a clear
    message and exit code 1 (and, with ``value_errors``, a ``ValueError`` is a usage error with
    exit code 2), not a traceback."""
    try:
        return (fast_loop_runner() if fast else asyncio.run)(coro)
    except ConnectionError as exc:
        fail(nats_error(exc))
    except ValueError as exc:
        if not value_errors:
            raise
        fail(str(exc), code=2)


# ---------------------------------------------------------------------------- durations

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|[smhdw])")


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``15m``, ``1h``, ``2d``, ``1w``, ``1h30m``, ``500ms`` or plain seconds.

    The one parser of every ``--since``/``--window`` style option; raises ``typer.BadParameter``.
    """
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = _PART.findall(t)
    if not parts or "".join(a + b for a, b in parts) != t:
        raise typer.BadParameter(f"{text!r} is not a duration like 90s, 15m, 1h30m, 2d")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_since(value: str, now: float | None = None) -> datetime:
    """A start time: a duration ago (``10m``, ``1h30m``, see :func:`parse_duration`) or ISO-8601."""
    now = time.time() if now is None else now
    try:
        secs = parse_duration(value)
    except typer.BadParameter:
        secs = None
    if secs is not None:
        return datetime.fromtimestamp(now - secs, tz=timezone.utc)
    try:
        dt = datetime.fromisoformat(value.strip())
    except ValueError:
        raise typer.BadParameter(f"{value!r} is neither a duration like 1h30m nor an ISO time "
                                 "like 2026-01-31T12:00:00Z") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


# ---------------------------------------------------------------------------- ports

def port_in_use(host: str, port: int) -> bool:
    """True if ``host:port`` cannot be bound now (something listens there)."""
    import socket

    if not port:
        return False
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def busy_port(what: str, host: str, port: int, option: str = "--port") -> str:
    return (f"{what}: port {port} on {host} is already in use (another infernex or nats-server?); "
            f"stop it, or choose another with {option} N ({option} 0 picks a free one)")
