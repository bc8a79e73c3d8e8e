"""A tiny fake OpenAI engine for router tests (aiohttp, in-process, port 0).

It generates ``tok0 tok1 ...`` deterministically; a continuation (prompt or final assistant
message already ending in ``tokK``) goes on from ``tok{K+1}``, so a migrated stream reads the
same as an uninterrupted one. Faults: ``die_after`` tokens (connection dropped mid-stream),
``status`` (every request answered with that HTTP status), ``delay_s`` per token. It records the
bodies and headers it received and whether a client went away mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_TOK = re.compile(r"tok(\d+)\s*$")


@dataclass
class FakeEngine:
    pod: str
    model: str = "m"
    tokens: int = 8
    delay_s: float = 0.0
    die_after: int | None = None
    status: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    def _start_index(self, kind: str, body: dict) -> int:
        if kind == "chat":
            msgs = body.get("messages") or []
            if body.get("continue_final_message") and msgs and msgs[-1].get("role") == "assistant":
                m = _TOK.search(msgs[-1].get("content") or "")
                return int(m.group(1)) + 1 if m else 0
            return 0
        m = _TOK.search(str(body.get("prompt", "")))
        return int(m.group(1)) + 1 if m else 0

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.pod} says {self.status}"}}, status=self.status)
        rid = request.headers.get("X-Request-Id", "none")
        n = min(self.tokens, body.get("max_tokens") or body.get("max_completion_tokens") or self.tokens)
        start = self._start_index(kind, body)
        pieces = [f"tok{start + i} " for i in range(n)]
        kvp = body.get("kv_transfer_params")
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
                 "prompt_tokens_details": {"cached_tokens": 4}}
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not body.get("stream"):
            if self.delay_s:
                await asyncio.sleep(self.delay_s * n)
            text = "".join(pieces)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
            out = {"id": rid, "object": obj, "model": self.model, "choices": [choice], "usage": usage,
                   "served_by": self.pod}
            if isinstance(kvp, dict) and kvp.get("do_remote_decode"):
                out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                             "remote_engine_id": self.pod, "remote_block_ids": [1, 2],
                                             "remote_host": "127.0.0.1", "remote_port": 1}
            self.finished += 1
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, p in enumerate(pieces):
                if self.die_after is not None and i >= self.die_after:
                    request.transport.close()  # the engine dies: connection dropped mid-stream
                    return resp
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if kind == "chat":
                    ch = {"index": 0, "delta": {"content": p}, "finish_reason": None}
                    ev = {"id": rid, "object": "chat.completion.chunk", "model": self.model, "choices": [ch]}
                else:
                    ev = {"id": rid, "object": "text_completion", "model": self.model,
                          "choices": [{"index": 0, "text": p, "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            so = body.get("stream_options") or {}
            if so.get("include_usage"):
                await resp.write(b"data: " + json.dumps({"id": rid, "choices": [], "usage": usage}).encode()
                                 + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            self.finished += 1
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp

    async def start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", lambda r: self._handle(r, "chat"))
        app.router.add_post("/v1/completions", lambda r: self._handle(r, "completions"))
        app.router.add_get("/v1/models", lambda r: web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.pod}]}))
        app.router.add_get("/health", lambda r: web.json_response({}))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, shutdown_timeout=0.5)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def wait_for(cond, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``cond()`` until true or ``timeout``; returns its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(interval)
    return bool(cond())


async def _serve_many(n: int, tokens: int) -> None:
    engines = [await FakeEngine(f"fake-{i}", tokens=tokens).start() for i in range(n)]
    print(" ".join(e.url for e in engines), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for e in engines:
            await e.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m router.testing N [TOKENS]``: N fake engines in one process; prints their URLs."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 4
    tokens = int(args[1]) if len(args) > 1 else 4
    try:
        asyncio.run(_serve_many(n, tokens))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
