"""What the endpoint picker learns from the response, so requests routed through a gateway land in
the SLA history like the HTTP router's own: status, time to first token, output tokens, cached
tokens (from ``usage``), end-to-end time.

The gateway has to send the response to the picker for this (ext_proc ``response_header_mode:
SEND`` and a response body mode other than ``NONE``; GIE's gateways send both in
``FULL_DUPLEX_STREAMED``). Without the response there is nothing true to record: the request is
counted (``infernex_router_epp_unobserved_total``) and no record is written.

The SSE events are read with the router's own event accounting (:func:`router.flow.on_event`),
and the record is built by :meth:`RouterService._finish`, so both paths measure the same way.
A stream carries its token counts only in a usage event, which vLLM sends when the request asks
for it; the picker asks on the client's behalf when it can take that event out of the answer
again (see :mod:`router.epp.service`), and this watch reads the event as the client never does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router import flow as answer
from router.epp import protocol as P

if TYPE_CHECKING:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from router.flow import Flow
    from router.server import RouterService

#: at most this much of a non-streamed answer is kept to read its ``usage`` (an answer is JSON with
#: the usage at its end; longer answers are counted by time only)
JSON_KEEP = 1 << 20


class ResponseWatch:
    """One request's response as the gateway relays it to the picker."""

    __slots__ = ("svc", "flow", "seen", "ended", "_buf", "sse", "_json", "_overflow")

    def __init__(self, svc: RouterService, flow: Flow):
        self.svc = svc
        self.flow = flow
        self.seen = False  # response headers arrived
        self.ended = False
        self._buf = bytearray()
        self.sse: bool | None = None  # the answer is a stream of server-sent events
        self._json = bytearray()
        self._overflow = False

    def headers(self, req: pb.ProcessingRequest) -> None:
        h = P.header_map(req.response_headers)
        self.seen = True
        try:
            status = int(h.get(":status", "200"))
        except ValueError:
            status = 200
        f = self.flow
        f.http_status = status
        if status >= 400:
            f.status = "rejected" if status == 429 else "error"
            f.error = f"HTTP {status} from {f.decode_pod or '?'}"
        ctype = h.get("content-type", "")
        self.sse = "text/event-stream" in ctype
        if req.response_headers.end_of_stream:
            self.ended = True

    def body(self, chunk: bytes, end: bool) -> None:
        if not self.seen:
            return
        f = self.flow
        if chunk and f.status == "ok":
            if self.sse:
                self._buf += chunk
                while True:
                    i = self._buf.find(b"\n\n")
                    if i < 0:
                        break
                    ev = bytes(self._buf[:i])
                    del self._buf[:i + 2]
                    answer.on_event(f, ev, retries_recomputed=self.svc.pd.retries_recomputed)
            elif not self._overflow:
                if len(self._json) + len(chunk) > JSON_KEEP:
                    self._overflow = True
                    self._json.clear()
                else:
                    self._json += chunk
        if end:
            self.ended = True
            if self.sse and self._buf and f.status == "ok":
                answer.on_event(f, bytes(self._buf), retries_recomputed=self.svc.pd.retries_recomputed)
                self._buf.clear()
            if not self.sse and f.status == "ok":
                if self._json and not self._overflow:
                    answer.account_json(f, bytes(self._json))
                else:
                    f.first_token_t = f.last_token_t = time.perf_counter()

    def finish(self) -> bool:
        """Record the request (metrics and the SLA record); False when the response was never seen.
        A response that started but did not end (the client or the gateway went away) is
        ``cancelled``."""
        if not self.seen:
            return False
        f = self.flow
        if f.engine_error is not None and f.status == "ok":
            # the engine ended the stream with an error event (vLLM: a generation that failed); the
            # gateway passed it to the client, and the record says so
            code, etype, msg = f.engine_error
            f.status, f.http_status, f.error = "error", code, f"engine error mid-stream: {etype}: {msg}"[:500]
        elif not self.ended and f.status == "ok":
            f.status = "cancelled"
        self.svc._finish(f)
        return True
