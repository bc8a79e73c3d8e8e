"""The JetStream topology as data: which streams exist, what they hold, how long.

Pure: :mod:`consumers.bus` turns these specs into nats-py ``StreamConfig`` and applies
them. Streams are bounded by age by default; byte limits are set per deployment
(``topology.limits``), because JetStream reserves them against the server's storage. Defaults follow how the data is used: KV events are only needed until the
indexer has snapshotted (hours), telemetry for incident replay (a day or more),
diagnoses, records and hints for SLA history (weeks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from schemas import subjects as S
from schemas.config import TopologyConfig

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class StreamSpec:
    name: str  # JetStream stream name
    logical: str  # logical name used for dead letters (schemas.subjects)
    subjects: tuple[str, ...]
    description: str
    max_age_s: float
    max_bytes: int = -1
    max_msgs: int = -1
    storage: str = "file"
    replicas: int = 1
    duplicate_window_s: float = 120.0
    discard: str = "old"
    extra: dict = field(default_factory=dict)


DEFAULT_STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name="KV_EVENTS",
        logical=S.KV_EVENTS,
        subjects=(S.ALL_KV_EVENTS,),
        description="vLLM KV-cache events, one message per engine batch",
        max_age_s=6 * HOUR,
    ),
    StreamSpec(
        name="ENGINE",
        logical=S.ENGINE,
        subjects=(S.ALL_ENGINE_METRICS, S.ALL_ENGINE_ANNOUNCE),
        description="engine metric snapshots and engine announcements",
        max_age_s=2 * DAY,
    ),
    StreamSpec(
        name="DEVICE_TELEMETRY",
        logical=S.DEVICE_TELEMETRY,
        subjects=(S.ALL_DEVICE_TELEMETRY,),
        description="NPU/GPU telemetry samples",
        max_age_s=2 * DAY,
    ),
    StreamSpec(
        name="DIAGNOSIS",
        logical=S.DIAGNOSIS,
        subjects=(S.ALL_DIAGNOSIS,),
        description="diagnosis findings and resolutions",
        max_age_s=30 * DAY,
    ),
    StreamSpec(
        name="ROUTER",
        logical=S.ROUTER,
        subjects=(S.ALL_ROUTER_REQUESTS, S.ALL_ROUTER_DECISIONS),
        description="per-request records and routing decisions",
        max_age_s=7 * DAY,
    ),
    StreamSpec(
        name="AUTOSCALE",
        logical=S.AUTOSCALE,
        subjects=(S.ALL_AUTOSCALE_HINTS,),
        description="planner scaling hints",
        max_age_s=30 * DAY,
    ),
    StreamSpec(
        name="DLQ",
        logical=S.DLQ,
        subjects=(S.ALL_DLQ,),
        description="dead letters: input a consumer rejected, with the reason",
        max_age_s=14 * DAY,
    ),
)


#: the share of ``TopologyConfig.store_bytes`` each stream may hold when no byte limit is configured
#: for it (0.9 in all: the rest is the store's own overhead). Router records and KV events grow with
#: traffic; metrics and telemetry with the number of engines and devices.
STORE_SHARES: dict[str, float] = {
    "KV_EVENTS": 0.30, "ENGINE": 0.08, "DEVICE_TELEMETRY": 0.08, "DIAGNOSIS": 0.04, "ROUTER": 0.30,
    "AUTOSCALE": 0.02, "DLQ": 0.08,
}


def build_topology(config: TopologyConfig | None = None, prefix: str | None = None) -> tuple[StreamSpec, ...]:
    """The streams for a deployment: defaults, then the config's overrides.

    ``prefix`` puts every subject (and stream name) under another root, which is how
    tests and sandboxed replays get streams of their own on a shared server.
    """
    config = config or TopologyConfig()
    unknown = set(config.limits) - {s.name for s in DEFAULT_STREAMS}
    if unknown:
        raise ValueError(f"limits given for unknown streams: {sorted(unknown)}")
    out = []
    for spec in DEFAULT_STREAMS:
        lim = config.limits.get(spec.name)
        spec = replace(
            spec,
            replicas=config.replicas,
            duplicate_window_s=config.duplicate_window_s,
            storage=config.storage,
        )
        if lim is not None:
            spec = replace(spec, max_age_s=lim.max_age_s, max_bytes=lim.max_bytes, max_msgs=lim.max_msgs)
        if config.store_bytes and spec.max_bytes <= 0:
            spec = replace(spec, max_bytes=int(config.store_bytes * STORE_SHARES[spec.name]))
        if spec.duplicate_window_s > spec.max_age_s:
            raise ValueError(f"{spec.name}: duplicate window longer than max age")
        if prefix:
            spec = replace(
                spec,
                name=f"{prefix.replace('.', '_').upper()}_{spec.name}",
                subjects=tuple(S.with_prefix(prefix, s) for s in spec.subjects),
            )
        out.append(spec)
    return tuple(out)


def stream_for_subject(topology: tuple[StreamSpec, ...], subject: str) -> StreamSpec | None:
    """The stream whose subjects cover ``subject`` (NATS wildcard rules)."""
    for spec in topology:
        for pattern in spec.subjects:
            if subject_matches(pattern, subject):
                return spec
    return None


def subject_matches(pattern: str, subject: str) -> bool:
    p = pattern.split(".")
    s = subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s):
            return False
        if tok != "*" and tok != s[i]:
            return False
    return len(p) == len(s)


def subject_intersection(a: str, b: str) -> str | None:
    """The subjects two filters (NATS wildcards allowed) have in common, as one filter, or None.

    ``router.>`` and ``router.requests.>`` -> ``router.requests.>``; ``router.*.p`` and
    ``router.requests.>`` -> ``router.requests.p``; ``kv.>`` and ``engine.>`` -> None."""
    x, y = a.split("."), b.split(".")
    out: list[str] = []
    for i in range(max(len(x), len(y))):
        p = x[i] if i < len(x) else None
        q = y[i] if i < len(y) else None
        if p == ">":
            out.extend(y[i:] if q is not None else [])
            return ".".join(out) if q is not None else None
        if q == ">":
            out.extend(x[i:] if p is not None else [])
            return ".".join(out) if p is not None else None
        if p is None or q is None:
            return None
        if p == "*":
            out.append(q)
        elif q == "*" or p == q:
            out.append(p)
        else:
            return None
    return ".".join(out)


def history_filters(topology: tuple[StreamSpec, ...], subject: str) -> list[tuple[StreamSpec, str]]:
    """Each stream holding part of ``subject`` (wildcards allowed, possibly spanning streams), with
    the consumer filter that selects that part: ``router.>`` -> (ROUTER, ``router.requests.>``),
    (ROUTER, ``router.decisions.>``). Empty when no stream stores any of it."""
    out = []
    for spec in topology:
        for pattern in spec.subjects:
            f = subject_intersection(pattern, subject)
            if f is not None:
                out.append((spec, f))
    return out
