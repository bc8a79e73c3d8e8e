"""The endpoint picker's ext_proc conversation, message by message over real gRPC (no Envoy):
subset hints, fallbacks, P/D header, buffered vs full-duplex answers, immediate errors, health."""

from __future__ import annotations

import grpc
import msgspec
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.config import RouterConfig, StaticBackend
from router.epp import protocol as P
from router.epp import start_epp
from router.server import RouterService

MODEL = "m"
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def _backends(n=3, role="aggregated"):
    return [StaticBackend(pod=f"p{i}", url=f"http://10.0.0.{i + 1}:8000", model=MODEL, role=role) for i in range(n)]


@pytest.fixture
async def epp():
    made = []

    async def make(backends=None, strategy="kv-aware", fallbacks=0, index=None, **cfg):
        svc = RouterService(RouterConfig(strategy=strategy, backends=backends or _backends(), bus=False,
                                         records=False, seed=5, **cfg), index=index)
        srv = await start_epp(svc, "127.0.0.1", 0, fallbacks=fallbacks)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
        made.append((srv, ch))
        return svc, srv, pb_grpc.ExternalProcessorStub(ch), ch

    yield make
    for srv, ch in made:
        await ch.close()
        await srv.stop(0)


def headers_msg(path="/v1/chat/completions", mode=DUPLEX, subset=None, eos=False, extra=(), response_mode=None):
    hs = [(":method", "POST"), (":path", path), ("content-type", "application/json"), *extra]
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=eos))
    req.protocol_config.request_body_mode = mode
    if response_mode is not None:
        req.protocol_config.response_body_mode = response_mode
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({P.SUBSET: subset})
        req.metadata_context.filter_metadata[P.SUBSET_NAMESPACE].CopyFrom(s)
    return req


def body_msgs(body: bytes, chunk=65536):
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
            for i, p in enumerate(parts)]


def chat(content="hello", **kw) -> bytes:
    return msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": content}], **kw})


async def converse(stub, msgs):
    call = stub.Process(iter(msgs))
    out = [m async for m in call]
    return out


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def test_full_duplex_answers_headers_with_the_pick_then_hands_the_body_back(epp):
    svc, _, stub, _ = await epp()
    body = chat("x" * 200_000)  # several chunks
    out = await converse(stub, [headers_msg(), *body_msgs(body)])
    assert out[0].WhichOneof("response") == "request_headers"
    hs = set_headers(out[0].request_headers.response)
    ep = hs[P.DESTINATION]
    assert ep in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    md = out[0].dynamic_metadata.fields[P.LB_NAMESPACE].struct_value.fields[P.DESTINATION].string_value
    assert md == ep  # the same value in the header and the metadata
    echoed = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in out[1:])
    assert echoed == body
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    assert all(b.inflight == 0 for b in svc.state.snapshot())  # released when the stream closed


async def test_buffered_mode_continues_headers_and_routes_on_the_body(epp):
    _, _, stub, _ = await epp()
    out = await converse(stub, [headers_msg(mode=BUFFERED), *body_msgs(chat(), chunk=1 << 30)])
    assert [m.WhichOneof("response") for m in out] == ["request_headers", "request_body"]
    assert not out[0].request_headers.response.header_mutation.set_headers
    assert P.DESTINATION in set_headers(out[1].request_body.response)


async def test_subset_hint_restricts_the_pick_and_an_empty_or_foreign_subset_is_503(epp):
    _, _, stub, _ = await epp()
    for _ in range(5):
        out = await converse(stub, [headers_msg(subset=["10.0.0.3:8000"]), *body_msgs(chat())])
        assert set_headers(out[0].request_headers.response)[P.DESTINATION] == "10.0.0.3:8000"
    for subset in ([], ["192.168.9.9:8000"]):
        out = await converse(stub, [headers_msg(subset=subset), *body_msgs(chat())])
        assert out[0].immediate_response.status.code == 503


async def test_fallbacks_follow_the_pick_in_score_order(epp):
    svc, _, stub, _ = await epp(fallbacks=2)
    svc.state.get("p0").waiting = 30
    svc.state.get("p2").waiting = 10
    svc.state.epoch += 1
    out = await converse(stub, [headers_msg(), *body_msgs(chat())])
    assert set_headers(out[0].request_headers.response)[P.DESTINATION] == "10.0.0.2:8000,10.0.0.3:8000,10.0.0.1:8000"


