"""Open-loop trace replay over plain OpenAI HTTP (httpx, async, streaming).

Each trace row is sent at its timestamp (times ``time_scale``: 0.1 replays ten times faster),
whether or not earlier requests have finished; ``concurrency`` optionally caps requests in
flight (those over the cap wait and their lag shows in ``start_s - scheduled_s``). Requests
stream with ``stream_options.include_usage`` so the last chunk carries ``usage`` and, when the
server reports it, ``prompt_tokens_details.cached_tokens``.

Works against any OpenAI-compatible endpoint: ``/v1/completions`` with token-id or text
prompts, or ``/v1/chat/completions`` with text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import httpx
import msgspec
from pydantic import BaseModel, ConfigDict, Field

from simulator.workloads.metrics import RequestResult, Summary, summarize
from simulator.workloads.synth import PromptSynthesizer
from simulator.workloads.trace import TraceRow

PromptMode = Literal["tokens", "text"]
Api = Literal["completions", "chat"]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


class ReplayResult(BaseModel):
    """A run: what was asked, the summary, and one row per request."""

    model_config = ConfigDict(extra="forbid")

    meta: dict[str, Any] = Field(default_factory=dict)
    summary: Summary
    requests: list[RequestResult]

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: str | Path) -> "ReplayResult":
        return cls.model_validate_json(Path(path).read_bytes())


class ReplayError(RuntimeError):
    """The replay could not start (bad arguments, model not discoverable)."""


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def discover_model(client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> str:
    """The first model ``GET /v1/models`` lists."""
    try:
        resp = await client.get(f"{_base(url)}/v1/models", headers=headers, timeout=10.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ReplayError(f"could not discover a model at {_base(url)}/v1/models ({exc}); pass a model name") from None


def _error_message(body: bytes) -> str:
    try:
        obj = _json_decode(body)
    except msgspec.DecodeError:
        return body[:300].decode(errors="replace").strip() or "empty body"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        if isinstance(err, str):
            return err[:300]
        return str(obj.get("message") or obj.get("detail") or obj)[:300]
    return str(obj)[:300]


class _Request:
    __slots__ = ("index", "row", "body", "scheduled_s", "request_id")

    def __init__(self, index: int, row: TraceRow, body: bytes, scheduled_s: float, request_id: str):
        self.index = index
        self.row = row
        self.body = body
        self.scheduled_s = scheduled_s
        self.request_id = request_id


async def _send(client: httpx.AsyncClient, endpoint: str, req: _Request, headers: dict[str, str], *,
                t0: float, timeout_s: float, api: Api, sem: asyncio.Semaphore | None) -> RequestResult:
    loop = asyncio.get_running_loop()
    res = RequestResult(index=req.index, request_id=req.request_id, scheduled_s=req.scheduled_s,
                        prompt_tokens=req.row.input_length, expected_output_tokens=req.row.output_length)
    start: float | None = None
    acquired = False
    events: list[float] = []
    usage: dict | None = None
    finished = False
    try:
        if sem is not None:
            await sem.acquire()
            acquired = True
        start = loop.time()
        res.start_s = start - t0
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", endpoint, content=req.body,
                                     headers={**headers, "X-Request-Id": req.request_id}) as resp:
                res.http_status = resp.status_code
                res.backend = resp.headers.get("x-infernex-backend") or resp.headers.get("x-infernex-pod")
                if resp.status_code != 200:
                    body = await resp.aread()
                    res.status = "error"
                    res.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    now = loop.time()
                    try:
                        chunk = _json_decode(data)
                    except msgspec.DecodeError:
                        res.status = "error"
                        res.error = f"bad stream chunk: {data[:120]!r}"
                        return res
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk or chunk.get("object") == "error":
                        res.status = "error"
                        res.error = f"stream error: {_error_message(data.encode())}"
                        return res
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
                        if text:
                            events.append(now)
                        if choice.get("finish_reason"):
                            finished = True
    except asyncio.CancelledError:
        # only the replay itself cancels these tasks (stop requested); record, do not raise
        res.status = "cancelled"
        res.error = "stopped before completion"
    except (TimeoutError, httpx.TimeoutException) as exc:
        res.status = "timeout"
        res.error = f"no complete answer within {timeout_s:g} s ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        res.status = "error"
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if acquired:
            sem.release()
        end = loop.time()
        res.end_s = end - t0
        if events and start is not None:
            res.ttft_s = events[0] - start
            res.itl_s = [b - a for a, b in zip(events, events[1:])]
        res.output_tokens = len(events)
        if usage:
            res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
            res.output_tokens = int(usage.get("completion_tokens") or res.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
    if res.status == "ok":
        if not finished:
            res.status = "error"
            res.error = "stream ended before [DONE] or a finish_reason"
        elif res.start_s is not None:
            res.e2e_s = res.end_s - res.start_s
    return res


def build_body(row: TraceRow, *, model: str, synth: PromptSynthesizer, prompt_mode: PromptMode, api: Api,
               index: int, ignore_eos: bool = True, extra_body: dict | None = None) -> bytes:
    """The JSON request body for one row."""
    body: dict[str, Any] = {"model": model, "max_tokens": max(1, row.output_length), "stream": True,
                            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": synth.text(row, request_key=index)}]
    elif prompt_mode == "tokens":
        body["prompt"] = synth.token_ids(row, request_key=index)
    else:
        body["prompt"] = synth.text(row, request_key=index)
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return _json_encode(body)


async def replay(
    rows: Sequence[TraceRow] | Iterable[TraceRow],
    url: str | Sequence[str],
    *,
    model: str | None = None,
    time_scale: float = 1.0,
    concurrency: int | None = None,
    limit: int | None = None,
    prompt_mode: PromptMode = "tokens",
    api: Api = "completions",
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    api_key: str | None = None,
    extra_body: dict | None = None,
    synthesizer: PromptSynthesizer | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    http_client: httpx.AsyncClient | None = None,
    run_id: str | None = None,
    stop: asyncio.Event | None = None,
) -> ReplayResult:
    """Replay ``rows`` open-loop against an OpenAI-compatible ``url``; returns every request's
    result and the summary. ``on_result`` is called as each request finishes (progress bars).
    Several URLs (replicas behind no load balancer): the requests go to them in turn, in
    arrival order.

    ``stop``: when set, nothing more is sent and requests in flight are cancelled (recorded as
    ``cancelled``); the partial result is returned with ``meta["stopped"]`` true."""
    if time_scale < 0:
        raise ReplayError("time_scale must be >= 0")
    if concurrency is not None and concurrency < 1:
        raise ReplayError("concurrency must be >= 1")
    if api == "chat" and prompt_mode == "tokens":
        prompt_mode = "text"  # chat messages carry text only
    rows = list(rows)
    if limit is not None:
        rows = rows[: max(0, limit)]
    synth = synthesizer or PromptSynthesizer()
    run_id = run_id or uuid.uuid4().hex[:8]
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ReplayError("no URL to replay against")
    url = urls[0]
    endpoints = [f"{_base(u)}/v1/{'chat/completions' if api == 'chat' else 'completions'}" for u in urls]
    own_client = http_client is None
    client = http_client or httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0, pool=None),
        limits=httpx.Limits(max_connections=concurrency or 1024, max_keepalive_connections=concurrency or 256),
    )
    started_wall = time.time()
    try:
        if model is None:
            model = await discover_model(client, url, {k: v for k, v in headers.items() if k == "Authorization"})
        order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp)
        ts0 = rows[order[0]].timestamp if rows else 0
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks: list[asyncio.Task] = []

        def _done(task: asyncio.Task) -> None:
            if on_result is not None and not task.cancelled() and task.exception() is None:
                on_result(task.result())

        stopped = False
        for i in order:
            if stop is not None and stop.is_set():
                stopped = True
                break
            row = rows[i]
            due = (row.timestamp - ts0) / 1000.0 * time_scale
            req = _Request(i, row, build_body(row, model=model, synth=synth, prompt_mode=prompt_mode, api=api,
                                              index=i, ignore_eos=ignore_eos, extra_body=extra_body),
                           due, f"replay-{run_id}-{i}")
            delay = t0 + due - loop.time()
            if delay > 0:
                if stop is None:
                    await asyncio.sleep(delay)
                else:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                        stopped = True
                        break
                    except TimeoutError:
                        pass
            endpoint = endpoints[len(tasks) % len(endpoints)]
            task = asyncio.create_task(_send(client, endpoint, req, headers, t0=t0, timeout_s=timeout_s,
                                             api=api, sem=sem))
            task.add_done_callback(_done)
            tasks.append(task)
        all_done = asyncio.gather(*tasks)
        try:
            if stop is not None and not all_done.done():
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({all_done, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not all_done.done():
                    stopped = True
                    for t in tasks:
                        t.cancel()
            results = await all_done
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        duration = loop.time() - t0
    finally:
        if own_client:
            await client.aclose()
    results.sort(key=lambda r: r.index)
    meta = {"url": url if len(urls) == 1 else urls, "model": model, "api": api, "prompt_mode": prompt_mode, "time_scale": time_scale,
            "concurrency": concurrency, "requests": len(rows), "run_id": run_id, "started_at": started_wall,
            "block_tokens": synth.block_tokens, "stopped": stopped, "unsent": len(rows) - len(results)}
    return ReplayResult(meta=meta, summary=summarize(results, duration), requests=results)
