"""The HTTP face of one simulated engine: vLLM's OpenAI-compatible server around an
:class:`~simulator.engine_core.EngineCore`, driven in scaled real time.

Endpoints (as vLLM): ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE
``data: ...`` / ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``POST /reset_prefix_cache``. Simulator extras: ``GET|POST /admin/faults`` (fault injection),
``POST /internal/kv/pull`` (a consumer engine pulls a producer's pinned KV blocks).

Time: virtual seconds = real seconds x ``time_scale``. Each scheduler step sleeps its modelled
duration (scaled), then delivers its tokens, publishes its KV events (one ZMQ batch per step
that changed the cache) and updates the metrics. Latency metrics are in virtual seconds.

A busy engine's next step starts where its last one ended in virtual time, not when this
process got round to it: a GPU does not stand idle while its host is descheduled, and at a
time scale of 8 one millisecond of this process's lateness would be eight of the model's (on a
machine running eight engines, a router and a client on two cores, that lateness was about as
long as a modelled decode step, so it made up half of every decode phase and grew with how many
engines were busy at once). An engine behind its model skips its sleeps until it has caught up.
A request that arrived meanwhile moves the start no earlier than its arrival. The simulator's
own metrics say how far it kept to the model: ``infernex_sim_step_seconds_total`` (modelled
step time), ``infernex_sim_lost_seconds_total`` (model time lost between steps: only to such
arrivals) and the histogram ``infernex_sim_late_seconds`` (how long after its modelled end
each step's tokens went out).

The server runs inside an existing asyncio loop (``await engine.start()``); several engines can
share one loop (see :mod:`simulator.cluster`). Peers of the same process find each other through
the ``peers`` mapping they were given; others through ``/internal/kv/pull``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from simulator.config import EngineConfig, FaultConfig
from simulator.engine_core import EngineCore, RemotePrefill, RequestOutput, StepResult, TransferError
from simulator.kv_publisher import KvEventPublisher
from simulator.tokenizer import load_tokenizer, request_to_ids

log = logging.getLogger(__name__)


class _OneLineBadRequests(logging.Filter):
    """vLLM's server (uvicorn) answers a request that is not HTTP/1.1 (an HTTP/2 preface, a broken
    request line) with a 400 and one warning line; aiohttp logs each with a traceback. This turns
    those records into uvicorn's one line; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            # (the class only: the message quotes the request's bytes, which may carry a credential)
            record.msg, record.args = "Invalid HTTP request received (%s).", (type(exc).__name__,)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


http_log = logging.getLogger("simulator.http")  # the engines' HTTP server (aiohttp's records, one line for bad requests)
http_log.addFilter(_OneLineBadRequests())

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # (simulator only)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


@dataclass
class Timeline:
    """How closely a live engine kept to its model, in virtual seconds (module docstring)."""

    modelled_s: float = 0.0  # the busy steps' modelled durations
    lost_s: float = 0.0  # between a busy step's end and the next step's start
    late_s: float = 0.0  # summed over the busy steps: how long after its modelled end each one's outputs went out
    steps: int = 0  # busy steps


