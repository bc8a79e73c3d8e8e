"""A small HTTP/1.1 server for the router's edge and the indexer's API: asyncio Protocol + httptools
(llhttp, as uvicorn).

aiohttp's web server spends ~40-60 µs of Python per request (request and response objects,
multidicts, router resolution, middleware chain, payload writers); the router's endpoints need
little of it. This server parses with httptools, reads the whole request body (bounded by
``max_body``, else 413) before calling the handler, and gives handlers three things:

``Request``         method, path, query, headers (lower-case names), remote address, ``body``
``Response``        status + bytes, written in one ``write`` with ``Content-Length``
``StreamResponse``  ``prepare`` / ``write`` / ``write_eof`` with chunked transfer encoding and
                    flow control (waits while the client is slow)

Keep-alive and pipelined requests are served in order; ``Expect: 100-continue`` is answered; a
``Content-Length`` over ``max_body`` is refused at the headers (413, then the rest of the upload is
read and dropped before closing, so the client sees the answer); request heads over 64 KiB get 431;
a client that goes away cancels its handler task (so the handler can cancel upstream work); idle
keep-alive connections are closed after ``keepalive_s`` (one that never sent a request after
``request_timeout_s``) by one sweeper task (no timer per request).
``Server.close`` stops listening, lets running handlers finish within a grace period and closes
the connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from email.utils import formatdate
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httptools
import msgspec

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_json_encode = msgspec.json.encode
MAX_HEAD_BYTES = 64 * 1024  # request line + headers; more is refused (431)
_date = [0, b""]
_TIMEOUT_BODY = (b'{"error": {"message": "request not received within timeout", "type": "invalid_request_error", '
                 b'"param": null, "code": "request_timeout"}}')
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))  # (second, "Date: ...\r\n"): formatted once a second


def _date_header() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date[1]


ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               408: "request_timeout", 413: "body_too_large", 429: "rate_limit_exceeded", 431: "headers_too_large",
               500: "internal_error", 502: "upstream_error", 503: "service_unavailable"}


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> "Response":
    """An OpenAI-shaped error answer (``{"error": {message, type, param, code}}``); ``code``
    defaults to the status's entry in :data:`ERROR_CODES`."""
    body = {"error": {"message": message, "type": type_, "param": param,
                      "code": code or ERROR_CODES.get(status, str(status))}}
    return Response(status, _json_encode(body), "application/json", headers)


class HttpError(Exception):
    """Raised by a handler or the server for a plain error answer (``status``, ``message``)."""

    def __init__(self, status: int, message: str = ""):
        super().__init__(message or _REASONS.get(status, b"error").decode())
        self.status = status
        self.message = str(self)


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "remote", "version", "keep_alive", "error",
                 "_store", "_proto")

    def __init__(self, proto: "_HttpProtocol", method: str, path: str, query: str, headers: dict[str, str],
                 body: bytes, version: str, keep_alive: bool):
        self._proto = proto
        self.method, self.path, self.query, self.headers = method, path, query, headers
        self.body, self.version, self.keep_alive = body, version, keep_alive
        self.remote = proto.remote
        self.error: HttpError | None = None  # set when the request cannot be served (body too large)
        self._store: dict[str, Any] = {}

    async def read(self) -> bytes:
        return self.body

    def __getitem__(self, key: str) -> Any:
        return self._store[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._store[key] = value


def _head(status: int, headers: dict[str, str]) -> bytearray:
    out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")))
    out += _date_header()
    for k, v in headers.items():
        out += k.encode("latin-1")
        out += b": "
        out += v.encode("latin-1")
        out += b"\r\n"
    return out


class Response:
    __slots__ = ("status", "body", "headers")
    prepared = False

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str | None = None,
                 headers: dict[str, str] | None = None):
        self.status = status
        self.body = body
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type

    def encode(self, keep_alive: bool, head_only: bool = False) -> bytes:
        out = _head(self.status, self.headers)
        out += b"Content-Length: %d\r\n" % len(self.body)
        if not keep_alive:
            out += b"Connection: close\r\n"
        out += b"\r\n"
        if not head_only:
            out += self.body
        return bytes(out)


