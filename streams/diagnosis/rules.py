"""Rule set of the diagnosis engine: validated models, built-in YAML plus user files, error catalog.

The built-in rules (``streams/data/rules.yaml``) and error-code catalog (``streams/data/error_codes.yaml``)
are data; a user file is deep-merged over them (mappings merge key by key, other values replace), then
the whole is validated, so a typo fails at start-up with the offending key named.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas.diagnosis import ActionLevel, Severity

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
BUILTIN_RULES = DATA_DIR / "rules.yaml"
BUILTIN_CATALOG = DATA_DIR / "error_codes.yaml"

THRESHOLD_METRICS = ("temperature_c", "power_w", "memory_used_pct")


class RulesError(ValueError):
    """A rules file is unreadable or invalid; the message names the file and the key."""


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timing(_M):
    hold_s: float = Field(default=15.0, ge=0)
    update_interval_s: float = Field(default=60.0, gt=0)
    stale_after_s: float = Field(default=15.0, gt=0)
    load_stale_after_s: float = Field(default=30.0, gt=0)
    max_future_s: float = Field(default=300.0, gt=0, description="reject samples stamped this far ahead")


class Threshold(_M):
    warning: float | None = None
    critical: float | None = None
    clear_margin: float = Field(default=0.0, ge=0)
    for_s: float = Field(default=0.0, ge=0)
    action_warning: ActionLevel = "SubHealth"
    action_critical: ActionLevel = "PreSeparateNPU"

    @model_validator(mode="after")
    def _order(self) -> "Threshold":
        if self.warning is not None and self.critical is not None and self.critical < self.warning:
            raise ValueError(f"critical ({self.critical}) is below warning ({self.warning})")
        return self

    def level(self, prev: int, value: float) -> int:
        """0 ok, 1 warning, 2 critical; a level is kept until the value drops below it by clear_margin."""
        m = self.clear_margin
        if self.critical is not None and (value >= self.critical or (prev == 2 and value > self.critical - m)):
            return 2
        if self.warning is not None and (value >= self.warning or (prev >= 1 and value > self.warning - m)):
            return 1
        return 0


class RateRule(_M):
    warning: float | None = None
    critical: float | None = None
    clear_margin: float = Field(default=0.0, ge=0)
    window_s: float = Field(default=60.0, gt=0)
    action: ActionLevel = "SubHealth"

    def as_threshold(self) -> Threshold:
        return Threshold(warning=self.warning, critical=self.critical, clear_margin=self.clear_margin,
                         action_warning=self.action, action_critical=self.action)


class EventRule(_M):
    severity: Severity = "critical"
    action: ActionLevel = "RestartBusiness"
    clear_after_s: float = Field(default=600.0, ge=0)


class TrendRule(_M):
    warning: float | None = Field(default=None, gt=0, description="rise per minute")
    window_s: float = Field(default=300.0, gt=0)
    min_span_s: float = Field(default=120.0, gt=0)
    min_r2: float = Field(default=0.9, ge=0, le=1)
    min_value: float | None = None
    every_s: float = Field(default=10.0, ge=0, description="re-fit the trend at most this often per device")
    action: ActionLevel = "SubHealth"


class StuckIdleRule(_M):
    util_below_pct: float = Field(default=1.0, ge=0, le=100)
    waiting_at_least: float = Field(default=1.0, gt=0)
    for_s: float = Field(default=60.0, ge=0)
    severity: Severity = "critical"
    action: ActionLevel = "RestartBusiness"


class LinkRule(_M):
    for_s: float = Field(default=10.0, ge=0)
    severity: Severity = "warning"
    action: ActionLevel = "SubHealth"


class VersionRule(_M):
    """Driver / firmware below a minimum version (compared number by number, ``rc`` before a release)."""

    min_driver: str | None = None
    min_firmware: str | None = None
    severity: Severity = "warning"
    action: ActionLevel = "Observe"


class DeviceRules(_M):
    """The rules that apply to one device model, after layering."""

    thresholds: dict[str, Threshold] = Field(default_factory=dict)
    ecc_single_bit_rate: RateRule = Field(default_factory=RateRule)
    ecc_double_bit: EventRule = Field(default_factory=EventRule)
    temperature_rise: TrendRule = Field(default_factory=TrendRule)
    stuck_idle: StuckIdleRule = Field(default_factory=StuckIdleRule)
    link_down: LinkRule = Field(default_factory=LinkRule)
    # GPU memory errors when the ECC counters are not exported (dcgm-exporter's defaults): row remapping
    remapped_rows_uncorrectable: EventRule = Field(default_factory=lambda: EventRule(action="ResetGPU"))
    row_remap_failure: EventRule = Field(default_factory=lambda: EventRule(action="DrainNode", clear_after_s=0))
    versions: VersionRule = Field(default_factory=VersionRule)

    @field_validator("thresholds")
    @classmethod
    def _known_metrics(cls, v: dict[str, Threshold]) -> dict[str, Threshold]:
        unknown = set(v) - set(THRESHOLD_METRICS)
        if unknown:
            raise ValueError(f"unknown threshold metric(s) {sorted(unknown)}; known: {list(THRESHOLD_METRICS)}")
        return v


class CodeEntry(_M):
    fault_mode: str = Field(min_length=1)
    meaning: str = ""
    level: ActionLevel
    severity: Severity | None = None
    remediation: str = ""
    clear_after_s: float = Field(default=0.0, ge=0)
    for_s: float = Field(default=0.0, ge=0)
    source: list[str] = Field(default_factory=list)


class XidEntry(_M):
    fault_mode: str = Field(min_length=1)
    meaning: str = ""
    level: ActionLevel
    severity: Severity | None = None
    remediation: str = ""
    clear_after_s: float = Field(default=300.0, ge=0)


class UnknownXid(_M):
    level: ActionLevel = "Observe"
    severity: Severity = "warning"
    clear_after_s: float = Field(default=300.0, ge=0)


class HealthEntry(_M):
    fault_mode: str
    level: ActionLevel
    severity: Severity
    meaning: str = ""
    remediation: str = ""


class Catalog(_M):
    level_severity: dict[str, Severity]
    level_remediation: dict[str, str] = Field(default_factory=dict, description="what to do at each handling "
                                              "level, for codes without their own remediation")
    error_codes: dict[str, CodeEntry] = Field(default_factory=dict)
    ascend_levels: dict[str, list[str]] = Field(default_factory=dict)
    unknown_code_level: ActionLevel = "SubHealth"
    xids: dict[int, XidEntry] = Field(default_factory=dict)
    unknown_xid: UnknownXid = Field(default_factory=UnknownXid)
    health_values: dict[str, HealthEntry] = Field(default_factory=dict)

    @field_validator("error_codes", mode="before")
    @classmethod
    def _norm_keys(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {normalize_code(k): e for k, e in v.items()}
        return v

    @field_validator("ascend_levels", mode="before")
    @classmethod
    def _norm_lists(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {lvl: [normalize_code(c) for c in (codes or [])] for lvl, codes in v.items()}
        return v

    def severity_of(self, level: str, explicit: Severity | None = None) -> Severity:
        return explicit or self.level_severity.get(level, "warning")

    @cached_property
    def code_levels(self) -> dict[str, str]:
        return _code_levels(self)

    def lookup_code(self, code: str) -> CodeEntry:
        """The entry for an Ascend code; codes with only a level get a generic entry."""
        c = normalize_code(code)
        entry = self.error_codes.get(c)
        if entry is not None:
            if not entry.remediation:
                entry = entry.model_copy(update={"remediation": self.level_remediation.get(entry.level, "")})
            return entry
        level = self.code_levels.get(c)
        if level is None:
            return CodeEntry(fault_mode=f"ascend_code_{c}", meaning="Ascend error code not in the catalog",
                             level=self.unknown_code_level,
                             remediation=self.level_remediation.get(self.unknown_code_level, ""))
        return CodeEntry(fault_mode=f"ascend_code_{c}", meaning=f"Ascend error code with handling level {level}",
                         level=level, source=["mindcluster-faultcode"],
                         remediation=self.level_remediation.get(level, ""))

    def lookup_xid(self, xid: int) -> XidEntry:
        entry = self.xids.get(int(xid))
        if entry is not None:
            if not entry.remediation:
                entry = entry.model_copy(update={"remediation": self.level_remediation.get(entry.level, "")})
            return entry
        u = self.unknown_xid
        return XidEntry(fault_mode=f"xid_{int(xid)}", meaning="NVIDIA Xid not in the catalog", level=u.level,
                        severity=u.severity, clear_after_s=u.clear_after_s,
                        remediation=self.level_remediation.get(u.level, ""))


_LEVEL_RANK = ["NotHandle", "Observe", "SubHealth", "RestartRequest", "RestartBusiness", "FreeRestartNPU",
               "RestartNPU", "ResetGPU", "PreSeparateNPU", "SeparateNPU", "DrainNode"]


def _code_levels(cat: Catalog) -> dict[str, str]:
    # a code listed under two levels keeps the more severe one
    out: dict[str, str] = {}
    for level, codes in cat.ascend_levels.items():
        for c in codes:
            prev = out.get(c)
            if prev is None or _LEVEL_RANK.index(level) > _LEVEL_RANK.index(prev):
                out[c] = level
    return out


def normalize_code(code: Any) -> str:
    """``0x80e01801`` / ``80E01801`` / 80818200 -> ``80E01801`` / ``80818200``."""
    s = str(code).strip()
    if s.lower().startswith("0x"):
        s = s[2:]
    s = s.upper()
    if not s or any(ch not in "0123456789ABCDEF" for ch in s):
        raise ValueError(f"error code {code!r} is not hexadecimal")
    return s


class RuleSet(_M):
    """Everything the engine needs: timing, layered device rules, the catalog."""

    version: Literal[1] = 1
    timing: Timing = Field(default_factory=Timing)
    defaults: dict[str, Any] = Field(default_factory=dict)
    kinds: dict[str, dict[str, Any]] = Field(default_factory=dict)
    models: dict[str, dict[str, Any]] = Field(default_factory=dict)
    catalog: Catalog

    @model_validator(mode="after")
    def _validate_layers(self) -> "RuleSet":
        # every combination must validate, so errors show at load time, not on the first sample
        for kind in ("npu", "gpu", *self.kinds):
            self._layered(kind)
            for pattern in self.models:
                self._layered(kind, (pattern,))
        return self

    def _layered(self, kind: str, patterns: tuple[str, ...] = ()) -> DeviceRules:
        raw = deep_merge(self.defaults, self.kinds.get(kind) or {})
        for pattern in patterns:
            raw = deep_merge(raw, self.models[pattern] or {})
        where = f"kind {kind}" + (f", model {' + '.join(repr(p) for p in patterns)}" if patterns else "")
        try:
            return DeviceRules.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"rules for {where}: {exc}") from None

    def match_models(self, device_model: str | None) -> tuple[str, ...]:
        """Every ``models`` key matching the device model: globs in file order, the exact name last."""
        if not device_model:
            return ()
        low = device_model.lower()
        globs = tuple(p for p in self.models if p != device_model and fnmatch.fnmatchcase(low, p.lower()))
        return globs + ((device_model,) if device_model in self.models else ())

    def for_device(self, kind: str, device_model: str | None) -> DeviceRules:
        return _for_device_cached(self, kind, self.match_models(device_model))


@lru_cache(maxsize=1024)
def _for_device_cached(rs: RuleSet, kind: str, patterns: tuple[str, ...]) -> DeviceRules:
    return rs._layered(kind, patterns)


# RuleSet holds dicts, so hash by identity for the cache.
RuleSet.__hash__ = object.__hash__  # type: ignore[assignment]


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``: mappings merge recursively, other values replace."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise RulesError(f"rules file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise RulesError(f"rules file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RulesError(f"rules file {path} must hold a mapping at the top")
    return data


_CATALOG_KEYS = set(Catalog.model_fields)


def build_ruleset(*overlays: dict) -> RuleSet:
    """Built-in rules and catalog with ``overlays`` (parsed rule mappings) merged over them in order."""
    rules = _read_yaml(BUILTIN_RULES)
    catalog = _normalize_catalog_keys(_read_yaml(BUILTIN_CATALOG))
    for over in overlays:
        over = dict(over or {})
        cat_over = {k: over.pop(k) for k in list(over) if k in _CATALOG_KEYS}
        if "catalog" in over:
            cat_over = deep_merge(over.pop("catalog") or {}, cat_over)
        catalog = deep_merge(catalog, _normalize_catalog_keys(cat_over))
        rules = deep_merge(rules, over)
    try:
        return RuleSet.model_validate({**rules, "catalog": _normalize_catalog_keys(catalog)})
    except ValidationError as exc:
        raise RulesError(f"invalid rules: {exc}") from None
    except ValueError as exc:
        raise RulesError(f"invalid rules: {exc}") from None


def _normalize_catalog_keys(cat: dict) -> dict:
    cat = dict(cat)
    if isinstance(cat.get("error_codes"), dict):
        try:
            cat["error_codes"] = {normalize_code(k): v for k, v in cat["error_codes"].items()}
        except ValueError as exc:
            raise RulesError(f"error_codes: {exc}") from None
    if isinstance(cat.get("xids"), dict):
        cat["xids"] = {int(k): v for k, v in cat["xids"].items()}
    return cat


def load_ruleset(paths: list[Path] | tuple[Path, ...] = ()) -> RuleSet:
    """Built-in rules with the user files merged over them, in the order given."""
    overlays = []
    for p in paths:
        overlays.append(_read_yaml(Path(p)))
    try:
        return build_ruleset(*overlays)
    except RulesError as exc:
        if paths:
            raise RulesError(f"{exc} (after merging {', '.join(str(p) for p in paths)})") from None
        raise


class DiagnosisConfig(_M):
    """Settings section ``diagnosis`` (env ``INFERNEX_DIAGNOSIS__...``) of the ``infernex diagnose`` service."""

    rules_files: list[Path] = Field(default_factory=list, description="user rule files merged over the built-in")
    durable: str = Field(default="diagnosis", min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    start: Literal["new", "all"] = Field(default="new", description="where a new durable starts in the stream")
    tick_s: float = Field(default=1.0, gt=0, description="staleness check period")
    watch_engine_metrics: bool = Field(default=True, description="read engine.metrics.> for waiting requests")
    adopt_window_s: float = Field(default=3600.0, ge=0, description="read back open findings this far at start")
    warning_score: float = Field(default=0.5, gt=0, le=1)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus /metrics; None = off")
    batch: int = Field(default=256, ge=1, description="most messages per pull")
    fetch_timeout_s: float = Field(default=0.01, gt=0, description="a pull waits at most this long for a full batch")

    @field_validator("rules_files", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):  # from the environment: comma-separated paths
            return [p.strip() for p in v.split(",") if p.strip()]
        return v


_VERSION_PART = re.compile(r"\d+|[a-z]+")


def version_key(v: str) -> tuple:
    """``24.1.rc2`` < ``24.1.0`` < ``550.127.05``: numbers compare as numbers, a word (``rc``,
    ``alpha``) sorts before any number at the same place (a pre-release comes before its release)."""
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in _VERSION_PART.findall(v.lower()))