class EngineMetrics:
    """vLLM's Prometheus metrics for one engine, in an injected registry.

    Names, types, label names, help texts and bucket bounds are those of vLLM 0.33.0's
    ``PrometheusStatLogger`` (checked against its real output, ``tests/fixtures/vllm/0.33.0/
    metrics.prom``, by ``tests/test_vllm_metrics_conformance.py``), for the metrics the collector
    reads and a few more. The ``engine`` label is the simulator's engine id, where vLLM puts the
    data-parallel rank (``"0"`` for a single engine).
    """

    # vLLM 0.33.0 writes every field of its CacheConfig as a label of vllm:cache_config_info
    # (``str()`` of the value). These are the values of a plain `vllm serve` (the fixture's);
    # the block size, block count, prefix caching and the KV tokens they make are set per engine
    # (the collector reads only block_size and num_gpu_blocks).
    CACHE_CONFIG_INFO = {
        "_block_size_resolved": "True", "block_size": "16", "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": "16",
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.92", "hash_block_size": "None", "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None", "kv_cache_max_concurrency": "None",
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": "None", "kv_offloading_backend": "native",
        "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto", "num_cpu_blocks": "None", "num_gpu_blocks": "None",
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
        "simple_cpu_offload_num_blocks": "None", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }
    FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, as labelled

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str, block_size: int,
                 num_gpu_blocks: int, enable_prefix_caching: bool):
        labels = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": engine}
        r = registry

        def g(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**lv)

        def c(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**lv)

        def h(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = c("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        for reason in self.FINISHED_REASONS:  # vLLM shows every reason from the start, at 0
            self.success.labels(**lv, finished_reason=reason)
        self._lv = lv
        # the simulator's own (not vLLM's): how closely this process kept to its model's timeline
        self.step_seconds = c("infernex_sim_step_seconds", "Modelled duration of the scheduler steps run, "
                              "in virtual seconds (simulator only).")
        self.lost_seconds = c("infernex_sim_lost_seconds", "Virtual seconds between a busy step's modelled "
                              "end and the next step's start (simulator only): the model's time lost to the host.")
        self.late_seconds = h("infernex_sim_late_seconds", "How long after its modelled end each busy step's "
                              "outputs went out, in virtual seconds (simulator only): the engine running behind "
                              "its model.", LATE_BUCKETS)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     LATENCY_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                       LATENCY_BUCKETS)
        cache = dict(self.CACHE_CONFIG_INFO, block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks),
                     enable_prefix_caching=str(enable_prefix_caching),
                     effective_attention_block_size=str(block_size),
                     kv_cache_size_tokens=str(block_size * num_gpu_blocks))
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache, "engine"],
                     registry=r)
        info.labels(**cache, engine=engine).set(1)
        self._last = None

    def update(self, core: EngineCore, res: StepResult | None) -> None:
        st = core.stats
        last = self._last
        if last is not None:
            self.queries.inc(st.prefix_cache_queries - last[0])
            self.hits.inc(st.prefix_cache_hits - last[1])
            self.prompt_tokens.inc(st.prompt_tokens - last[2])
            self.generation_tokens.inc(st.generation_tokens - last[3])
            self.preemptions.inc(st.preemptions - last[4])
        self._last = (st.prefix_cache_queries, st.prefix_cache_hits, st.prompt_tokens, st.generation_tokens,
                      st.preemptions)
        self.running.set(core.num_running)
        self.waiting.set(core.num_waiting)
        self.kv_usage.set(core.kv_usage)
        if res is not None:
            for v in res.ttft:
                self.ttft.observe(v)
            for v in res.itl:
                self.itl.observe(v)
            for v in res.e2e:
                self.e2e.observe(v)
            for v in res.queue_time:
                self.queue.observe(v)
            for o in res.outputs:
                if o.finished:
                    self.success.labels(**self._lv, finished_reason=o.finish_reason or "length").inc()


class _Killed(Exception):
    """Fault injection: the engine 'died' while serving this request."""


