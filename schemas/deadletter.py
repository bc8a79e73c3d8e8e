"""Dead letters: input a consumer could not use, kept with the reason.

A dead letter is bounded whatever the input: ``payload`` holds at most the first
:data:`MAX_DEAD_LETTER_PAYLOAD` bytes of the original (base64), with the original's size and
sha256, so a message near the server's ``max_payload`` still fits in its dead letter.
"""

from __future__ import annotations

from pydantic import Field

from schemas.base import Event

MAX_DEAD_LETTER_PAYLOAD = 16 * 1024  # bytes of the original kept (before base64)
MAX_DEAD_LETTER_REASON = 2000


class DeadLetter(Event):
    stream: str = Field(min_length=1, description="logical stream, e.g. kv-events")
    subject: str = Field(description="subject the bad message arrived on")
    reason: str = Field(min_length=1, max_length=MAX_DEAD_LETTER_REASON)
    ts: float = Field(ge=0)
    consumer: str = ""
    payload: str = Field(description="the original payload's first bytes (at most 16 KiB), base64")
    payload_size: int | None = Field(default=None, ge=0, description="the original payload's size in bytes")
    payload_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                       description="sha256 of the whole original payload, hex")
    truncated: bool = Field(default=False, description="payload holds only the first bytes of the original")
    stream_seq: int | None = Field(default=None, ge=0, description="the original's JetStream sequence, if known")
    headers: dict[str, str] = Field(default_factory=dict)
