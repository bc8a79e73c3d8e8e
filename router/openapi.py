"""The router's request models and its OpenAPI 3.1 document, generated from them.

The models are msgspec Structs: ``check(kind, body)`` converts an already-decoded JSON object to
the model of its endpoint (a few µs) and raises :class:`BadRequest` with the offending field as
``param``; unknown fields are allowed and forwarded as they are (engines take many more than the
router reads). The same Structs produce the JSON Schemas of ``/openapi.json`` (JSON Schema 2020-12,
which OpenAPI 3.1 uses as is).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Name = Annotated[str, Meta(min_length=1)]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatMessage(Struct, kw_only=True):
    role: Name
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Sampling(Struct, kw_only=True):
    model: Name
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    n: PosInt | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    priority: int | None = None
    lora: Annotated[str | None, Meta(description="LoRA adapter (InferNex extension; vLLM selects it as 'model')")] = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[str | list[Any] | None, Meta(
        description="a string, a list of strings, a list of token ids or a list of token-id lists")] = None
    prompt_token_ids: list[NonNegInt] | None = None
    echo: bool | None = None
    logprobs: NonNegInt | None = None
    suffix: str | None = None


class EmbeddingRequest(Struct, kw_only=True):
    model: Name
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PosInt | None = None
    user: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: Name
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool | None = None
    max_output_tokens: PosInt | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    user: str | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: Name
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: Name
    tokens: list[NonNegInt]


MODELS: dict[str, type[Struct]] = {
    "chat": ChatCompletionRequest, "completions": CompletionRequest, "embeddings": EmbeddingRequest,
    "responses": ResponsesRequest, "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest,
}

_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def check(kind: str, body: dict[str, Any]) -> Struct:
    """``body`` as the model of endpoint ``kind``; :class:`BadRequest` names the first wrong field."""
    try:
        req = msgspec.convert(body, MODELS[kind], strict=True)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _AT.search(msg)
        param = m.group(1) if m else None
        if param is None and msg.startswith("Object missing required field"):
            param = msg.split("`")[1] if "`" in msg else None
        raise BadRequest(msg.replace("`$.", "`"), param) from None
    if kind == "completions":
        _check_prompt(req)
    elif kind == "tokenize" and req.prompt is None and not req.messages:
        raise BadRequest("one of 'prompt' or 'messages' is required", "prompt")
    return req


def _check_prompt(req: CompletionRequest) -> None:
    p = req.prompt
    if p is None:
        if req.prompt_token_ids is None:
            raise BadRequest("'prompt' is required", "prompt")
        return
    if isinstance(p, str):
        return
    if not p:
        raise BadRequest("'prompt' must not be an empty list", "prompt")
    if all(isinstance(x, str) for x in p):
        return
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
        return
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)
           for x in p):
        return
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                     "token-id lists", "prompt")


# -- the document ------------------------------------------------------------------------------

class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(Struct):
    error: ErrorDetail


_ERR = {"description": "OpenAI-shaped error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
_ANY = {"description": "the engine's answer, passed through",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}}

_POSTS = [  # path, model kind, summary
    ("/v1/chat/completions", "chat", "Chat completion (streamed with stream=true)"),
    ("/v1/completions", "completions", "Text completion (streamed with stream=true)"),
    ("/v1/embeddings", "embeddings", "Embeddings, passed through to a backend serving the model"),
    ("/v1/responses", "responses", "Responses API, passed through to a backend serving the model"),
    ("/tokenize", "tokenize", "Tokenize with a backend serving the model"),
    ("/detokenize", "detokenize", "Detokenize with a backend serving the model"),
    ("/v1/router/decide", "chat", "Routing decision only (admin); the body is a chat or completion request"),
]
_GETS = [
    ("/v1/models", "List the models the backends serve"),
    ("/v1/models/{model}", "One model"),
    ("/v1/router/backends", "Backends as the router sees them (admin)"),
    ("/health", "Liveness"),
    ("/ready", "Readiness: 503 while draining or without a usable backend"),
    ("/version", "Router version"),
    ("/metrics", "Prometheus metrics"),
]


def document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the router's endpoints, schemas generated from the request models."""
    kinds = list(dict.fromkeys(k for _, k, _ in _POSTS))
    schemas, components = msgspec.json.schema_components(
        [MODELS[k] for k in kinds] + [ErrorResponse], ref_template="#/components/schemas/{name}")
    ref = dict(zip(kinds, schemas))
    paths: dict[str, Any] = {}
    errors = {str(s): _ERR for s in (400, 401, 404, 408, 413, 429, 502, 503)}
    for path, kind, summary in _POSTS:
        paths[path] = {"post": {
            "summary": summary, "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref[kind]}}},
            "responses": {"200": _ANY, **errors}}}
    for path, summary in _GETS:
        op: dict[str, Any] = {"summary": summary, "operationId": "get_" + path.strip("/").replace("/", "_")
                              .replace("{", "").replace("}", ""),
                              "responses": {"200": {"description": "OK"}, **errors}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {"get": op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "InferNex hermes-router", "version": version,
                 "description": "OpenAI-compatible API in front of vLLM-compatible engines."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }


DOCS_HTML = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>InferNex hermes-router API</title></head>
<body><h1>InferNex hermes-router API</h1>
<p>The OpenAPI 3.1 document is at <a href="/openapi.json">/openapi.json</a>; load it into any OpenAPI
viewer (no scripts are fetched from the internet by this page).</p>
<pre id="paths"></pre>
<script>
fetch('/openapi.json').then(r => r.json()).then(d => {
  const lines = [];
  for (const [p, ops] of Object.entries(d.paths)) for (const [m, op] of Object.entries(ops))
    lines.push(m.toUpperCase().padEnd(5) + ' ' + p.padEnd(24) + ' ' + (op.summary || ''));
  document.getElementById('paths').textContent = lines.join('\\n');
});
</script></body></html>
"""
