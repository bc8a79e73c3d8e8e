"""The indexer's HTTP API on the project's own HTTP server (:mod:`consumers.http`, as the router's).

Routes: ``POST /v1/index/query`` (the hot path), ``POST /v1/index/route``, ``GET /v1/index/pods``,
``GET /v1/index/state``, and the open probes ``/health``, ``/healthz``, ``/readyz``, ``/metrics``.

In front of them: the router's key scheme (when keys are configured, every ``/v1/`` request
needs ``Authorization: Bearer <key>``, compared in constant time with every key; the probes stay
open for kubelets and scrapers), bodies over ``max_body_bytes`` refused (413, at the
``Content-Length`` or while reading), a request whose head and body have not all arrived within
``header_timeout_s + body_timeout_s`` of its first byte answered 408 and its connection closed,
and a connection that sends nothing for that long closed. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import msgspec

from consumers.http import HttpError, Request, Response, Server, error_response
from consumers.index_api import QueryError, pods_body, record_route

OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})
_JSON = "application/json"
_encode = msgspec.json.Encoder().encode


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status, _encode(obj), _JSON)


def build_server(service: Any) -> Server:  # noqa: ANN401 - an IndexerService
    """The indexer's routes on a :class:`consumers.http.Server`, guarded as its config says."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    cfg = service.config
    keys = [k.encode() for k in cfg.load_api_keys()]

    async def guard(request: Request, handler):  # noqa: ANN001, ANN202
        if keys and request.path not in OPEN_PATHS:
            auth = request.headers.get("authorization", "")
            if not auth.startswith("Bearer "):
                return error_response(401, "missing API key (Authorization: Bearer ...)")
            token = auth[7:].strip().encode()
            ok = False
            for k in keys:  # every key, each in constant time
                ok |= hmac.compare_digest(token, k)
            if not ok:
                return error_response(401, "invalid API key")
        return await handler(request)

    async def on_error(request: Request | None, e: HttpError) -> Response:
        if e.status == 413:
            return error_response(413, f"request body larger than {cfg.max_body_bytes} bytes")
        return error_response(e.status, e.message)

    async def query(request: Request) -> Response:
        status, out = service.query_json(request.body, "http")
        return Response(status, out, _JSON)

    async def route(request: Request) -> Response:
        try:
            return _json(record_route(service.index, json.loads(request.body), max_ttl_s=cfg.max_route_ttl_s))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _json({"error": f"invalid JSON: {exc}"}, 400)
        except QueryError as exc:
            return _json({"error": str(exc)}, exc.status)

    async def pods(request: Request) -> Response:
        return _json(pods_body(service.index))

    async def state(request: Request) -> Response:
        return _json({"fingerprint": service.index.fingerprint(), "applied_seq": service.applied_seq})

    async def health(request: Request) -> Response:
        return _json(service.health())

    probes = service._probes()

    async def healthz(request: Request) -> Response:
        status, body = await probes.report(ready=False)
        return _json(body, status)

    async def readyz(request: Request) -> Response:
        status, body = await probes.report(ready=True)
        return _json(body, status)

    async def metrics(request: Request) -> Response:
        if service.registry is None:
            return _json({"error": "no metrics registry"}, 404)
        return Response(200, generate_latest(service.registry), CONTENT_TYPE_LATEST)

    srv = Server(max_body=cfg.max_body_bytes, wrap=guard, on_error=on_error, keepalive_s=5.0,
                 request_timeout_s=cfg.header_timeout_s + cfg.body_timeout_s)
    srv.add("POST", "/v1/index/query", query)
    srv.add("POST", "/v1/index/route", route)
    srv.add("GET", "/v1/index/pods", pods)
    srv.add("GET", "/v1/index/state", state)
    srv.add("GET", "/health", health)
    srv.add("GET", "/healthz", healthz)
    srv.add("GET", "/readyz", readyz)
    srv.add("GET", "/metrics", metrics)
    return srv


async def serve(service: Any) -> tuple[Server, int]:  # noqa: ANN401
    """Bind ``http_host:http_port`` and serve the routes; returns ``(server, port)``."""
    cfg = service.config
    srv = build_server(service)
    _, port = await srv.start(cfg.http_host, cfg.http_port or 0)
    return srv, port
