"""Which payload model each subject carries (used by ``pub``, ``tail``, AsyncAPI, replay)."""

from __future__ import annotations

from schemas import subjects as S
from schemas.announce import EngineAnnouncement
from schemas.base import Event
from schemas.deadletter import DeadLetter
from schemas.device import DeviceTelemetry
from schemas.diagnosis import Diagnosis
from schemas.kv import KvEventBatch
from schemas.metrics import EngineMetrics
from schemas.records import ReplicaLoad, RequestRecord, RouteEnds, RoutingDecision
from schemas.scaling import ScalingHint

#: subject kind (as returned by :func:`schemas.subjects.parse`) -> (model, subject template, description);
#: template parameters are escaped tokens (see :func:`schemas.subjects.escape_token`)
CHANNELS: dict[str, tuple[type[Event], str, str]] = {
    "kv.events": (KvEventBatch, "kv.events.{model}.{pod}", "KV-cache events of one engine batch"),
    "engine.metrics": (EngineMetrics, "engine.metrics.{pod}", "engine metric snapshot"),
    "engine.announce": (EngineAnnouncement, "engine.announce.{pod}", "engine announces itself"),
    "device.telemetry": (DeviceTelemetry, "device.telemetry.{node}.{device}", "device telemetry sample"),
    "diagnosis": (Diagnosis, "diagnosis.{node}.{device}", "diagnosis finding or resolution"),
    "router.requests": (RequestRecord, "router.requests.{pool}", "per-request record"),
    "router.decisions": (RoutingDecision, "router.decisions.{pool}", "routing decision with scores"),
    "router.sync": (ReplicaLoad, "router.sync.{pool}", "a router replica's own in-flight load per engine, "
                    "for the other replicas of its pool (core NATS, not stored)"),
    "router.sync.ends": (RouteEnds, "router.sync.{pool}.ends", "the routes a router replica shared on "
                         "router.sync.{pool} that stop counting as predicted blocks (its request over, or gone "
                         "before its prefill), for the other replicas of its pool (core NATS, not stored)"),
    "autoscale.hints": (ScalingHint, "autoscale.hints.{pool}.{role}", "replica hint for a pool role"),
    "dlq": (DeadLetter, "dlq.{stream}", "dead letter with the reason"),
}

#: channels on core NATS only: live state no stream stores (nothing to replay)
CORE_ONLY: frozenset[str] = frozenset({"router.sync", "router.sync.ends"})


def model_for_subject(subject: str) -> type[Event]:
    """The payload model for a concrete subject; ``ValueError`` if it is not ours."""
    kind = S.parse(subject)["kind"]
    return CHANNELS[kind][0]