async def test_busy_is_429_nothing_serves_is_503_bad_input_is_4xx(epp):
    svc, _, stub, _ = await epp(max_body_bytes=1000)
    out = await converse(stub, [headers_msg(), *body_msgs(b"{not json")])
    assert out[0].immediate_response.status.code == 400
    err = msgspec.json.decode(out[0].immediate_response.body)["error"]
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    out = await converse(stub, [headers_msg(), *body_msgs(chat("y" * 5000))])
    assert out[-1].immediate_response.status.code == 413
    out = await converse(stub, [headers_msg(), *body_msgs(msgspec.json.encode({"model": "other", "messages": [
        {"role": "user", "content": "a"}]}))])
    assert out[0].immediate_response.status.code == 404
    for b in svc.state.snapshot():
        b.waiting = 1000
    svc.state.epoch += 1
    out = await converse(stub, [headers_msg(), *body_msgs(chat())])
    r = out[0].immediate_response
    assert r.status.code == 429
    assert {h.header.key: h.header.raw_value for h in r.headers.set_headers}["retry-after"] == b"1"
    for b in svc.state.snapshot():
        b.waiting, b.health = 0, "critical"
    svc.state.epoch += 1
    out = await converse(stub, [headers_msg(), *body_msgs(chat())])
    assert out[0].immediate_response.status.code == 503


async def test_pd_pick_names_the_prefill_pod_and_strips_a_client_supplied_one(epp):
    bs = [StaticBackend(pod="pre", url="http://10.1.0.1:8000", model=MODEL, role="prefill", group="g"),
          StaticBackend(pod="dec", url="http://10.1.0.2:8200", model=MODEL, role="decode", group="g")]
    _, _, stub, _ = await epp(backends=bs, strategy="pd-kv-aware")
    out = await converse(stub, [headers_msg(), *body_msgs(chat("word " * 600))])
    hs = set_headers(out[0].request_headers.response)
    assert hs == {P.DESTINATION: "10.1.0.2:8200", P.PREFILLER: "10.1.0.1:8000"}
    # a short prompt: the decode pod prefills it itself, and a smuggled header is removed
    out = await converse(stub, [headers_msg(extra=[(P.PREFILLER, "6.6.6.6:1")]), *body_msgs(chat("hi"))])
    common = out[0].request_headers.response
    assert set_headers(common) == {P.DESTINATION: "10.1.0.2:8200"}
    assert list(common.header_mutation.remove_headers) == [P.PREFILLER]


async def test_requests_without_a_body_go_to_the_least_loaded_endpoint(epp):
    svc, _, stub, _ = await epp()
    svc.state.get("p0").waiting = 5
    svc.state.get("p1").waiting = 2
    out = await converse(stub, [headers_msg(path="/v1/models", eos=True)])
    assert set_headers(out[0].request_headers.response)[P.DESTINATION] == "10.0.0.3:8000"


async def test_grpc_health_reports_liveness_readiness_and_the_service(epp):
    _, srv, _, ch = await epp()
    h = health_pb2_grpc.HealthStub(ch)
    for name in ("liveness", "readiness", P.SERVICE):
        r = await h.Check(health_pb2.HealthCheckRequest(service=name))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    # readiness follows the router: no usable backend (or draining) -> NOT_SERVING, liveness stays
    for b in srv.svc.state.snapshot():
        b.health = "critical"
    assert await srv.check_ready() is False
    for name, want in (("readiness", "NOT_SERVING"), (P.SERVICE, "NOT_SERVING"), ("liveness", "SERVING")):
        r = await h.Check(health_pb2.HealthCheckRequest(service=name))
        assert r.status == getattr(health_pb2.HealthCheckResponse, want), name
    for b in srv.svc.state.snapshot():
        b.health = "ok"
    assert await srv.check_ready() is True
    srv.svc.draining = True
    assert await srv.check_ready() is False


