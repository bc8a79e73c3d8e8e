"""The HTTP edge: OpenAI-compatible API in front of the engines (consumers.http server, router.upstream client).

Request path: parse and check the body -> tokenize -> ``Router.decide`` over the state snapshot
-> (PD: prefill with ``max_tokens=1`` and ``do_remote_decode``) -> forward to the target, SSE
passed through event by event -> record. Connect failures go to another backend (bounded);
a backend dying mid-stream makes the request migrate with the text generated so far; a client
disconnect closes the upstream connection; all backends busy -> 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router import openapi
from router.admission import Admission, Refused
from router.config import RouterConfig
from consumers.http import ERROR_CODES, HttpError, Request, Response, Server, StreamResponse, error_response
from router import lazy_prompt
from router.relay import SseRelay
from router.metrics import ITL_BUCKETS, LATENCY_BUCKETS, LOOP_LAG_BUCKETS, FastMetrics, PluginEventsCollector, watch_loop_lag
from router.pd_protocol import PdProtocol, PrefillPeer
from router.core import Router
from router import flow as answer
# (_Flow: the name bench/router_path.py's child imports from this module in every tree it compares)
from router.flow import Flow as _Flow, sse_event as _sse_event
from router.records import BackendCapture, RecordSink, decision_inputs, decision_json
from router.resilience import RateLimiter, is_breaker_failure
from router.state import ClusterState
from router.tokenize import PromptEncoder
from router.types import BackendState, Decision, RoutingRequest
from router.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from schemas.records import RequestRecord
from simulator.tokenizer import request_text
from schemas.redact import redact_url
from streams.kv_keys import request_salt

log = logging.getLogger(__name__)

_KV_INDEX = None


def _kv_index():
    """:mod:`streams.kv_index`, imported the first time a request needs it (with numba: only a
    router with an index loads it), then kept: an import statement per request costs a lookup."""
    global _KV_INDEX
    if _KV_INDEX is None:
        import streams.kv_index as mod

        _KV_INDEX = mod
    return _KV_INDEX

_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode
_UPSTREAM_ERRORS = (UpstreamError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
_RID = "rid"
#: the log names an engine whose answers lack cached-token counts after this many of them
_WARN_AFTER = 20
_JSON = "application/json"
_BACKEND_HEADER = "X-InferNex-Backend"
_UNSET: Any = object()  # (an argument not given)
#: at most this many blocks a model's index tables are sized for ahead (~160 MB of tables with one
#: tier); past it they grow as blocks arrive
_RESERVE_MAX_BLOCKS = 1 << 21
# sent as they are to a backend serving the body's model
_PASSTHROUGH = {"/v1/embeddings": "embeddings", "/v1/responses": "responses", "/tokenize": "tokenize",
                "/detokenize": "detokenize"}
# OpenAI's error ``code`` is a string; these name the plain HTTP failures


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, _json_encode(obj), _JSON)


class RouterMetrics:
    """Per-request metrics are cheap :mod:`router.metrics` families; the rare events
    (rejections, retries, migrations) are prometheus_client counters."""

    def __init__(self, registry: CollectorRegistry, inflight=lambda: 0, queued=lambda: 0):
        fast = FastMetrics(registry)
        self.requests = fast.counter("infernex_router_requests_total", "Requests by outcome", ["strategy", "status"])
        self.duration = fast.histogram("infernex_router_request_duration_seconds", "End-to-end request time",
                                       ["strategy"], buckets=LATENCY_BUCKETS)
        self.ttft = fast.histogram("infernex_router_ttft_seconds", "Time to first token through the router",
                                   ["strategy", "pool", "role"], buckets=LATENCY_BUCKETS)
        self.itl = fast.histogram("infernex_router_itl_seconds",
                                  "Mean inter-token latency of a streamed request through the router",
                                  ["strategy", "pool", "role"], buckets=ITL_BUCKETS)
        self.queue = fast.histogram("infernex_router_queue_seconds",
                                    "Time a request waited for a backend slot (admission control)",
                                    ["strategy", "pool", "role"], buckets=LATENCY_BUCKETS)
        fast.gauge_function("infernex_router_queued_requests", "Requests waiting for a backend slot", queued)
        self.loop_lag = fast.histogram("infernex_router_event_loop_lag_seconds",
                                       "How late the router's event loop woke a task that sleeps 50 ms at a time: "
                                       "latency added to every request and stream event meanwhile",
                                       buckets=LOOP_LAG_BUCKETS)
        self.decision = fast.histogram("infernex_router_decision_seconds", "Time spent in Router.decide",
                                       ["strategy"],
                                       buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.1))
        self.dispatch = fast.histogram(
            "infernex_router_dispatch_seconds",
            "The router's own time before a request reaches an engine: from its body read to its first send "
            "(parsing, tokenizing, the routing decision, the decision record; the admission queue's wait, "
            "infernex_router_queue_seconds, and the connection to the engine left out)", ["strategy"],
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
        self.retries = Counter("infernex_router_retries_total", "Requests re-sent after a failure",
                               ["reason"], registry=registry)
        self.migrations = Counter("infernex_router_migrations_total", "Streams moved to another backend",
                                  registry=registry)
        self.picks = fast.counter("infernex_router_picks_total", "Backends picked", ["pod", "stage"])
        fast.gauge_function("infernex_router_inflight_requests", "Requests in flight", inflight)
        self.rejected = Counter("infernex_router_rejected_total", "Requests refused", ["reason"],
                                registry=registry)
        self.uncounted_cache = Counter(
            "infernex_router_answers_without_cached_tokens_total",
            "Answers that did not say how many prompt tokens the engine took from its cache, so their records "
            "count 0: reason no_details, a usage without prompt_tokens_details (vLLM started without "
            "--enable-prompt-tokens-details); no_usage, no usage at all (a stream through the endpoint picker "
            "whose client did not ask for it)", ["pod", "reason"], registry=registry)
        self.regret = fast.histogram("infernex_router_regret_blocks",
                                     "Best cached prefix any backend had minus the one chosen, in blocks",
                                     ["strategy"], buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
        self.overlap = fast.counter("infernex_router_overlap_blocks_total",
                                    "Cached prefix blocks: the best any backend had, and the chosen one's",
                                    ["strategy", "kind"])


class RouterService:
    """The HTTP server plus its upstream pool; start/stop/drain for the CLI and tests."""

    def __init__(self, cfg: RouterConfig, *, router: Router | None = None, state: ClusterState | None = None,
                 index: Any = None, registry: CollectorRegistry | None = None, records: RecordSink | None = None,
                 encoder: PromptEncoder | None = None):
        self.cfg = cfg
        self.router = router or Router(cfg.strategy, seed=cfg.seed, default_block_size=cfg.block_size)
        self.state = state or ClusterState(cfg)
        self.index = index
        # (model, pod, keys[, pieces=]) of a predicted route; ``pieces``: its untokenized text's keys (router.lazy_prompt)
        self.on_route: Callable[..., None] | None = None
        # (model, pod, "settle"|"forget", keys=, pieces=) when such a route ends here: the other replicas end it too
        self.on_route_end: Callable[..., None] | None = None
        self.replicas: Callable[[], dict] | None = None  # this replica and the others it hears (replica sync)
        # (ready, why not) of the embedded KV index: not ready while it reads the KV stream's backlog (router.feeds)
        self.kv_status: Callable[[], tuple[bool, str | None]] | None = None
        self.registry = registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.registry, inflight=lambda: self.inflight,
                                     queued=lambda: self.admission.queued)
        self.registry.register(PluginEventsCollector(lambda: self.router.strategy))
        name = self.router.name
        self._m_decision = self.metrics.decision.labels(name)
        self._m_duration = self.metrics.duration.labels(name)
        self._m_dispatch = self.metrics.dispatch.labels(name)
        self._m_role: dict[str, tuple[Any, Any, Any]] = {}  # role -> (ttft, itl, queue) children
        self._m_regret = self.metrics.regret.labels(name)
        self._m_overlap_best = self.metrics.overlap.labels(name, "best")
        self._m_overlap_chosen = self.metrics.overlap.labels(name, "chosen")
        self._m_requests: dict[str, Any] = {}
        self._no_cached_n: dict[tuple[str, str], int] = {}  # (backend, reason) -> answers without cached tokens
        self._reports_cached: set[str] = set()  # backends that have reported cached tokens (run with the flag)
        self._m_picks: dict[tuple[str, str], Any] = {}
        self.records = records
        self.pd = PdProtocol(cfg.pd)
        self._capture = BackendCapture()  # the backends each decision read, for its record
        self.encoder = encoder or PromptEncoder(cfg.tokenizer, cfg.tokenizer_vocab_size, fast=cfg.tokenizer_fast)
        # long prompts' tokenizing, off the event loop (a tokenizer.json's encoder releases the GIL);
        # the threads start with the first such prompt
        self._tok_threads = cfg.tokenize_threads if cfg.tokenizer is not None else 0
        self._tok_pool: ThreadPoolExecutor | None = None
        # pieces of text routed untokenized (router.lazy_prompt), for as long as route predictions last
        self.piece_routes = lazy_prompt.PieceRoutes(cfg.route_prediction_ttl_s)
        self._reserved: dict[str, int] = {}  # model -> blocks the index was sized for (_reserve_index)
        self._keys = [k.encode() for k in cfg.load_api_keys()]
        self._admin = cfg.admin_key.get_secret_value().encode() if cfg.admin_key else None
        self._engine_key, self._engine_keys = cfg.load_engine_keys()
        self.admission = Admission(cfg.admission)
        self.state.on_peer_change = self._peer_changed  # other router replicas' requests (replica sync)
        self.router.admission = cfg.admission.enabled  # busy filters defer to the queue (issue 22)
        self._limiter = RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst, self.state.clock) \
            if cfg.rate_limit_rps else None
        # request ids: a random 64-bit prefix per process and a counter (uuid4 costs a syscall each)
        self._rid_prefix = secrets.token_hex(8)
        self._rid_seq = itertools.count()
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.session: aiohttp.ClientSession | None = None  # /v1/models fan-out
        self.upstream: UpstreamPool | None = None  # inference requests (the hot path)
        self._tasks: list[asyncio.Task] = []
        self._preloads: set[asyncio.Task] = set()  # tokenizer loads started before any request asked
        self.url: str | None = None
        self._openapi: bytes | None = None
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------
    def _build_app(self) -> Server:
        app = Server(max_body=self.cfg.max_body_bytes, wrap=self._middleware, on_error=self._http_error,
                     request_timeout_s=self.cfg.request_timeout_s)
        app.add("POST", "/v1/chat/completions", self.chat)
        app.add("POST", "/v1/completions", self.completions)
        app.add("GET", "/v1/models", self.models)
        app.add("GET", "/health", self.health)
        app.add("GET", "/ready", self.ready)
        app.add("GET", "/healthz", self.health)  # the probe names every component answers (issue 21)
        app.add("GET", "/readyz", self.ready)
        app.add("GET", "/metrics", self.prom)
        app.add("POST", "/v1/router/decide", self.decide)
        app.add("GET", "/v1/router/backends", self.backends)
        # the surface vLLM users reach for: the API document, version, one model, pass-through
        app.add("GET", "/openapi.json", self.openapi_doc)
        app.add("GET", "/docs", self.docs)
        app.add("GET", "/version", self.version)
        app.add_prefix("GET", "/v1/models/", self.model)
        for path, kind in _PASSTHROUGH.items():
            app.add("POST", path, lambda r, path=path, kind=kind: self._passthrough(r, kind, path))
        return app

    async def open(self) -> None:
        if self.session is None:
            conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                            sock_read=self.cfg.read_timeout_s)
            self.session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False,
                                                 json_serialize=lambda o: _json_encode(o).decode())
        if self.upstream is None:
            self.upstream = UpstreamPool(connect_timeout=self.cfg.connect_timeout_s,
                                         read_timeout=self.cfg.read_timeout_s)
        self._tasks.append(asyncio.create_task(self._refresher()))
        self._tasks.append(asyncio.create_task(watch_loop_lag(self.metrics.loop_lag.observe), name="router-loop-lag"))
        self._preload_tokenizers()

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        await self.open()
        h, p = await self.app.start(host or self.cfg.host, self.cfg.port if port is None else port)
        self.url = f"http://{h}:{p}"
        return self.url

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests, wait for in-flight ones; True if all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), self.cfg.drain_timeout_s if timeout is None else timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        from consumers.bus import cancel_task

        for t in [*self._tasks, *self._preloads]:
            await cancel_task(t)
        self._tasks.clear()
        await self.app.close(grace_s=1.0)
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        if self._tok_pool is not None:
            self._tok_pool.shutdown(wait=False, cancel_futures=True)
            self._tok_pool = None

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.state.refresh()
            self.admission.resync(self.state.snapshot())
            self._preload_tokenizers()
            self._reserve_index()

    def _reserve_index(self) -> None:
        """Size the embedded index's tables for the KV capacity the engines report (the sum of
        ``num_gpu_blocks`` per model), so they do not grow, stalling every request for a rehash of
        the whole table, while the engines fill their caches (:meth:`KvIndex.reserve`)."""
        reserve = getattr(self.index, "reserve", None)
        if reserve is None:
            return
        total: dict[str, int] = {}
        for b in self.state.snapshot():
            if b.model and b.num_gpu_blocks:
                total[b.model] = total.get(b.model, 0) + b.num_gpu_blocks
        for model, blocks in total.items():
            blocks = min(blocks, _RESERVE_MAX_BLOCKS)
            if blocks > self._reserved.get(model, 0):
                self._reserved[model] = blocks
                if reserve(model, blocks):
                    log.info("KV index for %s sized for %d blocks (the engines' reported capacity)", model, blocks)

    def _preload_tokenizers(self) -> None:
        """Start loading the tokenizer of each model the backends serve (on a thread, once per model:
        :meth:`PromptEncoder.load`), so that model's first requests find it loaded."""
        st = self.router.strategy
        if not (st.needs_overlap or st.pd) or not self.encoder.enabled:
            return
        for model in {b.model for b in self.state.snapshot()}:
            if model and not self.encoder.ready(model) and not self.encoder.loading(model):
                task = asyncio.create_task(self.encoder.load(model), name=f"tokenizer-{model}")
                self._preloads.add(task)
                task.add_done_callback(self._preloads.discard)

    # -- middleware: request id, auth, limits, errors ---------------------------------------
    async def _middleware(self, request: Request, handler):
        rid = request.headers.get("x-request-id") or f"req-{self._rid_prefix}{next(self._rid_seq):016x}"
        request[_RID] = rid
        try:
            path = request.path
            if path.startswith("/v1/"):
                self._authorize(request, admin=path.startswith("/v1/router/"))
            resp = await handler(request)
        except ApiError as e:
            if e.status in (401, 403, 429):
                self.metrics.rejected.labels({401: "auth", 403: "auth", 429: "rate"}[e.status]).inc()
            resp = error_response(e.status, e.message, e.type, e.code, e.param, e.headers)
        except HttpError as e:
            resp = await self._http_error(request, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - never a stack trace to the client
            log.exception("internal error on %s (request %s)", request.path, rid)
            resp = error_response(500, "internal router error", "server_error", "internal_error")
        if not resp.prepared:
            resp.headers["X-Request-Id"] = rid
        return resp

    async def _http_error(self, request: Request | None, e: HttpError) -> Response:
        """Errors of the HTTP layer (no route, body too large, malformed request) as OpenAI errors."""
        if e.status == 413:
            self.metrics.rejected.labels("body_size").inc()
            return error_response(413, f"request body larger than {self.cfg.max_body_bytes} bytes",
                                  code="body_too_large")
        return error_response(e.status, e.message, code=ERROR_CODES.get(e.status, str(e.status)))

    def _authorize(self, request: Request, admin: bool) -> None:
        keys = [self._admin] if (admin and self._admin) else self._keys
        token = None
        if keys:
            auth = request.headers.get("authorization", "")
            if not auth.startswith("Bearer "):
                raise ApiError(401, "missing API key (Authorization: Bearer ...)", "authentication_error",
                               "invalid_api_key")
            token = auth[7:].strip().encode()
            ok = False
            for k in keys:  # compare with every key, in constant time each
                ok |= hmac.compare_digest(token, k)
            if not ok:
                raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key")
        if self._limiter is not None and not admin:
            key = token.decode(errors="replace") if token else (request.remote or "-")
            allowed, wait = self._limiter.allow(key)
            if not allowed:
                raise ApiError(429, "rate limit exceeded", "rate_limit_error", "rate_limit_exceeded",
                               headers={"Retry-After": str(max(1, int(wait + 0.999)))})

    # -- simple endpoints -------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    def not_ready_reason(self) -> str | None:
        """Why the router should not get traffic (None: it should): draining, no usable backend, or
        its KV index still reading the KV stream's backlog after a start."""
        if self.draining:
            return "draining"
        if not any(b.health != "critical" for b in self.state.snapshot()):
            return "no usable backend"
        if self.kv_status is not None:
            ok, why = self.kv_status()
            if not ok:
                return why
        return None

    async def ready(self, request: Request) -> Response:
        reason = self.not_ready_reason()
        if reason is not None:
            return json_response({"ready": False, "reason": reason}, status=503)
        usable = [b for b in self.state.snapshot() if b.health != "critical"]
        # backends with an open circuit still count: the healthy filter fails open to them when
        # every one is tripped, so taking the router out of service would only add an outage
        return json_response({"ready": True, "backends": len(usable),
                              "circuit_open": sum(1 for b in usable if b.circuit_open)})

    async def prom(self, request: Request) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": await self._model_list()})

    async def _model_list(self) -> list[dict]:
        backends = [b for b in self.state.snapshot() if not b.circuit_open]
        seen: dict[str, dict] = {}

        async def one(b: BackendState):
            try:
                async with self.session.get(b.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return _json_decode(await r.read()).get("data", [])
            except (*_UPSTREAM_ERRORS, msgspec.DecodeError, AttributeError):
                pass
            return []

        results = await asyncio.gather(*(one(b) for b in backends))
        for items in results:
            for m in items:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    seen.setdefault(m["id"], m)
        for b in backends:
            for mid in (b.model, *b.loras):
                seen.setdefault(mid, {"id": mid, "object": "model", "created": 0, "owned_by": "infernex"})
        return sorted(seen.values(), key=lambda m: m["id"])

    async def openapi_doc(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = _json_encode(openapi.document(_version()))
        return Response(200, self._openapi, _JSON)

    async def docs(self, request: Request) -> Response:
        return Response(200, openapi.DOCS_HTML, "text/html; charset=utf-8")

    async def version(self, request: Request) -> Response:
        return json_response({"version": _version(), "name": "infernex-hermes-router"})

    async def model(self, request: Request) -> Response:
        """``/v1/models/{id}``: the id may hold slashes (``Qwen/Qwen3-8B``) and %-escapes."""
        from urllib.parse import unquote

        mid = unquote(request.path[len("/v1/models/"):])
        for m in (await self._model_list()):
            if m["id"] == mid:
                return json_response(m)
        raise ApiError(404, f"The model `{mid}` does not exist.", "invalid_request_error", "model_not_found",
                       "model")

    def _refuse_if_draining(self) -> None:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise ApiError(503, "router is draining", "service_unavailable", "draining",
                           headers={"Retry-After": str(self.cfg.retry_after_s)})

    async def _passthrough(self, request: Request, kind: str, path: str) -> Response | StreamResponse:
        """Embeddings, Responses, tokenize, detokenize: checked, then sent unchanged to a backend serving
        the model (connect failures go to another one); the answer, streamed or not, comes back as is."""
        self._refuse_if_draining()
        body = await self._read_json(request)
        self._check_body(kind, body)
        rid = request[_RID]
        model = body["model"]
        base = self.state.lora_base(model)
        rreq = RoutingRequest(model=model, request_id=rid, prompt_tokens=max(1, len(request.body) // 4),
                              lora=model if base else None, index_model=base)
        key = self._client_key(request)
        self._enter(key)
        try:
            return await self._passthrough_run(request, rreq, path, key)
        finally:
            self.admission.leave(key)

    async def _passthrough_run(self, request: Request, rreq: RoutingRequest, path: str,
                               key: str) -> Response | StreamResponse:
        rid = rreq.request_id
        t0 = time.perf_counter()
        exclude: set[str] = set()
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
        for _ in range(self.cfg.max_retries + 1):
            d, _ = await self._admit(rreq, exclude, key, t0)
            if not d.ok:
                raise self._decision_error(d, rreq)
            b = d.target
            self._started(b, 0, 0)
            up: UpstreamResponse | None = None
            try:
                try:
                    up = await self.upstream.post(b.url, path, request.body, self._upstream_headers(b, headers))
                except _UPSTREAM_ERRORS as e:
                    log.warning("connect to %s failed for %s: %s", b.pod, rid, type(e).__name__)
                    if is_breaker_failure(e):  # slowness (a timed-out connect) is not a failure
                        self.state.breakers.failure(b.pod)
                    exclude.add(b.pod)
                    continue
                self.state.breakers.success(b.pod)
                ctype = up.headers.get("content-type", _JSON)
                out_headers = {"X-Request-Id": rid, _BACKEND_HEADER: b.pod}
                if not ctype.startswith("text/event-stream"):
                    try:
                        data = await up.read()
                    except _UPSTREAM_ERRORS:
                        raise ApiError(502, f"backend {b.pod} broke off its answer", "server_error",
                                       "upstream_error") from None
                    if up.status >= 400:
                        data, ctype = _openai_error_body(up.status, data), _JSON
                    return Response(up.status, data, ctype, out_headers)
                resp = StreamResponse(up.status, {"Content-Type": ctype, "Cache-Control": "no-cache", **out_headers})
                await resp.prepare(request)
                try:
                    async for chunk in up.iter_any():
                        await resp.write(chunk)
                except _UPSTREAM_ERRORS:
                    log.warning("backend %s failed mid-stream for %s", b.pod, rid)
                    return resp
                await resp.write_eof()
                return resp
            finally:
                if up is not None:
                    if up.at_eof():
                        up.release()
                    else:
                        up.close()
                self._finished(b, 0, 0)
        raise ApiError(502, f"no backend answered after {len(exclude)} attempts", "server_error",
                       "upstream_unavailable")

    async def backends(self, request: Request) -> Response:
        infos = self._index_pods()
        out = []
        for b in self.state.snapshot():
            d = b.public()
            d["circuit"] = self.state.breakers.state(b.pod)
            d["max_inflight"] = self.admission.cap(b)
            d["url"] = redact_url(b.url)
            info = infos.get(b.pod)
            d["cached_blocks"] = sum(info.blocks.values()) if info is not None else 0
            d["cached_blocks_by_tier"] = dict(info.blocks) if info is not None else {}
            d["findings"] = self.state.health.reasons(b.pod)
            d["inflight_other_replicas"] = self.state.peer_load(b.pod)[0]  # of "inflight" (replica sync)
            out.append(d)
        body = {"strategy": self.router.name, "pool": self.state.pool, "backends": out}
        if self.replicas is not None:
            body["replicas"] = self.replicas()
        return json_response(body)

    def _index_pods(self) -> dict[str, Any]:
        fn = getattr(self.index, "pods", None)
        if fn is None:
            return {}
        return fn()

    async def decide(self, request: Request) -> Response:
        body = await self._read_json(request)
        kind = "chat" if "messages" in body else "completions"
        self._check_body(kind, body)
        model = body.get("model")
        if isinstance(model, str):
            await self.encoder.load(model, self._base_model(body, model))  # (on a thread, the first time)
        rreq = self._routing_request(kind, body, request[_RID])
        decision = self._decide(rreq)
        return json_response({"request_id": request[_RID], "prompt_tokens": rreq.prompt_tokens,
                                  **decision.to_dict()})

    # -- inference --------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response | StreamResponse:
        return await self._inference(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response | StreamResponse:
        return await self._inference(request, "completions", "/v1/completions")

    async def _read_json(self, request: Request) -> dict[str, Any]:
        raw = request.body
        try:
            body = _json_decode(raw)
        except msgspec.DecodeError:
            raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not valid UTF-8", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    @staticmethod
    def _check_body(kind: str, body: dict[str, Any]) -> None:
        """The body against the endpoint's request model (router.openapi): wrong types are 400s here,
        not errors deeper in the router."""
        try:
            openapi.check(kind, body)
        except openapi.BadRequest as e:
            raise ApiError(400, e.message, code="invalid_value", param=e.param) from None

    def _routing_request(self, kind: str, body: dict[str, Any], rid: str, raw_len: int = 0,
                         ids: Any = _UNSET) -> RoutingRequest:
        """The request as the strategy reads it; ``ids``: the prompt's token ids when already
        tokenized (:meth:`_routing_request_async`), else tokenized here when the strategy reads them."""
        st = self.router.strategy
        lora = body.get("lora") if isinstance(body.get("lora"), str) else None
        model = body["model"]
        base = self._base_model(body, model)
        if base is not None:  # vLLM selects a LoRA adapter by its name in "model"
            lora = model
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        mt = body.get("max_completion_tokens") or body.get("max_tokens")
        rreq = RoutingRequest(model=model, request_id=rid, max_tokens=mt, lora=lora, cache_salt=salt, index_model=base)
        # token ids only when the strategy reads them (prefix overlap, PD decider, buckets); an
        # adapter's prompt with its base model's tokenizer, as the engine tokenizes it; a long text
        # prompt only as far as an engine may hold it (router.lazy_prompt)
        if ids is _UNSET:
            lazy = self._lazy_plan(kind, body, rreq)
            if lazy is not None:
                self._lazy_finish(rreq, lazy, lazy_prompt.run(lazy[1], lazy[0]))
                return rreq
            ids = self.encoder.encode(kind, body, as_array=True, base=base) if (st.needs_overlap or st.pd) else None
        if ids is None:
            n = max(1, raw_len // 4) if raw_len else len(str(body.get("messages") or body.get("prompt"))) // 4
        else:
            n = len(ids)
        rreq.token_ids, rreq.prompt_tokens = ids, n
        return rreq

    def _lazy_plan(self, kind: str, body: dict[str, Any], rreq: RoutingRequest) -> tuple[Any, Any, int] | None:
        """(piece plan, its :func:`router.lazy_prompt.lazy_steps`, block size) when the prompt is
        long text to tokenize only as far as an engine may hold it, else None."""
        st = self.router.strategy
        if not (self.cfg.tokenize_lazily and st.needs_overlap and self.index is not None):
            return None
        tok = self.encoder.tokenizer_for(rreq.model, rreq.index_model)
        if tok is None or getattr(tok, "plan", None) is None:
            return None
        try:
            got = request_text(tok, kind, body)
            plan = tok.plan(got[0], got[1]) if got is not None else None
        except (ValueError, KeyError, TypeError):
            return None
        if plan is None:
            return None
        block_key_array = _kv_index().block_key_array
        model = rreq.index_model or rreq.model
        bs = self.index.block_size(model)
        salt = request_salt(rreq.cache_salt)
        index = self.index
        rec = getattr(index, "record_route", None) if st.approximate else None

        def keys_of(ids):
            return block_key_array(ids, bs, lora=rreq.lora, salt=salt)

        def counts(keys) -> tuple[dict[str, int], dict[str, int]]:
            """(matched blocks, of them predicted only) per pod."""
            if hasattr(index, "match_counts"):
                return index.match_counts(model, keys)
            got = index.match_keys(model, keys)
            return {p: m.matched_blocks for p, m in got.items()}, {p: m.predicted_blocks for p, m in got.items()}

        def matched(keys) -> int:
            return max(counts(keys)[0].values(), default=0)

        def materialize(pod: str, keys) -> None:
            # only past what the engine's events say it holds: a held block evicted later must not
            # stay counted as predicted (no event would confirm it again)
            if rec is None or not len(keys):
                return
            got, pred = counts(keys)
            held = got.get(pod, 0) - pred.get(pod, 0)
            if held < len(keys):
                rec(model, pod, keys=keys[held:] if held > 0 else keys)

        steps = lazy_prompt.lazy_steps(plan, self.piece_routes, model, time.monotonic(), bs, keys_of=keys_of,
                                       matched=matched, materialize=materialize)
        return plan, steps, bs

    @staticmethod
    def _lazy_finish(rreq: RoutingRequest, lazy: tuple[Any, Any, int], done: tuple[Any, Any, int]) -> None:
        plan, _, bs = lazy
        ids, keys, k, chars = done
        rreq.token_ids = ids
        rreq.prompt_keys = (bs, keys)
        rreq.prompt_tokens = lazy_prompt.estimate_tokens(plan, chars, len(ids))
        rreq.piece_tail = [plan.chain(i) for i in range(k, len(plan))] if k < len(plan) else None

    def _base_model(self, body: dict[str, Any], model: str) -> str | None:
        """The base model when ``model`` names a LoRA adapter (and the body names no ``lora``)."""
        return self.state.lora_base(model) if not isinstance(body.get("lora"), str) else None

    async def _routing_request_async(self, kind: str, body: dict[str, Any], rid: str, raw_len: int) -> RoutingRequest:
        """:meth:`_routing_request`; a long prompt is tokenized on the tokenizer threads when its
        tokenizer releases the GIL (a ``tokenizer.json``), so the event loop serves other requests
        meanwhile and several prompts are tokenized at once on a machine with the cores. A model's
        tokenizer is loaded on a thread the first time it is needed (:meth:`PromptEncoder.load`)."""
        st = self.router.strategy
        model = body.get("model")
        reads = (st.needs_overlap or st.pd) and isinstance(model, str)  # the prompt's tokens, to route
        base = self._base_model(body, model) if reads else None
        if reads and not self.encoder.ready(model, base):
            await self.encoder.load(model, base)
        if not self._tok_threads or raw_len < self.cfg.tokenize_offload_bytes:
            return self._routing_request(kind, body, rid, raw_len)
        if self.cfg.tokenize_lazily and st.needs_overlap and isinstance(model, str):
            tok = self.encoder.tokenizer_for(model, base)
            rreq = self._routing_request(kind, body, rid, raw_len, ids=None)  # everything but the ids
            lazy = self._lazy_plan(kind, body, rreq)
            if lazy is not None:  # the pieces to encode on a tokenizer thread, the index read here
                plan, steps, _ = lazy
                at = next(steps)
                while True:
                    if getattr(tok, "releases_gil", False) and plan.missing_chars_at(*at) >= self.cfg.tokenize_offload_bytes:
                        ids = await asyncio.get_running_loop().run_in_executor(self._pool(), plan.ids_at, *at)
                    else:
                        ids = plan.ids_at(*at)
                    try:
                        at = steps.send(ids)
                    except StopIteration as done:
                        self._lazy_finish(rreq, lazy, done.value)
                        return rreq
        text = kind == "chat" or isinstance(body.get("prompt"), str)  # (token ids need no tokenizer)
        if not reads or not text:
            return self._routing_request(kind, body, rid, raw_len)
        tok = self.encoder.tokenizer_for(model, base)
        if tok is None or not getattr(tok, "releases_gil", False):
            return self._routing_request(kind, body, rid, raw_len)
        ids = await asyncio.get_running_loop().run_in_executor(self._pool(), self.encoder.encode_with, tok, kind, body)
        return self._routing_request(kind, body, rid, raw_len, ids)

    def _pool(self) -> ThreadPoolExecutor:
        pool = self._tok_pool
        if pool is None:
            pool = self._tok_pool = ThreadPoolExecutor(self._tok_threads, thread_name_prefix="router-tokenize")
        return pool

    def _decide(self, rreq: RoutingRequest, flow: _Flow | None = None) -> Decision:
        t = time.perf_counter()
        st = self.state
        snap, now = st.snapshot(), st.clock.now()
        if (flow is not None and rreq.token_ids is not None and len(rreq.token_ids)
                and self.router.strategy.approximate and self.index is not None):
            if self._prompt_keys(flow, self.index.block_size(rreq.index_model or rreq.model)) is not None:
                rreq.prompt_keys = flow.keys  # the index is read with them (router.core.overlaps_from_index)
        d = self.router.decide(rreq, snap, self.index, now, load_epoch=st.epoch)
        if flow is not None and self.records is not None:  # what it read, for replay (recorded later)
            flow.captured = (self._capture(snap, st.epoch), now)
        self._m_decision.observe(time.perf_counter() - t)
        return d

    def _started(self, b: BackendState, prompt_tokens: int, prefill_tokens: int) -> None:
        self.state.started(b, prompt_tokens, prefill_tokens)
        self.admission.started(b)

    def _finished(self, b: BackendState, prompt_tokens: int, prefill_tokens_left: int) -> None:
        self.state.finished(b, prompt_tokens, prefill_tokens_left)
        self.admission.finished(b)

    def _peer_changed(self, b: BackendState, inflight: int) -> None:
        """Another replica's requests on ``b`` went up or down by ``inflight``: the same admission
        bookkeeping as this replica's own (a backend at its cap is left out; a freed slot wakes a
        waiter)."""
        if inflight > 0:
            self.admission.started(b)
        else:
            for _ in range(-inflight):
                self.admission.finished(b)

    def _client_key(self, request: Request) -> str:
        """Who a request counts against for quotas and fairness: its (already checked) API key, or
        its address when the router takes no keys (a free-form header could dodge the quota)."""
        if self._keys:
            return request.headers.get("authorization", "-")
        return request.remote or "-"

    def _enter(self, key: str) -> None:
        try:
            self.admission.enter(key)
        except Refused as e:
            self.metrics.rejected.labels("quota").inc()
            raise ApiError(e.status, e.message, "rate_limit_error", e.code,
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None

    async def _admit(self, rreq: RoutingRequest, exclude: set[str], key: str, t0: float,
                     flow: _Flow | None = None) -> tuple[Decision, float]:
        """A decision over the backends with a free slot; when all that could serve the request are
        at their cap, wait in the model's queue (bounded, with a deadline) -> (decision, seconds queued)."""
        adm = self.admission
        if not adm.cfg.enabled:
            if exclude:
                rreq.exclude = frozenset(exclude)
            return self._decide(rreq, flow), 0.0
        qkey = rreq.index_model or rreq.model
        queued = 0.0
        jump = adm.waiting(qkey)  # others wait for this model already: queue behind them
        while True:
            if not jump:
                full = adm.full
                ex = (exclude | full) if full else exclude
                if ex or rreq.exclude:
                    rreq.exclude = frozenset(ex)
                d = self._decide(rreq, flow)
                if d.ok or not full:
                    return d, queued
                rreq.exclude = frozenset(exclude)
                d2 = self._decide(rreq, flow)
                if not d2.ok:
                    return d2, queued  # not for lack of slots
            jump = False
            t = time.perf_counter()
            try:
                await adm.wait(qkey, key, t0 + adm.cfg.queue_timeout_s - t)
            except Refused as e:
                self.metrics.rejected.labels(e.code).inc()
                raise ApiError(e.status, e.message, "service_unavailable", e.code,
                               headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
            finally:
                queued += time.perf_counter() - t

    async def _inference(self, request: Request, kind: str, path: str) -> Response | StreamResponse:
        entered = time.perf_counter()
        self._refuse_if_draining()
        body = await self._read_json(request)
        self._check_body(kind, body)
        rid = request[_RID]
        stream = bool(body.get("stream"))
        arrival, t0 = time.time(), time.perf_counter()
        rreq = await self._routing_request_async(kind, body, rid, len(request.body))
        flow = _Flow(rid=rid, kind=kind, path=path, body=body, stream=stream, arrival=arrival, t0=t0, rreq=rreq,
                     raw=request.body, entered=entered)
        if stream:
            so = body.get("stream_options")
            flow.wants_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        flow.key = self._client_key(request)
        self._enter(flow.key)
        self.inflight += 1
        self._idle.clear()
        resp: StreamResponse | None = None
        try:
            resp = await self._run(request, flow)
            return resp
        except asyncio.CancelledError:
            flow.status, flow.http_status, flow.error = "cancelled", 499, "client disconnected"
            raise
        except ConnectionResetError:  # the client went away while we wrote to it
            flow.status, flow.http_status, flow.error = "cancelled", 499, "client disconnected"
            raise asyncio.CancelledError() from None
        except ApiError as e:
            flow.status = "rejected" if e.status in (404, 503) else "error"
            flow.http_status, flow.error = e.status, e.message
            raise
        finally:
            self.admission.leave(flow.key)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
            # metrics and records after the response is written (off the request's latency)
            asyncio.get_running_loop().call_soon(self._finish, flow)

    async def _run(self, request: Request, flow: _Flow) -> Response | StreamResponse:
        cfg = self.cfg
        resp: StreamResponse | None = None
        body = flow.body
        while True:
            rreq = flow.rreq
            decision, waited = await self._admit(rreq, flow.exclude, flow.key, flow.t0, flow)
            flow.queue_s += waited
            flow.decision = decision
            self._publish_decision(flow, decision)
            if not decision.ok:
                err = self._decision_error(decision, rreq)
                if resp is not None:  # mid-migration: tell the client in-band
                    flow.status, flow.error = "error", err.message
                    await self._write_sse_error(resp, err.message)
                    return resp
                raise err
            target = decision.target
            send_body = body
            prefill_tokens = max(flow.rreq.prompt_tokens - decision.chosen_overlap_blocks * decision.block_size, 0)
            if decision.prefill is not None:
                kvp = await self._prefill(flow, decision.prefill, body)
                if kvp is None:  # prefill failed; retry the whole decision without that pod
                    if flow.retries > cfg.max_retries:
                        raise ApiError(502, "no prefill backend answered", "server_error", "upstream_unavailable")
                    continue
                send_body = dict(body)
                send_body.pop("kv_transfer_params", None)
                send_body["kv_transfer_params"] = kvp
                prefill_tokens = 0
            if flow.stream and not flow.wants_usage:
                send_body = dict(send_body)
                send_body["stream_options"] = answer.usage_asked(send_body.get("stream_options"))
            self._note_route(flow, decision)
            resp, outcome = await self._forward(request, flow, target, send_body, resp, prefill_tokens)
            if outcome is None:
                return resp
            if outcome == "recomputed":  # vllm-ascend: the rest again, on a fresh prefill/decode pair
                flow.recomputed = False
                flow.recomputes += 1
                self.metrics.retries.labels("recomputed").inc()
                nb = self._continuation(flow) if flow.recomputes <= self.pd.cfg.max_recomputes else False
                if nb is False or nb is None:
                    msg = None if nb is None else "decode recomputed too often"
                    if resp is not None and resp.prepared:
                        if msg:
                            flow.status, flow.error = "error", msg
                            await self._write_sse_error(resp, msg)
                        else:
                            await resp.write(b"data: [DONE]\n\n")
                            await resp.write_eof()
                            flow.done = True
                        return resp
                    raise ApiError(502, msg or "decode recomputed with nothing left", "server_error",
                                   "upstream_unavailable")
                body = nb
                continue
            # the backend failed; outcome is the reason ("slow": timed out, not counted as broken)
            if is_breaker_failure(outcome):
                self.state.breakers.failure(target.pod)
            flow.exclude.add(target.pod)
            if resp is not None and resp.prepared:
                # mid-stream: migrate with what was generated so far
                flow.migrations += 1
                flow.migrated_tokens = flow.out_tokens  # (the continuation's usage is counted from here)
                self.metrics.migrations.inc()
                if flow.migrations > cfg.max_migrations:
                    flow.status, flow.error = "error", "backend failed mid-stream; migration limit reached"
                    await self._write_sse_error(resp, flow.error)
                    return resp
                try:
                    nb = self._continuation(flow)
                except ApiError as e:
                    flow.status, flow.error = "error", e.message
                    await self._write_sse_error(resp, e.message)
                    return resp
                if nb is None:  # nothing left to generate
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    flow.done = True
                    return resp
                body = nb
                continue
            flow.retries += 1
            self.metrics.retries.labels(str(outcome)).inc()
            if flow.retries > cfg.max_retries:
                raise ApiError(502, f"no backend answered after {flow.retries} attempts", "server_error",
                               "upstream_unavailable")

    def _decision_error(self, d: Decision, rreq: RoutingRequest | None = None) -> ApiError:
        if d.status == "no_model":
            return ApiError(404, d.reason, "invalid_request_error", "model_not_found", "model")
        lora = rreq.lora if rreq is not None else None
        if lora and d.status == "no_backend" and not any(lora in b.loras for b in self.state.snapshot()):
            # no backend holds the adapter at all: retrying will not help (404, not 503)
            return ApiError(404, f"LoRA adapter {lora!r} is not served by any backend", "invalid_request_error",
                            "model_not_found", "lora" if rreq.index_model is None else "model")
        if d.status == "busy":
            self.metrics.rejected.labels("busy").inc()
            return ApiError(503, "all backends are busy, retry later", "service_unavailable", "busy",
                            headers={"Retry-After": str(self.cfg.retry_after_s)})
        self.metrics.rejected.labels("no_backend").inc()
        return ApiError(503, f"no backend available: {d.reason}", "service_unavailable", "no_backend",
                        headers={"Retry-After": str(self.cfg.retry_after_s)})

    def _pick(self, pod: str, stage: str) -> None:
        c = self._m_picks.get((pod, stage))
        if c is None:
            c = self._m_picks[(pod, stage)] = self.metrics.picks.labels(pod, stage)
            for why in ("no_details", "no_usage"):  # (at 0 from the engine's first pick: increase() sees the first)
                self.metrics.uncounted_cache.labels(pod, why)
        c.inc()

    def _note_route(self, flow: _Flow, d: Decision) -> None:
        t = d.target
        self._m_regret.observe(max(0, d.best_overlap_blocks - d.chosen_overlap_blocks))
        self._m_overlap_best.inc(d.best_overlap_blocks)
        self._m_overlap_chosen.inc(d.chosen_overlap_blocks)
        if d.prefill is not None:
            flow.prefill_pod = d.prefill.pod
            flow.decode_pod = t.pod
            self._pick(d.prefill.pod, "prefill")
            self._pick(t.pod, "decode")
        else:
            self._pick(t.pod, "decode" if self.router.strategy.pd else "aggregated")
            if self.router.strategy.pd:
                flow.decode_pod = t.pod
        for p in ([d.prefill.pod] if d.prefill else []) + [t.pod]:
            if p not in flow.pods:
                flow.pods.append(p)
        self.predict_route(flow.rreq, d, lambda bs: self._prompt_keys(flow, bs))

    def predict_route(self, rreq: RoutingRequest, d: Decision, keys_at: Callable[[int | None], Any]) -> None:
        """With an approximate prefix scorer: the prompt's blocks count as predicted on the engine it
        goes to (the prefill engine under PD) until that engine's KV events say what it holds; its
        untokenized text (router.lazy_prompt) is remembered there too; both are shared with the
        other replicas. ``keys_at(block_size)``: the prompt's block keys."""
        rec = getattr(self.index, "record_route", None) if self.router.strategy.approximate else None
        if rec is None or rreq.token_ids is None or not len(rreq.token_ids):
            return
        try:
            model = rreq.index_model or rreq.model  # a LoRA adapter's blocks live under its base
            keys = keys_at(self.index.block_size(model))
            if keys is None:
                return
            pod = (d.prefill or d.target).pod
            # the blocks the engine already reported there need no prediction: only the rest
            held = 0
            if d.stages:
                st0 = d.stages[0]
                held = st0.overlap.get(pod, 0) - st0.predicted.get(pod, 0)
            todo = keys if held <= 0 else keys[held:]  # (empty when it holds them all)
            if len(todo):
                rec(model, pod, keys=todo)
            tail = rreq.piece_tail  # the text past what was tokenized (router.lazy_prompt)
            if tail:
                self.piece_routes.add(model, tail, pod, time.monotonic())
            if self.on_route is not None and (len(todo) or tail):  # the other replicas (router.replica_sync)
                if tail:
                    self.on_route(model, pod, todo, pieces=tail)
                else:
                    self.on_route(model, pod, todo)
        except (KeyError, ValueError, TypeError):
            pass

    def settle_routes(self, rreq: RoutingRequest | None, pods: Sequence[str]) -> None:
        """The request is over on ``pods``: its untokenized text's routes there end shortly
        (:meth:`router.lazy_prompt.PieceRoutes.settle`), and from then on the engines' KV events alone
        say what they hold of it. The other replicas, which got these routes, end theirs too."""
        tail = rreq.piece_tail if rreq is not None else None
        if not tail:
            return
        model = rreq.index_model or rreq.model
        until = time.monotonic() + lazy_prompt.SETTLE_S
        for pod in pods:
            self.piece_routes.settle(model, tail, pod, until)
        if self.on_route_end is not None and self.router.strategy.approximate:  # (only then shared: predict_route)
            for pod in pods:  # the other replicas' copies (router.replica_sync)
                self.on_route_end(model, pod, "settle", pieces=tail)  # the pieces as on_route sent them

    def _forget_route(self, flow: _Flow, pod: str) -> None:
        """``flow`` left ``pod`` before its prefill ran there (failed, timed out, cancelled): the
        blocks predicted there for it end now instead of counting for their time to live, here and
        on the other replicas."""
        forget = getattr(self.index, "forget_route", None) if self.router.strategy.approximate else None
        if forget is None or flow.rreq.token_ids is None:
            return
        model = flow.rreq.index_model or flow.rreq.model
        try:
            keys = self._prompt_keys(flow, self.index.block_size(model))
            if keys is not None and len(keys):
                forget(model, pod, keys)
                if self.on_route_end is not None:  # the other replicas' copies (router.replica_sync)
                    # (the whole prompt's keys, as here: the route shared the part past what the
                    # engine had reported, and only predictions end, never what its events said)
                    self.on_route_end(model, pod, "forget", keys=keys)
        except (KeyError, ValueError, TypeError):
            pass

    def request_keys(self, rreq: RoutingRequest, block_size: int | None) -> Any:
        """The prompt's block keys at ``block_size`` (``uint64``), hashed once and kept on ``rreq``."""
        ids = rreq.token_ids
        if ids is None or not len(ids) or not block_size:
            return None
        if rreq.prompt_keys is None or rreq.prompt_keys[0] != block_size:
            rreq.prompt_keys = (block_size, _kv_index().block_key_array(ids, block_size, lora=rreq.lora,
                                                                        salt=request_salt(rreq.cache_salt)))
        return rreq.prompt_keys[1]

    def _prompt_keys(self, flow: _Flow, block_size: int | None) -> Any:
        """The whole prompt's block keys (under its LoRA adapter and cache salt) at ``block_size``, a
        ``uint64`` array hashed once per request: the predicted blocks and the decision record use them."""
        keys = self.request_keys(flow.rreq, block_size)
        if keys is not None:
            flow.keys = flow.rreq.prompt_keys
        return keys

    async def _prefill(self, flow: _Flow, pb: BackendState, body: dict[str, Any]) -> dict | None:
        """PD stage one (fields per KV connector: :mod:`router.pd_protocol`); returns the decode's
        kv_transfer_params, None when the prefill failed."""
        pre = self.pd.prefill_body(body, flow.rid)
        peer = PrefillPeer(pb.url, pb.pod)
        self.state.breakers.attempt(pb.pod)
        self._started(pb, flow.rreq.prompt_tokens, flow.rreq.prompt_tokens)
        t = time.perf_counter()
        try:
            headers = self._headers(flow, pb)
            extra = self.pd.prefill_headers(peer)
            if extra:
                headers = {**headers, **extra}
            data = _json_encode(pre)
            _dispatched(flow)
            r = await self.upstream.post(pb.url, flow.path, data, headers)
            try:
                data = await r.read()
            finally:
                r.release()
            if r.status >= 500:
                raise UpstreamError("read", f"prefill answered HTTP {r.status}")
            if r.status >= 400:
                raise ApiError(r.status, _upstream_message(data), code="prefill_rejected")
            answered = _json_decode(data).get("kv_transfer_params")
            try:
                kvp = self.pd.decode_params(answered if isinstance(answered, dict) else None, peer, flow.rid)
            except ValueError as e:
                raise UpstreamError("read", f"prefill on {pb.pod}: {e}") from None
            self.state.breakers.success(pb.pod)
            flow.prefill_end_t = time.perf_counter()
            flow.prefill_s = flow.prefill_end_t - t
            return kvp
        except (*_UPSTREAM_ERRORS, msgspec.DecodeError, AttributeError) as e:
            log.warning("prefill on %s failed for %s: %s", pb.pod, flow.rid, type(e).__name__)
            self._forget_route(flow, pb.pod)
            if is_breaker_failure(e):
                self.state.breakers.failure(pb.pod)
            flow.exclude.add(pb.pod)
            flow.retries += 1
            self.metrics.retries.labels("prefill").inc()
            return None
        finally:
            self._finished(pb, flow.rreq.prompt_tokens, flow.rreq.prompt_tokens)

    async def _forward(self, request: Request, flow: _Flow, b: BackendState, body: dict[str, Any],
                       resp: StreamResponse | None, prefill_tokens: int):
        """Send to ``b``: ``(client response, None)`` when done, ``(response or None, reason)`` on failure."""
        self.state.breakers.attempt(b.pod)
        self._started(b, flow.rreq.prompt_tokens, prefill_tokens)
        pending = prefill_tokens
        up: UpstreamResponse | None = None
        try:
            try:
                data = flow.raw if (body is flow.body and flow.raw is not None) else _json_encode(body)
                headers = self._headers(flow, b)
                _dispatched(flow)
                up = await self.upstream.post(b.url, flow.path, data, headers)
            except _UPSTREAM_ERRORS as e:
                log.warning("connect to %s failed for %s: %s", b.pod, flow.rid, type(e).__name__)
                return resp, "connect" if is_breaker_failure(e) else "slow"
            if up.status >= 500 and resp is None:
                await up.read()
                return resp, f"http_{up.status}"
            if up.status >= 400 or not flow.stream:
                try:
                    data = await up.read()
                except _UPSTREAM_ERRORS as e:
                    return resp, "read" if is_breaker_failure(e) else "slow"
                if resp is not None:  # continuation refused mid-migration
                    await self._write_sse_error(resp, _upstream_message(data))
                    flow.done = True
                    return resp, None
                self.state.breakers.success(b.pod)
                flow.http_status = up.status
                if up.status >= 400:  # refused: no prefill ran (`pending` is left for the finally block)
                    flow.status, flow.error = "error", _upstream_message(data)[:500]
                    data = _openai_error_body(up.status, data)
                else:
                    if answer.recomputed_json(flow, data, retries_recomputed=self.pd.retries_recomputed):
                        return resp, "recomputed"
                    if flow.recomputes:
                        data = answer.merge_recomputed(flow, data)
                    answer.account_json(flow, data)
                    self.state.first_token(b, pending)
                    pending = 0
                flow.done = True
                return Response(up.status, data, _JSON if up.status >= 400 else up.headers.get("content-type", _JSON),
                                {"X-Request-Id": flow.rid, _BACKEND_HEADER: b.pod}), None
            # streaming pass-through, event by event
            if resp is None:
                resp = StreamResponse(up.status, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  "X-Request-Id": flow.rid, "X-Accel-Buffering": "no",
                                                  _BACKEND_HEADER: b.pod})
                await resp.prepare(request)
            # the first token out ends the engine's prefill (the relay clears its callback once called)
            first = (lambda n=pending: self.state.first_token(b, n)) if pending else None
            relay = SseRelay(flow, resp, up, retries_recomputed=self.pd.retries_recomputed, on_first_token=first)
            try:
                try:
                    await up.pipe(relay, relay.flush)
                finally:
                    if pending and relay.on_first_token is None:
                        pending = 0
            except _UPSTREAM_ERRORS as e:
                if not flow.done and not flow.recomputed and flow.engine_error is None:
                    log.warning("backend %s failed mid-stream for %s: %s", b.pod, flow.rid, type(e).__name__)
                    return resp, "mid_stream" if is_breaker_failure(e) else "slow"
            if flow.engine_error is not None:
                # the engine ended the stream with an error event (a generation that failed): the
                # request goes on elsewhere with the text so far, as when an engine dies mid-stream;
                # vLLM's retryable kind (503, ServiceUnavailableError) does not count as broken
                code, etype, msg = flow.engine_error
                flow.engine_error = None
                log.warning("backend %s failed the generation of %s mid-stream: %s %s %s", b.pod, flow.rid, code,
                            etype, msg[:200])
                return resp, "slow" if (code == 503 or etype == "ServiceUnavailableError") else "engine_error"
            if flow.recomputed:
                self.state.breakers.success(b.pod)
                return resp, "recomputed"
            if not flow.done:
                # the stream ended without [DONE]: the backend went away
                log.warning("backend %s ended the stream early for %s", b.pod, flow.rid)
                return resp, "mid_stream"
            self.state.breakers.success(b.pod)
            await resp.write_eof()
            return resp, None
        finally:
            if up is not None:
                if flow.done and up.at_eof():
                    up.release()
                else:
                    up.close()  # closes the connection: the engine sees the cancel
            self._finished(b, flow.rreq.prompt_tokens, pending)
            if pending:  # no first token from it: what was predicted there for this prompt may never come
                self._forget_route(flow, b.pod)

    def _headers(self, flow: _Flow, b: BackendState | None = None) -> dict[str, str]:
        h = {"X-Request-Id": flow.rid, "Content-Type": "application/json"}
        return self._upstream_headers(b, h) if b is not None else h

    def _upstream_headers(self, b: BackendState, h: dict[str, str]) -> dict[str, str]:
        """``Authorization: Bearer`` for engines started with ``--api-key`` (per backend, else global)."""
        key = self._engine_keys.get(b.pod, self._engine_key)
        if key is not None:
            h["Authorization"] = key
        return h

    def _continuation(self, flow: _Flow) -> dict[str, Any] | None:
        """The request re-issued elsewhere: the text so far appended, ``max_tokens`` reduced."""
        body = dict(flow.body)
        if flow.stream and not flow.wants_usage:
            body["stream_options"] = answer.usage_asked(body.get("stream_options"))
        if not flow.text:
            return body  # nothing generated yet: the same request again
        key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        limit = body.get(key)
        if isinstance(limit, int):
            left = limit - flow.out_tokens
            if left <= 0:
                return None
            body[key] = left
        if flow.kind == "chat":
            msgs = list(body["messages"])
            msgs.append({"role": "assistant", "content": flow.text})
            body["messages"] = msgs
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            # token ids when we can tokenize like the engine (no re-split at the join), else text
            base = self.state.lora_base(flow.body.get("model"))  # an adapter: its base model's tokenizer
            prompt_ids = self.encoder.encode("completions", flow.body, base=base)
            gen = self.encoder.encode_text(flow.body.get("model"), flow.text, base) if prompt_ids is not None else None
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if prompt_ids is not None and gen is not None:
                body["prompt"] = prompt_ids + gen
                body.pop("prompt_token_ids", None)
            elif isinstance(p, str):
                body["prompt"] = p + flow.text
            else:
                raise ApiError(502, "backend failed mid-stream and the prompt form cannot be continued",
                               "server_error", "migration_impossible")
        return body

    async def _write_sse_error(self, resp: StreamResponse, message: str) -> None:
        try:
            await resp.write(_sse_event({"error": {"message": message, "type": "server_error", "param": None,
                                                   "code": "upstream_error"}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass

    # -- records ----------------------------------------------------------------------------
    def _publish_decision(self, flow: _Flow, d: Decision) -> None:
        if self.records is None:
            return
        now = time.time()
        pool, model = self.state.pool, flow.rreq.model
        captured, rreq, strategy = flow.captured, flow.rreq, self.router.strategy
        exclude = rreq.exclude
        for i, st in enumerate(d.stages):
            # built by the publisher task, off the request path; the first stage carries the inputs
            def build(st=st, first=i == 0):
                inputs = None
                if first and captured is not None:
                    keys = flow.keys[1] if flow.keys is not None and flow.keys[0] == d.block_size else None
                    inputs = decision_inputs(strategy=strategy, request=rreq, exclude=exclude, backends=captured[0],
                                             now=captured[1], block_size=d.block_size, overlap=st.overlap,
                                             predicted=st.predicted, prompt_keys=keys)
                return decision_json(request_id=flow.rid, ts=now, pool=pool, model=model, profile=d.profile,
                                     stage=st, inputs=inputs)

            self.records.submit_decision(build, msg_id=f"dec:{flow.rid}:{st.stage}:{now}")

    def _no_cached_report(self, pod: str, reason: str) -> None:
        """An answer that did not say how many prompt tokens the engine took from its cache, so its
        record says 0 (and the SLA history's prefix hit rate with it). ``no_details``: vLLM sends
        ``prompt_tokens_details`` only when started with ``--enable-prompt-tokens-details``.
        ``no_usage``: no usage at all, as a stream whose client did not ask carries none through an
        endpoint picker whose gateway does not relay answers in full duplex (the HTTP router, and the
        picker behind a full-duplex gateway, ask on the client's behalf and drop the usage chunk).
        ``no_details`` is counted only for an engine that has never reported cached tokens: vLLM 0.22
        and before send them only when the prompt took some from the cache. Counted per engine and
        reason, and said once per engine and reason in the log, after :data:`_WARN_AFTER` answers
        (not at an engine's first answers, which no cache can serve)."""
        self.metrics.uncounted_cache.labels(pod, reason).inc()
        n = self._no_cached_n[(pod, reason)] = self._no_cached_n.get((pod, reason), 0) + 1
        if n == _WARN_AFTER:
            if reason == "no_details":
                log.warning("backend %s reported no cached tokens in its usage in %d answers (start vLLM with "
                            "--enable-prompt-tokens-details); its request records count 0 cached tokens", pod, n)
            else:
                log.warning("%d answers from backend %s carried no usage (streams whose clients did not set "
                            "stream_options.include_usage); their request records count 0 cached tokens", n, pod)

    def _finish(self, flow: _Flow) -> None:
        e2e = time.perf_counter() - flow.t0
        self.settle_routes(flow.rreq, flow.pods)
        name = self.router.name
        c = self._m_requests.get(flow.status)
        if c is None:
            c = self._m_requests[flow.status] = self.metrics.requests.labels(name, flow.status)
        c.inc()
        self._m_duration.observe(e2e)
        if flow.dispatch_s is not None:
            self._m_dispatch.observe(flow.dispatch_s)
        if flow.pods and flow.status == "ok":
            pod = flow.pods[-1]
            if flow.cached_reported:
                self._reports_cached.add(pod)
            elif flow.prompt_tokens_reported is None:
                self._no_cached_report(pod, "no_usage")
            elif pod not in self._reports_cached:
                # (an engine that has reported cached tokens runs with the flag: vLLM 0.22 and before
                # leave them out of an answer whose prompt took nothing from the cache)
                self._no_cached_report(pod, "no_details")
        role = "pd" if flow.prefill_pod else "aggregated"
        hs = self._m_role.get(role)
        if hs is None:
            m, pool = self.metrics, self.state.pool
            hs = self._m_role[role] = (m.ttft.labels(name, pool, role), m.itl.labels(name, pool, role),
                                       m.queue.labels(name, pool, role))
        hs[2].observe(flow.queue_s)
        ttft = None
        if flow.first_token_t is not None:
            ttft = flow.first_token_t - flow.t0
            hs[0].observe(ttft)
        itl = None
        if flow.out_tokens > 1 and flow.first_token_t is not None and flow.last_token_t is not None:
            itl = (flow.last_token_t - flow.first_token_t) / (flow.out_tokens - 1)
            if flow.stream:  # (a non-streamed answer arrives at once: no inter-token time to see)
                hs[1].observe(itl)
        if self.records is None:
            return
        d = flow.decision
        pd = self.router.strategy.pd
        stage = ("pd" if flow.prefill_pod else "decode") if pd else "aggregated"
        tpot = kv_s = None
        if ttft is not None and flow.out_tokens > 1:
            tpot = max(e2e - ttft, 0.0) / (flow.out_tokens - 1)
        if flow.prefill_end_t is not None and flow.first_token_t is not None and flow.first_token_t >= flow.prefill_end_t:
            kv_s = flow.first_token_t - flow.prefill_end_t
        # built by a publisher task, after the response went out
        self.records.submit_request(lambda: RequestRecord(
            request_id=flow.rid, ts=flow.arrival, pool=self.state.pool, served_stage=stage,
            prefill_ttft_s=flow.prefill_s if flow.prefill_pod else None, kv_transfer_s=kv_s, tpot_s=tpot,
            role="pd" if pd else "aggregated", model=flow.rreq.model, profile=name,
            pods=flow.pods, prefill_pod=flow.prefill_pod, decode_pod=flow.decode_pod,
            prompt_tokens=flow.prompt_tokens_reported or flow.rreq.prompt_tokens, output_tokens=flow.out_tokens,
            cached_tokens=flow.cached_tokens, ttft_s=ttft, itl_s=itl, e2e_s=e2e, status=flow.status,
            http_status=flow.http_status, error=flow.error,
            best_overlap_blocks=d.best_overlap_blocks if d else 0,
            chosen_overlap_blocks=d.chosen_overlap_blocks if d else 0,
            retries=flow.retries, migrations=flow.migrations, stream=flow.stream, queue_s=flow.queue_s,
            router_s=flow.dispatch_s), msg_id=f"req:{flow.rid}")


def _dispatched(flow: _Flow) -> None:
    """The request goes to an engine now: its first send ends the router's own time (the queue's wait left out)."""
    if flow.dispatch_s is None:
        flow.dispatch_s = time.perf_counter() - flow.entered - flow.queue_s


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infernex")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0.0.0+source"


def _openai_error_body(status: int, data: bytes) -> bytes:
    """An engine's error answer in OpenAI's shape (vLLM's ``code`` is an int; FastAPI says ``detail``):
    ``{"error": {"message", "type", "param", "code": str}}``; the message is the engine's."""
    try:
        obj = _json_decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"] and isinstance(err.get("type"), str) \
            and "param" in err and isinstance(err.get("message"), str):
        return data  # already the right shape
    err = err if isinstance(err, dict) else {}
    code = err.get("code")
    out = {"message": err.get("message") if isinstance(err.get("message"), str) else _upstream_message(data),
           "type": err.get("type") if isinstance(err.get("type"), str) and err.get("type") else
           ("invalid_request_error" if status < 500 else "server_error"),
           "param": err.get("param") if isinstance(err.get("param"), str) else None,
           "code": code if isinstance(code, str) and code else ERROR_CODES.get(status, str(status))}
    return _json_encode({"error": out})


def _upstream_message(data: bytes) -> str:
    try:
        obj = _json_decode(data)
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
            if isinstance(obj.get("message"), str):
                return obj["message"]
    except msgspec.DecodeError:
        pass
    return data[:200].decode(errors="replace") or "upstream error"
