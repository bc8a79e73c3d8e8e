"""Health that checks something: ``/healthz`` (alive) and ``/readyz`` (ready) for every
long-running component, next to its ``/metrics``.

A :class:`Health` holds named checks; each returns a :class:`Check` (ok + what was seen).
``/healthz`` runs the liveness checks (the event loop answers and the component's tasks are
running); ``/readyz`` runs them all (NATS connected, the age of the last frame for a bridge, the
consumer lag of a fold ...). Each answers 200 or 503 with a JSON body naming every check, so a
probe failure says why. Any other path is a 404 (a probe on a typo fails instead of passing).

:func:`serve` mounts ``/metrics``, ``/healthz`` and ``/readyz`` on one aiohttp server inside the
component's event loop; :meth:`Health.report` serves the same bodies from another HTTP stack
(the indexer's Starlette app, the router's server).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_LAG = 10_000  # messages a durable consumer may be behind and still be ready


@dataclass
class Check:
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)


CheckFn = Callable[[], "Check | Awaitable[Check]"]


class Health:
    """Named checks of one component; ``live=True`` checks also decide ``/healthz``."""

    def __init__(self, component: str, *, expect: tuple[str, ...] = ("nats",), timeout_s: float = 2.0):
        self.component = component
        self.expect = expect  # checks that must be there before ready (added once connected)
        self.timeout_s = timeout_s
        self._checks: dict[str, tuple[CheckFn, bool]] = {}

    def add(self, name: str, fn: CheckFn, *, live: bool = False) -> "Health":
        self._checks[name] = (fn, live)
        return self

    @property
    def names(self) -> list[str]:
        return list(self._checks)

    async def report(self, *, ready: bool) -> tuple[int, dict[str, Any]]:
        """``(status, body)``: 200 if every check asked for passes, else 503."""
        body: dict[str, Any] = {"component": self.component, "checks": {}}
        ok = True
        for name, (fn, live) in self._checks.items():
            if not ready and not live:
                continue
            try:
                res = fn()
                if inspect.isawaitable(res):
                    res = await asyncio.wait_for(res, timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failing check is a failed probe, with the reason
                res = Check(False, {"error": f"{type(exc).__name__}: {exc}"[:300]})
            body["checks"][name] = {"ok": res.ok, **res.detail}
            ok = ok and res.ok
        if ready:
            for name in self.expect:
                if name not in self._checks:
                    body["checks"][name] = {"ok": False, "state": "starting"}
                    ok = False
        body["status"] = "ok" if ok else "fail"
        return (200 if ok else 503), body


# ---------------------------------------------------------------------------- checks

def nats_check(nc) -> CheckFn:  # noqa: ANN001 - a nats.aio.client.Client
    """Ready while the NATS client is connected (not reconnecting, not closed)."""

    def check() -> Check:
        url = getattr(nc, "connected_url", None)
        state = ("connected" if nc.is_connected else "reconnecting" if nc.is_reconnecting
                 else "closed" if nc.is_closed else "connecting")
        return Check(nc.is_connected, {"state": state, **({"server": url.netloc} if url else {})})

    return check


def age_check(last: Callable[[], float | None], *, max_age_s: float | None = None,
              clock: Callable[[], float] = time.monotonic, what: str = "last_frame") -> CheckFn:
    """The age of the last thing seen (``last()`` is a ``clock`` time, or None if nothing yet).

    With ``max_age_s`` an older (or missing) one fails; without, the age is only reported (an
    idle engine sends no KV events, which is not a fault of its bridge)."""

    def check() -> Check:
        t = last()
        age = None if t is None else round(clock() - t, 3)
        ok = max_age_s is None or (age is not None and age <= max_age_s)
        detail: dict[str, Any] = {f"{what}_age_s": age}
        if max_age_s is not None:
            detail["max_age_s"] = max_age_s
        return Check(ok, detail)

    return check


def tasks_check(tasks: Callable[[], list[asyncio.Task]]) -> CheckFn:
    """Alive while none of the component's tasks has ended (a crashed loop is not alive)."""

    def check() -> Check:
        ended = [t.get_name() for t in tasks() if t.done()]
        return Check(not ended, {"ended": ended} if ended else {})

    return check


def lag_check(js, durable_prefix: str, *, max_lag: int = DEFAULT_MAX_LAG) -> CheckFn:  # noqa: ANN001
    """Ready while every durable consumer named ``durable_prefix*`` is at most ``max_lag``
    messages behind its stream (pending delivery + delivered but not acknowledged)."""

    async def check() -> Check:
        lags: dict[str, int] = {}
        for stream in await js.streams_info():
            for ci in await js.consumers_info(stream.config.name):
                if ci.name and ci.name.startswith(durable_prefix):
                    lags[ci.name] = int(ci.num_pending or 0) + int(ci.num_ack_pending or 0)
        worst = max(lags.values(), default=0)
        ok = bool(lags) and worst <= max_lag
        detail: dict[str, Any] = {"consumer_lag": lags, "max_lag": max_lag}
        if not lags:
            detail["error"] = f"no durable consumer named {durable_prefix}* yet"
        return Check(ok, detail)

    return check


# ---------------------------------------------------------------------------- HTTP

async def serve(health: Health, port: int, *, host: str = "0.0.0.0", registry=None):  # noqa: ANN001
    """Serve ``/healthz``, ``/readyz`` (and ``/metrics`` of ``registry``) on ``host:port`` in this
    event loop; returns the aiohttp runner (``await runner.cleanup()`` to stop)."""
    from aiohttp import web

    async def healthz(_request: web.Request) -> web.Response:
        status, body = await health.report(ready=False)
        return web.json_response(body, status=status)

    async def readyz(_request: web.Request) -> web.Response:
        status, body = await health.report(ready=True)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def bound_port(runner) -> int:  # noqa: ANN001
    """The port a :func:`serve` runner listens on (for ``port=0``)."""
    return runner.addresses[0][1]
