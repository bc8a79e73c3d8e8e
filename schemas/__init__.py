"""The contract of InferNex: event and API models, and every subject name.

Owns: pydantic models for everything that crosses a process boundary (KV events,
engine metrics, device telemetry, diagnoses, request records, routing decisions,
scaling hints, dead letters), the configuration models that services receive, and
the subject builders of :mod:`schemas.subjects`.

May import: the standard library and pydantic only. No I/O, no broker, no HTTP.
Every other package imports from here; this package imports from none of them.
"""

from schemas.base import SCHEMA_VERSION, Event, ValidationFailure, decode_event, encode_event
from schemas.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    PodGone,
    PodReset,
)
from schemas.metrics import EngineMetrics, HistogramSnapshot
from schemas.device import DeviceTelemetry
from schemas.diagnosis import Diagnosis
from schemas.records import CandidateScore, ReplicaLoad, RequestRecord, RoutingDecision
from schemas.scaling import ScalingHint
from schemas.deadletter import DeadLetter
from schemas.announce import EngineAnnouncement

__all__ = [
    "SCHEMA_VERSION",
    "Event",
    "ValidationFailure",
    "decode_event",
    "encode_event",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvEvent",
    "KvEventBatch",
    "PodGone",
    "PodReset",
    "EngineMetrics",
    "HistogramSnapshot",
    "DeviceTelemetry",
    "Diagnosis",
    "CandidateScore",
    "RequestRecord",
    "RoutingDecision",
    "ReplicaLoad",
    "ScalingHint",
    "DeadLetter",
    "EngineAnnouncement",
]
