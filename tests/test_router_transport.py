"""The router's own HTTP layer: the httptools server (consumers.http) and the pooled upstream client
(router.upstream), against real sockets (raw asyncio servers/clients and the fake engine)."""

from __future__ import annotations

import asyncio
import json

import pytest

from consumers.http import HttpError, Response, Server, StreamResponse
from router.testing import FakeEngine, wait_for
from router.upstream import UpstreamError, UpstreamPool


# -- helpers ------------------------------------------------------------------------------------
async def raw_server(handler):
    """A plain asyncio TCP server; ``handler(reader, writer)`` plays the backend."""
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    return head + (await reader.readexactly(n) if n else b"")


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return status, headers, body


@pytest.fixture
async def app():
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def echo(req):
        return Response(200, json.dumps({"path": req.path, "query": req.query, "body": req.body.decode(),
                                         "ct": req.headers.get("content-type")}).encode(), "application/json")

    async def hang(req):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200)

    async def stream(req):
        resp = StreamResponse(200, {"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    async def fails(req):
        raise HttpError(418, "no coffee")

    srv = Server(max_body=1000)
    srv.add("POST", "/echo", echo)
    srv.add("GET", "/echo", echo)
    srv.add("GET", "/hang", hang)
    srv.add("GET", "/stream", stream)
    srv.add("GET", "/fails", fails)
    host, port = await srv.start("127.0.0.1", 0)
    srv.started, srv.cancelled = started, cancelled
    srv.port = port
    yield srv
    await srv.close(grace_s=0.1)


async def connect(app):
    return await asyncio.open_connection("127.0.0.1", app.port)


# -- server -------------------------------------------------------------------------------------
async def test_keep_alive_and_pipelined_requests_are_answered_in_order(app):
    r, w = await connect(app)
    w.write(b"GET /echo?a=1 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello")
    s1, _, b1 = await read_response(r)
    s2, h2, b2 = await read_response(r)
    assert (s1, json.loads(b1)["query"]) == (200, "a=1")
    assert (s2, json.loads(b2)["body"], json.loads(b2)["ct"]) == (200, "hello", "text/plain")
    assert "connection" not in h2  # still open
    w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    s3, h3, _ = await read_response(r)
    assert s3 == 200 and h3["connection"] == "close"
    assert await asyncio.wait_for(r.read(), 5) == b""  # the server closed it
    w.close()


async def test_chunked_request_body_and_expect_continue(app):
    r, w = await connect(app)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    status, _, body = await read_response(r)
    assert status == 200 and json.loads(body)["body"] == "abcde"
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"ok")
    status, _, body = await read_response(r)
    assert status == 200 and json.loads(body)["body"] == "ok"
    w.close()


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"GET /fails HTTP/1.1\r\nHost: x\r\n\r\n", 418),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, 413),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n" + b"x" * 2000 + b"\r\n0\r\n\r\n",
     413),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 70_000 + b"\r\n\r\n", 431),
])
async def test_errors(app, request_bytes, status):
    r, w = await connect(app)
    w.write(request_bytes)
    got, _, _ = await read_response(r)
    assert got == status
    w.close()


async def test_idle_keep_alive_connections_are_closed():
    srv = Server(keepalive_s=0.3)

    async def ok(req):
        return Response(200, b"ok")

    srv.add("GET", "/", ok)
    _, port = await srv.start("127.0.0.1", 0)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        status, h, body = await read_response(r)
        assert (status, body) == (200, b"ok") and h["date"].endswith("GMT")
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed by the server once idle
        w.close()
    finally:
        await srv.close(grace_s=0.1)


async def test_a_connection_that_never_sends_a_request_is_closed_after_the_request_timeout():
    """Opened and silent: closed after ``request_timeout_s``, not held for the keep-alive time;
    a connection that finished a request stays open for its keep-alive time."""
    async def ok(req):
        return Response(200, b"ok")

    srv = Server(request_timeout_s=0.4, keepalive_s=60)
    srv.add("GET", "/", ok)
    host, port = await srv.start("127.0.0.1", 0)
    try:
        silent_r, silent_w = await asyncio.open_connection(host, port)
        used_r, used_w = await asyncio.open_connection(host, port)
        used_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(used_r))[0] == 200
        t = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(silent_r.read(), 10) == b""  # closed by the server
        assert asyncio.get_running_loop().time() - t < 5
        await asyncio.sleep(0.5)
        used_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the used one is still open
        assert (await read_response(used_r))[0] == 200
        silent_w.close()
        used_w.close()
    finally:
        await srv.close(grace_s=0.1)


async def test_oversized_body_is_refused_at_the_headers(app):
    r, w = await connect(app)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"x" * 10_000)
    status, h, _ = await read_response(r)  # answered without waiting for the 10 MB
    assert status == 413 and h["connection"] == "close"
    w.write(b"x" * 100_000)  # the server drops the rest of the upload, then closes
    await w.drain()
    assert await asyncio.wait_for(r.read(), 10) == b""
    w.close()


