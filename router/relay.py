"""A streamed answer passed from the engine to the client event by event, as the bytes arrive.

:class:`SseRelay` is the sink of :meth:`router.upstream.UpstreamResponse.pipe`: it is called from
the engine connection's own callback with each piece of the body, cuts it into SSE events (an
event may arrive split, or several in one piece), lets :func:`router.flow.on_event` account for
each one (tokens, usage, the engine's error event, a recomputed stop) and decide whether it goes
on, and gathers what goes on; :meth:`SseRelay.flush`, which ``pipe`` calls once the read that
brought it has been handed over, writes it to the client in one piece (the engine writes each event
as its own HTTP chunk, and a read often holds several: one write and one wake-up of the client for
all of them, not one each). Nothing is awaited per event: a 64-token answer costs no more task
switches than a whole one. When the client's socket buffer is full the engine is not read until it
drains, so a slow client holds back its own engine connection only.

The relay stops (returns False) once the engine has sent an error event in place of the rest of
the answer: the caller continues the request elsewhere or ends it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from router import flow as answer

if TYPE_CHECKING:
    from consumers.http import StreamResponse
    from router.flow import Flow
    from router.upstream import UpstreamResponse

_END = b"\n\n"


class SseRelay:
    """One streamed answer's relay. ``on_first_token()`` is called once, when the first event that
    carries a token goes to the client (the engine's prefill is over)."""

    __slots__ = ("flow", "resp", "up", "retries_recomputed", "on_first_token", "_buf", "_out")

    def __init__(self, flow: Flow, resp: StreamResponse, up: UpstreamResponse, *, retries_recomputed: bool,
                 on_first_token: Callable[[], None] | None = None):
        self.flow = flow
        self.resp = resp
        self.up = up
        self.retries_recomputed = retries_recomputed
        self.on_first_token = on_first_token
        self._buf = b""
        self._out: list[bytes] = []  # what goes on to the client at the next flush()

    def __call__(self, chunk: bytes) -> bool:
        flow = self.flow
        buf = self._buf + chunk if self._buf else chunk
        i = buf.find(_END)
        if i < 0:
            self._buf = buf
            return True
        if i == len(buf) - 2:  # one whole event: what an engine sends for each token
            self._buf = b""
            keep = answer.on_event(flow, buf, retries_recomputed=self.retries_recomputed)
            out = buf if keep is True else (keep or b"")
        else:
            parts = bytearray()
            start = 0
            while i >= 0:
                ev = buf[start:i + 2]
                keep = answer.on_event(flow, ev, retries_recomputed=self.retries_recomputed)
                if keep is True:
                    parts += ev
                elif keep:
                    parts += keep  # the event rewritten
                start = i + 2
                i = buf.find(_END, start)
            self._buf = buf[start:]
            out = bytes(parts)
        if out:
            self._out.append(out)
        if flow.engine_error is not None:  # what came before the error goes out now: the caller moves on
            self.flush()
            return False
        return True

    def flush(self) -> None:
        """What the events since the last flush let through, to the client in one write."""
        pending = self._out
        if not pending:
            return
        out = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        if self.on_first_token is not None and self.flow.first_token_t is not None:
            first, self.on_first_token = self.on_first_token, None
            first()
        if self.resp.send_now(out):  # the client is behind: read no more from the engine until it drains
            self.up.pause()
            self.resp.when_drained(self.up.resume)