class SimEngine:
    """One simulated vLLM engine: core + HTTP server + KV-event publisher + metrics."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_endpoint: str | None = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        kv_topic: str = "",  # vLLM's KVEventsConfig.topic default
        time_scale: float = 1.0,
        registry: CollectorRegistry | None = None,
        peers: MutableMapping[str, "SimEngine"] | None = None,
        default_chat_max_tokens: int = 256,
        kv_array_like: bool = False,
    ):
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.config = config
        self.host, self._port = host, port
        self.time_scale = time_scale
        self.registry = registry if registry is not None else CollectorRegistry()
        self.peers = peers if peers is not None else {}
        self.tokenizer = load_tokenizer(config.tokenizer, config.vocab_size or config.model.vocab_size)
        self.core = self._new_core()
        # (vLLM's engine label is the engine's index in its server, the data-parallel rank: "0" for
        # a server of one engine, as each simulated engine is; tests/fixtures/vllm/0.33.0/metrics.prom)
        self.metrics = EngineMetrics(self.registry, config.served_model_name, "0",
                                     config.block_size, self.core.num_blocks, config.enable_prefix_caching)
        self.faults = config.faults
        self.core.slow_factor = self.faults.slow_factor
        self._rng = random.Random(self.faults.seed)
        self._kv_args = (kv_endpoint, replay_endpoint, kv_topic, kv_array_like)
        self.publisher: KvEventPublisher | None = None
        self.default_chat_max_tokens = default_chat_max_tokens
        self._streams: dict[str, asyncio.Queue[RequestOutput | None]] = {}
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._driver: asyncio.Task | None = None
        self._client: aiohttp.ClientSession | None = None
        self._stopping = False
        self._drop_batches = 0
        self._vend: float | None = None  # virtual end of the last busy step (None: idle since)
        self._varrived = 0.0  # virtual arrival of the latest request
        self.timeline = Timeline()
        self.created = int(time.time())

    # ------------------------------------------------------------------ lifecycle

    def _new_core(self) -> EngineCore:
        return EngineCore(self.config, vocab_size=self.tokenizer.vocab_size)

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def kv_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    def vnow(self) -> float:
        return (time.monotonic() - self._t0) * self.time_scale

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._fault_middleware], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_post("/admin/faults", self._set_faults)
        app.router.add_post("/internal/kv/pull", self._kv_pull)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions/render", self._render_completion)
        return app

    async def start(self) -> "SimEngine":
        from simulator.tokenizer import warm_up

        await asyncio.to_thread(warm_up)  # the toy tokenizer's kernel, before the first long prompt
        kv_endpoint, replay_endpoint, topic, array_like = self._kv_args
        if kv_endpoint is not None and self.config.emit_kv_events:
            self.publisher = KvEventPublisher(kv_endpoint, replay_endpoint, topic=topic, array_like=array_like,
                                              fmt=None if array_like else self.config.kv_events_format)
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False, logger=http_log)
        await self._runner.setup()
        await self._listen()
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._driver = asyncio.create_task(self._drive(), name=f"sim-driver-{self.engine_id}")
        self.peers[self.engine_id] = self
        if self.faults.refuse_connections:
            await self._stop_listening()
        return self

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self._port, reuse_address=True)
        await self._site.start()
        server = self._site._server  # noqa: SLF001 - the bound port when asked for port 0
        if server is not None and server.sockets:
            self._port = server.sockets[0].getsockname()[1]

    async def _stop_listening(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self.peers.get(self.engine_id) is self:
            del self.peers[self.engine_id]
        if self._driver is not None:
            # cancel until it is really done: on Python 3.11 a cancellation racing with a
            # finishing wait_for can be swallowed, leaving the task running
            for _ in range(50):
                if self._driver.done():
                    break
                self._driver.cancel()
                await asyncio.wait({self._driver}, timeout=0.1)
        for q in self._streams.values():
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()
        if self.publisher is not None:
            self.publisher.close()

    async def drain(self, timeout_s: float) -> bool:
        """Wait (real seconds) until no request runs here and no prefilled KV waits to be pulled."""
        end = time.monotonic() + timeout_s
        while self._streams or self.core.transfers:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.02)
        return True

    def restart(self) -> None:
        """Behave like a restarted engine: empty cache, requests dropped, KV sequence back to 0."""
        for q in self._streams.values():
            q.put_nowait(None)
        self._streams.clear()
        self.core = self._new_core()
        self.core.slow_factor = self.faults.slow_factor
        self.metrics._last = None
        if self.publisher is not None:
            self.publisher.reset_sequence()

    async def set_faults(self, faults: FaultConfig) -> None:
        was_refusing = self.faults.refuse_connections
        self.faults = faults
        self.core.slow_factor = faults.slow_factor
        self._rng = random.Random(faults.seed)
        if faults.refuse_connections and not was_refusing:
            await self._stop_listening()
        elif was_refusing and not faults.refuse_connections and self._site is None and not self._stopping:
            await self._listen()

    # ------------------------------------------------------------------ driver

    async def _drive(self) -> None:
        while not self._stopping:
            try:
                await self._drive_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a model bug must not hang every client
                log.exception("engine %s: scheduler step failed; failing its requests", self.engine_id)
                for q in self._streams.values():
                    q.put_nowait(None)
                self._streams.clear()
                self.core = self._new_core()
                self.core.slow_factor = self.faults.slow_factor
                self._vend = None

    async def _drive_once(self) -> None:
        """One scheduler step in scaled real time (or a wait when there is nothing to do)."""
        scale = self.time_scale
        core = self.core
        if not core.has_work:
            self._vend = None
            self._flush_events(core.take_pending_events())
            self.metrics.update(core, None)
            self._wake.clear()
            await self._wake.wait()
            return
        vnow = start = self.vnow()
        vend = self._vend
        if vend is not None and vend < vnow:  # late: go on from the last step's end (module docstring)
            start = vend if self._varrived <= vend else min(vnow, self._varrived)
            if start > vend:
                self.metrics.lost_seconds.inc(start - vend)
                self.timeline.lost_s += start - vend
        res = core.step(start)
        if res.idle:
            self._vend = None
            self._flush_events(res.events)
            self.metrics.update(core, res)
            self._wake.clear()
            delay = 0.05 if res.next_wakeup is None else max(0.0, (res.next_wakeup - vnow) / scale)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
            return
        self._vend = res.end
        self.metrics.step_seconds.inc(res.duration)
        self.timeline.modelled_s += res.duration
        delay = self._t0 + res.end / scale - time.monotonic()
        await asyncio.sleep(delay if delay > 0 else 0)
        late = self.vnow() - res.end
        late = late if late > 0 else 0.0
        self.metrics.late_seconds.observe(late)
        self.timeline.late_s += late
        self.timeline.steps += 1
        if core is not self.core:
            return  # restarted while this step was "running"
        self._flush_events(res.events)
        self.metrics.update(core, res)
        for out in res.outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _flush_events(self, events: list) -> None:
        if events and self.publisher is not None:
            drop = self._drop_batches > 0
            if drop:
                self._drop_batches -= 1
            self.publisher.publish(events, drop=drop)

    def drop_kv_batches(self, n: int) -> None:
        """Lose the next ``n`` KV-event frames on the way (kept for replay): a sequence gap."""
        self._drop_batches = n

    def _submit(self, rid: str, prompt_ids: list[int], max_tokens: int, *, cache_salt: str | None,
                do_remote_decode: bool, remote: RemotePrefill | None, transfer_id: str | None = None) -> asyncio.Queue:
        q: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        try:
            self._varrived = arrived = self.vnow()
            self.core.add_request(rid, prompt_ids, max_tokens, arrived, cache_salt=cache_salt,
                                  do_remote_decode=do_remote_decode, remote_prefill=remote, transfer_id=transfer_id)
        except TransferError as exc:
            raise ApiError(400, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        self._streams[rid] = q
        self._wake.set()
        return q

    def _abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self.core.abort_request(rid)

    # ------------------------------------------------------------------ faults

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler):  # noqa: ANN001
        f = self.faults
        if f.refuse_connections and not request.path.startswith("/admin/"):
            if request.transport is not None:
                request.transport.close()  # existing keep-alive connections die too
            raise web.HTTPServiceUnavailable()
        if f.error_rate > 0 and request.path.startswith("/v1/") and request.method == "POST":
            if self._rng.random() < f.error_rate:
                return ApiError(500, "injected fault: internal server error", "InternalServerError").response()
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.model_dump())

    async def _set_faults(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            faults = FaultConfig.model_validate({**self.faults.model_dump(), **body})
        except ValidationError as exc:
            raise ApiError(400, f"invalid faults: {exc.errors(include_url=False)}") from None
        await self.set_faults(faults)
        return web.json_response(faults.model_dump())

    # ------------------------------------------------------------------ simple endpoints

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.update(self.core, None)
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        name = self.config.served_model_name
        # (vLLM 0.33's ModelList: a ModelCard per served name with one default ModelPermission)
        perm = {"id": f"modelperm-{self.engine_id}", "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": name,
            "parent": None, "max_model_len": self.config.max_model_len, "permission": [perm],
        }]})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self.core.reset_prefix_cache()
        self._flush_events(self.core.take_pending_events())
        if not ok:
            raise ApiError(409, "prefix cache reset refused: KV blocks are in use", "ConflictError")
        return web.Response(status=200)

    async def _kv_pull(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        tid = body.get("remote_request_id")
        if not isinstance(tid, str):
            raise ApiError(400, "remote_request_id is required")
        want = body.get("remote_engine_id")
        if want is not None and want != self.engine_id:
            raise ApiError(404, f"this bootstrap serves engine {self.engine_id!r}, not {want!r}", "NotFoundError")
        try:
            t = self.take_transfer(tid, body.get("num_tokens"), body.get("remote_block_ids"),
                                   body.get("prompt_digest"))
        except TransferError as exc:
            raise ApiError(404, str(exc), "NotFoundError") from None
        return web.json_response({"engine_id": self.engine_id, "num_tokens": t.num_tokens,
                                  "block_ids": t.block_ids})

    def take_transfer(self, transfer_id: str, num_tokens: Any, block_ids: Any, prompt_digest: Any = None):
        if self.config.role not in ("kv_producer", "kv_both"):
            raise TransferError(f"engine {self.engine_id} is not a KV producer")
        t = self.core.transfers.get(transfer_id)
        if t is not None and block_ids is not None and list(block_ids) != t.block_ids:
            raise TransferError(f"remote_block_ids do not match KV transfer {transfer_id!r}")
        return self.core.take_transfer(transfer_id, self.vnow(),
                                       num_tokens=num_tokens if isinstance(num_tokens, int) else None,
                                       prompt_digest=prompt_digest if isinstance(prompt_digest, int) else None)

    # ------------------------------------------------------------------ PD

    def _kv_params_out(self, out: RequestOutput) -> dict | None:
        t = out.kv_transfer
        if t is None or self.config.kv_connector == "mooncake":
            # upstream MooncakeConnector: the decode side is told where to pull by the proxy
            # (transfer_id, remote_bootstrap_addr, remote_engine_id); the prefill answer carries none
            return None
        if self.config.kv_connector == "nixl":
            # vLLM 0.33's NixlConnector (pull mode): these fields in this order, the block ids per KV
            # cache group (one group here); tests/fixtures/vllm/0.33.0/openai.json nixl_kv_transfer_params
            return {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [t.block_ids],
                "remote_engine_id": self.engine_id, "remote_request_id": t.transfer_id,
                "remote_host": self.host, "remote_port": self._port, "tp_size": self.config.tensor_parallel_size,
                "dcp_size": 1, "pp_size": 1, "remote_num_tokens": out.num_prompt_tokens,
                "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
            }
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": t.block_ids,
            "remote_engine_id": self.engine_id, "remote_request_id": t.transfer_id,
            "remote_host": self.host, "remote_port": self._port, "tp_size": self.config.tensor_parallel_size,
            "num_prompt_blocks": len(t.block_ids), "remote_block_size": self.config.block_size,
        }

    def _consumer_fields(self, params: dict) -> tuple[str, str, str | None, int | None]:
        """What this engine's connector needs to pull a prompt's KV: (engine id, transfer key, host, port).

        The fields each real connector reads on the decode side (a request missing one fails there):
        NIXL (vLLM) and vllm-ascend's MooncakeConnectorV1 take the prefill's own answer
        (remote_engine_id, remote_request_id, remote_block_ids, remote_host, remote_port); upstream
        vLLM's MooncakeConnector takes the proxy's transfer_id, remote_bootstrap_addr and remote_engine_id.
        """
        conn = self.config.kv_connector
        if conn == "mooncake":
            missing = [k for k in ("transfer_id", "remote_bootstrap_addr", "remote_engine_id")
                       if not isinstance(params.get(k), str) or not params.get(k)]
            if missing:
                raise ApiError(400, f"MooncakeConnector: kv_transfer_params lack {', '.join(missing)}",
                               param="kv_transfer_params")
            addr = params["remote_bootstrap_addr"]
            if not addr.startswith(("http://", "https://")):
                raise ApiError(400, "MooncakeConnector: remote_bootstrap_addr must be an http:// URL",
                               param="kv_transfer_params")
            from urllib.parse import urlsplit
            u = urlsplit(addr)
            return params["remote_engine_id"], params["transfer_id"], u.hostname, u.port
        need = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")
        missing = [k for k in need if params.get(k) is None]
        if missing:
            name = "MooncakeConnectorV1" if conn == "mooncake_ascend" else "NixlConnector"
            raise ApiError(400, f"{name}: kv_transfer_params lack {', '.join(missing)}", param="kv_transfer_params")
        engine_id, tid = params.get("remote_engine_id"), params.get("remote_request_id")
        if not isinstance(engine_id, str) or not isinstance(tid, str):
            raise ApiError(400, "kv_transfer_params need remote_engine_id and remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        return engine_id, tid, host if isinstance(host, str) else None, port if isinstance(port, int) else None

    async def _pull_remote(self, params: dict, prompt_ids: list[int]) -> RemotePrefill:
        role = self.config.role
        if role not in ("kv_consumer", "kv_both"):
            raise ApiError(400, f"engine role {role} cannot take kv_transfer_params with do_remote_prefill")
        engine_id, tid, host, port = self._consumer_fields(params)
        block_ids = params.get("remote_block_ids")
        if isinstance(block_ids, list) and len(block_ids) == 1 and isinstance(block_ids[0], list):
            block_ids = block_ids[0]  # (vLLM's NixlConnector: the ids per KV cache group; one group here)
        if params.get("remote_block_size", self.config.block_size) != self.config.block_size:
            raise ApiError(400, "remote block size differs from this engine's block size")
        peer = self.peers.get(engine_id)
        if peer is not None and self.config.kv_connector == "mooncake" and (host, port) != (peer.host, peer.port):
            raise ApiError(400, f"KV transfer failed: engine {engine_id!r} does not serve bootstrap {host}:{port}")
        if peer is not None:
            try:
                t = peer.take_transfer(tid, len(prompt_ids), block_ids, EngineCore.prompt_digest(prompt_ids))
            except TransferError as exc:
                raise ApiError(400, f"KV transfer failed: {exc}") from None
            return RemotePrefill(engine_id, t.num_tokens)
        if not isinstance(host, str) or not isinstance(port, int):
            raise ApiError(400, f"unknown remote engine {engine_id!r} and no remote_host/remote_port to reach it")
        assert self._client is not None
        try:
            async with self._client.post(f"http://{host}:{port}/internal/kv/pull", json={
                "remote_request_id": tid, "remote_engine_id": engine_id,
                "num_tokens": len(prompt_ids), "remote_block_ids": block_ids,
                "prompt_digest": EngineCore.prompt_digest(prompt_ids),
            }) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    msg = (data or {}).get("error", {}).get("message", f"HTTP {resp.status}")
                    raise ApiError(400, f"KV transfer failed: {msg}")
        except aiohttp.ClientError as exc:
            raise ApiError(400, f"KV transfer failed: cannot reach {host}:{port}: {exc}") from None
        return RemotePrefill(engine_id, int(data["num_tokens"]))

    # ------------------------------------------------------------------ generation

    async def _prepare(self, body: dict, prompt_ids: list[int], default_max: int) -> tuple[str, asyncio.Queue, dict]:
        if body.get("model") not in (None, self.config.served_model_name):
            raise ApiError(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported by the simulator", param="n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(default_max, max(1, self.config.max_model_len - len(prompt_ids)))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, "max_tokens must be a positive integer", param="max_tokens")
        for key in ("min_tokens", "min_completion_tokens"):  # vLLM's SamplingParams checks
            mt = body.get(key)
            if mt is None:
                continue
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
                raise ApiError(400, f"{key} must be greater than or equal to 0, got {mt}", param=key)
            if mt > max_tokens:
                raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {mt}",
                               param=key)
        params = body.get("kv_transfer_params") or {}
        if not isinstance(params, dict):
            raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        do_remote_decode = bool(params.get("do_remote_decode"))
        remote = None
        transfer_id = None
        if do_remote_decode:
            if self.config.role not in ("kv_producer", "kv_both"):
                raise ApiError(400, f"engine role {self.config.role} cannot serve do_remote_decode requests")
            if self.config.kv_connector == "mooncake":
                transfer_id = params.get("transfer_id")
                if not isinstance(transfer_id, str) or not transfer_id:
                    raise ApiError(400, "MooncakeConnector: a do_remote_decode request needs a transfer_id",
                                   param="kv_transfer_params")
            max_tokens = 1
        if params.get("do_remote_prefill"):
            remote = await self._pull_remote(params, prompt_ids)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ApiError(400, "cache_salt must be a string", param="cache_salt")
        rid = str(body.get("_request_id"))
        q = self._submit(rid, prompt_ids, max_tokens, cache_salt=salt, do_remote_decode=do_remote_decode,
                         remote=remote, transfer_id=transfer_id)
        return rid, q, params

    async def _tokens(self, rid: str, q: asyncio.Queue):
        """Yield outputs of one request; enforces the die-mid-stream fault."""
        sent = 0
        while True:
            out = await q.get()
            if out is None:
                raise ApiError(500, "the engine aborted the request (stopped, restarted or failed)",
                               "InternalServerError")
            die = self.faults.die_after_tokens
            if die is not None and sent + len(out.new_token_ids) > die:
                raise _Killed(f"injected fault: died after {sent} tokens")
            sent += len(out.new_token_ids)
            yield out
            if out.finished:
                return

    def _text(self, ids: list[int], first: bool) -> str:
        text = self.tokenizer.decode(ids)
        return text if first else " " + text

    async def _generate(self, request: web.Request, body: dict, prompt_ids: list[int], chat: bool) -> web.StreamResponse:
        body["_request_id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        rid, q, params = await self._prepare(body, prompt_ids, self.default_chat_max_tokens if chat else 16)
        # vllm-ascend: a decode node that cannot keep a remote-prefilled request ends it with
        # stop_reason "recomputed"; its proxy re-issues the rest (prefill + decode) elsewhere
        recompute_at = self.faults.recompute_after_tokens if params.get("do_remote_prefill") else None
        fail_at = self.faults.fail_generation_after_tokens
        created = int(time.time())
        model = self.config.served_model_name
        public_id = ("chatcmpl-" if chat else "cmpl-") + rid
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        finished = False
        try:
            details = self.config.enable_prompt_tokens_details
            if not stream:
                pieces: list[str] = []
                last = None
                stop_reason = None
                async for out in self._tokens(rid, q):
                    if recompute_at is not None and last is not None and last.num_output_tokens >= recompute_at:
                        stop_reason = "recomputed"
                        break
                    if fail_at is not None and out.num_output_tokens > fail_at:
                        raise ApiError(500, "Internal server error", "InternalServerError")
                    pieces.append(self._text(out.new_token_ids, not pieces))
                    last = out
                if stop_reason is None:
                    finished = True
                assert last is not None
                return web.json_response(_whole_answer(
                    chat, public_id, created, model, "".join(pieces),
                    "stop" if stop_reason is not None else last.finish_reason, stop_reason,
                    _usage(last, details), self._kv_params_out(last)))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            continuous = include_usage and isinstance(opts, dict) and bool(opts.get("continuous_usage_stats"))

            async def send(payload: dict) -> None:
                await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

            def chunk(choice: dict, kv: dict | None, produced: int | None) -> dict:
                # (vLLM 0.33's chunks: serving.py builds them with these fields, dumped exclude_unset)
                c = {"id": public_id, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}
                if produced is not None:
                    c["usage"] = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + produced,
                                  "completion_tokens": produced}
                c["kv_transfer_params"] = kv
                return c

            n_prompt = len(prompt_ids)
            if chat:
                first_chunk = {"id": public_id, "object": chunk_obj, "created": created, "model": model,
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
                if continuous:
                    first_chunk["usage"] = {"prompt_tokens": n_prompt, "total_tokens": n_prompt,
                                            "completion_tokens": 0}
                first_chunk.update(prompt_token_ids=None, prompt_text=None)
                await send(first_chunk)
            first = True
            last = None
            cut = failed = False
            try:
                async for out in self._tokens(rid, q):
                    if recompute_at is not None and last is not None and last.num_output_tokens >= recompute_at:
                        await send(chunk(_stream_choice(chat, "", "stop", "recomputed"), None,
                                         last.num_output_tokens if continuous else None))
                        cut = True
                        break
                    if fail_at is not None and out.num_output_tokens > fail_at:
                        # vLLM's stream generator on GenerationError: create_streaming_error_response
                        # (json.dumps of ErrorResponse.model_dump()), then [DONE]
                        err = {"error": {"message": "Internal server error", "type": "InternalServerError",
                                         "param": None, "code": 500}}
                        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                        cut = failed = True
                        break
                    text = self._text(out.new_token_ids, first)
                    first = False
                    last = out
                    done = out.finished
                    await send(chunk(_stream_choice(chat, text, out.finish_reason if done else None, None, done),
                                     self._kv_params_out(out) if done else None,
                                     out.num_output_tokens if continuous else None))
                finished = not cut
            except (_Killed, ApiError):  # headers are out: all a dying engine can do is hang up
                _drop_connection(request)
                return resp
            if include_usage and last is not None and not failed:  # (vLLM's error path sends no usage)
                # (exclude_none: a usage without details leaves the key out)
                u = _usage(last, details)
                u = {k: v for k, v in u.items() if v is not None}
                if u.get("prompt_tokens_details"):
                    u["prompt_tokens_details"] = {k: v for k, v in u["prompt_tokens_details"].items() if v is not None}
                await send({"id": public_id, "object": chunk_obj, "created": created, "model": model,
                            "choices": [], "usage": u})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except _Killed:
            _drop_connection(request)
            return web.Response(status=500)
        except ConnectionResetError:
            # the client hung up mid-stream: the request is aborted below, as vLLM aborts it; a
            # response is still returned so aiohttp closes quietly instead of logging an error
            return web.Response(status=499)
        except asyncio.CancelledError:
            raise
        finally:
            if not finished:
                self._abort(rid)
            else:
                self._streams.pop(rid, None)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        try:
            prompt_ids = request_to_ids(self.tokenizer, "completions", body)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        return await self._generate(request, body, prompt_ids, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        try:
            prompt_ids = request_to_ids(self.tokenizer, "chat", body)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if not prompt_ids:
            raise ApiError(400, "the chat prompt is empty", param="messages")
        return await self._generate(request, body, prompt_ids, chat=True)


    # -- vLLM's tokenizer endpoints and the render API (routers call these to key requests) --

    def _check_model(self, body: dict) -> None:
        if body.get("model") not in (None, self.config.served_model_name):
            raise ApiError(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")

    def _prompt_ids(self, body: dict) -> list[int]:
        """The ids the engine would run for a completions ``prompt`` or chat ``messages`` body."""
        try:
            return request_to_ids(self.tokenizer, "chat" if "messages" in body else "completions", body)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages" if "messages" in body else "prompt") from None

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: ``{prompt | messages}`` -> ``{count, max_model_len, tokens}``."""
        body = await _json_body(request)
        self._check_model(body)
        ids = self._prompt_ids(body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                               "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = [self.tokenizer.decode([t]) for t in ids]
        return web.json_response(out)

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: ``{tokens}`` -> ``{prompt}``."""
        body = await _json_body(request)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids", param="tokens")
        if any(t < 0 or t >= self.tokenizer.vocab_size for t in tokens):
            raise ApiError(400, f"token ids must be in [0, {self.tokenizer.vocab_size})", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _render_completion(self, request: web.Request) -> web.Response:
        """vLLM 0.33's ``POST /v1/completions/render``: a completions request -> a list of
        ``GenerateRequest`` (``request_id``, ``token_ids``, ``sampling_params`` ...), the
        tokens the engine would run, without running them."""
        body = await _json_body(request)
        self._check_model(body)
        if body.get("use_beam_search"):
            raise ApiError(400, "Beam search is not supported by the render endpoint")
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        rendered = []
        base = f"cmpl-{body.get('request_id') or uuid.uuid4().hex}"
        for i, p in enumerate(prompts):
            ids = self._prompt_ids({"prompt": p} if "prompt_token_ids" not in body else body)
            if not ids:
                raise ApiError(400, "No token_ids rendered", param="prompt")
            max_tokens = body.get("max_tokens")
            if max_tokens is None:
                max_tokens = max(1, self.config.max_model_len - len(ids))
            rendered.append({
                "request_id": base if len(prompts) == 1 else f"{base}-{i}", "token_ids": ids,
                "features": None, "sampling_params": {
                    "n": 1, "max_tokens": max_tokens, "temperature": body.get("temperature", 1.0),
                    "top_p": body.get("top_p", 1.0), "seed": body.get("seed"), "stop": body.get("stop") or []},
                "model": body.get("model") or self.config.served_model_name, "stream": bool(body.get("stream")),
                "cache_salt": body.get("cache_salt"), "kv_transfer_params": body.get("kv_transfer_params"),
            })
        return web.json_response(rendered)


def _usage(out: RequestOutput, details: bool = True) -> dict:
    """vLLM's ``UsageInfo`` of an answer; ``prompt_tokens_details`` only with
    ``enable_prompt_tokens_details`` (vLLM's --enable-prompt-tokens-details)."""
    return {"prompt_tokens": out.num_prompt_tokens, "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
            "completion_tokens": out.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens, "created_cache_tokens": None,
                                      "multimodal_tokens": None} if details else None,
            "completion_tokens_details": None}


def _stream_choice(chat: bool, text: str, finish_reason: str | None, stop_reason: Any,
                   final: bool | None = None) -> dict:
    """One streamed choice as vLLM 0.33 sends it (tests/fixtures/vllm/0.33.0/openai.json): a
    completion's carries every field on each chunk; a chat's carries ``stop_reason`` and
    ``weight_versions`` only on the chunk that finishes it."""
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None, "weight_versions": None}
    c: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None or final:
        c.update(stop_reason=stop_reason, token_ids=None, weight_versions=None)
    else:
        c["token_ids"] = None
    return c


def _whole_answer(chat: bool, rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  stop_reason: Any, usage: dict, kv: dict | None) -> dict:
    """A non-streamed answer as vLLM 0.33's ``CompletionResponse`` / ``ChatCompletionResponse``
    ``model_dump()`` gives it (every field, None as null; an empty ``tool_calls`` left out)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                          "audio": None, "function_call": None, "reasoning": None},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": None,
                  "routed_experts": None, "weight_versions": None}
        tail = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                  "routed_experts": None, "weight_versions": None}
        tail = {}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": usage, **tail, "kv_transfer_params": kv, "ec_transfer_params": None, "metrics": None}


def _drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort() if hasattr(request.transport, "abort") else request.transport.close()


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body
