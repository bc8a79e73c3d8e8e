"""The hot path to the engines: a lean pooled HTTP/1.1 client (asyncio Protocol + httptools).

aiohttp's client spends ~100-150 µs of Python per request (request/response objects, yarl URLs,
multidict headers, cookie jar, tracing, timers). This client does what the proxy needs and no
more: one ``write`` per request, the response parsed by llhttp (httptools, C), keep-alive
connections pooled per backend, the body read once (non-streamed) or passed on chunk by chunk
(SSE), a connect timeout and a read timeout (longest silence), and ``close()`` that drops the
connection so the engine sees the cancel.

Errors are :class:`UpstreamError` with ``kind`` ``connect`` (no connection, or a reused keep-alive
connection the engine had closed: retried once on a fresh one), ``read`` (the connection broke
mid-response, or the response is not HTTP) or ``timeout``.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 256 * 1024  # buffered body bytes before the socket is paused (slow client)


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Target:
    """A backend base URL, parsed once."""

    __slots__ = ("key", "host", "port", "ssl", "prefix", "host_header", "idle")

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"backend URL {base_url!r}: expected http(s)://host[:port][/prefix]")
        self.ssl = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.ssl else 80)
        self.prefix = u.path.rstrip("/").encode()
        default = (self.port == 443) if self.ssl else (self.port == 80)
        hh = self.host if ":" not in self.host else f"[{self.host}]"
        self.host_header = (hh if default else f"{hh}:{self.port}").encode("idna")
        self.key = (self.host, self.port, self.ssl)
        self.idle: deque[_Conn] = deque()


class _Conn(asyncio.Protocol):
    __slots__ = ("transport", "parser", "resp", "closed", "idle_since", "paused")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self.paused = False

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:  # bytes on an idle connection: not HTTP we can use
            self.transport.close()
            return
        r.nbytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            r._fail(UpstreamError("read", f"bad HTTP response: {exc}"))
            self.transport.close()
        if r._flush is not None:  # piping: what this read carried goes on in one piece
            r._flush_out()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.resp
        if r is not None and not r.complete:
            if r.until_eof and exc is None:
                r.complete = True
                r._wake()
            else:
                kind = "connect" if r.nbytes == 0 else "read"
                r._fail(UpstreamError(kind, "connection closed by the backend" if exc is None
                                      else f"connection lost: {type(exc).__name__}"))

    def pause_writing(self) -> None:  # request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.resp
        r.status = self.parser.get_status_code()
        h = r.headers
        if "content-length" not in h and "chunked" not in h.get("transfer-encoding", "") \
                and r.status not in (204, 304) and r.status >= 200:
            r.until_eof = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.resp
        if r._sink is not None:
            r._to_sink(body)
            return
        r.chunks.append(body)
        r.buffered += len(body)
        if r.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        r._wake()

    def on_message_complete(self) -> None:
        r = self.resp
        r.complete = True
        r.keep_alive = self.parser.should_keep_alive() and not r.until_eof
        r._wake()


class UpstreamResponse:
    """Status and headers on return from :meth:`UpstreamPool.post`; then ``read()`` or ``iter_any()``."""

    __slots__ = ("_conn", "_pool", "_target", "status", "headers", "chunks", "buffered", "nbytes", "complete",
                 "keep_alive", "until_eof", "_exc", "_waiter", "_done", "_sink", "_flush", "_last", "_timer")

    def __init__(self, conn: _Conn, pool: "UpstreamPool", target: _Target):
        self._conn, self._pool, self._target = conn, pool, target
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.nbytes = 0
        self.complete = False
        self.keep_alive = False
        self.until_eof = False
        self._exc: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._sink: Callable[[bytes], bool] | None = None  # pipe(): body bytes go straight to it
        self._flush: Callable[[], None] | None = None  # pipe(): called after each read's bytes went to the sink
        self._last = 0.0  # pipe(): loop time of the last body bytes
        self._timer: asyncio.TimerHandle | None = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: UpstreamError) -> None:
        self._exc = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    async def _wait(self) -> None:
        """Until the protocol wakes us (data, completion, error) or the read timeout passes."""
        if self._exc is not None:
            raise self._exc
        loop = self._pool.loop
        w = self._waiter = loop.create_future()
        timer = loop.call_later(self._pool.read_timeout, self._timeout, w)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None

    def _timeout(self, w: asyncio.Future) -> None:
        if not w.done():
            w.set_exception(UpstreamError("timeout", f"no data from the backend for {self._pool.read_timeout:g} s"))

    def _take(self) -> bytes:
        ch = self.chunks
        data = ch[0] if len(ch) == 1 else b"".join(ch)
        ch.clear()
        self.buffered = 0
        c = self._conn
        if c.paused:
            c.paused = False
            c.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body (waits for the end of the response)."""
        while not self.complete:
            await self._wait()
        return self._take() if self.chunks else b""

    async def iter_any(self):
        """Body bytes as they arrive (already de-chunked), until the response ends."""
        while True:
            if self.chunks:
                yield self._take()
            elif self.complete:
                return
            else:
                await self._wait()

    async def pipe(self, sink: Callable[[bytes], bool], flush: Callable[[], None] | None = None) -> None:
        """Body bytes (de-chunked) to ``sink`` as they arrive, called from the connection's own
        callback: no future, timer or task switch per chunk, which a token-by-token stream would pay
        for every token. Returns when the response ends or ``sink`` returns False (the caller then
        closes or releases the response); raises what ended it otherwise (an :class:`UpstreamError`,
        or what ``sink`` or ``flush`` raised). The read timeout is the longest silence, as in
        :meth:`read`. While piping, a slow reader downstream holds the engine back with
        :meth:`pause` / :meth:`resume`.

        ``flush()``, when given, is called once after each read from the engine's socket has gone to
        ``sink`` (a read holds as many chunks as the engine wrote since the last one, e.g. several
        tokens' events when the router ran late): a sink that gathers what it passes on and writes it
        in ``flush`` makes one write to its client per read instead of one per chunk."""
        if self.chunks:
            go_on = sink(self._take())
            if flush is not None:
                flush()
            if go_on is False:
                return
        if self._exc is not None:
            raise self._exc
        if self.complete:
            return
        loop = self._pool.loop
        w = self._waiter = loop.create_future()
        self._sink, self._flush = sink, flush
        self._last = loop.time()
        self._timer = loop.call_at(self._last + self._pool.read_timeout, self._silence, w)
        try:
            await w
        finally:
            self._sink = self._flush = None
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _to_sink(self, body: bytes) -> None:
        """(from the protocol) body bytes while piping."""
        self._last = self._pool.loop.time()
        try:
            go_on = self._sink(body)
        except Exception as exc:  # noqa: BLE001 - the sink's error ends pipe() with it
            self._ended(exc)
            return
        if go_on is False:
            self._sink = None
            self._wake()

    def _flush_out(self) -> None:
        """(from the protocol) a read's bytes have all gone to the sink."""
        try:
            self._flush()
        except Exception as exc:  # noqa: BLE001 - as the sink's: it ends pipe() with it
            self._ended(exc)

    def _ended(self, exc: Exception) -> None:
        self._sink = self._flush = None
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def _silence(self, w: asyncio.Future) -> None:
        if w.done():
            return
        loop = self._pool.loop
        due = self._last + self._pool.read_timeout
        if loop.time() < due:  # bytes came since the timer was set: wait for the rest of the silence
            self._timer = loop.call_at(due, self._silence, w)
            return
        self._timer = None
        w.set_exception(UpstreamError("timeout", f"no data from the backend for {self._pool.read_timeout:g} s"))

    def pause(self) -> None:
        """Stop reading from the engine (the reader downstream is behind)."""
        c = self._conn
        if not c.paused and not c.closed:
            c.paused = True
            c.transport.pause_reading()

    def resume(self) -> None:
        c = self._conn
        if c.paused and not c.closed:
            c.paused = False
            c.transport.resume_reading()

    def at_eof(self) -> bool:
        return self.complete and not self.chunks

    def release(self) -> None:
        """Back to the pool if the response was read to its end and the connection may be reused."""
        if self._done:
            return
        self._done = True
        c = self._conn
        c.resp = None
        if self.complete and self.keep_alive and not self.chunks and not c.closed:
            self._pool._put(self._target, c)
        else:
            c.transport.close()

    def close(self) -> None:
        """Drop the connection (the engine sees the client going away)."""
        if self._done:
            return
        self._done = True
        self._conn.resp = None
        self._conn.transport.close()


