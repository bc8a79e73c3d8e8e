"""The endpoint picker: an ``envoy.service.ext_proc.v3.ExternalProcessor`` gRPC service that runs
the HTTP router's own strategy pipeline (the same :class:`router.core.Router`, cluster state and
KV index of a :class:`router.server.RouterService`) and tells Envoy where to send each request.

One ext_proc stream per HTTP request. Body modes:
- ``BUFFERED``: Envoy sends the headers (answered at once), then the whole body; the pick rides
  on the body response (header mutation + dynamic metadata).
- ``FULL_DUPLEX_STREAMED`` (what GIE gateways use; no size limit): headers and body chunks arrive
  without waiting; the EPP holds them until the body ends, then answers the headers with the pick
  and hands the body back in chunks.
Requests without a body (``GET /v1/models``) are routed to the least-loaded healthy endpoint, and
so are requests in ``STREAMED`` mode (Envoy forwards their headers before the body arrives, so a
body-aware pick is impossible there; a warning says so once).

While the stream lives the pick counts as in flight on its backend (the router's own in-flight and
active-token counters, which its load scorers read); the stream ends when Envoy is done with the
request. With an approximate prefix scorer (kv-aware) the picked prompt counts as predicted on its
engine until the engine's KV events say what it holds, as in the HTTP router, so a burst sharing a
new prefix goes to one engine. Each pick is published as a routing decision (with its inputs, for ``replay explain``) and,
when the gateway relays the response, as a request record for the SLA history
(:mod:`router.epp.observe`).

Token counts for streams: vLLM sends a stream's usage (prompt, completion and cached tokens) only
to a client that sets ``stream_options.include_usage``, and most OpenAI clients do not. When the
picker writes request records, the gateway relays the answer in ``FULL_DUPLEX_STREAMED`` mode
and the request body came whole to the picker (``FULL_DUPLEX_STREAMED`` or ``BUFFERED``), the
picker asks for usage on the client's behalf: it sends the body on with ``include_usage`` (and
the matching ``content-length``), reads the usage for the record and takes the usage event out of
the answer (:mod:`router.epp.usage`), so the client gets what it would have got. With any other response mode the client would see
the usage event, so the body goes on as it came and such a record counts 0 cached tokens
(``infernex_router_answers_without_cached_tokens_total{reason="no_usage"}``). Setting
``epp_ask_usage: false`` turns the question off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
from prometheus_client import Counter
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp import protocol as P
from router.epp import usage
from router.epp.observe import ResponseWatch
from router.flow import Flow
from router.server import ApiError
from router.types import BackendState, Decision, RoutingRequest

if TYPE_CHECKING:
    from router.server import RouterService

log = logging.getLogger(__name__)

_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_HEALTH_NAMES = ("", "liveness", "readiness", P.SERVICE)


@dataclass(slots=True)
class _Req:
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    duplex: bool = False
    streamed: bool = False  # STREAMED: the headers go upstream before the body reaches us
    buffered: bool = False
    response_duplex: bool = False
    body: bytearray = field(default_factory=bytearray)
    sent: bytes | None = None  # the body as it goes upstream, when the picker changed it
    strip: usage.UsageStrip | None = None  # the usage event the picker asked for, taken out of the answer
    picked: list[tuple[BackendState, int, int]] = field(default_factory=list)  # (backend, tokens, prefill)
    t0: float = 0.0  # perf_counter when the headers arrived
    arrival: float = 0.0  # wall time of the same
    watch: ResponseWatch | None = None
    rreq: RoutingRequest | None = None  # the picked request (its text's routes end with it)


class _Reject(Exception):
    def __init__(self, response: pb.ProcessingResponse):
        self.response = response


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer. ``fallbacks``: how many next-best endpoints follow the pick."""

    def __init__(self, service: RouterService, *, fallbacks: int = 0):
        self.svc = service
        self.fallbacks = fallbacks
        self._ep: dict[str, str] = {}
        self.picks = 0
        self.rejects: dict[int, int] = {}
        self._warned_streamed = False
        self._warned_unobserved = False
        self.ask_usage = service.cfg.epp_ask_usage
        self.unobserved = Counter("infernex_router_epp_unobserved_total",
                                  "Picked requests whose response the gateway did not relay to the picker "
                                  "(no request record: set ext_proc response_header_mode SEND)",
                                  registry=service.registry)

    # -- helpers ---------------------------------------------------------------------------
    def endpoint(self, b: BackendState) -> str:
        ep = self._ep.get(b.url)
        if ep is None:
            ep = self._ep[b.url] = P.endpoint_of(b.url)
        return ep

    def _candidates(self, subset: frozenset[str] | None) -> list[BackendState]:
        snap = self.svc.state.snapshot()
        if subset is None:
            return snap
        return [b for b in snap if self.endpoint(b) in subset]

    def _reject(self, status: int, message: str, code: str, type_: str = "service_unavailable") -> _Reject:
        self.rejects[status] = self.rejects.get(status, 0) + 1
        retry = self.svc.cfg.retry_after_s if status in (429, 503) else None
        return _Reject(P.immediate(status, message, code, type_, retry))

    def _fallbacks(self, d: Decision) -> list[str]:
        if not self.fallbacks or not d.stages:
            return []
        st = d.stages[-1]
        order = sorted(range(len(st.cands)), key=lambda i: -st.totals[i])
        out = []
        for i in order:
            if i != st.picked_index:
                out.append(self.endpoint(st.cands[i]))
                if len(out) == self.fallbacks:
                    break
        return out

    async def pick(self, r: _Req) -> tuple[pb.CommonResponse, Any]:
        """Run the strategy on the request; the mutation and metadata that carry the pick. A long
        prompt is tokenized on the router's tokenizer threads (RouterService._routing_request_async)."""
        svc = self.svc
        cands = self._candidates(r.subset)
        if r.subset is not None and not cands:
            raise self._reject(503, "none of the endpoints in the subset hint is known to the picker", "no_backend")
        if not r.body:
            return self._pick_without_body(cands)
        try:
            body = msgspec.json.decode(bytes(r.body))
        except msgspec.DecodeError:
            raise self._reject(400, "request body is not valid JSON", "invalid_json", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise self._reject(400, "request body must be a JSON object", "invalid_json", "invalid_request_error")
        path = r.headers.get(":path", "")
        kind = "chat" if ("messages" in body or path.startswith("/v1/chat")) else "completions"
        try:
            svc._check_body(kind, body)
        except ApiError as e:
            raise self._reject(e.status, e.message, str(e.code or "invalid_request"), e.type) from None
        rid = r.headers.get("x-request-id") or ""
        rreq = await svc._routing_request_async(kind, body, rid, len(r.body))
        t = time.perf_counter()
        st = svc.state
        now = st.clock.now()
        d = svc.router.decide(rreq, cands, svc.index, now, load_epoch=st.epoch,
                              queued=False)  # Envoy sends at once: busy is busy (429)
        svc._m_decision.observe(time.perf_counter() - t)
        flow = None
        if svc.records is not None:
            flow = Flow(rid=rid or f"epp-{self.picks}-{time.time_ns()}", kind=kind, path=path, body=body,
                         stream=bool(body.get("stream")), arrival=r.arrival or time.time(), t0=r.t0 or t, rreq=rreq)
            flow.decision = d
            flow.captured = (svc._capture(cands, st.epoch if r.subset is None else None), now)
            svc._publish_decision(flow, d)
        if not d.ok:
            if d.status == "no_model":
                raise self._reject(404, d.reason, "model_not_found", "invalid_request_error")
            if d.status == "busy":
                raise self._reject(429, "all endpoints are busy, retry later", "busy")
            raise self._reject(503, f"no endpoint available: {d.reason}", "no_backend")
        target = d.target
        n = rreq.prompt_tokens
        if d.prefill is not None:
            svc._started(d.prefill, n, n)
            r.picked.append((d.prefill, n, n))
            svc._started(target, n, 0)
            r.picked.append((target, n, 0))
        else:
            svc._started(target, n, n)
            r.picked.append((target, n, n))
        if flow is not None:
            flow.prefill_pod = d.prefill.pod if d.prefill is not None else None
            flow.decode_pod = target.pod
            flow.pods = [*([flow.prefill_pod] if flow.prefill_pod else []), target.pod]
            r.watch = ResponseWatch(svc, flow)
            if self.ask_usage and r.response_duplex and (r.duplex or r.buffered) and usage.needs_asking(body):
                self._ask_usage(r, body)
        if d.prefill is not None:
            svc._pick(d.prefill.pod, "prefill")
        svc._pick(target.pod, "decode" if svc.router.strategy.pd else "aggregated")
        # as the HTTP router: the prompt counts as predicted on its engine until the engine's events come
        svc.predict_route(rreq, d, lambda bs: svc.request_keys(rreq, bs))
        r.rreq = rreq
        self.picks += 1
        eps = [self.endpoint(target), *self._fallbacks(d)]
        common, md = P.routing_mutation(eps, self.endpoint(d.prefill) if d.prefill is not None else None)
        if r.sent is not None:
            P.set_content_length(common, len(r.sent))
            if r.buffered:
                common.body_mutation.body = r.sent
        return common, md

    @staticmethod
    def _ask_usage(r: _Req, body: dict[str, Any]) -> None:
        """A stream whose client did not ask for usage: ask for it upstream (so the record gets the
        engine's token counts) and take the usage event out of the answer (:mod:`router.epp.usage`).
        Only when the gateway relays the answer through the picker chunk by chunk (response body
        mode ``FULL_DUPLEX_STREAMED``): any other way, the client would get the usage event."""
        r.sent = usage.asking(body)
        r.strip = usage.UsageStrip()

    def _pick_without_body(self, cands: list[BackendState]) -> tuple[pb.CommonResponse, Any]:
        ok = [b for b in cands if b.health != "critical" and not b.circuit_open and not b.draining]
        if not ok:
            raise self._reject(503, "no endpoint available", "no_backend")
        b = min(ok, key=lambda b: (b.inflight + b.waiting, b.pod))
        return P.routing_mutation([self.endpoint(b)], None)

    def _served(self, r: _Req, served: str) -> None:
        """The proxy reports (``x-gateway-destination-endpoint-served``) that a fallback served the
        request: its in-flight count moves there from the primary pick."""
        if not r.picked:
            return
        b, n, pre = r.picked[-1]
        if self.endpoint(b) == served:
            return
        other = next((x for x in self.svc.state.snapshot() if self.endpoint(x) == served), None)
        if other is None:
            return
        svc = self.svc
        svc._finished(b, n, pre)
        svc._started(other, n, pre)
        r.picked[-1] = (other, n, pre)
        if r.watch is not None:
            f = r.watch.flow
            f.retries += 1
            f.decode_pod = other.pod
            f.pods = [*([f.prefill_pod] if f.prefill_pod else []), other.pod]

    def _release(self, r: _Req) -> None:
        for b, n, pre in r.picked:
            self.svc._finished(b, n, pre)
        if r.picked:
            self.svc.settle_routes(r.rreq, [b.pod for b, _, _ in r.picked])
        r.picked.clear()
        w, r.watch = r.watch, None
        if w is not None and not w.finish():
            self.unobserved.inc()
            if not self._warned_unobserved:
                self._warned_unobserved = True
                log.warning("the gateway does not relay responses to the endpoint picker: no request records "
                            "for the SLA history (set ext_proc response_header_mode SEND and a response body "
                            "mode); counted in infernex_router_epp_unobserved_total")

    # -- the stream ------------------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context) -> AsyncIterator[pb.ProcessingResponse]:
        r = _Req()
        limit = self.svc.cfg.max_body_bytes
        try:
            async for req in request_iterator:
                which = req.WhichOneof("request")
                if which == "request_headers":
                    r.t0, r.arrival = time.perf_counter(), time.time()
                    if req.HasField("protocol_config"):
                        pc = req.protocol_config
                        r.duplex = pc.request_body_mode == _DUPLEX
                        r.streamed = pc.request_body_mode == _STREAMED
                        r.buffered = pc.request_body_mode == _BUFFERED
                        r.response_duplex = pc.response_body_mode == _DUPLEX
                    r.headers = P.header_map(req.request_headers)
                    r.subset = P.subset_hint(req)
                    if r.streamed and not self._warned_streamed:
                        self._warned_streamed = True
                        log.warning("ext_proc request_body_mode STREAMED: the pick cannot read the body (the "
                                    "headers are forwarded first); routing by load only. Use FULL_DUPLEX_STREAMED "
                                    "or BUFFERED")
                    if req.request_headers.end_of_stream or r.streamed:
                        try:
                            common, md = await self.pick(r)
                        except _Reject as rej:
                            yield rej.response
                            return
                        yield P.headers_response(common, md)
                    elif not r.duplex:
                        yield P.headers_response()
                elif which == "request_body":
                    rb = req.request_body
                    r.body += rb.body
                    if len(r.body) > limit:
                        yield self._reject(413, f"request body exceeds {limit} bytes", "body_too_large",
                                           "invalid_request_error").response
                        return
                    if r.streamed:  # already routed on the headers; pass every chunk on
                        yield P.body_response()
                        continue
                    if not rb.end_of_stream:
                        if not r.duplex:  # BUFFERED_PARTIAL: every chunk wants an answer
                            yield P.body_response()
                        continue
                    try:
                        common, md = await self.pick(r)
                    except _Reject as rej:
                        yield rej.response
                        return
                    if r.duplex:
                        yield P.headers_response(common, md)
                        for m in P.streamed_body(r.sent if r.sent is not None else bytes(r.body)):
                            yield m
                    else:
                        yield P.body_response(common, md)
                elif which == "request_trailers":
                    if r.duplex and not r.picked:  # the body ended with the trailers
                        try:
                            common, md = await self.pick(r)
                        except _Reject as rej:
                            yield rej.response
                            return
                        yield P.headers_response(common, md)
                        for m in P.streamed_body(r.sent if r.sent is not None else bytes(r.body)):
                            yield m
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif which == "response_headers":
                    served = P.served_endpoint(req)
                    if served is not None:
                        self._served(r, served)
                    if r.watch is not None:
                        r.watch.headers(req)
                        if not r.watch.sse:  # (an error answer, or JSON: nothing to take out)
                            r.strip = None
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse()))
                elif which == "response_body":
                    rb = req.response_body
                    if r.watch is not None:
                        r.watch.body(rb.body, rb.end_of_stream)
                    if r.response_duplex:  # hand each chunk straight back
                        out = rb.body
                        if r.strip is not None:
                            out = r.strip.feed(out)
                            if rb.end_of_stream:
                                out += r.strip.flush()
                            elif not out:  # only part of an event: it goes on with its rest
                                continue
                        yield P.streamed_response_chunk(out, rb.end_of_stream)
                    else:
                        yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))
                elif which == "response_trailers":
                    if r.strip is not None and (rest := r.strip.flush()):
                        yield P.streamed_response_chunk(rest, False)
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            self._release(r)


