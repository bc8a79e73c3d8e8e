"""Findings of the diagnosis engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Event

Severity = Literal["info", "warning", "critical"]
FindingStatus = Literal["open", "updated", "resolved"]
ActionLevel = Literal[
    "NotHandle",
    "RestartRequest",
    "RestartBusiness",
    "RestartNPU",
    "FreeRestartNPU",
    "SeparateNPU",
    "PreSeparateNPU",
    "SubHealth",
    "ResetGPU",
    "DrainNode",
    "Observe",
]


class Diagnosis(Event):
    """One finding; a persisting fault is the same ``finding_id`` updated, then resolved."""

    finding_id: str = Field(min_length=1)
    node: str = Field(min_length=1)
    device: str = Field(min_length=1)
    fault_mode: str = Field(min_length=1, description="e.g. over_temperature, hbm_ecc_burst, xid_79")
    severity: Severity
    status: FindingStatus
    action: ActionLevel
    summary: str
    remediation: str = ""
    evidence: dict[str, float | int | str | None] = Field(default_factory=dict)
    first_seen: float = Field(ge=0)
    last_seen: float = Field(ge=0)
    pods: list[str] = Field(default_factory=list)
    revision: int = Field(default=0, ge=0, description="1 for the opening message, +1 per update/resolution")
