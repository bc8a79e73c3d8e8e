"""The Gateway API Inference Extension endpoint-picker protocol over Envoy ext_proc: names and
message builders. Pure functions over the protobuf types from ``xds-protos``; no I/O.

Facts (GIE ``docs/proposals/004-endpoint-picker-protocol``, llm-d inference scheduler):
- the pick goes in the request header ``x-gateway-destination-endpoint`` and in the dynamic
  metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``, both ``ip:port[,ip:port...]``
  (first the primary, then fallbacks), the same value in both places;
- the proxy may restrict the pick to ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``); nothing eligible -> 503;
- nothing can serve -> an immediate 503; the request should be shed under load -> 429;
- llm-d's P/D: the prefill pick rides in ``x-prefiller-host-port`` to the decode pod's sidecar.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
PREFILLER = "x-prefiller-host-port"
#: the ext_proc service name (also the gRPC health service name GIE's EPP reports)
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

#: a streamed body is answered in chunks no larger than this (Envoy caps one message near 4 MB)
CHUNK = 64 * 1024


def endpoint_of(url: str) -> str:
    """``http://10.0.0.5:8000/x`` -> ``10.0.0.5:8000`` (IPv6 in brackets)."""
    u = urlsplit(url if "//" in url else f"//{url}")
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased header names -> values (Envoy sends ``raw_value`` bytes, older ones ``value``)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def subset_hint(req: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows (``None``: no hint, the whole pool)."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    fields = md[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    v = fields[SUBSET]
    if v.HasField("list_value"):
        return frozenset(x.string_value for x in v.list_value.values if x.string_value)
    if v.HasField("string_value"):  # tolerate "a:1,b:2"
        return frozenset(s.strip() for s in v.string_value.split(",") if s.strip())
    return frozenset()


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    md = req.metadata_context.filter_metadata
    if LB_NAMESPACE in md and SERVED in md[LB_NAMESPACE].fields:
        return md[LB_NAMESPACE].fields[SERVED].string_value or None
    return None


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def routing_mutation(endpoints: Iterable[str], prefiller: str | None) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    """The header mutation and dynamic metadata that carry a pick (same value in both)."""
    value = ",".join(endpoints)
    sets = [_set(DESTINATION, value)]
    if prefiller:
        sets.append(_set(PREFILLER, prefiller))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=(
        [] if prefiller else [PREFILLER])),  # a client must not smuggle its own prefill target in
        clear_route_cache=True)  # routes may match on the destination header
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION: value}})
    return common, md


def headers_response(common: pb.CommonResponse | None = None,
                     metadata: struct_pb2.Struct | None = None) -> pb.ProcessingResponse:
    r = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common or pb.CommonResponse()))
    if metadata is not None:
        r.dynamic_metadata.CopyFrom(metadata)
    return r


def body_response(common: pb.CommonResponse | None = None,
                  metadata: struct_pb2.Struct | None = None) -> pb.ProcessingResponse:
    r = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common or pb.CommonResponse()))
    if metadata is not None:
        r.dynamic_metadata.CopyFrom(metadata)
    return r


def streamed_body(body: bytes, *, response: bool = False) -> list[pb.ProcessingResponse]:
    """A body handed back to Envoy in FULL_DUPLEX_STREAMED mode: chunks, the last ends the stream."""
    parts = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    out = []
    for i, part in enumerate(parts):
        mut = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=part, end_of_stream=i == len(parts) - 1))
        br = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mut))
        out.append(pb.ProcessingResponse(response_body=br) if response else pb.ProcessingResponse(request_body=br))
    return out


def streamed_response_chunk(body: bytes, end: bool) -> pb.ProcessingResponse:
    """One chunk of the response body handed back in FULL_DUPLEX_STREAMED mode."""
    mut = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mut)))


def set_content_length(common: pb.CommonResponse, n: int) -> None:
    """The request body was changed: its new length, in the header mutation that goes with it."""
    common.header_mutation.set_headers.append(_set("content-length", str(n)))


def immediate(status: int, message: str, code: str, type_: str = "service_unavailable",
              retry_after: int | None = None) -> pb.ProcessingResponse:
    """An OpenAI-shaped error answered by the proxy itself (the request goes nowhere)."""
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})
    sets = [_set("content-type", "application/json")]
    if retry_after is not None:
        sets.append(_set("retry-after", str(retry_after)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=pb.HeaderMutation(set_headers=sets), details=f"infernex_epp_{code}"))