class EppServer:
    """The gRPC server: the ext_proc service and the gRPC health service on one port.

    Health as GIE's EPP reports it: ``liveness`` SERVING while the process answers; ``readiness``
    and the ext_proc service name SERVING while the router is not draining, knows at least one
    usable backend and its KV index has read the KV stream's backlog at start (the router's own
    ``/ready`` rule), re-checked every ``ready_every_s``."""

    def __init__(self, service: RouterService, *, fallbacks: int = 0, ready_every_s: float = 1.0):
        self.svc = service
        self.ready_every_s = ready_every_s
        self._ready: bool | None = None
        self._task: asyncio.Task | None = None
        self.picker = EndpointPicker(service, fallbacks=fallbacks)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> str:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                                          ("grpc.max_send_message_length", 64 * 1024 * 1024)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"endpoint picker: cannot listen on {host}:{port}")
        await server.start()
        r = self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        if asyncio.iscoroutine(r):
            await r
        self.server, self.port = server, bound
        await self.check_ready()
        self._task = asyncio.create_task(self._watch_ready())
        return f"{host}:{bound}"

    def is_ready(self) -> bool:
        svc = self.svc
        if svc.draining or not any(b.health != "critical" and not b.circuit_open for b in svc.state.snapshot()):
            return False
        return svc.kv_status is None or svc.kv_status()[0]

    async def check_ready(self) -> bool:
        ready = self.is_ready()
        if ready != self._ready:
            self._ready = ready
            await self.set_serving(ready)
        return ready

    async def _watch_ready(self) -> None:
        while True:
            await asyncio.sleep(self.ready_every_s)
            await self.check_ready()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *_HEALTH_NAMES[2:]):
            r = self.health.set(name, status)
            if asyncio.iscoroutine(r):
                await r

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None


async def start_epp(service: RouterService, host: str, port: int, *, fallbacks: int = 0) -> EppServer:
    """Start the endpoint picker beside ``service`` (sharing its router, state and KV index)."""
    srv = EppServer(service, fallbacks=fallbacks)
    await srv.start(host, port)
    return srv
