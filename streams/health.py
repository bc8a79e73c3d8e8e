"""Device health folds.

:class:`HealthState` folds :class:`schemas.DeviceTelemetry` (and, optionally, :class:`schemas.Diagnosis`)
into per-device and per-node state: latest readings, device facts, rates (single-bit ECC errors per
minute, temperature rise per minute), staleness (a silent device is UNKNOWN), and the open findings.

:class:`PodHealthView` is the small fold the router reads: it folds :class:`schemas.Diagnosis` (and
:class:`schemas.EngineAnnouncement`, to know which pods sit on which device) into a per-pod status:
critical -> excluded (score 0), warning -> lower score, ok -> 1.

Pure: no I/O, time from an injected :class:`streams.clock.Clock`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from schemas import DeviceTelemetry, Diagnosis, EngineAnnouncement, EngineMetrics
from streams.clock import Clock, SystemClock

Status = Literal["ok", "warning", "critical", "unknown"]
_RANK = {"ok": 0, "info": 0, "unknown": 1, "warning": 2, "critical": 3}

#: how much history a device keeps for rates (seconds of sample time)
HISTORY_S = 900.0


def worst(statuses: Iterable[str]) -> str:
    out = "ok"
    for s in statuses:
        if _RANK.get(s, 0) > _RANK[out]:
            out = "ok" if s == "info" else s
    return out


class FutureSample(ValueError):
    """A telemetry sample stamped too far ahead of the clock."""


@dataclass
class DeviceRecord:
    """What the fold knows about one device."""

    node: str
    device: str
    kind: str
    latest: DeviceTelemetry
    last_ts: float  # sample time of the newest sample
    last_seen: float  # clock time it arrived
    facts: dict[str, str | None] = field(default_factory=dict)
    history: deque = field(default_factory=deque)  # (ts, temperature_c, ecc_single_bit_total, ecc_double_bit_total)
    dbe_delta: float = 0.0  # double-bit errors added by the newest sample
    # NVIDIA Xid as dcgm-exporter reports it, a "last value" gauge: a change to a non-zero value is
    # an event (the first value seen counts as one); a return to 0 (GPU reset, driver reload) clears
    xid_events: list[int] = field(default_factory=list)
    xid_cleared: bool = False
    remap_unc_delta: float = 0.0  # rows remapped for uncorrectable errors added by the newest sample
    out_of_order: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.node, self.device)

    @property
    def pods(self) -> list[str]:
        return list(self.latest.pods)

    # -- rates ------------------------------------------------------------------------------------
    def _recent(self, window_s: float):
        """History entries with ts >= newest - window_s, newest first (walks back only that far)."""
        start = self.last_ts - window_s
        for h in reversed(self.history):
            if h[0] < start:
                return
            yield h

    def ecc_single_bit_per_min(self, window_s: float = 60.0) -> float | None:
        """Single-bit ECC errors added within the last ``window_s``, per minute (counter resets ignored)."""
        added, later, n = 0.0, None, 0
        for h in self._recent(window_s):
            sbe = h[2]
            if sbe is None:
                continue
            if later is not None and later > sbe:
                added += later - sbe
            later = sbe
            n += 1
        if n < 2:
            return None
        return added * 60.0 / window_s

    def temperature_slope_per_min(self, window_s: float = 300.0, min_span_s: float = 120.0
                                  ) -> tuple[float, float] | None:
        """Least-squares slope (°C per minute) and r² over the last ``window_s``; None if too short."""
        pts = [(h[0], h[1]) for h in self._recent(window_s) if h[1] is not None]
        if len(pts) < 5 or pts[0][0] - pts[-1][0] < min_span_s:
            return None
        n = len(pts)
        t0 = pts[-1][0]
        sx = sy = sxx = syy = sxy = 0.0
        for ts, y in pts:
            x = ts - t0
            sx += x
            sy += y
            sxx += x * x
            syy += y * y
            sxy += x * y
        vxx = sxx - sx * sx / n
        vyy = syy - sy * sy / n
        vxy = sxy - sx * sy / n
        if vxx <= 0:
            return None
        slope = vxy / vxx
        r2 = 1.0 if vyy <= 1e-12 else min(1.0, (vxy * vxy) / (vxx * vyy))
        return slope * 60.0, r2

    def memory_used_pct(self) -> float | None:
        t = self.latest
        if t.memory_used_mb is None or not t.memory_total_mb:
            return None
        return 100.0 * t.memory_used_mb / t.memory_total_mb


@dataclass(frozen=True)
class DeviceHealth:
    node: str
    device: str
    status: Status
    score: float
    reasons: tuple[str, ...]
    stale: bool
    age_s: float
    facts: dict[str, Any]
    readings: dict[str, Any]
    rates: dict[str, float | None]
    pods: tuple[str, ...]


def _score(status: str, n_warnings: int, warning_score: float) -> float:
    if status == "critical":
        return 0.0
    if status == "warning":
        return max(0.1, warning_score ** max(1, n_warnings))
    if status == "unknown":
        return warning_score
    return 1.0


class HealthState:
    """Per-device and per-node health, folded from telemetry and findings.

    ``apply(telemetry)`` returns the device's record (or ``None`` for a sample older than the newest
    one, which is counted and otherwise ignored). Queries: ``device_health``, ``node_health``,
    ``pod_health``. ``dump()`` / ``HealthState.restore()`` round-trip the state.
    """

    def __init__(self, clock: Clock | None = None, *, stale_after_s: float = 15.0, warning_score: float = 0.5,
                 history_s: float = HISTORY_S, max_future_s: float = 300.0):
        self.clock = clock or SystemClock()
        self.max_future_s = max_future_s
        self.stale_after_s = stale_after_s
        self.warning_score = warning_score
        self.history_s = history_s
        self.devices: dict[tuple[str, str], DeviceRecord] = {}
        self.findings: dict[str, Diagnosis] = {}  # open findings by id
        self._by_dev: dict[tuple[str, str], dict[str, Diagnosis]] = {}  # same, per device
        self.load: dict[str, tuple[float, float]] = {}  # pod -> (waiting requests, sample ts)

    # -- folding ----------------------------------------------------------------------------------
    def apply(self, t: DeviceTelemetry) -> DeviceRecord | None:
        """Fold one sample. Raises :class:`FutureSample` for a sample stamped more than ``max_future_s``
        ahead of the clock (it would make every later, correct sample look out of order)."""
        key = (t.node, t.device)
        now = self.clock.now()
        if t.ts > now + self.max_future_s:
            raise FutureSample(f"sample of {t.node}/{t.device} is stamped {t.ts - now:.0f}s in the future "
                               f"(limit {self.max_future_s:g}s): check the node's clock")
        rec = self.devices.get(key)
        if rec is None:
            rec = DeviceRecord(node=t.node, device=t.device, kind=t.kind, latest=t, last_ts=t.ts, last_seen=now)
            self.devices[key] = rec
        elif t.ts < rec.last_ts:
            rec.out_of_order += 1
            rec.last_seen = now
            return None
        prev = rec.latest if rec.latest is not t else None
        prev_dbe = prev.ecc_double_bit_total if prev is not None else None
        rec.xid_events, rec.xid_cleared, rec.remap_unc_delta = [], False, 0.0
        x = t.xid_last
        if x is not None:
            px = prev.xid_last if prev is not None else None
            if x != 0 and x != px:
                rec.xid_events = [x]
            elif x == 0 and px:
                rec.xid_cleared = True
        unc = t.remapped_rows_uncorrectable
        punc = prev.remapped_rows_uncorrectable if prev is not None else None
        if unc is not None and punc is not None and unc > punc:
            rec.remap_unc_delta = unc - punc
        rec.kind = t.kind
        rec.latest = t
        rec.last_ts = t.ts
        rec.last_seen = now
        for name in ("device_model", "driver", "firmware"):
            v = getattr(t, name)
            if v is not None:
                rec.facts[name] = v
        rec.facts["source"] = t.source
        dbe = t.ecc_double_bit_total
        rec.dbe_delta = (dbe - prev_dbe) if (dbe is not None and prev_dbe is not None and dbe > prev_dbe) else 0.0
        rec.history.append((t.ts, t.temperature_c, t.ecc_single_bit_total, dbe))
        horizon = t.ts - self.history_s
        while rec.history and rec.history[0][0] < horizon:
            rec.history.popleft()
        return rec

    def apply_diagnosis(self, d: Diagnosis) -> None:
        key = (d.node, d.device)
        if d.status == "resolved":
            self.findings.pop(d.finding_id, None)
            per = self._by_dev.get(key)
            if per is not None:
                per.pop(d.finding_id, None)
                if not per:
                    del self._by_dev[key]
        else:
            self.findings[d.finding_id] = d
            self._by_dev.setdefault(key, {})[d.finding_id] = d

    def apply_load(self, m: EngineMetrics) -> None:
        """Engine metrics of a pod: its waiting requests feed the stuck-device rule."""
        prev = self.load.get(m.pod)
        if prev is None or m.ts >= prev[1]:
            self.load[m.pod] = (m.num_requests_waiting, m.ts)

    def waiting_on(self, rec: DeviceRecord, max_age_s: float) -> float | None:
        """Requests waiting in the engines of the pods on this device; None if no recent load input."""
        total, known = 0.0, False
        for pod in rec.pods:
            v = self.load.get(pod)
            if v is not None and rec.last_ts - v[1] <= max_age_s:
                total += v[0]
                known = True
        return total if known else None

    def forget(self, node: str, device: str) -> None:
        self.devices.pop((node, device), None)

    # -- queries ----------------------------------------------------------------------------------
    def is_stale(self, rec: DeviceRecord, now: float | None = None) -> bool:
        now = self.clock.now() if now is None else now
        return now - rec.last_seen > self.stale_after_s

    def _device_findings(self, node: str, device: str) -> list[Diagnosis]:
        return list(self._by_dev.get((node, device), {}).values())

    def device_status(self, node: str, device: str) -> Status | None:
        """Just the status of a device (cheap: no rates); None if never seen."""
        rec = self.devices.get((node, device))
        if rec is None:
            return None
        status = worst(d.severity for d in self._by_dev.get((node, device), {}).values())
        if status == "ok" and (self.is_stale(rec) or rec.latest.health == "UNKNOWN"):
            return "unknown"
        return status

    def device_health(self, node: str, device: str) -> DeviceHealth | None:
        rec = self.devices.get((node, device))
        if rec is None:
            return None
        now = self.clock.now()
        stale = self.is_stale(rec, now)
        found = [d for d in self._device_findings(node, device) if d.severity != "info"]
        reasons = [f"{d.fault_mode} ({d.severity}, {d.action})" for d in found]
        status = worst(d.severity for d in found)
        if stale:
            reasons.append(f"no telemetry for {now - rec.last_seen:.0f}s")
            if status == "ok":
                status = "unknown"
        if rec.latest.health == "UNKNOWN" and status == "ok":
            status = "unknown"
            reasons.append("npu-smi health UNKNOWN")
        n_warn = sum(1 for d in found if d.severity == "warning")
        t = rec.latest
        slope = rec.temperature_slope_per_min()
        return DeviceHealth(
            node=node, device=device, status=status, score=_score(status, n_warn, self.warning_score),
            reasons=tuple(reasons), stale=stale, age_s=now - rec.last_seen, facts=dict(rec.facts),
            readings={"temperature_c": t.temperature_c, "power_w": t.power_w, "utilization_pct": t.utilization_pct,
                      "memory_used_pct": rec.memory_used_pct(), "health": t.health, "link_status": t.link_status,
                      "error_codes": list(t.error_codes)},
            rates={"ecc_single_bit_per_min": rec.ecc_single_bit_per_min(),
                   "temperature_rise_c_per_min": slope[0] if slope else None},
            pods=tuple(t.pods),
        )

    def node_health(self, node: str) -> tuple[str, list[DeviceHealth]]:
        devs = [self.device_health(n, d) for (n, d) in self.devices if n == node]
        devs = [d for d in devs if d is not None]
        return worst(d.status for d in devs) if devs else "unknown", devs

    def pod_health(self, pod: str) -> tuple[str, float, list[str]]:
        """(severity, score, reasons) of a pod: the worst of the devices it runs on and findings naming it."""
        statuses, reasons, n_warn = [], [], 0
        seen: set[str] = set()
        for rec in self.devices.values():
            if pod in rec.latest.pods:
                h = self.device_health(rec.node, rec.device)
                statuses.append(h.status)
                reasons.extend(f"{rec.node}/{rec.device}: {r}" for r in h.reasons)
                seen.update(d.finding_id for d in self._device_findings(rec.node, rec.device))
                n_warn += sum(1 for d in self._device_findings(rec.node, rec.device) if d.severity == "warning")
        for d in self.findings.values():
            if pod in d.pods and d.finding_id not in seen and d.severity != "info":
                statuses.append(d.severity)
                reasons.append(f"{d.node}/{d.device}: {d.fault_mode} ({d.severity}, {d.action})")
                n_warn += d.severity == "warning"
        status = worst(statuses)
        return status, _score(status, n_warn, self.warning_score), reasons

    # -- snapshot ---------------------------------------------------------------------------------
    def dump(self) -> dict:
        return {
            "stale_after_s": self.stale_after_s,
            "warning_score": self.warning_score,
            "history_s": self.history_s,
            "max_future_s": self.max_future_s,
            "devices": [
                {"latest": r.latest.model_dump(mode="json"), "last_ts": r.last_ts, "last_seen": r.last_seen,
                 "facts": dict(r.facts), "history": [list(h) for h in r.history], "dbe_delta": r.dbe_delta,
                 "out_of_order": r.out_of_order}
                for r in self.devices.values()
            ],
            "findings": [d.model_dump(mode="json") for d in self.findings.values()],
            "load": {p: list(v) for p, v in self.load.items()},
        }

    @classmethod
    def restore(cls, data: dict, clock: Clock | None = None) -> "HealthState":
        hs = cls(clock, stale_after_s=data["stale_after_s"], warning_score=data["warning_score"],
                 history_s=data["history_s"], max_future_s=data.get("max_future_s", 300.0))
        for r in data["devices"]:
            t = DeviceTelemetry.model_validate(r["latest"])
            rec = DeviceRecord(node=t.node, device=t.device, kind=t.kind, latest=t, last_ts=r["last_ts"],
                               last_seen=r["last_seen"], facts=dict(r["facts"]),
                               history=deque(tuple(h) for h in r["history"]), dbe_delta=r["dbe_delta"],
                               out_of_order=r["out_of_order"])
            hs.devices[rec.key] = rec
        for d in data["findings"]:
            hs.apply_diagnosis(Diagnosis.model_validate(d))
        hs.load = {p: (float(v[0]), float(v[1])) for p, v in data["load"].items()}
        return hs


class PodHealthView:
    """Per-pod status from diagnosis findings, for the router's health filter and scorer.

    ``apply(event)`` takes a :class:`schemas.Diagnosis` (open/updated findings count, resolved ones are
    dropped) or a :class:`schemas.EngineAnnouncement` (maps a pod to its node and devices, so findings
    that do not list the pod still reach it). ``status(pod) -> (status, score)``:
    ``("critical", 0.0)`` means send no new requests; ``("warning", s)`` with ``s < 1`` lowers the
    score (``warning_score`` per warning finding, floored at 0.1); ``("ok", 1.0)`` otherwise.
    ``info`` findings are recorded but do not change the status.
    """

    def __init__(self, warning_score: float = 0.5):
        if not 0 < warning_score <= 1:
            raise ValueError("warning_score must be in (0, 1]")
        self.warning_score = warning_score
        self._findings: dict[str, Diagnosis] = {}
        self._placement: dict[str, tuple[str | None, frozenset[str]]] = {}  # pod -> (node, devices)

    def apply(self, event: Diagnosis | EngineAnnouncement) -> None:
        if isinstance(event, Diagnosis):
            if event.status == "resolved":
                self._findings.pop(event.finding_id, None)
            else:
                self._findings[event.finding_id] = event
        elif isinstance(event, EngineAnnouncement):
            if event.state == "down":
                self._placement.pop(event.pod, None)
            else:
                self._placement[event.pod] = (event.node, frozenset(event.devices))
        else:
            raise TypeError(f"PodHealthView cannot fold {type(event).__name__}")

    def findings_for(self, pod: str) -> list[Diagnosis]:
        node, devices = self._placement.get(pod, (None, frozenset()))
        return [d for d in self._findings.values()
                if pod in d.pods or (node is not None and d.node == node and d.device in devices)]

    def status(self, pod: str) -> tuple[str, float]:
        found = [d for d in self.findings_for(pod) if d.severity != "info"]
        if any(d.severity == "critical" for d in found):
            return "critical", 0.0
        n_warn = sum(1 for d in found if d.severity == "warning")
        if n_warn:
            return "warning", max(0.1, self.warning_score ** n_warn)
        return "ok", 1.0

    def reasons(self, pod: str) -> list[str]:
        return [f"{d.node}/{d.device}: {d.fault_mode} ({d.severity}, {d.action})" for d in self.findings_for(pod)]

    def device_status(self, node: str, device: str) -> str:
        return worst(d.severity for d in self._findings.values() if d.node == node and d.device == device)

    def open_findings(self) -> list[Diagnosis]:
        return list(self._findings.values())

    def dump(self) -> dict:
        return {"warning_score": self.warning_score,
                "findings": [d.model_dump(mode="json") for d in self._findings.values()],
                "placement": {p: [n, sorted(devs)] for p, (n, devs) in self._placement.items()}}

    @classmethod
    def restore(cls, data: dict) -> "PodHealthView":
        v = cls(data["warning_score"])
        for d in data["findings"]:
            v.apply(Diagnosis.model_validate(d))
        v._placement = {p: (n, frozenset(devs)) for p, (n, devs) in data["placement"].items()}
        return v


__all__ = ["DeviceHealth", "DeviceRecord", "FutureSample", "HealthState", "PodHealthView", "worst"]
