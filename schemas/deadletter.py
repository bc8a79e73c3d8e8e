"""Dead letters: input a consumer could not use, kept with the reason."""

from __future__ import annotations

from pydantic import Field

from schemas.base import Event


class DeadLetter(Event):
    stream: str = Field(min_length=1, description="logical stream, e.g. kv-events")
    subject: str = Field(description="subject the bad message arrived on")
    reason: str = Field(min_length=1)
    ts: float = Field(ge=0)
    consumer: str = ""
    payload: str = Field(description="original payload, base64")
    headers: dict[str, str] = Field(default_factory=dict)
