"""A small control API over a running :class:`simulator.cluster.SimCluster`: list its engines
and set the number of engines per role at run time, so the planner can actuate a local cluster
the way it patches a Deployment or a Kthena ModelServing role.

    GET  /control/engines               -> {"engines": [{engine_id, role, url, group}], "replicas": {role: n}}
    GET  /control/replicas/{role}       -> {"role": "prefill", "replicas": 2}
    PUT  /control/replicas/{role}       <- {"replicas": 3}   (also POST /control/scale {role, replicas})

Roles are the router's names (``prefill``, ``decode``, ``aggregated``). A new engine copies the
configuration of the role's template (``templates[role]``, else its newest engine) under a fresh
id ``<prefix>-<role>-<n>``; removing takes the newest engines first, each leaving the peer map at
once, finishing its requests and handing out its prefilled KV (bounded) before it stops.
``listeners`` hear every change (``(added, removed)`` lists of engine dicts) - the one-machine
launcher feeds them to the router's backends.

The server runs on the cluster's own event loop (``SimControl.start`` is called through
``SimCluster.run``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from simulator.cluster import EngineHandle, SimCluster
from simulator.config import EngineConfig

log = logging.getLogger(__name__)

ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode", "aggregated": "aggregated", "kv_both": "aggregated"}
Listener = Callable[[list[dict], list[dict]], None]


def engine_role(cfg: EngineConfig) -> str:
    return ROLE_OF[cfg.role]


class SimControl:
    def __init__(self, cluster: SimCluster, *, templates: dict[str, EngineConfig] | None = None,
                 groups: dict[str, str] | None = None, prefix: str = "sim", max_per_role: int = 32,
                 drain_s: float = 30.0):
        self.cluster = cluster
        self.templates = dict(templates or {})
        self.groups = dict(groups or {})  # engine id -> PD group, for the engine list
        self.prefix = prefix
        self.max_per_role = max_per_role
        self.drain_s = drain_s
        self.listeners: list[Listener] = []
        self._seq = itertools.count(len(cluster.engines))
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self.group_of_role: dict[str, str] = {}  # default group for engines a role gains

    # -- the model -----------------------------------------------------------------------
    def describe(self, h: EngineHandle) -> dict[str, Any]:
        cfg = h.engine.config
        role = engine_role(cfg)
        return {"engine_id": h.engine_id, "role": role, "url": h.url, "model": cfg.served_model_name,
                "group": self.groups.get(h.engine_id, self.group_of_role.get(role))}

    def engines(self, role: str | None = None) -> list[EngineHandle]:
        return [h for h in self.cluster.engines if role is None or engine_role(h.engine.config) == role]

    def replicas(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.cluster.engines:
            r = engine_role(h.engine.config)
            out[r] = out.get(r, 0) + 1
        return out

    async def scale(self, role: str, replicas: int) -> dict[str, Any]:
        if role not in ("prefill", "decode", "aggregated"):
            raise ValueError(f"unknown role {role!r}: prefill, decode or aggregated")
        if not 0 <= replicas <= self.max_per_role:
            raise ValueError(f"replicas must be within [0, {self.max_per_role}]")
        async with self._lock:
            have = self.engines(role)
            added, removed = [], []
            if replicas > len(have):
                tmpl = self.templates.get(role) or (have[-1].engine.config if have else None)
                if tmpl is None:
                    raise ValueError(f"no {role} engine or template to copy")
                for _ in range(replicas - len(have)):
                    eid = f"{self.prefix}-{role}-{next(self._seq)}"
                    h = await self.cluster.add_engine(tmpl.model_copy(update={"engine_id": eid}))
                    added.append(self.describe(h))
            elif replicas < len(have):
                victims = have[replicas:]
                removed = [self.describe(h) for h in victims]
                self._notify([], removed)  # first: no new requests go there while it drains
                await asyncio.gather(*(self.cluster.remove_engine(h.engine_id, self.drain_s) for h in victims))
            if added:
                self._notify(added, [])
            if added or removed:
                log.info("simulator %s: %d -> %d engines", role, len(have), replicas)
            return {"role": role, "replicas": len(self.engines(role)), "added": added, "removed": removed}

    def _notify(self, added: list[dict], removed: list[dict]) -> None:
        for f in self.listeners:
            try:
                f(added, removed)
            except Exception:  # noqa: BLE001 - a listener must not break scaling
                log.exception("simulator control listener failed")

    # -- HTTP ------------------------------------------------------------------------------
    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"engines": [self.describe(h) for h in self.cluster.engines],
                                  "replicas": self.replicas()})

    async def _get(self, request: web.Request) -> web.Response:
        role = request.match_info["role"]
        return web.json_response({"role": role, "replicas": len(self.engines(role))})

    async def _set(self, request: web.Request, role: str | None = None) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        role = role or body.get("role")
        n = body.get("replicas")
        if not isinstance(n, int) or isinstance(n, bool):
            return _error(400, "'replicas' must be an integer")
        if request.query.get("dryRun") == "All":
            if role not in ("prefill", "decode", "aggregated") or not 0 <= n <= self.max_per_role:
                return _error(400, f"invalid role {role!r} or replicas {n}")
            return web.json_response({"role": role, "replicas": len(self.engines(role)), "dry_run": True})
        try:
            return web.json_response(await self.scale(str(role), n))
        except ValueError as exc:
            return _error(400, str(exc))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/control/engines", self._list)
        app.router.add_get("/control/replicas/{role}", self._get)
        app.router.add_put("/control/replicas/{role}", lambda r: self._set(r, r.match_info["role"]))
        app.router.add_post("/control/scale", self._set)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        p = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://{host}:{p}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                             status=status)
