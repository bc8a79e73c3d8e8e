"""Base model for every event on the bus, and strict encode/decode helpers."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

SCHEMA_VERSION = 1

T = TypeVar("T", bound="Event")


class ValidationFailure(ValueError):
    """Raised when bytes or a mapping do not form a valid event.

    ``str(exc)`` names every offending field and the reason, e.g.
    ``KvEventBatch: events.0.block_hashes: Input should be a valid list``.
    """

    def __init__(self, model: str, errors: list[dict[str, Any]]):
        self.model = model
        self.errors = errors
        parts = []
        for err in errors:
            loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        super().__init__(f"{model}: " + "; ".join(parts))

    @property
    def fields(self) -> list[str]:
        return [".".join(str(p) for p in e.get("loc", ())) for e in self.errors]


class Event(BaseModel):
    """Every payload carries ``schema_version``; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=False).encode()

    @classmethod
    def from_json(cls: type[T], data: bytes | str) -> T:
        return decode_event(cls, data)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v < 1 or v > SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is not understood by this build (1..{SCHEMA_VERSION})")
        return v


def decode_event(model: type[T], data: bytes | str | dict[str, Any]) -> T:
    """Validate ``data`` as ``model``; raise :class:`ValidationFailure` naming fields."""
    try:
        if isinstance(data, dict):
            return model.model_validate(data)
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise ValidationFailure(model.__name__, exc.errors(include_url=False)) from None


def encode_event(event: Event) -> bytes:
    return event.to_json()
