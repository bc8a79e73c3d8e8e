"""One request's journey through the router, and what its answer says (no I/O).

:class:`Flow` is everything a request carries through retries, the PD stages and a migration.
The functions below read the engine's answer as it passes: each SSE event of a stream
(:func:`on_event`) or a whole JSON answer (:func:`account_json`) updates the flow's text so far,
token counts, first and last token times and the cached tokens the engine reports, so a migration
can continue where the answer broke off and the request's record says what happened. The HTTP
router (:mod:`router.server`) and the endpoint picker's response observer (:mod:`router.epp.observe`)
both read answers with them, so the two paths measure the same way.

vllm-ascend's PD proxy protocol: a decode that stops with ``stop_reason: "recomputed"`` is
re-issued with the text so far (:func:`recomputed_json`, :func:`merge_recomputed`; on a stream
:func:`on_event` drops what such a decode says after it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.pd_protocol import stop_reason_recomputed
from router.types import Decision, RoutingRequest

_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode


def sse_event(obj: Any) -> bytes:
    """``obj`` as one server-sent event."""
    return b"data: " + _json_encode(obj) + b"\n\n"


@dataclass(slots=True)
class Flow:
    """Everything one request carries through retries, PD and migration."""

    rid: str
    kind: str  # chat | completions
    path: str
    body: dict[str, Any]
    stream: bool
    arrival: float
    t0: float
    rreq: RoutingRequest
    raw: bytes | None = None  # the client's body, forwarded as is when unchanged
    wants_usage: bool = False
    exclude: set[str] = field(default_factory=set)
    retries: int = 0
    migrations: int = 0
    # the text generated so far, as the pieces the engine sent (joined when read: appending to one
    # string copies all of it for every token, quadratic in a long answer)
    pieces: list[str] = field(default_factory=list)
    out_tokens: int = 0
    first_token_t: float | None = None
    last_token_t: float | None = None
    cached_tokens: int = 0
    cached_reported: bool = False  # the engine's usage carried prompt_tokens_details.cached_tokens
    prompt_tokens_reported: int | None = None
    pods: list[str] = field(default_factory=list)
    prefill_pod: str | None = None
    decode_pod: str | None = None
    decision: Decision | None = None
    captured: tuple | None = None  # (backends, now) the last decision read, for its record
    keys: tuple[int, Any] | None = None  # (block size, the whole prompt's block keys: uint64 array), hashed once
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    done: bool = False
    key: str = "-"  # the client (API key or address) for quotas and fairness
    queue_s: float = 0.0  # time spent waiting for a backend slot
    entered: float = 0.0  # perf_counter when the router's handler took the request (its body read)
    dispatch_s: float | None = None  # entered -> first send to an engine, queue_s left out
    prefill_s: float | None = None  # PD: the prefill stage's time (its TTFT)
    prefill_end_t: float | None = None
    recomputed: bool = False  # the decode answered stop_reason "recomputed" (vllm-ascend)
    recomputes: int = 0
    # (code, type, message) of an error the engine sent in place of the rest of a stream (vLLM: a
    # generation that failed, finish_reason "error"); what it says after that is dropped
    engine_error: tuple[int, str, str] | None = None
    migrated_tokens: int = 0  # output tokens the client had when the stream last moved to another engine

    @property
    def text(self) -> str:
        """The text generated so far (read on a migration or a re-issue, not per token)."""
        p = self.pieces
        if len(p) > 1:
            p[:] = ["".join(p)]
        return p[0] if p else ""


def usage_asked(stream_options: Any) -> dict[str, Any]:
    """A client's ``stream_options`` with ``include_usage`` set, for a client that did not set it
    (the router asks the engine for the usage event and drops it from the answer). The other
    options stay, except ``continuous_usage_stats``, which becomes false: vLLM reads it only
    together with ``include_usage``, so it meant nothing for this client, and left on it would put
    a usage on every chunk the client gets."""
    so = dict(stream_options) if isinstance(stream_options, dict) else {}
    so["include_usage"] = True
    if so.get("continuous_usage_stats"):
        so["continuous_usage_stats"] = False
    return so


def _token(flow: Flow, piece: str) -> None:
    now = time.perf_counter()
    if flow.first_token_t is None:
        flow.first_token_t = now
    flow.last_token_t = now
    flow.pieces.append(piece)
    flow.out_tokens += 1


def on_event(flow: Flow, ev: bytes, *, retries_recomputed: bool = False) -> bool | bytes:
    """Track one SSE event of the answer: True passes it on, False drops it (the usage chunk the
    client did not ask for), bytes replace it. ``retries_recomputed``: a decode that stops
    ``recomputed`` (vllm-ascend) is to be re-issued, so it and all that decode says after it are
    dropped (the rest comes from the re-issued request). An error event in place of the rest of
    the stream (vLLM's answer to a generation that failed) sets ``flow.engine_error`` and is
    dropped with all after it: the caller continues the request elsewhere or ends it."""
    if flow.recomputed or flow.engine_error is not None:
        return False
    for line in ev.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            flow.done = True
            return True
        try:
            obj = _json_decode(payload)
        except msgspec.DecodeError:
            return True
        if not isinstance(obj, dict):
            return True
        err = obj.get("error")
        if isinstance(err, dict) and "choices" not in obj:  # (vLLM's create_streaming_error_response)
            code = err.get("code")
            flow.engine_error = (code if isinstance(code, int) else 500, str(err.get("type") or "")[:100],
                                 str(err.get("message") or "")[:500])
            return False
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if choices and retries_recomputed and stop_reason_recomputed(choices[0]):
            flow.recomputed = True
            return False
        # the chunk's tokens first, then its usage: with continuous_usage_stats every chunk carries
        # usage, whose completion_tokens already counts the chunk's own token
        if flow.migrations and flow.kind == "chat" and choices:
            kept = strip_role(obj, choices, flow)
            if isinstance(usage, dict):
                account_usage(flow, usage)
            return kept
        for c in choices:
            if not isinstance(c, dict):
                continue
            piece = c.get("text")
            if piece is None:
                delta = c.get("delta") or {}
                piece = delta.get("content") if isinstance(delta, dict) else None
            if piece:
                _token(flow, piece)
        if isinstance(usage, dict):
            account_usage(flow, usage)
        if not choices and usage is not None and not flow.wants_usage:
            return False
        if not choices and isinstance(usage, dict) and flow.migrated_tokens:
            return _whole_usage(obj, usage, flow.migrated_tokens)
    return True


def _whole_usage(obj: dict, usage: dict, before: int) -> bytes:
    """A migrated stream's usage chunk, counting the whole answer the client got: the continuation's
    engine counted the text generated before the migration in its prompt, and only its own tokens
    as completion tokens."""
    u = dict(usage)
    ct, pt = u.get("completion_tokens"), u.get("prompt_tokens")
    if isinstance(ct, int):
        u["completion_tokens"] = ct + before
    if isinstance(pt, int) and pt >= before:
        u["prompt_tokens"] = pt - before
    return sse_event({**obj, "usage": u})


def strip_role(obj: dict, choices: list, flow: Flow) -> bool | bytes:
    """A continuation's chunk after a migration: the client already had the ``role`` delta, so it
    is removed (a chunk left with nothing is dropped); text is tracked as usual."""
    changed = False
    empty = True
    for c in choices:
        if not isinstance(c, dict):
            empty = False
            continue
        delta = c.get("delta")
        if isinstance(delta, dict):
            if "role" in delta:
                del delta["role"]
                changed = True
            piece = delta.get("content")
            if piece and isinstance(piece, str):
                _token(flow, piece)
            if any(v for v in delta.values()):
                empty = False
        if c.get("finish_reason") or c.get("logprobs"):
            empty = False
    if not changed:
        return True
    if empty and not obj.get("usage"):
        return False
    return sse_event(obj)


def recomputed_json(flow: Flow, data: bytes, *, retries_recomputed: bool = False) -> bool:
    """A non-streamed decode answer that stopped ``recomputed``, when such a decode is re-issued
    (``retries_recomputed``): its text kept for the re-issue."""
    if not retries_recomputed or b"recomputed" not in data:
        return False
    try:
        obj = _json_decode(data)
        c = obj["choices"][0]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return False
    if not stop_reason_recomputed(c):
        return False
    piece = c.get("text")
    if piece is None:
        piece = (c.get("message") or {}).get("content") or ""
    flow.pieces.append(piece)
    u = obj.get("usage") or {}
    flow.out_tokens += u.get("completion_tokens") or 0 if isinstance(u, dict) else 0
    if flow.first_token_t is None and piece:
        flow.first_token_t = time.perf_counter()
    return True


def merge_recomputed(flow: Flow, data: bytes) -> bytes:
    """The final answer of a re-issued request: the text before the recompute put back in front."""
    try:
        obj = _json_decode(data)
        c = obj["choices"][0]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return data
    if isinstance(c.get("text"), str):
        c["text"] = flow.text + c["text"]
    elif isinstance(c.get("message"), dict):
        c["message"]["content"] = flow.text + (c["message"].get("content") or "")
    u = obj.get("usage")
    if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
        u["completion_tokens"] += flow.out_tokens
        u["total_tokens"] = u.get("prompt_tokens", 0) + u["completion_tokens"]
    return _json_encode(obj)


def account_usage(flow: Flow, usage: dict) -> None:
    """An answer's ``usage``: the prompt tokens and cached tokens the engine counted, and the
    output tokens (unless the answer is a continuation's, whose count starts again)."""
    pt = usage.get("prompt_tokens")
    if isinstance(pt, int):
        flow.prompt_tokens_reported = pt
    det = usage.get("prompt_tokens_details")
    if isinstance(det, dict) and isinstance(det.get("cached_tokens"), int):
        flow.cached_tokens = det["cached_tokens"]
        flow.cached_reported = True
    ct = usage.get("completion_tokens")
    if isinstance(ct, int) and flow.migrations == 0 and flow.recomputes == 0:
        flow.out_tokens = max(flow.out_tokens, ct)


def account_json(flow: Flow, data: bytes) -> None:
    """A whole (non-streamed) answer: its time is the first and last token's, its usage counted."""
    now = time.perf_counter()
    flow.first_token_t = flow.last_token_t = now
    try:
        obj = _json_decode(data)
    except msgspec.DecodeError:
        return
    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
        account_usage(flow, obj["usage"])
        ct = obj["usage"].get("completion_tokens")
        if isinstance(ct, int):
            flow.out_tokens = ct
