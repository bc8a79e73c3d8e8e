"""The diagnosis engine: telemetry in, deduplicated findings out. Pure; time from the samples and a Clock.

``observe(telemetry)`` folds one sample into the :class:`streams.health.HealthState`, evaluates the
rules for that device and returns the :class:`schemas.Diagnosis` messages to publish:

* a condition that becomes active opens a finding (``status="open"``, revision 1);
* while it persists the same ``finding_id`` is ``"updated"`` - immediately when the severity rises,
  otherwise at most once per ``timing.update_interval_s``;
* a condition that has been clear for ``timing.hold_s`` publishes ``"resolved"``.

Threshold rules have hysteresis (levels are left only ``clear_margin`` below the threshold), rules
with ``for_s`` must hold that long before opening, and the minimum hold before resolving means a
flapping reading yields one open finding, not a storm. Event-like evidence (Xids, double-bit ECC
increments, error codes with ``clear_after_s``) keeps its finding open for that long after the last
occurrence. ``tick(now)`` turns devices silent for ``timing.stale_after_s`` into ``device_silent``
findings (UNKNOWN), resolved by the next sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from schemas import DeviceTelemetry, Diagnosis, EngineMetrics
from streams.clock import Clock, SystemClock
from streams.diagnosis.rules import DeviceRules, RuleSet, build_ruleset, version_key
from streams.health import DeviceRecord, HealthState

SILENT = "device_silent"
_SEV_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass
class Signal:
    """A condition that is active now for one device."""

    fault_mode: str
    severity: str
    action: str
    summary: str
    remediation: str = ""
    evidence: dict = field(default_factory=dict)
    for_s: float = 0.0  # must be active this long before a finding opens
    sticky_s: float = 0.0  # stays active this long after the last occurrence


@dataclass
class Finding:
    finding_id: str
    node: str
    device: str
    fault_mode: str
    severity: str
    action: str
    summary: str
    remediation: str
    evidence: dict
    first_seen: float
    last_seen: float
    pods: list[str]
    revision: int = 1
    last_published: float = 0.0
    clear_since: float | None = None
    lower_since: float | None = None

    def to_diagnosis(self, status: str) -> Diagnosis:
        return Diagnosis(finding_id=self.finding_id, node=self.node, device=self.device,
                         fault_mode=self.fault_mode, severity=self.severity, status=status, action=self.action,
                         summary=self.summary, remediation=self.remediation, evidence=dict(self.evidence),
                         first_seen=self.first_seen, last_seen=self.last_seen, pods=list(self.pods),
                         revision=self.revision)



def finding_id(node: str, device: str, fault_mode: str, first_seen: float) -> str:
    h = xxhash.xxh64_hexdigest(f"{node}\x00{device}\x00{fault_mode}\x00{first_seen:.3f}".encode())
    return f"{fault_mode}-{h}"


def msg_id(d: Diagnosis) -> str:
    """Nats-Msg-Id of a finding message: finding id + revision, so a re-publish is stored once."""
    return f"{d.finding_id}:{d.revision}"


@dataclass
class _DevState:
    levels: dict[str, int] = field(default_factory=dict)  # hysteresis level per metric
    pending: dict[str, float] = field(default_factory=dict)  # fault mode -> active since (for for_s)
    sticky: dict[str, tuple[float, Signal]] = field(default_factory=dict)  # fault mode -> (until, signal)
    trend_at: float | None = None  # sample time of the last trend fit
    trend_fit: tuple[float, float] | None = None


class DiagnosisEngine:
    """Rules over a :class:`HealthState`; emits findings with dedup, throttling and resolution."""

    def __init__(self, rules: RuleSet | None = None, clock: Clock | None = None, *, warning_score: float = 0.5):
        self.rules = rules or build_ruleset()
        self.clock = clock or SystemClock()
        self.health = HealthState(self.clock, stale_after_s=self.rules.timing.stale_after_s,
                                  warning_score=warning_score, max_future_s=self.rules.timing.max_future_s)
        self.open: dict[tuple[str, str, str], Finding] = {}  # (node, device, fault mode) -> open finding
        self._open_by_dev: dict[tuple[str, str], set[str]] = {}  # (node, device) -> fault modes open
        self._dev: dict[tuple[str, str], _DevState] = {}

    # -- inputs -----------------------------------------------------------------------------------
    def observe(self, t: DeviceTelemetry) -> list[Diagnosis]:
        """Findings caused by one sample. Raises :class:`streams.health.FutureSample` (a ValueError)
        for a sample stamped too far ahead of the clock."""
        rec = self.health.apply(t)
        if rec is None:  # older than what we have: ignore for rules
            return []
        signals = self._evaluate(rec)
        return self._reconcile(rec, signals, t.ts)

    def apply_load(self, m: EngineMetrics) -> None:
        self.health.apply_load(m)

    def tick(self, now: float | None = None) -> list[Diagnosis]:
        """Staleness: devices silent longer than ``stale_after_s`` get a ``device_silent`` finding."""
        now = self.clock.now() if now is None else now
        out: list[Diagnosis] = []
        stale_after = self.rules.timing.stale_after_s
        for key, rec in self.health.devices.items():
            silent_for = now - rec.last_seen
            if silent_for <= stale_after:
                continue
            k = (*key, SILENT)
            f = self.open.get(k)
            if f is None:
                sig = Signal(SILENT, "warning", "Observe",
                             f"no telemetry from {rec.node}/{rec.device} for {silent_for:.0f}s: health UNKNOWN",
                             "check the exporter / npu-smi / DCGM on the node and the device itself",
                             {"silent_s": round(silent_for, 1), "last_sample_ts": rec.last_ts})
                out.append(self._open(rec, sig, now))
            else:
                f.evidence["silent_s"] = round(silent_for, 1)
                f.last_seen = now
                if now - f.last_published >= self.rules.timing.update_interval_s:
                    out.append(self._emit(f, "updated", now))
        return out

    # -- rule evaluation --------------------------------------------------------------------------
    def _evaluate(self, rec: DeviceRecord) -> dict[str, Signal]:
        t = rec.latest
        now = t.ts
        rules: DeviceRules = self.rules.for_device(t.kind, t.device_model)
        st = self._dev.setdefault(rec.key, _DevState())
        cat = self.rules.catalog
        sig: dict[str, Signal] = {}
        model = t.device_model or t.kind

        def add(s: Signal) -> None:
            if s.sticky_s > 0:
                prev = st.sticky.get(s.fault_mode)
                until = now + s.sticky_s
                st.sticky[s.fault_mode] = (max(until, prev[0]) if prev else until, s)
            old = sig.get(s.fault_mode)
            if old is None or _SEV_RANK[s.severity] > _SEV_RANK[old.severity]:
                sig[s.fault_mode] = s

        # thresholds with hysteresis
        values = {"temperature_c": t.temperature_c, "power_w": t.power_w, "memory_used_pct": rec.memory_used_pct()}
        modes = {"temperature_c": "over_temperature", "power_w": "over_power", "memory_used_pct": "memory_pressure"}
        units = {"temperature_c": "°C", "power_w": "W", "memory_used_pct": "% HBM/FB used"}
        for metric, th in rules.thresholds.items():
            v = values.get(metric)
            if v is None:
                continue
            lvl = th.level(st.levels.get(metric, 0), v)
            st.levels[metric] = lvl
            if lvl:
                limit = th.critical if lvl == 2 else th.warning
                sev = "critical" if lvl == 2 else "warning"
                add(Signal(modes[metric], sev, th.action_critical if lvl == 2 else th.action_warning,
                           f"{metric} {v:.1f}{units[metric]} >= {sev} {limit:g} ({model})",
                           _REMEDY.get(metric, ""), {metric: round(v, 2), f"{sev}_threshold": limit},
                           for_s=th.for_s))

        # single-bit ECC burst (rate with hysteresis)
        rr = rules.ecc_single_bit_rate
        rate = rec.ecc_single_bit_per_min(rr.window_s)
        if rate is not None and (rr.warning is not None or rr.critical is not None):
            lvl = rr.as_threshold().level(st.levels.get("ecc_sbe_rate", 0), rate)
            st.levels["ecc_sbe_rate"] = lvl
            if lvl:
                sev = "critical" if lvl == 2 else "warning"
                add(Signal("hbm_ecc_burst", sev, rr.action,
                           f"single-bit ECC errors at {rate:.1f}/min over {rr.window_s:g}s",
                           "memory is degrading: watch for uncorrectable errors, plan a reset / row isolation",
                           {"ecc_single_bit_per_min": round(rate, 2),
                            "ecc_single_bit_total": t.ecc_single_bit_total}))

        # double-bit (uncorrectable) ECC increments
        if rec.dbe_delta > 0:
            er = rules.ecc_double_bit
            add(Signal("hbm_ecc_uncorrectable", er.severity, er.action,
                       f"{rec.dbe_delta:g} new double-bit (uncorrectable) ECC error(s)",
                       "the running job may hold corrupt data: restart it; isolate the device if it repeats",
                       {"ecc_double_bit_added": rec.dbe_delta, "ecc_double_bit_total": t.ecc_double_bit_total},
                       sticky_s=er.clear_after_s))

        # steady temperature rise
        tr = rules.temperature_rise
        if tr.warning is not None and t.temperature_c is not None and (
                tr.min_value is None or t.temperature_c >= tr.min_value):
            if st.trend_at is None or now - st.trend_at >= tr.every_s or now < st.trend_at:
                st.trend_fit = rec.temperature_slope_per_min(tr.window_s, tr.min_span_s)
                st.trend_at = now
            fit = st.trend_fit
            if fit is not None and fit[0] >= tr.warning and fit[1] >= tr.min_r2:
                add(Signal("temperature_rising", "warning", tr.action,
                           f"temperature rising {fit[0]:.2f}°C/min over {tr.window_s:g}s, now {t.temperature_c:.1f}°C",
                           "check cooling (fans, airflow, liquid loop) before the device throttles",
                           {"temperature_rise_c_per_min": round(fit[0], 3), "r2": round(fit[1], 3),
                            "temperature_c": t.temperature_c}))

        # utilisation stuck at 0 while requests wait
        si = rules.stuck_idle
        waiting = self.health.waiting_on(rec, self.rules.timing.load_stale_after_s)
        if t.utilization_pct is not None and waiting is not None and \
                t.utilization_pct < si.util_below_pct and waiting >= si.waiting_at_least:
            add(Signal("stuck_idle", si.severity, si.action,
                       f"utilisation {t.utilization_pct:.1f}% while {waiting:g} request(s) wait",
                       "the engine on this device looks hung: restart it",
                       {"utilization_pct": t.utilization_pct, "waiting_requests": waiting}, for_s=si.for_s))

        # link status
        if t.link_status == "DOWN":
            lr = rules.link_down
            add(Signal("link_down", lr.severity, lr.action, "network link of the device is DOWN",
                       "check the device network port, optics and switch port", {"link_status": "DOWN"},
                       for_s=lr.for_s))

        # npu-smi Health
        if t.health and t.health != "OK":
            he = cat.health_values.get(t.health)
            if he is not None:
                add(Signal(he.fault_mode, he.severity, he.level, f"npu-smi health {t.health}: {he.meaning}",
                           he.remediation, {"health": t.health}))

        # Ascend error codes (current state as reported)
        for raw in t.error_codes:
            try:
                entry = cat.lookup_code(raw)
            except ValueError:
                continue
            sev = cat.severity_of(entry.level, entry.severity)
            add(Signal(entry.fault_mode, sev, entry.level,
                       f"error code {raw}: {entry.meaning}",
                       entry.remediation, {"error_code": raw, "sources": ",".join(entry.source)},
                       for_s=entry.for_s, sticky_s=entry.clear_after_s))

        # GPU memory errors from row remapping (the ECC counters are off in dcgm-exporter's defaults)
        if rec.remap_unc_delta > 0:
            rr_ = rules.remapped_rows_uncorrectable
            add(Signal("gpu_rows_remapped_uncorrectable", rr_.severity, rr_.action,
                       f"{rec.remap_unc_delta:g} row(s) remapped for uncorrectable memory errors",
                       "an uncorrectable memory error hit the GPU: restart the job, then reset the GPU so the "
                       "remapping takes effect",
                       {"remapped_rows_added": rec.remap_unc_delta,
                        "remapped_rows_uncorrectable": t.remapped_rows_uncorrectable},
                       sticky_s=rr_.clear_after_s))
        if t.row_remap_failure:
            rf = rules.row_remap_failure
            add(Signal("gpu_row_remap_failure", rf.severity, rf.action,
                       "row remapping failed: the GPU has no spare memory rows left",
                       "drain the node and have the GPU serviced (it can no longer repair memory errors)",
                       {"row_remap_failure": True}))

        # driver / firmware below the minimum validated for the model
        vr = rules.versions
        for what, have, need in (("driver", t.driver, vr.min_driver), ("firmware", t.firmware, vr.min_firmware)):
            if have and need and version_key(have) < version_key(need):
                add(Signal(f"{what}_outdated", vr.severity, vr.action,
                           f"{what} {have} is older than {need}, the minimum for {model}",
                           f"upgrade the {what} to {need} or later (drain the node first)",
                           {what: have, f"min_{what}": need}))

        # NVIDIA Xids: events in the sample, and changes of dcgm-exporter's last-Xid gauge
        if rec.xid_cleared:  # back to 0: the GPU was reset; earlier Xids no longer hold
            for mode in [m for m, (_, s) in st.sticky.items() if "xid" in s.evidence]:
                del st.sticky[mode]
        for xid in list(t.xid_errors) + rec.xid_events:
            entry = cat.lookup_xid(xid)
            sev = cat.severity_of(entry.level, entry.severity)
            add(Signal(entry.fault_mode, sev, entry.level, f"Xid {xid}: {entry.meaning}", entry.remediation,
                       {"xid": int(xid)}, sticky_s=entry.clear_after_s))

        # sticky evidence that is not repeated in this sample
        for mode, (until, s) in list(st.sticky.items()):
            if now >= until:
                del st.sticky[mode]
            elif mode not in sig:
                sig[mode] = s
        return sig

    # -- dedup / lifecycle ------------------------------------------------------------------------
    def _reconcile(self, rec: DeviceRecord, signals: dict[str, Signal], now: float) -> list[Diagnosis]:
        out: list[Diagnosis] = []
        st = self._dev.setdefault(rec.key, _DevState())
        timing = self.rules.timing
        for mode, s in signals.items():
            k = (rec.node, rec.device, mode)
            f = self.open.get(k)
            if f is None:
                since = st.pending.setdefault(mode, now)
                if now - since < s.for_s:
                    continue
                st.pending.pop(mode, None)
                out.append(self._open(rec, s, now, first_seen=since))
                continue
            f.clear_since = None
            f.last_seen = now
            f.evidence = dict(s.evidence)
            f.pods = list(rec.pods)
            if _SEV_RANK[s.severity] > _SEV_RANK[f.severity]:
                f.severity, f.action, f.summary, f.remediation = s.severity, s.action, s.summary, s.remediation
                f.lower_since = None
                out.append(self._emit(f, "updated", now))
                continue
            if _SEV_RANK[s.severity] < _SEV_RANK[f.severity]:
                f.lower_since = f.lower_since if f.lower_since is not None else now
                if now - f.lower_since >= timing.hold_s:
                    f.severity, f.action, f.summary, f.remediation = s.severity, s.action, s.summary, s.remediation
                    f.lower_since = None
                    out.append(self._emit(f, "updated", now))
                    continue
            else:
                f.lower_since = None
                f.summary = s.summary
            if now - f.last_published >= timing.update_interval_s:
                out.append(self._emit(f, "updated", now))
        # modes pending but no longer active
        for mode in [m for m in st.pending if m not in signals]:
            del st.pending[mode]
        # open findings whose condition is gone
        modes = self._open_by_dev.get(rec.key, ())
        for k in [(rec.node, rec.device, m) for m in modes if m not in signals]:
            f = self.open[k]
            hold = 0.0 if f.fault_mode == SILENT else timing.hold_s
            if f.clear_since is None:
                f.clear_since = now
            if now - f.clear_since >= hold:
                self._close(k)
                f.evidence = {**f.evidence, "clear_since": f.clear_since, "resolved_at": now}
                out.append(self._emit(f, "resolved", now))
        return out

    def _open(self, rec: DeviceRecord, s: Signal, now: float, first_seen: float | None = None) -> Diagnosis:
        first = now if first_seen is None else first_seen
        f = Finding(finding_id=finding_id(rec.node, rec.device, s.fault_mode, first), node=rec.node,
                    device=rec.device, fault_mode=s.fault_mode, severity=s.severity, action=s.action,
                    summary=s.summary, remediation=s.remediation, evidence=dict(s.evidence), first_seen=first,
                    last_seen=now, pods=list(rec.pods), revision=0)
        self._put(f)
        return self._emit(f, "open", now)

    def _emit(self, f: Finding, status: str, now: float) -> Diagnosis:
        f.revision += 1
        f.last_published = now
        d = f.to_diagnosis(status)
        self.health.apply_diagnosis(d)
        return d

    # -- adoption / snapshot ----------------------------------------------------------------------
    def adopt(self, d: Diagnosis) -> None:
        """Take over an open finding published earlier (e.g. read back from the stream at start-up)."""
        k = (d.node, d.device, d.fault_mode)
        if d.status == "resolved":
            f = self.open.get(k)
            if f is not None and f.finding_id == d.finding_id:
                self._close(k)
            self.health.apply_diagnosis(d)
            return
        self._put(Finding(finding_id=d.finding_id, node=d.node, device=d.device, fault_mode=d.fault_mode,
                          severity=d.severity, action=d.action, summary=d.summary, remediation=d.remediation,
                          evidence=dict(d.evidence), first_seen=d.first_seen, last_seen=d.last_seen,
                          pods=list(d.pods), revision=max(d.revision, 1), last_published=d.last_seen))
        self.health.apply_diagnosis(d)

    def _put(self, f: Finding) -> None:
        self.open[(f.node, f.device, f.fault_mode)] = f
        self._open_by_dev.setdefault((f.node, f.device), set()).add(f.fault_mode)

    def _close(self, k: tuple[str, str, str]) -> None:
        del self.open[k]
        modes = self._open_by_dev.get(k[:2])
        if modes is not None:
            modes.discard(k[2])
            if not modes:
                del self._open_by_dev[k[:2]]

    def open_findings(self) -> list[Diagnosis]:
        return [f.to_diagnosis("open" if f.revision == 1 else "updated") for f in self.open.values()]

    def counts_by_severity(self) -> dict[str, int]:
        out = {"info": 0, "warning": 0, "critical": 0}
        for f in self.open.values():
            out[f.severity] += 1
        return out


_REMEDY = {
    "temperature_c": "check cooling (fans, airflow, liquid loop, inlet temperature); reduce load on the device",
    "power_w": "check power capping and the workload; a device over its power budget throttles",
    "memory_used_pct": "device memory is nearly exhausted: lower gpu_memory_utilization / batch size, look for leaks",
}
