"""A small fake OpenAI streaming server for tests of replay clients.

It answers ``/v1/completions``, ``/v1/chat/completions`` (SSE with ``include_usage``) and
``/v1/models``; keeps a prefix cache of ``cache_chunk``-token chunks so ``cached_tokens``
is the longest prefix seen before (cached once a request's first token is sent); and can
misbehave per request index (taken from ``X-Request-Id`` ``...-<index>``):

``http500``, ``http400``: an OpenAI JSON error with that status; ``abort``: close the
connection after two chunks; ``truncate``: end the stream cleanly but without ``[DONE]`` or
a finish reason; ``stream_error``: an ``{"error": ...}`` chunk; ``slow``: first token after
``slow_s``. It runs on its own event loop in a thread, on a free port.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from simulator.tokenizer import SimpleTokenizer


@dataclass
class Received:
    index: int | None
    path: str
    body: dict[str, Any]
    token_ids: list[int]
    arrived: float  # time.monotonic()


@dataclass
class FakeOpenAI:
    ttft_s: float = 0.05
    itl_s: float = 0.005
    slow_s: float = 5.0
    model: str = "fake-model"
    cache_chunk: int = 16
    faults: dict[int, str] = field(default_factory=dict)
    ttft_by_index: dict[int, float] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tok = SimpleTokenizer()
        self._seen: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- prefix cache ------------------------------------------------------------------
    def _chain(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full ``cache_chunk``-token chunks (each covers its prefix)."""
        c = self.cache_chunk
        out, h = [], 0
        for k in range(0, len(ids) - c + 1, c):
            h = hash((h, tuple(ids[k:k + c])))
            out.append(h)
        return out

    def _cached(self, ids: list[int]) -> int:
        n = 0
        for h in self._chain(ids):
            if h not in self._seen:
                break
            n += 1
        return n * self.cache_chunk

    def _remember(self, ids: list[int]) -> None:
        self._seen.update(self._chain(ids))

    # -- handlers ----------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._complete_inner(request)
        except (ConnectionResetError, ConnectionError):  # the client went away: nothing to answer
            return web.Response(status=499)

    async def _complete_inner(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON", "type": "invalid_request_error"}},
                                     status=400)
        rid = request.headers.get("X-Request-Id", "")
        tail = rid.rsplit("-", 1)[-1]
        index = int(tail) if tail.isdigit() else None
        if chat:
            ids = self._tok.encode("\n".join(m.get("content", "") for m in body.get("messages", [])))
        elif isinstance(body.get("prompt"), str):
            ids = self._tok.encode(body["prompt"])
        else:
            ids = list(body.get("prompt") or [])
        self.received.append(Received(index, request.path, body, ids, time.monotonic()))
        fault = self.faults.get(index) if index is not None else None
        if fault in ("http500", "http400"):
            status = int(fault[4:])
            return web.json_response({"error": {"message": f"injected failure {status}", "type": "server_error",
                                                "code": status}}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-infernex-backend": "fake-0"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        ttft = self.slow_s if fault == "slow" else self.ttft_by_index.get(index, self.ttft_s)
        await asyncio.sleep(ttft)
        cached = self._cached(ids)
        self._remember(ids)
        n = int(body.get("max_tokens") or 16)
        for i in range(n):
            if i and fault == "abort" and i == 2:
                request.transport.close()
                return resp
            if i == 2 and fault == "stream_error":
                await send({"error": {"object": "error", "message": "engine died", "code": 500}})
                return resp
            if i == 2 and fault == "truncate":
                return resp
            if i:
                await asyncio.sleep(self.itl_s)
            last = i == n - 1
            choice = ({"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": "length" if last else None}
                      if chat else {"index": 0, "text": f" w{i}", "finish_reason": "length" if last else None})
            await send({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                        "choices": [choice], "usage": None})
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": rid, "choices": [], "usage": usage})
        await send(b"[DONE]")
        await resp.write_eof()
        return resp

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "FakeOpenAI":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                app = web.Application()
                app.router.add_get("/v1/models", self._models)
                app.router.add_post("/v1/completions", self._complete)
                app.router.add_post("/v1/chat/completions", self._complete)
                self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, "127.0.0.1", 0)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("fake OpenAI server did not start")
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            if self._runner is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
                except Exception:  # noqa: BLE001 - best effort; the loop is stopped below anyway
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._thread = None

    def __enter__(self) -> "FakeOpenAI":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    """``python -m simulator.workloads.testing [--ttft S] [--itl S]``: serve until stdin closes
    or the process is terminated; prints the URL on the first line."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft", type=float, default=0.0)
    ap.add_argument("--itl", type=float, default=0.0)
    args = ap.parse_args()
    srv = FakeOpenAI(ttft_s=args.ttft, itl_s=args.itl).start()
    print(srv.url, flush=True)
    try:
        sys.stdin.read()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
