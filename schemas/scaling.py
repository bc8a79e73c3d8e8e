"""Autoscaling hints from the planner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Event


class ScalingHint(Event):
    pool: str = Field(min_length=1)
    role: Literal["prefill", "decode", "aggregated"]
    ts: float = Field(ge=0)
    current: int = Field(ge=0)
    desired: int = Field(ge=0)
    reason: str
    predictor: str = "constant"
    mode: Literal["stable", "panic"] = "stable"
    inputs: dict[str, float] = Field(default_factory=dict)