def test_endpoint_of_urls():
    assert P.endpoint_of("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert P.endpoint_of("http://[fd00::1]:8000/v1") == "[fd00::1]:8000"
    assert P.endpoint_of("http://pod.ns.svc") == "pod.ns.svc:80"


async def test_served_fallback_takes_over_the_in_flight_count(epp):
    """The proxy reports in envoy.lb / x-gateway-destination-endpoint-served which endpoint
    served (a fallback after a failed primary): the in-flight count follows it."""
    import asyncio

    svc, _, stub, _ = await epp(fallbacks=1)
    call = stub.Process()
    for m in [headers_msg(), *body_msgs(chat())]:
        await call.write(m)
    first = await call.read()
    primary, fallback = set_headers(first.request_headers.response)[P.DESTINATION].split(",")
    await call.read()  # the body handed back
    by_ep = {P.endpoint_of(b.url): b for b in svc.state.snapshot()}
    assert by_ep[primary].inflight == 1 and by_ep[fallback].inflight == 0
    resp = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    s = struct_pb2.Struct()
    s.update({P.SERVED: fallback})
    resp.metadata_context.filter_metadata[P.LB_NAMESPACE].CopyFrom(s)
    await call.write(resp)
    assert (await call.read()).WhichOneof("response") == "response_headers"
    assert by_ep[primary].inflight == 0 and by_ep[fallback].inflight == 1
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    for _ in range(100):
        if by_ep[fallback].inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert by_ep[fallback].inflight == 0


async def test_streamed_mode_routes_on_the_headers_and_passes_chunks(epp):
    svc, _, stub, _ = await epp()
    svc.state.get("p0").waiting = 3
    svc.state.get("p2").waiting = 1
    out = await converse(stub, [headers_msg(mode=processing_mode_pb2.ProcessingMode.STREAMED),
                                *body_msgs(chat("z" * 100_000))])
    assert set_headers(out[0].request_headers.response)[P.DESTINATION] == "10.0.0.2:8000"
    assert [m.WhichOneof("response") for m in out[1:]] == ["request_body"] * 2
    assert not any(m.request_body.response.body_mutation.ListFields() for m in out[1:])


async def test_a_long_prompt_is_tokenized_on_the_tokenizer_threads(epp):
    """The picker hands a long prompt to the router's tokenizer threads (a tokenizer.json releases
    the GIL), as the HTTP router does; a short one is tokenized on the loop."""
    import threading
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "tokenize"
    svc, _, stub, _ = await epp(tokenizer=str(fixture), tokenize_threads=2, tokenize_offload_bytes=4096)
    seen: list[tuple[str, int]] = []
    real = svc.encoder.encode_with

    def encode_with(tok, kind, body, as_array=True):
        seen.append((threading.current_thread().name, len(body["messages"][0]["content"])))
        return real(tok, kind, body, as_array=as_array)

    svc.encoder.encode_with = encode_with
    for content in ("the cache router " * 400, "hello"):
        out = await converse(stub, [headers_msg(), *body_msgs(chat(content))])
        assert P.DESTINATION in set_headers(out[0].request_headers.response)
    assert [(name.startswith("router-tokenize"), n) for name, n in seen] == [(True, 6800), (False, 5)]


async def test_a_picked_prompt_counts_as_predicted_on_its_endpoint(epp):
    """As the HTTP router: until the engine's KV events come, the prompt the picker just placed is
    a predicted prefix on that engine, so the next request with it goes there too."""
    from streams.clock import SystemClock
    from streams.kv_index import KvIndex

    svc, _, stub, _ = await epp(index=KvIndex(SystemClock(), default_block_size=16), tokenizer="simple")
    body = chat(" ".join(f"word{i}" for i in range(400)))
    ids = svc.encoder.encode("chat", msgspec.json.decode(body))
    picked = []
    for _ in range(3):
        out = await converse(stub, [headers_msg(), *body_msgs(body)])
        picked.append(set_headers(out[0].request_headers.response)[P.DESTINATION])
        if len(picked) == 1:
            pod = next(b.pod for b in svc.state.snapshot() if b.url.endswith(picked[0]))
            m = svc.index.match_tokens(MODEL, ids).get(pod)
            assert m is not None and m.predicted_blocks == m.matched_blocks >= (len(ids) - 1) // 16
    assert len(set(picked)) == 1


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_DELTA = _sse({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
_USAGE = _sse({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
               "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                         "prompt_tokens_details": {"cached_tokens": 8}}})


def _response(status=200, ctype="text/event-stream"):
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=ctype.encode())])))


def _response_body(data: bytes, eos=False):
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def _records(svc):
    from prometheus_client import CollectorRegistry

    from router.records import RecordSink

    svc.records = RecordSink("default", registry=CollectorRegistry())
    return svc.records


def _sent(out, mode) -> bytes:
    """The request body as the picker hands it to Envoy."""
    if mode == BUFFERED:
        body = [m.request_body.response.body_mutation.body for m in out if m.WhichOneof("response") == "request_body"]
        return body[0] if body else b""
    return b"".join(m.request_body.response.body_mutation.streamed_response.body for m in out
                    if m.WhichOneof("response") == "request_body")