class StreamResponse:
    """Chunked response written piece by piece; ``write`` waits while the client is slow."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None):
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.prepared = False
        self.finished = False
        self._proto: _HttpProtocol | None = None
        self._chunked = True

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        p = self._proto = request._proto
        self._chunked = request.version != "1.0"
        out = _head(self.status, self.headers)
        if self._chunked:
            out += b"Transfer-Encoding: chunked\r\n"
        if not request.keep_alive or not self._chunked:
            out += b"Connection: close\r\n"
            p.close_after = True
        out += b"\r\n"
        self.prepared = True
        p.send(bytes(out))
        await p.drain()

    async def write(self, data: bytes) -> None:
        if not data:
            return
        p = self._proto
        if p is None or p.closed:
            raise ConnectionResetError("client went away")
        p.send(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if p.paused:
            await p.drain()

    def send_now(self, data: bytes) -> bool:
        """:meth:`write` without waiting: True when the client is behind (its buffer full), so the
        writer should hold further data until :meth:`when_drained` calls back."""
        p = self._proto
        if p is None or p.closed:
            raise ConnectionResetError("client went away")
        p.send(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        return p.paused

    def when_drained(self, callback: Callable[[], None]) -> None:
        """``callback()`` once the client has caught up (at once if it has); not if it goes away."""
        p = self._proto
        if p is None or p.closed:
            return
        if not p.paused:
            callback()
            return
        if p._drain is None:
            p._drain = p.server.loop.create_future()
        p._drain.add_done_callback(lambda f: None if f.cancelled() or f.exception() else callback())

    async def write_eof(self) -> None:
        if self.finished:
            return
        self.finished = True
        p = self._proto
        if p is None or p.closed:
            raise ConnectionResetError("client went away")
        if self._chunked:
            p.send(b"0\r\n\r\n")
        await p.drain()


Handler = Callable[[Request], Awaitable[Any]]


class _HttpProtocol(asyncio.Protocol):
    __slots__ = ("server", "transport", "parser", "remote", "closed", "paused", "close_after", "_url", "_headers",
                 "_body", "_size", "_head_size", "_queue", "_task", "_drain", "_too_large", "idle_since", "_stopped",
                 "_discard", "reading_since", "fresh")

    def __init__(self, server: "Server"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        self.closed = False
        self.paused = False
        self.close_after = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._head_size = 0
        self._too_large = False
        self.idle_since = 0.0  # loop time when the connection last finished a request (0: busy or new)
        self.reading_since = 0.0  # loop time a request began arriving, until it is complete (0: none)
        self.fresh = True  # no request has begun on it yet
        self._stopped = False  # reading paused after an error: unread input may be pending
        self._discard = False  # lingering close: input is read and dropped
        self._queue: deque[Request | HttpError] = deque()
        self._task: asyncio.Task | None = None
        self._drain: asyncio.Future | None = None

    # -- transport ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        self.server._conns.add(self)
        self.idle_since = self.server.loop.time()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server._conns.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: cancel its handler
        self._wake_drain(ConnectionResetError("client went away"))

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(HttpError(400, "protocol upgrade is not supported"))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, HttpError) else HttpError(400, "malformed HTTP request"))
        except httptools.HttpParserError:
            self._fail(HttpError(400, "malformed HTTP request"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain(None)

    def _wake_drain(self, exc: Exception | None) -> None:
        d = self._drain
        if d is not None and not d.done():
            if exc is None:
                d.set_result(None)
            else:
                d.set_exception(exc)
        self._drain = None

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client went away")
        if not self.paused:
            return
        if self._drain is None:
            self._drain = self.server.loop.create_future()
        await self._drain

    def send(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    # -- httptools callbacks --------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.fresh = False
        self.idle_since = 0.0
        self.reading_since = self.server.loop.time()
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._head_size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            raise HttpError(431, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value)
        if self._head_size > MAX_HEAD_BYTES:
            raise HttpError(431, "request headers too large")
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        h = self._headers
        h[k] = f"{h[k]}, {v}" if k in h else v

    def on_headers_complete(self) -> None:
        h = self._headers
        cl = h.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.server.max_body:
            # answer 413 now rather than after reading a body we would throw away
            self._too_large = True
            self._queue_request()
            self._stop_reading()
        elif h.get("expect", "").lower() == "100-continue":
            self.send(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self.server.max_body:
            self._too_large = True
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._too_large and self.close_after:
            return  # already answered at the headers
        self._queue_request()

    def _queue_request(self) -> None:
        self.reading_since = 0.0
        p = self.parser
        url = self._url.decode("latin-1")
        path, _, query = url.partition("?")
        b = self._body
        body = b"" if not b else (b[0] if len(b) == 1 else b"".join(b))
        item = Request(self, p.get_method().decode("latin-1"), path, query, self._headers, body,
                       p.get_http_version(), p.should_keep_alive())
        if self._too_large:
            item.error = HttpError(413, "request body too large")
            self.close_after = True  # the rest of an oversized body is not worth reading
        self._queue.append(item)
        if self._task is None:
            self._task = self.server.loop.create_task(self._serve())

    def _stop_reading(self) -> None:
        self.close_after = True  # the connection closes after the queued answers
        self._stopped = True
        try:
            self.transport.pause_reading()  # nothing more will be parsed on this connection
        except RuntimeError:
            pass

    def _close(self) -> None:
        """Close; after an early error answer, linger: closing with unread input would send a
        reset that can make the client lose the answer, so drop input until it stops (max 2 s)."""
        t = self.transport
        if not self._stopped or t.is_closing():
            t.close()
            return
        self._discard = True
        try:
            if t.can_write_eof():
                t.write_eof()
            t.resume_reading()
        except (RuntimeError, OSError):
            t.close()
            return
        self.server.loop.call_later(2.0, t.close)

    def _fail(self, err: HttpError) -> None:
        if self.close_after and self._queue:
            return  # already failing
        self._stop_reading()
        self._queue.append(err)
        if self._task is None:
            self._task = self.server.loop.create_task(self._serve())

    # -- serving ---------------------------------------------------------------------------
    async def _serve(self) -> None:
        srv = self.server
        try:
            while self._queue and not self.closed:
                item = self._queue.popleft()
                srv.active += 1
                try:
                    if isinstance(item, HttpError):
                        resp = await srv.on_error(None, item)
                        keep = False
                        head_only = False
                    else:
                        resp = await srv.dispatch(item)
                        keep = item.keep_alive and not self.close_after and not srv.closing
                        head_only = item.method == "HEAD"
                finally:
                    srv.active -= 1
                if not isinstance(resp, Response) and not (isinstance(resp, StreamResponse) and resp.prepared):
                    log.error("handler for %s gave no response", getattr(item, "path", "?"))
                    resp = Response(500, b"internal server error: no response", "text/plain")
                if isinstance(resp, Response):
                    self.send(resp.encode(keep, head_only))
                elif not resp.finished and not self.closed:
                    try:
                        await resp.write_eof()
                    except ConnectionResetError:
                        pass
                if not keep or self.close_after:
                    self._close()
                    return
        except asyncio.CancelledError:
            pass  # the client went away
        finally:
            self._task = None
            if self._queue and not self.closed:  # a request arrived while the last one finished
                self._task = srv.loop.create_task(self._serve())
            else:
                self.idle_since = srv.loop.time()


class Server:
    """Routes ``(method, path) -> handler``; ``wrap`` is the one middleware (ids, auth, errors)."""

    def __init__(self, *, max_body: int = 4 * 1024 * 1024,
                 wrap: Callable[[Request, Handler], Awaitable[Any]] | None = None,
                 on_error: Callable[[Request | None, HttpError], Awaitable[Response]] | None = None,
                 keepalive_s: float = 75.0, request_timeout_s: float = 30.0):
        self.max_body = max_body
        self.keepalive_s = keepalive_s  # idle keep-alive connections are closed after this long
        # a request whose head and body have not all arrived this long after its first byte is
        # answered 408 and its connection closed (a client trickling bytes holds no socket forever)
        self.request_timeout_s = request_timeout_s
        self._sweeper: asyncio.Task | None = None
        self.routes: dict[str, dict[str, Handler]] = {}
        self.prefixes: list[tuple[str, dict[str, Handler]]] = []  # "/v1/models/" -> handlers (rest of path)
        self.wrap = wrap
        self._on_error = on_error
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_HttpProtocol] = set()
        self.active = 0
        self.closing = False

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})[method] = handler
        if method == "GET":
            self.routes[path].setdefault("HEAD", handler)

    def add_prefix(self, method: str, prefix: str, handler: Handler) -> None:
        """Route every path under ``prefix`` (looked up only when no exact route matches)."""
        for p, methods in self.prefixes:
            if p == prefix:
                methods[method] = handler
                return
        self.prefixes.append((prefix, {method: handler}))
        if method == "GET":
            self.prefixes[-1][1].setdefault("HEAD", handler)

    async def on_error(self, request: Request | None, err: HttpError) -> Response:
        if self._on_error is not None:
            return await self._on_error(request, err)
        return Response(err.status, err.message.encode(), "text/plain")

    async def _not_routed(self, request: Request) -> Any:
        if request.error is not None:
            raise request.error
        methods = self.routes.get(request.path)
        if methods is None:
            methods = self._prefixed(request.path)
        if methods is None:
            raise HttpError(404, f"no route for {request.path}")
        raise HttpError(405, f"method {request.method} not allowed on {request.path}")

    async def dispatch(self, request: Request) -> Any:
        methods = self.routes.get(request.path)
        if methods is None and self.prefixes:
            methods = self._prefixed(request.path)
        handler = methods.get(request.method) if methods else None
        if handler is None or request.error is not None:
            handler = self._not_routed
        try:
            if self.wrap is not None:
                return await self.wrap(request, handler)
            return await handler(request)
        except HttpError as e:
            return await self.on_error(request, e)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the connection silently
            log.exception("unhandled error on %s %s", request.method, request.path)
            return Response(500, b"internal server error", "text/plain")

    def _prefixed(self, path: str) -> dict[str, Handler] | None:
        for p, methods in self.prefixes:
            if path.startswith(p) and len(path) > len(p):
                return methods
        return None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _HttpProtocol(self), host, port, reuse_address=True)
        self._sweeper = self.loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[:2]

    async def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than ``keepalive_s`` (a connection that has
        sent nothing since it opened: ``request_timeout_s``), and answer 408 to requests still
        arriving after ``request_timeout_s`` (no timer per request)."""
        while True:
            await asyncio.sleep(min(5.0, self.keepalive_s / 2, self.request_timeout_s / 2))
            now = self.loop.time()
            limit = now - self.keepalive_s
            slow = now - self.request_timeout_s
            for c in list(self._conns):
                if c._task is not None or c.transport is None:
                    continue
                if c.idle_since and (c.idle_since < limit or (c.fresh and c.idle_since < slow)):
                    c.transport.close()  # idle past keep-alive, or opened and silent past the request timeout
                elif c.reading_since and c.reading_since < slow:
                    c.send(_TIMEOUT_408)
                    # linger: the client may still be sending; a close with unread input would
                    # reset the connection and the client would lose the answer
                    c.reading_since = 0.0
                    c._stopped = True
                    c.close_after = True
                    c._close()

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop listening; wait up to ``grace_s`` for running handlers; close every connection."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        end = self.loop.time() + grace_s if self.loop else 0
        while self.active and self.loop and self.loop.time() < end:
            await asyncio.sleep(0.02)
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.close()
            if c._task is not None and not c._task.done():
                c._task.cancel()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
