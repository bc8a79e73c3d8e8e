"""The index's query API: query and route-record bodies in, JSON out (HTTP and NATS share it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.kv import U64
from streams.kv_index import KvIndex


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class QueryError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class IndexQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    block_hashes: list[int] | None = None
    pods: list[str] | None = None
    lora: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "IndexQuery":
        given = [n for n in ("token_ids", "prompt", "messages", "block_hashes") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of token_ids, prompt, messages, block_hashes"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


def _messages_text(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(messages)
    parts = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            raise QueryError(400, "message content must be a string")
        parts.append(f"{m.get('role', 'user')}: {content}\n")
    return "".join(parts)


def run_query(index: KvIndex, body: Any, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Answer one query body (already parsed JSON); raise :class:`QueryError` on bad input."""
    if not isinstance(body, dict):
        raise QueryError(400, "the query must be a JSON object")
    try:
        q = IndexQuery.model_validate(body)
    except ValidationError as exc:
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise QueryError(400, msg) from None
    ids: Sequence[int] | None = q.token_ids
    if q.block_hashes is None and ids is None:
        if tokenizer is None:
            raise QueryError(400, "this indexer has no tokenizer configured; send token_ids")
        try:
            text = q.prompt if q.prompt is not None else _messages_text(tokenizer, q.messages or [])
            ids = tokenizer.encode(text)
        except QueryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input problem
            raise QueryError(400, f"cannot tokenize: {exc}") from None
    return _answer(index, q.model, ids, q.block_hashes, q.pods, q.lora)


class _FastQuery(msgspec.Struct, forbid_unknown_fields=True):
    """The common query shapes (token ids or block hashes), decoded without pydantic."""

    model: str
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    pods: list[str] | None = None
    lora: str | None = None


_query_decoder = msgspec.json.Decoder(_FastQuery)
_json_encode = msgspec.json.Encoder().encode


def run_query_json(index: KvIndex, data: bytes, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Answer one query given as JSON bytes (HTTP and NATS). ``token_ids`` / ``block_hashes``
    queries are decoded with msgspec; anything else, and every malformed query, goes through
    :func:`run_query` (pydantic), which names what is wrong."""
    try:
        q = _query_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        q = None
    if q is None or not q.model or (q.token_ids is None) == (q.block_hashes is None):
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QueryError(400, f"invalid JSON: {exc}") from None
        return run_query(index, body, tokenizer)
    return _answer(index, q.model, q.token_ids, q.block_hashes, q.pods, q.lora)


def _answer(index: KvIndex, model: str, ids: Sequence[int] | None, hashes: list[int] | None,
            pods: list[str] | None, lora: str | None) -> dict[str, Any]:
    if hashes is not None:
        if hashes and (min(hashes) < 0 or max(hashes) > U64):
            raise QueryError(400, "block_hashes must be unsigned 64-bit integers")
        matches = index.match_keys(model, hashes, pods)
    else:
        try:
            matches = index.match_tokens(model, ids, pods, lora=lora)
        except ValueError as exc:
            raise QueryError(400, str(exc)) from None
    return {
        "block_size": index.block_size(model),
        "pods": {
            pod: {"matched_blocks": m.matched_blocks, "tiers": m.tiers, "score": round(m.score, 6),
                  "predicted_blocks": m.predicted_blocks}
            for pod, m in matches.items()
        },
    }


class RouteRecord(BaseModel):
    """``POST /v1/index/route``: a router's decision, recorded as predicted blocks."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    pod: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    ttl_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_input(self) -> "RouteRecord":
        if (self.token_ids is None) == (self.block_hashes is None):
            raise ValueError("give exactly one of token_ids, block_hashes")
        return self


MAX_ROUTE_TTL_S = 600.0


def record_route(index: KvIndex, body: Any, *, max_ttl_s: float = MAX_ROUTE_TTL_S) -> dict[str, Any]:
    """Record a routing decision as predicted blocks; ``ttl_s`` may not exceed ``max_ttl_s``."""
    if not isinstance(body, dict):
        raise QueryError(400, "the body must be a JSON object")
    try:
        r = RouteRecord.model_validate(body)
        if r.ttl_s is not None and r.ttl_s > max_ttl_s:
            raise QueryError(400, f"ttl_s: at most {max_ttl_s:g} seconds")
        index.record_route(r.model, r.pod, token_ids=r.token_ids, keys=r.block_hashes, ttl_s=r.ttl_s)
    except ValidationError as exc:
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise QueryError(400, msg) from None
    except ValueError as exc:
        raise QueryError(400, str(exc)) from None
    return {"recorded": True, "block_size": index.block_size(r.model)}


def pods_body(index: KvIndex) -> dict[str, Any]:
    return {"pods": {name: {"model": p.model, "blocks": p.blocks, "total_blocks": sum(p.blocks.values()),
                            "predicted_blocks": p.predicted_blocks, "epoch": p.epoch, "seq": p.seq,
                            "last_event_ts": p.last_event_ts, "last_seen": p.last_seen, "live": p.live}
                     for name, p in index.pods().items()}}