def _mutation(out) -> pb.CommonResponse:
    """The header mutation that carries the pick (on the headers in full duplex, on the body when buffered)."""
    for m in out:
        which = m.WhichOneof("response")
        if which in ("request_headers", "request_body"):
            common = getattr(m, which).response
            if P.DESTINATION in set_headers(common):
                return common
    raise AssertionError("no pick")


@pytest.mark.parametrize("mode", [DUPLEX, BUFFERED])
async def test_a_stream_without_usage_is_asked_for_it_and_the_usage_event_taken_out(epp, mode):
    """The gateway relays the answer in full duplex: the picker adds include_usage to the request
    (content-length to match), then removes the usage event from the answer, wherever the gateway
    cut it, and the record has the engine's counts."""
    svc, _, stub, _ = await epp()
    sink = _records(svc)
    body = chat("hello", stream=True, stream_options={"continuous_usage_stats": False})
    cut = len(_USAGE) // 2
    out = await converse(stub, [headers_msg(mode=mode, response_mode=DUPLEX),
                                *body_msgs(body, chunk=1 << 30 if mode == BUFFERED else 16),
                                _response(), _response_body(_DELTA + _USAGE[:cut]),
                                _response_body(_USAGE[cut:]),  # nothing whole: no answer to this one
                                _response_body(b"data: [DONE]\n\n", eos=True)])
    sent = _sent(out, mode)
    assert msgspec.json.decode(sent) == {**msgspec.json.decode(body),
                                         "stream_options": {"continuous_usage_stats": False, "include_usage": True}}
    assert set_headers(_mutation(out))["content-length"] == str(len(sent))
    back = [m.response_body.response.body_mutation.streamed_response for m in out
            if m.WhichOneof("response") == "response_body"]
    assert [(b.body, b.end_of_stream) for b in back] == [(_DELTA, False), (b"data: [DONE]\n\n", True)]
    rec = [ev for subj, ev, _ in (sink.queue.get_nowait() for _ in range(sink.queue.qsize()))
           if subj.startswith("router.requests")]
    assert len(rec) == 1
    from router.records import RecordSink

    r = RecordSink.build(rec[0])
    assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (9, 8, 1)
    assert not any(svc.registry.get_sample_value("infernex_router_answers_without_cached_tokens_total",
                                                 {"pod": f"p{i}", "reason": "no_usage"}) for i in range(3))


@pytest.mark.parametrize("case", ["response_streamed", "response_none", "no_protocol_config", "not_a_stream",
                                  "client_asked", "setting_off", "request_streamed"])
async def test_no_usage_question_when_the_client_would_see_the_answer(epp, case):
    """The body goes upstream as the client sent it when the picker could not take the usage
    event out of the answer (the gateway does not relay it chunk by chunk in full duplex), when
    the answer has usage anyway, or when the setting is off."""
    svc, _, stub, _ = await epp(**({"epp_ask_usage": False} if case == "setting_off" else {}))
    _records(svc)
    body = chat("hello", stream=case != "not_a_stream",
                **({"stream_options": {"include_usage": True}} if case == "client_asked" else {}))
    mode = processing_mode_pb2.ProcessingMode.STREAMED if case == "request_streamed" else DUPLEX
    rmode = {"response_streamed": processing_mode_pb2.ProcessingMode.STREAMED,
             "response_none": processing_mode_pb2.ProcessingMode.NONE}.get(case, DUPLEX)
    h = headers_msg(mode=mode, response_mode=rmode)
    if case == "no_protocol_config":
        h.ClearField("protocol_config")
    out = await converse(stub, [h, *body_msgs(body)])
    if case == "request_streamed":
        assert not any(m.request_body.response.body_mutation.ListFields() for m in out[1:])
    elif case == "no_protocol_config":  # (read as buffered: the body is answered without a mutation)
        assert not out[-1].request_body.response.body_mutation.ListFields()
    else:
        assert _sent(out, DUPLEX) == body
    assert "content-length" not in set_headers(_mutation(out))


async def test_an_error_answer_is_handed_back_unchanged(epp):
    svc, _, stub, _ = await epp()
    _records(svc)
    err = b'{"error": {"message": "bad", "usage": {}, "choices": []}}'
    out = await converse(stub, [headers_msg(response_mode=DUPLEX), *body_msgs(chat("x", stream=True)),
                                _response(400, "application/json"), _response_body(err[:10]),
                                _response_body(err[10:], eos=True)])
    back = [m.response_body.response.body_mutation.streamed_response.body for m in out
            if m.WhichOneof("response") == "response_body"]
    assert back == [err[:10], err[10:]]
