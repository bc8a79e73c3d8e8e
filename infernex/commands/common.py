"""Helpers shared by the command modules (no commands of its own)."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console

err = Console(stderr=True)


def run_async(coro, *, value_errors: bool = False):
    """Run ``coro``; an unreachable NATS is a clear message and exit code 1 (and, with
    ``value_errors``, a ``ValueError`` is a usage error with exit code 2), not a traceback."""
    try:
        return asyncio.run(coro)
    except ConnectionError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    except ValueError as exc:
        if not value_errors:
            raise
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
