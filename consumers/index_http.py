"""The indexer's HTTP API: routes, and the guard in front of them.

The guard (plain ASGI, around every route) applies the router's key scheme -- when keys are
configured, every ``/v1/`` request needs ``Authorization: Bearer <key>`` (compared in constant
time; ``/health`` and ``/metrics`` stay open for probes and scrapes) --, refuses bodies over
``max_body_bytes`` (413, at the ``Content-Length`` or while reading) and bodies that do not
arrive within ``body_timeout_s`` (408). Under it, :class:`HeadTimeoutProtocol` closes a
connection whose request head has not arrived ``header_timeout_s`` after its first byte (or
after the connection opened): uvicorn itself waits forever for a slow head.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from consumers.index_api import QueryError, pods_body, record_route

_JSON = (b"content-type", b"application/json")
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


def _error(status: int, message: str, code: str) -> bytes:
    """An OpenAI-shaped error body."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


async def _send(send, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class HeadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus a deadline for each request head."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # noqa: ANN001
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if getattr(self, "_head_timer", None) is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def on_headers_complete(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:  # noqa: ANN001
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport is not None and not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:  # not inside a request being answered
                body = b"request head not received within timeout\n"
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()


def guarded(app, *, keys: list[bytes], max_body: int, body_timeout_s: float):  # noqa: ANN001, ANN201
    """ASGI middleware: auth, body size and body time limits; the inner app gets the body whole."""

    async def asgi(scope, receive, send):  # noqa: ANN001
        if scope["type"] != "http":
            return await app(scope, receive, send)
        path = scope["path"]
        if keys and path not in OPEN_PATHS:
            auth = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    auth = v
            if not auth.startswith(b"Bearer "):
                return await _send(send, 401, _error(401, "missing API key (Authorization: Bearer ...)",
                                                     "invalid_api_key"))
            token = auth[7:].strip()
            ok = False
            for k in keys:  # every key, each in constant time
                ok |= hmac.compare_digest(token, k)
            if not ok:
                return await _send(send, 401, _error(401, "invalid API key", "invalid_api_key"))
        for k, v in scope["headers"]:
            if k == b"content-length" and (not v.isdigit() or int(v) > max_body):
                return await _send(send, 413, _error(413, f"request body larger than {max_body} bytes",
                                                     "body_too_large"), [(b"connection", b"close")])
        parts: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body_timeout_s
        more = True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(0.001, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await _send(send, 408, _error(408, f"request body not received within {body_timeout_s:g}s",
                                                     "request_timeout"), [(b"connection", b"close")])
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > max_body:
                parts = []
                while more and loop.time() < deadline:  # drop the rest (not kept), so the client reads the 413
                    try:
                        msg = await asyncio.wait_for(receive(), max(0.001, deadline - loop.time()))
                    except asyncio.TimeoutError:
                        break
                    more = msg.get("more_body", False) and msg["type"] != "http.disconnect"
                return await _send(send, 413, _error(413, f"request body larger than {max_body} bytes",
                                                     "body_too_large"), [(b"connection", b"close")])
            parts.append(chunk)
        body = b"".join(parts)
        sent = False

        async def replay():  # noqa: ANN202
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await app(scope, replay, send)

    return asgi


def build_app(service: Any):  # noqa: ANN401, ANN201 - an IndexerService
    """The indexer's ASGI app, guarded as its config says."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    cfg = service.config

    async def route(request: Request):
        try:
            return JSONResponse(record_route(service.index, json.loads(await request.body()),
                                             max_ttl_s=cfg.max_route_ttl_s))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse({"error": f"invalid JSON: {exc}"}, status_code=400)
        except QueryError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)

    async def pods(request: Request):
        return JSONResponse(pods_body(service.index))

    async def health(request: Request):
        return JSONResponse(service.health())

    probes = service._probes()

    async def healthz(request: Request):
        status, body = await probes.report(ready=False)
        return JSONResponse(body, status_code=status)

    async def readyz(request: Request):
        status, body = await probes.report(ready=True)
        return JSONResponse(body, status_code=status)

    async def state(request: Request):
        return JSONResponse({"fingerprint": service.index.fingerprint(), "applied_seq": service.applied_seq})

    async def metrics(request: Request):
        if service.registry is None:
            return JSONResponse({"error": "no metrics registry"}, status_code=404)
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    app = Starlette(routes=[
        Route("/v1/index/route", route, methods=["POST"]),
        Route("/v1/index/pods", pods, methods=["GET"]),
        Route("/v1/index/state", state, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])

    async def asgi(scope, receive, send):  # noqa: ANN001
        # the hot path, POST /v1/index/query, as plain ASGI: no routing, request or response
        # objects (half the latency of a Starlette route); everything else goes to Starlette
        if scope["type"] != "http" or scope["path"] != "/v1/index/query":
            return await app(scope, receive, send)
        if scope["method"] != "POST":
            status, out = 405, b'{"error":"use POST"}'
        else:
            msg = await receive()  # the guard hands over the whole body at once
            status, out = service.query_json(msg.get("body", b""), "http")
        await _send(send, status, out)

    return guarded(asgi, keys=[k.encode() for k in cfg.load_api_keys()], max_body=cfg.max_body_bytes,
                   body_timeout_s=cfg.body_timeout_s)


async def serve(service: Any):  # noqa: ANN401, ANN201
    """Bind ``http_host:http_port`` and serve :func:`build_app`; returns ``(uvicorn server, task, port)``."""
    import uvicorn

    cfg = service.config
    family = socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: small responses must not wait for a delayed ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((cfg.http_host, cfg.http_port or 0))
    port = sock.getsockname()[1]
    proto = type("IndexerHttpProtocol", (HeadTimeoutProtocol,), {"header_timeout_s": cfg.header_timeout_s})
    ucfg = uvicorn.Config(build_app(service), log_level="warning", access_log=False, lifespan="off", http=proto,
                          timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024)
    server = uvicorn.Server(ucfg)
    server.install_signal_handlers = lambda: None  # the owner handles signals
    task = asyncio.create_task(server.serve(sockets=[sock]), name="indexer-http")
    for _ in range(200):
        if server.started:
            return server, task, port
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    raise RuntimeError("the HTTP server did not start")
