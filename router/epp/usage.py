"""Token counts for streams whose client did not ask for them (no I/O).

vLLM ends a stream with a usage event (``"choices": []`` and ``usage``: prompt, completion and
cached tokens) only when the request sets ``stream_options.include_usage``; most OpenAI clients
do not. The endpoint picker asks on the client's behalf (:func:`asking`), so the request record
has the real counts, and takes that one event out of the answer (:class:`UsageStrip`), so the
client gets exactly what it would have got without the question. The HTTP router does the same
with its own ``Flow.wants_usage``.

Events are split at ``\\n\\n`` (what vLLM writes). A complete event goes on as soon as it arrives;
only an event still incomplete at the end of a chunk waits for the rest of it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.flow import usage_asked

#: an incomplete event longer than this is passed on as it is (it cannot be the small usage event)
HOLD_MAX = 1 << 20


def needs_asking(body: dict[str, Any]) -> bool:
    """A stream whose client did not ask for usage (``body`` already checked against the API)."""
    if not body.get("stream"):
        return False
    so = body.get("stream_options")
    return not (isinstance(so, dict) and so.get("include_usage"))


def asking(body: dict[str, Any]) -> bytes:
    """``body`` re-encoded with ``include_usage: true`` (:func:`router.flow.usage_asked`)."""
    return msgspec.json.encode({**body, "stream_options": usage_asked(body.get("stream_options"))})


def is_usage_only(event: bytes) -> bool:
    """The event is vLLM's closing usage chunk: ``choices`` empty, ``usage`` an object."""
    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data.startswith(b"{"):
        return False
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)


class UsageStrip:
    """One answer's SSE bytes, chunk by chunk, less the usage-only event."""

    __slots__ = ("_held", "dropped")

    def __init__(self) -> None:
        self._held = b""
        self.dropped = 0  # usage events taken out

    def feed(self, chunk: bytes) -> bytes:
        """What of the answer so far goes on now."""
        data = self._held + chunk if self._held else chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            if len(data) > HOLD_MAX:
                self._held = b""
                return data
            self._held = data
            return b""
        whole, self._held = data[:cut], data[cut:]
        if b'"usage"' not in whole:
            return whole
        events = whole.split(b"\n\n")[:-1]
        kept = [ev for ev in events if not (b'"usage"' in ev and is_usage_only(ev))]
        if len(kept) == len(events):
            return whole
        self.dropped += len(events) - len(kept)
        return b"".join(ev + b"\n\n" for ev in kept)

    def flush(self) -> bytes:
        """The answer ended: what is left of it (an event without its closing blank line)."""
        rest, self._held = self._held, b""
        if rest and b'"usage"' in rest and is_usage_only(rest):
            self.dropped += 1
            return b""
        return rest