class UpstreamPool:
    """Keep-alive connections per backend; ``post()`` sends a request and returns at the headers."""

    def __init__(self, *, connect_timeout: float = 2.0, read_timeout: float = 300.0, keepalive_s: float = 15.0,
                 max_idle_per_backend: int = 256):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle_per_backend
        self._targets: dict[str, _Target] = {}
        self._ssl: _ssl.SSLContext | None = None
        self.loop = asyncio.get_running_loop()
        self.connects = 0  # new TCP connections opened (for tests and metrics)

    def target(self, base_url: str) -> _Target:
        t = self._targets.get(base_url)
        if t is None:
            t = self._targets[base_url] = _Target(base_url)
        return t

    def _put(self, t: _Target, c: _Conn) -> None:
        if len(t.idle) >= self.max_idle:
            c.transport.close()
            return
        c.idle_since = time.monotonic()
        t.idle.append(c)

    def _idle_conn(self, t: _Target) -> _Conn | None:
        idle = t.idle
        if not idle:
            return None
        limit = time.monotonic() - self.keepalive_s
        while idle:
            c = idle.pop()  # the most recently used: the warmest
            if not c.closed and c.idle_since >= limit and not c.transport.is_closing():
                return c
            c.transport.close()
        return None

    async def _connect(self, t: _Target) -> _Conn:
        ssl = None
        if t.ssl:
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ssl = self._ssl
        try:
            _, c = await asyncio.wait_for(self.loop.create_connection(_Conn, t.host, t.port, ssl=ssl),
                                          self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("connect", f"connect to {t.host}:{t.port} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"connect to {t.host}:{t.port} failed: {exc.strerror or exc}") from None
        self.connects += 1
        return c

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
                   ) -> UpstreamResponse:
        t = self.target(base_url)
        extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()) if headers else b""
        head = (b"POST " + t.prefix + path.encode() + b" HTTP/1.1\r\nHost: " + t.host_header
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n")
        for attempt in (0, 1):
            c = self._idle_conn(t) if attempt == 0 else None
            reused = c is not None
            if c is None:
                c = await self._connect(t)
            r = UpstreamResponse(c, self, t)
            c.resp = r
            try:
                c.transport.write(head + body)
                while not r.status:
                    await r._wait()
                return r
            except UpstreamError as exc:
                r.close()
                if reused and exc.kind == "connect":
                    continue  # the engine had closed the idle connection: once more on a fresh one
                raise
            except BaseException:
                r.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for t in self._targets.values():
            while t.idle:
                t.idle.pop().transport.close()
