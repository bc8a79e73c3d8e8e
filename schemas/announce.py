"""Engines announcing themselves on the bus (discovery without Kubernetes)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Event


class EngineAnnouncement(Event):
    pod: str = Field(min_length=1)
    url: str = Field(min_length=1, description="base URL of the OpenAI server, e.g. http://10.0.0.5:8000")
    model: str = Field(min_length=1)
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    group: str | None = Field(default=None, description="PD group id")
    pool: str = "default"
    node: str | None = None
    devices: list[str] = Field(default_factory=list)
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None
    block_size: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0, description="sequences the engine runs at once")
    ts: float = Field(ge=0)
    state: Literal["up", "draining", "down"] = "up"
    ttl_s: float = Field(default=30.0, gt=0)
