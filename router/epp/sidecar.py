"""The decode-side P/D sidecar llm-d deploys in front of each decode engine: when the endpoint
picker names a prefill pod in ``x-prefiller-host-port``, it runs stage one there
(``max_tokens=1``, ``kv_transfer_params.do_remote_decode``), then sends the request with the
returned ``kv_transfer_params`` to its own decode engine and streams the answer back. Without the
header the request goes straight to the decode engine.

``infernex``'s chart runs it as the decode pods' serving port in EPP mode; tests run it locally.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from router.epp.protocol import PREFILLER

log = logging.getLogger(__name__)

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", PREFILLER}


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": code}}
    return web.json_response(body, status=status)


class PdSidecar:
    """``decode_url``: the local decode engine's base URL."""

    def __init__(self, decode_url: str, *, timeout_s: float = 300.0):
        self.decode_url = decode_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.prefills = 0
        self.url: str | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s),
                                             auto_decompress=False)
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        h, p = site._server.sockets[0].getsockname()[:2]
        self.url = f"http://{h}:{p}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _prefill(self, hostport: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict | web.Response:
        pre = dict(body)
        pre.update(stream=False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        try:
            async with self.session.post(f"http://{hostport}{path}", data=msgspec.json.encode(pre),
                                         headers={**headers, "content-type": "application/json"}) as r:
                data = await r.read()
                if r.status >= 400:
                    return _error(502 if r.status >= 500 else r.status,
                                  f"prefill on {hostport} answered HTTP {r.status}", "prefill_failed")
                self.prefills += 1
                return msgspec.json.decode(data).get("kv_transfer_params") or {}
        except (aiohttp.ClientError, msgspec.DecodeError, TimeoutError) as e:
            return _error(502, f"prefill on {hostport} failed: {type(e).__name__}", "prefill_failed")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        hostport = request.headers.get(PREFILLER)
        if hostport:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                return _error(400, "request body is not valid JSON", "invalid_json")
            if not isinstance(body, dict):
                return _error(400, "request body must be a JSON object", "invalid_json")
            kvp = await self._prefill(hostport, request.path, body, headers)
            if isinstance(kvp, web.Response):
                return kvp
            body["kv_transfer_params"] = kvp
            raw = msgspec.json.encode(body)
        return await self._forward(request, raw, headers)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        return await self._forward(request, await request.read(), headers)

    async def _forward(self, request: web.Request, raw: bytes, headers: dict[str, str]) -> web.StreamResponse:
        try:
            up = await self.session.request(request.method, f"{self.decode_url}{request.path_qs}", data=raw,
                                            headers=headers)
        except aiohttp.ClientError as e:
            return _error(502, f"decode engine unreachable: {type(e).__name__}", "upstream_unavailable")
        try:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP and k.lower() != "content-encoding"})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            up.release()