async def test_head_on_a_get_route_has_no_body(app):
    r, w = await connect(app)
    w.write(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
    status, _, body = await read_response(r)  # the next bytes are the GET's answer, not a HEAD body
    assert status == 200 and json.loads(body)["path"] == "/echo"
    w.close()


async def test_streamed_response_is_chunked_and_plain_for_http10(app):
    r, w = await connect(app)
    w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    status, h, body = await read_response(r)
    assert status == 200 and h["transfer-encoding"] == "chunked" and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    w.close()
    r, w = await connect(app)
    w.write(b"GET /stream HTTP/1.0\r\n\r\n")
    status, h, body = await read_response(r)  # no length, no chunks: the body ends with the connection
    assert status == 200 and "transfer-encoding" not in h and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    w.close()


async def test_client_going_away_cancels_the_handler(app):
    r, w = await connect(app)
    w.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    w.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)
    assert app.active == 0


# -- upstream client ------------------------------------------------------------------------------
async def test_pool_reuses_connections_and_streams_chunks():
    eng = await FakeEngine("e", tokens=3).start()
    pool = UpstreamPool(connect_timeout=2, read_timeout=10)
    try:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
        for _ in range(3):
            r = await pool.post(eng.url, "/v1/completions", body, {"X-Request-Id": "rid-1",
                                                                   "Content-Type": "application/json"})
            data = await r.read()
            r.release()
            assert r.status == 200 and json.loads(data)["choices"][0]["text"] == "tok0 tok1 tok2 "
        assert pool.connects == 1
        assert eng.headers[-1]["X-Request-Id"] == "rid-1"
        sbody = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
        r = await pool.post(eng.url, "/v1/completions", sbody, {"Content-Type": "application/json"})
        got = b"".join([c async for c in r.iter_any()])
        assert r.at_eof() and r.headers["content-type"].startswith("text/event-stream")
        r.release()
        events = [e for e in got.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 4
        assert pool.connects == 1  # the streamed response ended cleanly: the connection was reused
    finally:
        pool.close()
        await eng.stop()


async def test_pool_retries_once_when_the_backend_closed_an_idle_connection():
    served = []

    async def one_per_connection(reader, writer):
        # answers one request as keep-alive, then drops the connection when the next one arrives
        # (the race of a backend's keep-alive timeout against the router reusing the connection)
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await read_request(reader)
        writer.close()

    srv, url = await raw_server(one_per_connection)
    pool = UpstreamPool(connect_timeout=2, read_timeout=5)
    try:
        for _ in range(3):
            r = await pool.post(url, "/x", b"{}")
            assert (r.status, await r.read()) == (200, b"ok")
            r.release()
        assert len(served) == 3 and pool.connects == 3  # each reuse failed and was retried on a fresh one
    finally:
        pool.close()
        srv.close()


async def test_pool_errors_connect_timeout_read_and_until_eof():
    pool = UpstreamPool(connect_timeout=2, read_timeout=0.3)
    srv, url = await raw_server(lambda r, w: None)
    srv.close()
    await srv.wait_closed()
    with pytest.raises(UpstreamError) as e:
        await pool.post(url, "/x", b"{}")  # nothing listens there any more
    assert e.value.kind == "connect"

    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(5)

    async def truncated(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()
        writer.close()

    async def until_eof(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")
        writer.close()

    servers = [await raw_server(h) for h in (silent, truncated, until_eof)]
    try:
        with pytest.raises(UpstreamError) as e:
            await pool.post(servers[0][1], "/x", b"{}")
        assert e.value.kind == "timeout"
        r = await pool.post(servers[1][1], "/x", b"{}")
        with pytest.raises(UpstreamError) as e:
            await r.read()
        assert e.value.kind == "read"
        r.close()
        r = await pool.post(servers[2][1], "/x", b"{}")
        assert await r.read() == b"hello world"
        r.release()
        assert all(not t.idle for t in pool._targets.values())  # nothing reusable was kept
    finally:
        pool.close()
        for s, _ in servers:
            s.close()


async def test_a_request_trickling_in_gets_408_and_its_connection_closed():
    async def ok(req):
        return Response(200, b"ok", "text/plain")

    srv = Server(request_timeout_s=0.4, keepalive_s=60)
    srv.add("POST", "/v1/completions", ok)
    host, port = await srv.start("127.0.0.1", 0)
    try:
        # a complete request on a fresh connection is served normally
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"ok")
        writer.close()
        # headers sent, the body promised but never finished: the server answers 408 and hangs up
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
        status, headers, body = await read_response(reader)
        assert status == 408 and headers.get("connection") == "close" and b"timeout" in body
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        writer.close()
    finally:
        await srv.close()


# -- piping a streamed body ------------------------------------------------------------------------
async def _sse_server(events: list[bytes], gaps: list[float]):
    """A backend that answers a chunked SSE stream: ``events[i]`` after ``gaps[i]`` seconds each,
    every one its own write (one chunk on the wire)."""

    async def h(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for ev, gap in zip(events, gaps):
            await asyncio.sleep(gap)
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    return await raw_server(h)


async def test_pipe_hands_every_chunk_to_the_sink_and_times_out_on_silence_only():
    """``pipe`` gives the sink each chunk as it comes, in order. Its read timeout is the longest
    silence: a stream whose whole length is many timeouts but whose gaps are shorter goes through;
    one gap longer than the timeout ends it with a timeout."""
    pool = UpstreamPool(connect_timeout=2, read_timeout=0.4)
    events = [f"data: {i}\n\n".encode() for i in range(8)]
    srv, url = await _sse_server(events, [0.0] + [0.15] * 7)  # 1.05 s in all, gaps of 0.15 s
    got = []
    try:
        r = await pool.post(url, "/x", b"{}")
        await r.pipe(lambda b: got.append(b) is None)
        assert b"".join(got) == b"".join(events) and r.at_eof()
        r.release()
    finally:
        srv.close()
    srv, url = await _sse_server(events[:3], [0.0, 0.1, 0.9])  # the last gap is longer than 0.4 s
    got.clear()
    try:
        r = await pool.post(url, "/x", b"{}")
        with pytest.raises(UpstreamError) as e:
            await r.pipe(lambda b: got.append(b) is None)
        assert e.value.kind == "timeout" and b"".join(got) == b"".join(events[:2])
        r.close()
    finally:
        pool.close()
        srv.close()


async def test_pipe_stops_when_the_sink_says_so_and_raises_what_the_sink_raised():
    pool = UpstreamPool(connect_timeout=2, read_timeout=5)
    events = [f"data: {i}\n\n".encode() for i in range(5)]
    srv, url = await _sse_server(events, [0.02] * 5)
    try:
        got = []
        r = await pool.post(url, "/x", b"{}")
        await r.pipe(lambda b: got.append(b) or len(got) < 2)  # stop after the second chunk
        assert got == events[:2] and not r.at_eof()
        r.close()

        def boom(b):
            raise ConnectionResetError("client went away")

        r = await pool.post(url, "/x", b"{}")
        with pytest.raises(ConnectionResetError):
            await r.pipe(boom)
        r.close()
    finally:
        pool.close()
        srv.close()


async def test_pipe_flushes_once_per_read_after_handing_over_its_chunks():
    """An engine that wrote several chunks at once (one read at the router): ``pipe`` gives the sink
    each chunk, then calls ``flush`` once; a later read gets its own flush."""
    events = [f"data: {i}\n\n".encode() for i in range(5)]

    async def h(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(ev), ev) for ev in events[:3]))  # three chunks, one write
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"".join(b"%x\r\n%s\r\n" % (len(ev), ev) for ev in events[3:]) + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    srv, url = await raw_server(h)
    pool = UpstreamPool(connect_timeout=2, read_timeout=5)
    seen: list = []
    try:
        r = await pool.post(url, "/x", b"{}")
        await r.pipe(lambda b: seen.append(b) is None, lambda: seen.append("flush"))
        assert seen == [*events[:3], "flush", *events[3:], "flush"] and r.at_eof()
        r.close()  # (this backend answers one request a connection)

        def bad_flush():
            raise ConnectionResetError("client went away")

        r = await pool.post(url, "/x", b"{}")  # what flush raises ends pipe() with it
        with pytest.raises(ConnectionResetError):
            await r.pipe(lambda b: True, bad_flush)
        r.close()
    finally:
        pool.close()
        srv.close()


class _Client:
    """A stand-in for the client side of the relay: what was sent, and whether it is 'behind'."""

    def __init__(self, behind_after: int | None = None):
        self.sent: list[bytes] = []
        self.behind_after = behind_after
        self.drained: list = []

    def send_now(self, data: bytes) -> bool:
        self.sent.append(data)
        return self.behind_after is not None and len(self.sent) >= self.behind_after

    def when_drained(self, cb) -> None:
        self.drained.append(cb)


class _Up:
    def __init__(self):
        self.paused = 0
        self.resumed = 0

    def pause(self):
        self.paused += 1

    def resume(self):
        self.resumed += 1


def _flow(**kw):
    from router.flow import Flow
    from router.types import RoutingRequest

    return Flow(rid="r", kind="completions", path="/v1/completions", body={}, stream=True, arrival=0.0, t0=0.0,
                rreq=RoutingRequest(model="m"), **kw)


def test_relay_cuts_events_wherever_the_chunks_end_and_drops_the_usage_the_client_did_not_ask_for():
    from router.relay import SseRelay

    tok = [b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(3)]
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n'
    done = b"data: [DONE]\n\n"
    stream = b"".join(tok) + usage + done
    for cut in ([5, 9], [len(tok[0]), len(tok[0]) + 3], [len(stream) - 3], [1, 2, 3, 70, 71]):
        flow, client, firsts = _flow(), _Client(), []
        relay = SseRelay(flow, client, _Up(), retries_recomputed=False, on_first_token=lambda: firsts.append(1))
        bounds = [0, *cut, len(stream)]
        for a, b in zip(bounds, bounds[1:]):
            assert relay(stream[a:b]) is True
            relay.flush()
        assert b"".join(client.sent) == b"".join(tok) + done  # the usage event taken out, nothing else
        assert flow.out_tokens == 3 and flow.done and flow.prompt_tokens_reported == 4 and firsts == [1]


def test_relay_writes_once_per_read_whatever_the_events_in_it():
    """The engine writes each event as an HTTP chunk of its own; ``pipe`` hands a read's chunks to
    the relay one by one and then flushes it: the client gets one write for the whole read, and the
    first-token callback fires at that write, not before anything went out."""
    from router.relay import SseRelay

    tok = [b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(5)]
    flow, client, firsts = _flow(), _Client(), []
    relay = SseRelay(flow, client, _Up(), retries_recomputed=False, on_first_token=lambda: firsts.append(len(client.sent)))
    for ev in tok[:3]:  # one read, three chunks
        assert relay(ev) is True
    assert client.sent == [] and firsts == []
    relay.flush()
    assert client.sent == [b"".join(tok[:3])] and firsts == [0]
    relay.flush()  # a read that brought nothing to pass on writes nothing
    relay(tok[3][:7])
    relay.flush()
    assert len(client.sent) == 1
    relay(tok[3][7:] + tok[4])
    relay.flush()
    assert client.sent == [b"".join(tok[:3]), tok[3] + tok[4]] and firsts == [0] and flow.out_tokens == 5


def test_relay_stops_at_the_engines_error_event_and_holds_the_engine_back_for_a_slow_client():
    from router.relay import SseRelay

    tok = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
    err = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'
    flow, client = _flow(), _Client()
    relay = SseRelay(flow, client, _Up(), retries_recomputed=False)
    assert relay(tok) is True
    assert relay(err + b"data: [DONE]\n\n") is False  # the caller goes on elsewhere
    assert client.sent == [tok] and flow.engine_error[0] == 500  # what came before the error, sent at once

    flow, client = _flow(), _Client()
    relay = SseRelay(flow, client, _Up(), retries_recomputed=False)
    assert relay(tok) is True and relay(err) is False  # in one read: the token still goes out, once
    relay.flush()
    assert client.sent == [tok]

    flow, client, up = _flow(), _Client(behind_after=2), _Up()
    relay = SseRelay(flow, client, up, retries_recomputed=False)
    for _ in range(3):
        relay(tok)
        relay.flush()
    assert up.paused == 2 and len(client.drained) == 2  # (asked again for every write while behind)
    for cb in client.drained:
        cb()
    assert up.resumed == 2 and len(client.sent) == 3


async def test_a_slow_client_gets_a_long_stream_whole_through_the_router():
    """The client reads nothing for a while: the router's socket buffer to it fills, the relay stops
    reading from the engine until the client catches up, and every byte arrives in order."""
    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend
    from router.upstream import UpstreamResponse

    n = 4000
    eng = await FakeEngine("e", tokens=n).start()
    app = RouterApp(RouterConfig(strategy="round-robin", backends=[StaticBackend(pod="e", url=eng.url, model="m")],
                                 bus=False, records=False))
    url = await app.start("127.0.0.1", 0)
    pauses = []
    real_pause = UpstreamResponse.pause
    UpstreamResponse.pause = lambda self: (pauses.append(1), real_pause(self))[1]
    try:
        host, port = url.removeprefix("http://").split(":")
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect((host, int(port)))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
        await wait_for(lambda: app.service.app._conns)
        for c in app.service.app._conns:  # small socket buffers on the router's side too: its own buffer fills
            c.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        body = json.dumps({"model": "m", "prompt": "p" * 20000, "max_tokens": n, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.transport.pause_reading()  # the client does not read
        await asyncio.sleep(1.0)
        writer.transport.resume_reading()
        status, _, got = await read_response(reader)
        writer.close()
    finally:
        UpstreamResponse.pause = real_pause
        await app.stop(drain=False)
        await eng.stop()
    assert status == 200
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in got.split(b"\n\n")
             if e.startswith(b"data: {") and json.loads(e[6:])["choices"]]
    assert texts == [f"tok{i} " for i in range(n)]
    assert pauses  # the engine was held back while the client did not read
