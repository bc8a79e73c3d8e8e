"""What a replay command looks at: ``--pool``, ``--role`` and ``--model`` as one :class:`Scope`.

A scope narrows the subjects read where the subject names the thing (``router.*.<pool>``,
``autoscale.hints.<pool>.<role>``, ``kv.events.<model>.>``) and decides, event by event, what is
in it: requests, decisions and hints by their own fields; pods (KV batches, engine metrics,
engine resets) by what their announcements say (pool, model, role); devices and findings by
the pods placed on them. Pure: no I/O.

Roles: ``aggregated``, ``prefill``, ``decode``, or ``pd`` for both PD roles. A request record
is ``aggregated`` or ``pd``; a ``prefill``/``decode`` scope keeps PD requests; a decision
is kept by its stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from schemas import subjects as S

ROLES = ("aggregated", "prefill", "decode", "pd")


class PodMeta(NamedTuple):
    pool: str
    model: str
    role: str
    node: str | None
    devices: tuple[str, ...]


@dataclass(frozen=True)
class Scope:
    pool: str | None = None
    role: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, not {self.role!r}")

    @property
    def narrowed(self) -> bool:
        return self.pool is not None or self.role is not None or self.model is not None

    # ------------------------------------------------------------------ subjects
    def subjects(self, subjects: list[str]) -> list[str]:
        """The subject filters to read: wildcards this scope can narrow are narrowed."""
        if not self.narrowed:
            return list(subjects)
        out: list[str] = []
        for s in subjects:
            out.extend(self._narrow(s))
        return list(dict.fromkeys(out))

    def _narrow(self, s: str) -> list[str]:
        pool = S.escape_token(self.pool) if self.pool else None
        if pool and s == "router.>":
            return [f"router.requests.{pool}", f"router.decisions.{pool}"]
        if pool and s in ("router.requests.>", "router.decisions.>"):
            return [s[:-1] + pool]
        if s == "autoscale.hints.>" and (pool or self.role):
            roles = [self.role] if self.role in ("aggregated", "prefill", "decode") else (
                ["prefill", "decode"] if self.role == "pd" else ["*"])
            return [f"autoscale.hints.{pool or '*'}.{r}" for r in roles]
        if s == "kv.events.>" and self.model:
            return [f"kv.events.{S.escape_token(self.model)}.>"]
        return [s]

    # ------------------------------------------------------------------ events
    def _role_ok(self, role: str) -> bool:
        r = self.role
        return r is None or role == r or (r == "pd" and role in ("prefill", "decode"))

    def keep_record(self, r) -> bool:
        if self.pool is not None and r.pool != self.pool:
            return False
        if self.model is not None and r.model != self.model:
            return False
        if self.role is not None:
            want = "aggregated" if self.role == "aggregated" else "pd"
            if r.role != want:
                return False
        return True

    def keep_decision(self, d) -> bool:
        if self.pool is not None and d.pool != self.pool:
            return False
        if self.model is not None and d.model != self.model:
            return False
        return self._role_ok(d.stage)

    def keep_hint(self, h) -> bool:
        if self.pool is not None and h.pool != self.pool:
            return False
        return self._role_ok(h.role)

    def keep_pod(self, meta: PodMeta | None) -> bool:
        """A pod is in scope when its announcement says so; an unannounced pod only when nothing
        narrows the scope."""
        if not self.narrowed:
            return True
        if meta is None:
            return False
        if self.pool is not None and meta.pool != self.pool:
            return False
        if self.model is not None and meta.model != self.model:
            return False
        return self._role_ok(meta.role)

    def keep_device(self, node: str, device: str, pods: list[str] | tuple[str, ...],
                    metas: dict[str, PodMeta]) -> bool:
        """A device (or a finding on it) is in scope when a pod in scope uses it: named in the
        event, or placed on it by its announcement."""
        if not self.narrowed:
            return True
        if any(self.keep_pod(metas.get(p)) for p in pods):
            return True
        return any(m.node == node and device in m.devices and self.keep_pod(m) for m in metas.values())


def keep_message(scope: Scope, subject: str, data: bytes, metas: dict[str, PodMeta]) -> bool:
    """Whether one stored message (subject without the deployment prefix) is in ``scope``;
    ``metas``: the pods' announcements known so far. Undecodable records are kept (they are
    evidence, and the scope cannot be judged)."""
    if not scope.narrowed:
        return True
    from schemas import RequestRecord, RoutingDecision, ScalingHint, ValidationFailure, decode_event

    try:
        p = S.parse(subject)
    except ValueError:
        return True
    kind = p["kind"]
    if kind in ("kv.events", "engine.metrics", "engine.announce"):
        if kind == "kv.events" and scope.model is not None and p["model"] != scope.model:
            return False
        return scope.keep_pod(metas.get(p["pod"]))
    if kind in ("device.telemetry", "diagnosis"):
        return scope.keep_device(p["node"], p["device"], (), metas)
    model = {"router.requests": RequestRecord, "router.decisions": RoutingDecision,
             "autoscale.hints": ScalingHint}.get(kind)
    if model is None:
        return True  # dead letters: not attributable
    if scope.pool is not None and p["pool"] != scope.pool:
        return False
    try:
        ev = decode_event(model, data)
    except ValidationFailure:
        return True
    if model is RequestRecord:
        return scope.keep_record(ev)
    if model is RoutingDecision:
        return scope.keep_decision(ev)
    return scope.keep_hint(ev)
