"""Every subject name InferNex uses, as builders. Nothing else spells a subject.

Tokens are escaped so any pod, model or node name is one safe subject token:
characters outside ``[A-Za-z0-9_-]`` become ``%HH`` (UTF-8 bytes), so
``llama-3.1`` -> ``llama-3%2E1`` and ``Qwen/Qwen3-8B`` -> ``Qwen%2FQwen3-8B``.
``unescape_token`` reverses it exactly.
"""

from __future__ import annotations

import re

_SAFE = re.compile(r"[A-Za-z0-9_\-]")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")

# Logical stream names (used for dead letters and topology).
KV_EVENTS = "kv-events"
ENGINE = "engine"
DEVICE_TELEMETRY = "device-telemetry"
DIAGNOSIS = "diagnosis"
ROUTER = "router"
AUTOSCALE = "autoscale"
DLQ = "dlq"

KV_INDEX_QUERY = "kv.index.query"


def escape_token(value: str) -> str:
    """Make ``value`` a single NATS subject token, reversibly."""
    if not isinstance(value, str) or value == "":
        raise ValueError("subject token must be a non-empty string")
    out = []
    for ch in value:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def unescape_token(token: str) -> str:
    data = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "%":
            m = _ESCAPE.match(token, i)
            if not m:
                raise ValueError(f"bad escape in subject token {token!r} at {i}")
            data.append(int(m.group(1), 16))
            i += 3
        else:
            data.extend(token[i].encode())
            i += 1
    return data.decode("utf-8")


def _join(*tokens: str) -> str:
    return ".".join(tokens)


def kv_events(model: str, pod: str) -> str:
    return _join("kv", "events", escape_token(model), escape_token(pod))


def kv_events_all(model: str | None = None) -> str:
    return _join("kv", "events", escape_token(model), ">") if model else "kv.events.>"


def engine_metrics(pod: str) -> str:
    return _join("engine", "metrics", escape_token(pod))


def engine_announce(pod: str) -> str:
    return _join("engine", "announce", escape_token(pod))


def device_telemetry(node: str, device: str) -> str:
    return _join("device", "telemetry", escape_token(node), escape_token(device))


def diagnosis(node: str, device: str) -> str:
    return _join("diagnosis", escape_token(node), escape_token(device))


def router_requests(pool: str) -> str:
    return _join("router", "requests", escape_token(pool))


def router_decisions(pool: str) -> str:
    return _join("router", "decisions", escape_token(pool))


def router_sync(pool: str) -> str:
    """Router replicas of a pool share their own in-flight load here (core NATS, not stored)."""
    return _join("router", "sync", escape_token(pool))


def router_sync_ends(pool: str) -> str:
    """The same replicas tell each other when the prompts they routed stopped counting as predicted
    blocks (core NATS, not stored). A token below :func:`router_sync`, so a replica from before it,
    subscribed to that exact subject, never receives these."""
    return _join("router", "sync", escape_token(pool), "ends")


def autoscale_hints(pool: str, role: str) -> str:
    return _join("autoscale", "hints", escape_token(pool), escape_token(role))


def dead_letter(stream: str) -> str:
    return _join("dlq", escape_token(stream))


def with_prefix(prefix: str | None, subject: str) -> str:
    """Subjects under another root, e.g. for replays into a sandbox (``sandbox.kv.events...``)."""
    if not prefix:
        return subject
    for tok in prefix.split("."):
        if not tok or any(c in tok for c in " *>"):
            raise ValueError(f"bad subject prefix {prefix!r}")
    return f"{prefix}.{subject}"


# Wildcards for consumers.
ALL_KV_EVENTS = "kv.events.>"
ALL_ENGINE_METRICS = "engine.metrics.>"
ALL_ENGINE_ANNOUNCE = "engine.announce.>"
ALL_DEVICE_TELEMETRY = "device.telemetry.>"
ALL_DIAGNOSIS = "diagnosis.>"
ALL_ROUTER_REQUESTS = "router.requests.>"
ALL_ROUTER_DECISIONS = "router.decisions.>"
ALL_AUTOSCALE_HINTS = "autoscale.hints.>"
ALL_DLQ = "dlq.>"


def parse(subject: str) -> dict[str, str]:
    """Split a concrete subject back into its named, unescaped parts."""
    t = subject.split(".")
    try:
        if t[:2] == ["kv", "events"] and len(t) == 4:
            return {"kind": "kv.events", "model": unescape_token(t[2]), "pod": unescape_token(t[3])}
        if t[:2] == ["engine", "metrics"] and len(t) == 3:
            return {"kind": "engine.metrics", "pod": unescape_token(t[2])}
        if t[:2] == ["engine", "announce"] and len(t) == 3:
            return {"kind": "engine.announce", "pod": unescape_token(t[2])}
        if t[:2] == ["device", "telemetry"] and len(t) == 4:
            return {"kind": "device.telemetry", "node": unescape_token(t[2]), "device": unescape_token(t[3])}
        if t[0] == "diagnosis" and len(t) == 3:
            return {"kind": "diagnosis", "node": unescape_token(t[1]), "device": unescape_token(t[2])}
        if t[:2] == ["router", "requests"] and len(t) == 3:
            return {"kind": "router.requests", "pool": unescape_token(t[2])}
        if t[:2] == ["router", "decisions"] and len(t) == 3:
            return {"kind": "router.decisions", "pool": unescape_token(t[2])}
        if t[:2] == ["router", "sync"] and len(t) == 3:
            return {"kind": "router.sync", "pool": unescape_token(t[2])}
        if t[:2] == ["router", "sync"] and len(t) == 4 and t[3] == "ends":
            return {"kind": "router.sync.ends", "pool": unescape_token(t[2])}
        if t[:2] == ["autoscale", "hints"] and len(t) == 4:
            return {"kind": "autoscale.hints", "pool": unescape_token(t[2]), "role": unescape_token(t[3])}
        if t[0] == "dlq" and len(t) == 2:
            return {"kind": "dlq", "stream": unescape_token(t[1])}
    except ValueError as exc:
        raise ValueError(f"subject {subject!r}: {exc}") from None
    raise ValueError(f"subject {subject!r} is not an InferNex subject")


class KvSubjectNames:
    """The (pod, model) each KV events subject names, remembered per subject; a subject that names
    none gives the reason instead. A batch is taken as its subject's only when both agree: a pod
    publishing on another pod's subject (or a message copied onto the wrong one) is bad input,
    and its headers' positions must not shorten that pod's wait for a gap."""

    def __init__(self, prefix: str | None = None, limit: int = 100_000):
        self._cut = len(prefix) + 1 if prefix else 0
        self._limit = limit
        self._seen: dict[str, tuple[str | None, str | None] | str] = {}

    def __call__(self, subject: str) -> tuple[str | None, str | None] | str:
        names = self._seen.get(subject)
        if names is None:
            try:
                parts = parse(subject[self._cut:])
                names = parts.get("pod"), parts.get("model")
            except ValueError as exc:
                names = str(exc)
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[subject] = names
        return names

    def match(self, subject: str, pod: str, model: str) -> bool:
        names = self(subject)
        return not isinstance(names, str) and names[0] == pod and names[1] == model

    def refusal(self, subject: str, pod: str, model: str) -> str | None:
        """None when the subject names this pod and model, else why the batch is refused."""
        names = self(subject)
        if isinstance(names, str):
            return names
        if names[0] != pod or names[1] != model:
            return (f"subject {subject} names pod {names[0]!r} model {names[1]!r} but the "
                    f"batch is for pod {pod!r} model {model!r}")
        return None
