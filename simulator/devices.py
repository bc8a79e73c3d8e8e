"""Simulated accelerator nodes: Ascend NPUs and NVIDIA GPUs, with scripted faults.

Pure API (no clock, no I/O): ``SimulatedNode(...).sample(t)`` returns one
:class:`schemas.DeviceTelemetry` per device for time ``t`` (any float timebase, the
faults use the same one). Readings are a deterministic function of ``(seed, node,
device, t)``, so two nodes built alike give identical samples.

Renderers write the samples in the formats real tools produce, so the real collectors
(:mod:`consumers.device_collector`) can read them unchanged:

* :func:`render_npu_smi` - the table printed by ``npu-smi info`` on Atlas 800 (910B);
* :func:`render_npu_exporter` - Prometheus text in MindCluster npu-exporter names;
* :func:`render_dcgm` - Prometheus text in dcgm-exporter names.

:func:`make_app` serves those texts over HTTP (``infernex sim-devices``).

Faults (``inject``): ``over_temperature``, ``hbm_ecc_burst``, ``link_down``,
``error_code`` (an Ascend error code such as ``0x80E01801``), ``xid`` (an NVIDIA XID,
79 by default), ``power_spike``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import DeviceTelemetry

FaultKind = Literal["over_temperature", "hbm_ecc_burst", "link_down", "error_code", "xid", "power_spike"]
FAULT_KINDS: tuple[str, ...] = ("over_temperature", "hbm_ecc_burst", "link_down", "error_code", "xid",
                                "power_spike")

#: Well-known Ascend error codes (hex as npu-smi / npu-exporter report them) and the
#: health state the device shows while they are active.
ASCEND_ERROR_CODES: dict[str, tuple[str, str]] = {
    "0x80E01801": ("Critical", "HBM multi-bit ECC error"),
    "0x80E18402": ("Alarm", "HBM single-bit ECC errors over threshold"),
    "0x80CB8009": ("Critical", "AI core exception"),
    "0x80E3A202": ("Warning", "chip over temperature"),
    "0x81078603": ("Alarm", "network port link down"),
    "0x80C98008": ("Critical", "HCCS link fault"),
}

#: NVIDIA XIDs the simulator knows how to describe.
NVIDIA_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}


@dataclass(frozen=True)
class DeviceProfile:
    kind: Literal["npu", "gpu"]
    model: str  # as DeviceTelemetry.device_model
    smi_name: str  # as npu-smi / DCGM print it
    memory_total_mb: float
    idle_power_w: float
    max_power_w: float
    idle_temp_c: float
    max_temp_c: float
    over_temp_c: float  # temperature an over_temperature fault drives to
    driver: str
    firmware: str | None = None


PROFILES: dict[str, DeviceProfile] = {
    "Ascend 910B4": DeviceProfile("npu", "Ascend 910B4", "910B4", 32768, 85.0, 310.0, 36.0, 62.0, 105.0,
                                  "24.1.rc2", "7.5.0.1.129"),
    "Ascend 910B3": DeviceProfile("npu", "Ascend 910B3", "910B3", 65536, 90.0, 350.0, 36.0, 64.0, 105.0,
                                  "24.1.rc2", "7.5.0.1.129"),
    "Ascend 910B2": DeviceProfile("npu", "Ascend 910B2", "910B2", 65536, 92.0, 392.0, 36.0, 65.0, 105.0,
                                  "24.1.rc2", "7.5.0.1.129"),
    # 310P: no HBM; its memory is DDR (npu-exporter: npu_chip_info_total_memory / used_memory)
    "Ascend 310P3": DeviceProfile("npu", "Ascend 310P3", "310P3", 21534, 18.0, 72.0, 38.0, 60.0, 95.0,
                                  "23.0.0", "7.1.0.4.220"),
    "H100": DeviceProfile("gpu", "H100", "NVIDIA H100 80GB HBM3", 81559, 70.0, 700.0, 32.0, 72.0, 92.0,
                          "550.127.05"),
    "A100": DeviceProfile("gpu", "A100", "NVIDIA A100-SXM4-80GB", 81920, 60.0, 400.0, 30.0, 70.0, 90.0,
                          "550.127.05"),
}
DEFAULT_MODEL = {"npu": "Ascend 910B4", "gpu": "H100"}


@dataclass(frozen=True)
class Fault:
    device: str
    kind: str
    start: float
    duration: float | None = None  # None: until the end of time
    params: dict[str, Any] = field(default_factory=dict)

    def active(self, t: float) -> bool:
        return t >= self.start and (self.duration is None or t < self.start + self.duration)

    def elapsed(self, t: float) -> float:
        """Seconds of this fault that have happened by ``t`` (0 before it starts)."""
        if t < self.start:
            return 0.0
        end = t if self.duration is None else min(t, self.start + self.duration)
        return end - self.start


def _mix(*parts: int) -> int:
    """splitmix64 over the parts: a stable hash across processes (unlike ``hash()``)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x


def _unit(*parts: int) -> float:
    """Deterministic value in [0, 1)."""
    return (_mix(*parts) >> 11) / float(1 << 53)


def _smooth_noise(seed: int, t: float) -> float:
    """Deterministic noise in [-1, 1] that varies smoothly, one knot per second."""
    k = math.floor(t)
    f = t - k
    a = _unit(seed, k) * 2 - 1
    b = _unit(seed, k + 1) * 2 - 1
    w = f * f * (3 - 2 * f)
    return a + (b - a) * w


class SimulatedNode:
    """A node with ``n_devices`` accelerators of one model.

    ``pods`` maps a device id to the pods that use it (reported in the telemetry).
    ``load`` scales the mean utilisation (0..1).
    """

    def __init__(self, node: str, n_devices: int = 8, kind: Literal["npu", "gpu"] = "npu",
                 device_model: str | None = None, seed: int = 0, *,
                 pods: dict[str, list[str]] | None = None, load: float = 0.6):
        if not node:
            raise ValueError("node name must not be empty")
        if n_devices < 1:
            raise ValueError("a node needs at least one device")
        if kind not in ("npu", "gpu"):
            raise ValueError(f"kind must be 'npu' or 'gpu', not {kind!r}")
        model = device_model or DEFAULT_MODEL[kind]
        if model not in PROFILES:
            raise ValueError(f"unknown device model {model!r}; known: {', '.join(sorted(PROFILES))}")
        profile = PROFILES[model]
        if profile.kind != kind:
            raise ValueError(f"{model} is a {profile.kind}, not a {kind}")
        if not 0 <= load <= 1:
            raise ValueError("load must be within 0..1")
        self.node = node
        self.kind = kind
        self.profile = profile
        self.seed = seed
        self.load = load
        self.devices = [str(i) for i in range(n_devices)]
        self.pods = {k: list(v) for k, v in (pods or {}).items()}
        self.faults: list[Fault] = []
        self._node_key = zlib.crc32(node.encode())

    # -- faults ---------------------------------------------------------------------------------

    def inject(self, device: str | int, fault: str, start: float, duration: float | None = None,
               **params: Any) -> Fault:
        """Schedule a fault on one device. Parameters by kind:

        ``over_temperature``: ``temp_c`` (default: the model's over-temperature);
        ``hbm_ecc_burst``: ``rate_per_s`` single-bit errors (default 40), ``double_bit`` total (0);
        ``link_down``: none; ``error_code``: ``code`` (default ``0x80E01801``), ``health``;
        ``xid``: ``xid`` (default 79); ``power_spike``: ``power_w``.
        """
        device = str(device)
        if device not in self.devices:
            raise ValueError(f"node {self.node} has no device {device!r} (devices 0..{len(self.devices) - 1})")
        if fault not in FAULT_KINDS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULT_KINDS)}")
        if duration is not None and duration <= 0:
            raise ValueError("fault duration must be positive")
        if fault == "xid" and self.kind != "gpu":
            raise ValueError("XID faults exist only on GPUs")
        if fault == "error_code":
            if self.kind != "npu":
                raise ValueError("Ascend error codes exist only on NPUs")
            code = normalize_error_code(params.get("code", "0x80E01801"))
            params = {**params, "code": code}
        if fault == "xid":
            params = {**params, "xid": int(params.get("xid", 79))}
        f = Fault(device=device, kind=fault, start=float(start), duration=duration, params=dict(params))
        self.faults.append(f)
        return f

    def scenario(self, name: str, start: float, device: str | int = "0") -> list[Fault]:
        """Scripted scenarios by name (see :data:`SCENARIOS`)."""
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        return [self.inject(device, kind, start + offset, duration, **params)
                for kind, offset, duration, params in SCENARIOS[name](self.kind)]

    # -- sampling -------------------------------------------------------------------------------

    def sample(self, t: float) -> list[DeviceTelemetry]:
        return [self.sample_device(d, t) for d in self.devices]

    def sample_device(self, device: str, t: float) -> DeviceTelemetry:
        p = self.profile
        dkey = _mix(self.seed, self._node_key, int(device))
        phase = _unit(dkey, 1) * 2 * math.pi
        wave = math.sin(2 * math.pi * t / 600.0 + phase)
        util = 100 * self.load * (0.8 + 0.2 * wave) + 6 * _smooth_noise(dkey ^ 0x55, t)
        util = min(100.0, max(0.0, util))
        frac = util / 100.0
        power = p.idle_power_w + (p.max_power_w - p.idle_power_w) * frac * 0.85 + 3 * _smooth_noise(dkey ^ 0x77, t)
        temp = p.idle_temp_c + (p.max_temp_c - p.idle_temp_c) * frac + 1.5 * _smooth_noise(dkey ^ 0x99, t)
        mem_used = p.memory_total_mb * (0.88 + 0.02 * _unit(dkey, 2)) if self.load > 0 else 3.0
        ecc_sb = 0.0
        ecc_db = 0.0
        health: str | None = "OK" if self.kind == "npu" else None
        link = "UP"
        codes: list[str] = []
        xids: list[int] = []
        # dcgm-exporter's XID field is the last XID the GPU reported: it keeps that value after the
        # fault (an ``xid`` fault with ``reset=True`` ends with a GPU reset, which sets it back to 0)
        xid_last: int | None = 0 if self.kind == "gpu" else None
        xid_from = -math.inf
        remapped_unc = 0.0 if self.kind == "gpu" else None
        remap_failure: bool | None = False if self.kind == "gpu" else None
        severity = {"OK": 0, "Warning": 1, "Alarm": 2, "Critical": 3}

        def worse(h: str) -> None:
            nonlocal health
            if self.kind == "npu" and severity[h] > severity[health or "OK"]:
                health = h

        for f in self.faults:
            if f.device != device:
                continue
            if f.kind == "xid" and f.start <= t and f.start >= xid_from:
                xid_from = f.start
                reset = f.params.get("reset") and f.duration is not None and t >= f.start + f.duration
                xid_last = 0 if reset else int(f.params["xid"])
            if f.kind == "hbm_ecc_burst":
                # counters are cumulative: they keep what the burst added after it ends
                ecc_sb += math.floor(f.params.get("rate_per_s", 40) * f.elapsed(t))
                if t >= f.start:
                    ecc_db += float(f.params.get("double_bit", 0))
                    if remapped_unc is not None:  # a GPU remaps a row per uncorrectable error
                        remapped_unc += float(f.params.get("double_bit", 0))
                if f.active(t) and remap_failure is not None and f.params.get("remap_failure"):
                    remap_failure = True
                if f.active(t):
                    worse("Critical" if f.params.get("double_bit") else "Warning")
                continue
            if not f.active(t):
                continue
            if f.kind == "over_temperature":
                target = float(f.params.get("temp_c", p.over_temp_c))
                ramp = min(1.0, (t - f.start) / 20.0)  # reaches the target within 20 s
                temp = temp + (target - temp) * ramp
                if temp >= p.over_temp_c - 10:
                    worse("Alarm" if temp >= p.over_temp_c else "Warning")
            elif f.kind == "link_down":
                link = "DOWN"
                worse("Alarm")
            elif f.kind == "error_code":
                codes.append(f.params["code"])
                worse(f.params.get("health") or ASCEND_ERROR_CODES.get(f.params["code"], ("Alarm", ""))[0])
            elif f.kind == "xid":
                if f.params["xid"] == 79:  # fallen off the bus: nothing reads any more
                    util, power = 0.0, 0.0
            elif f.kind == "power_spike":
                power = float(f.params.get("power_w", p.max_power_w * 1.1))

        return DeviceTelemetry(
            node=self.node,
            device=device,
            kind=self.kind,
            source="sim",
            ts=max(0.0, float(t)),
            device_model=p.model,
            driver=p.driver,
            firmware=p.firmware,
            temperature_c=round(temp, 1),
            power_w=round(max(0.0, power), 1),
            utilization_pct=round(util, 1),
            memory_used_mb=round(mem_used),
            memory_total_mb=p.memory_total_mb,
            ecc_single_bit_total=ecc_sb,
            ecc_double_bit_total=ecc_db,
            health=health,
            link_status=link,
            error_codes=codes,
            xid_errors=xids,
            xid_last=xid_last,
            remapped_rows_uncorrectable=remapped_unc,
            remapped_rows_correctable=0.0 if self.kind == "gpu" else None,
            row_remap_failure=remap_failure,
            bus_id=_bus_id(self.node, device, self.kind),
            pods=list(self.pods.get(device, [])),
        )


def normalize_error_code(code: str | int) -> str:
    """``0x80e01801`` / ``80E01801`` / 2162169857 -> ``0x80E01801``."""
    if isinstance(code, int):
        value = code
    else:
        text = str(code).strip()
        try:
            value = int(text, 16)
        except ValueError:
            raise ValueError(f"error code {code!r} is not hexadecimal") from None
    if not 0 < value < (1 << 32):
        raise ValueError(f"error code {code!r} is out of range")
    return f"0x{value:08X}"


def _scenario_over_temp(kind: str):
    return [("over_temperature", 0.0, 120.0, {})]


def _scenario_ecc_burst(kind: str):
    return [("hbm_ecc_burst", 0.0, 30.0, {"rate_per_s": 60})]


def _scenario_link_down(kind: str):
    return [("link_down", 0.0, 60.0, {})]


def _scenario_error_code(kind: str):
    return [("error_code", 0.0, None, {"code": "0x80E01801"})] if kind == "npu" else [
        ("xid", 0.0, None, {"xid": 48})]


def _scenario_xid79(kind: str):
    if kind != "gpu":
        raise ValueError("scenario xid79 needs a GPU node")
    return [("xid", 0.0, None, {"xid": 79})]


SCENARIOS = {
    "over-temperature": _scenario_over_temp,
    "hbm-ecc-burst": _scenario_ecc_burst,
    "link-down": _scenario_link_down,
    "error-code": _scenario_error_code,
    "xid79": _scenario_xid79,
}


# -- renderers ----------------------------------------------------------------------------------

_NPU_SMI_VERSION = "24.1.rc2"
_SEP_LINE = "+---------------------------+---------------+----------------------------------------------------+"
_EQ_LINE = "+===========================+===============+====================================================+"


def _bus_id(node: str, device: str, kind: str) -> str:
    bus = [0xC1, 0x81, 0x41, 0x01, 0xC2, 0x82, 0x42, 0x02][int(device) % 8] + int(device) // 8
    return f"0000:{bus:02X}:00.0" if kind == "npu" else f"00000000:{bus:02X}:00.0"


def render_npu_smi(samples: list[DeviceTelemetry], *, version: str = _NPU_SMI_VERSION,
                   processes: dict[str, list[tuple[int, str, int]]] | None = None) -> str:
    """``npu-smi info`` as printed on 910B servers: two rows per chip, then the process table.

    ``processes`` maps a device id to ``(pid, name, memory_mb)`` rows.
    """
    lines = [
        "+------------------------------------------------------------------------------------------------+",
        f"| npu-smi {version:<24} Version: {version:<54}|",
        _SEP_LINE,
        "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        _EQ_LINE,
    ]
    for s in samples:
        name = (s.device_model or "").replace("Ascend ", "")
        power = "NA" if s.power_w is None else f"{s.power_w:.1f}"
        temp = "NA" if s.temperature_c is None else f"{s.temperature_c:.0f}"
        hbm_used = int(s.memory_used_mb or 0)
        hbm_total = int(s.memory_total_mb or 0)
        left1 = f"| {s.device:<5} {name:<19} | {s.health or 'UNKNOWN':<13} | "
        right1 = f"{power:<11} {temp:<17} {'0    / 0':<21}|"
        left2 = f"| {'0':<25} | {_bus_id(s.node, s.device, 'npu'):<13} | "
        util = "NA" if s.utilization_pct is None else f"{s.utilization_pct:.0f}"
        hbm = f"{hbm_used:<4} / {hbm_total}"
        right2 = f"{util:<11} {'0    / 0':<17} {hbm:<21}|"
        lines += [left1 + right1, left2 + right2, _EQ_LINE]
    lines += [
        _SEP_LINE,
        "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |",
        _EQ_LINE,
    ]
    for s in samples:
        rows = (processes or {}).get(s.device) or []
        if not rows:
            lines.append(f"| {'No running processes found in NPU ' + s.device:<95}|")
        for pid, pname, mem in rows:
            lines.append(f"| {s.device:<7} {'0':<17} | {pid:<13} | {pname:<24} | {mem:<24}|")
        lines.append(_EQ_LINE)
    return "\n".join(lines) + "\n"


class _Family:
    """One metric family for the text exposition format (written by hand so names,
    types and label order are exactly the exporters', e.g. dcgm-exporter's counters
    have no ``_total`` suffix)."""

    def __init__(self, name: str, doc: str, mtype: str = "gauge", labels: list[str] | None = None):
        self.name, self.doc, self.mtype = name, doc, mtype
        self.labels = labels or []
        self.samples: list[tuple[list[str], float]] = []

    def add_metric(self, values: list[str], value: float) -> None:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name}: {len(self.labels)} labels, {len(values)} values")
        self.samples.append((list(values), value))


def _fmt_value(v: float) -> str:
    f = float(v)
    if math.isfinite(f) and f == int(f) and abs(f) < 1e15:
        return str(int(f))
    return repr(f)


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _expose(families: list[_Family]) -> str:
    out: list[str] = []
    for fam in families:
        out.append(f"# HELP {fam.name} {fam.doc}")
        out.append(f"# TYPE {fam.name} {fam.mtype}")
        for values, v in fam.samples:
            if fam.labels:
                lab = ",".join(f'{k}="{_escape_label(x)}"' for k, x in zip(fam.labels, values))
                out.append(f"{fam.name}{{{lab}}} {_fmt_value(v)}")
            else:
                out.append(f"{fam.name} {_fmt_value(v)}")
    return "\n".join(out) + "\n"


def _error_code_int(code: str) -> int:
    return int(code, 16)


def _npu_model_label(device_model: str | None) -> str:
    """``Ascend 910B4`` -> ``910B4-Ascend-V1``: the exporter writes ``<chip name>-<type>-<version>``."""
    name = (device_model or "").replace("Ascend ", "").replace("Ascend", "")
    return f"{name}-Ascend-V1" if name else ""


def render_npu_exporter(samples: list[DeviceTelemetry], *, pod_namespace: str = "default") -> str:
    """Prometheus text as MindCluster npu-exporter writes it: families sorted by name and labels by
    name (the Go client's order), the card labels on every series (``id`` = the chip's physical id,
    ``model_name`` = ``<name>-Ascend-V1``), ``npu_chip_info_name`` with the model in ``name``; HBM
    series on 910 chips, DDR series (``npu_chip_info_total_memory`` / ``used_memory``) on 310P."""
    labels = ["container_name", "id", "model_name", "namespace", "pcie_bus_info", "pod_name", "vdie_id"]
    fams: dict[str, _Family] = {}

    def put(name: str, doc: str, lv: list[str], value: float, label_names: list[str] = labels) -> None:
        fam = fams.get(name)
        if fam is None:
            fam = fams[name] = _Family(name, doc, "gauge", label_names)
        fam.add_metric(lv, value)

    for s in samples:
        pod = s.pods[0] if s.pods else ""
        key = _mix(zlib.crc32(s.node.encode()), int(s.device))
        vdie = f"{key:016X}{_mix(key, 1):016X}"
        model = _npu_model_label(s.device_model)
        bus = s.bus_id or _bus_id(s.node, s.device, "npu")
        lv = ["vllm" if pod else "", s.device, model, pod_namespace if pod else "", bus, pod, vdie]
        put("npu_chip_info_name", "the npu name with value '1'", [lv[0], lv[1], lv[2], *lv[3:]], 1,
            ["container_name", "id", "name", "namespace", "pcie_bus_info", "pod_name", "vdie_id"])
        put("npu_chip_info_temperature", "the npu temperature", lv, s.temperature_c or 0)
        put("npu_chip_info_power", "the npu power", lv, s.power_w or 0)
        put("npu_chip_info_health_status", "the npu health status", lv, 1 if s.health in (None, "OK") else 0)
        put("npu_chip_info_utilization", "the ai core utilization", lv, s.utilization_pct or 0)
        if (s.device_model or "").startswith("Ascend 310P"):
            put("npu_chip_info_used_memory", "the npu used memory", lv, s.memory_used_mb or 0)
            put("npu_chip_info_total_memory", "the npu total memory", lv, s.memory_total_mb or 0)
        else:
            put("npu_chip_info_hbm_used_memory", "the npu hbm used memory", lv, s.memory_used_mb or 0)
            put("npu_chip_info_hbm_total_memory", "the npu hbm total memory", lv, s.memory_total_mb or 0)
            put("npu_chip_info_hbm_ecc_single_bit_error_cnt", "HBM Single Bit Error Count", lv,
                s.ecc_single_bit_total or 0)
            put("npu_chip_info_hbm_ecc_double_bit_error_cnt", "HBM Double Bit Error Count", lv,
                s.ecc_double_bit_total or 0)
        put("npu_chip_info_error_code", "the npu error code", lv,
            _error_code_int(s.error_codes[0]) if s.error_codes else 0)
        for i, code in enumerate(s.error_codes[1:], start=1):
            put(f"npu_chip_info_error_code_{i}", f"the npu error code {i}", lv, _error_code_int(code))
        put("npu_chip_info_link_status", "the npu link status", lv, 1 if s.link_status != "DOWN" else 0)
        put("npu_chip_info_network_status", "the npu network health status", lv, 1 if s.link_status != "DOWN" else 0)
    count = _Family("machine_npu_nums", "Amount of npu installed on the machine.")
    count.add_metric([], len(samples))
    return _expose([count] + [fams[k] for k in sorted(fams)])


#: dcgm-exporter's text for the XIDs the simulator uses (err_msg label of DCGM_FI_DEV_XID_ERRORS)
_XID_TEXT = {0: "No Error", 13: "Graphics Engine Exception", 31: "GPU memory page fault",
             48: "Double Bit ECC Error", 63: "ECC page retirement or row remapping recording event",
             74: "NVLINK Error", 79: "GPU has fallen off the bus", 94: "Contained ECC error",
             95: "Uncontained ECC error"}


def render_dcgm(samples: list[DeviceTelemetry], *, hostname: str | None = None, ecc: bool = False) -> str:
    """Prometheus text as dcgm-exporter writes it with its default counters: labels in the order of
    its template (``gpu, UUID, pci_bus_id, device, modelName, hostname``, then label fields and pod
    labels sorted, then ``err_code``/``err_msg`` on the XID gauge), the XID as the last value seen,
    row-remapping fields, and no ECC counters (they are commented out in the defaults; ``ecc=True``
    adds them as a custom counters file would)."""
    fams: dict[str, _Family] = {}
    rows: dict[str, list] = {}

    def put(name: str, doc: str, mtype: str, names: list[str], lv: list[str], value: float) -> None:
        fam = fams.get(name)
        if fam is None:
            fam = fams[name] = _Family(name, doc, mtype, names)
            rows[name] = []
        if fam.labels != names:  # series of one family with other labels (pod / no pod): own family object
            fam = _Family(name, doc, mtype, names)
            rows[name].append(fam)
        fam.add_metric(lv, value)

    for s in samples:
        pod = s.pods[0] if s.pods else ""
        uuid = "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}".format(
            *(lambda x: (x >> 96 & 0xFFFFFFFF, x >> 80 & 0xFFFF, x >> 64 & 0xFFFF, x >> 48 & 0xFFFF,
                         x & 0xFFFFFFFFFFFF))(_mix(zlib.crc32(s.node.encode()), int(s.device)) << 64
                                              | _mix(int(s.device), 7)))
        model = PROFILES[s.device_model].smi_name if s.device_model in PROFILES else (s.device_model or "")
        names = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname", "DCGM_FI_DRIVER_VERSION"]
        lv = [s.device, uuid, s.bus_id or _bus_id(s.node, s.device, "gpu"), f"nvidia{s.device}", model,
              hostname or s.node, s.driver or ""]
        if pod:
            names += ["container", "namespace", "pod"]
            lv += ["vllm", "default", pod]

        def g(name, doc, value, mtype="gauge"):
            if value is not None:
                put(name, doc, mtype, names, lv, value)

        used = s.memory_used_mb or 0
        g("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", s.temperature_c or 0)
        g("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", round((s.temperature_c or 0) + 4))
        g("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", s.power_w or 0)
        g("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", s.utilization_pct or 0)
        g("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", used)
        g("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", max(0.0, (s.memory_total_mb or 0) - used))
        g("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", 0)
        xid = s.xid_last if s.xid_last is not None else (s.xid_errors[-1] if s.xid_errors else 0)
        put("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "gauge",
            names + ["err_code", "err_msg"], lv + [str(xid), _XID_TEXT.get(xid, "Unknown Error")], xid)
        g("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors",
          s.remapped_rows_uncorrectable or 0, "counter")
        g("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors",
          s.remapped_rows_correctable or 0, "counter")
        g("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed", 1 if s.row_remap_failure else 0)
        if ecc:
            g("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.",
              s.ecc_single_bit_total or 0, "counter")
            g("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.",
              s.ecc_double_bit_total or 0, "counter")
        g("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "Total number of NVLink bandwidth counters for all lanes.",
          0 if s.link_status == "DOWN" else 1_000_000, "counter")
    out = []
    for name, fam in fams.items():  # one HELP/TYPE block per family, series of every label shape in it
        fam.samples = [(dict(zip(fam.labels, v)), x) for v, x in fam.samples]
        for extra in rows[name]:
            fam.samples += [(dict(zip(extra.labels, v)), x) for v, x in extra.samples]
        out.append(fam)
    return _expose_mixed(out)


def _expose_mixed(families: list[_Family]) -> str:
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {fam.doc}")
        lines.append(f"# TYPE {fam.name} {fam.mtype}")
        for labels, v in fam.samples:
            lab = ",".join(f'{k}="{_escape_label(x)}"' for k, x in labels.items())
            lines.append(f"{fam.name}{{{lab}}} {_fmt_value(v)}")
    return "\n".join(lines) + "\n"


def render(samples: list[DeviceTelemetry], fmt: str, **kw: Any) -> str:
    if fmt == "npu-smi":
        return render_npu_smi(samples, **kw)
    if fmt == "npu-exporter":
        return render_npu_exporter(samples, **kw)
    if fmt == "dcgm":
        return render_dcgm(samples, **kw)
    raise ValueError(f"unknown format {fmt!r}; use npu-smi, npu-exporter or dcgm")


# -- HTTP mode ----------------------------------------------------------------------------------

def make_app(nodes: list[SimulatedNode], clock=None):
    """A Starlette app: ``/metrics`` (npu-exporter for NPU nodes, DCGM for GPU nodes),
    ``/npu-smi`` (text), ``/telemetry`` (JSON samples); ``?node=`` picks one node."""
    import time

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    now = clock.now if clock is not None else time.time
    by_name = {n.node: n for n in nodes}

    def pick(request: Request) -> list[SimulatedNode] | JSONResponse:
        name = request.query_params.get("node")
        if name is None:
            return nodes
        if name not in by_name:
            return JSONResponse({"error": f"unknown node {name!r}", "nodes": sorted(by_name)}, status_code=404)
        return [by_name[name]]

    async def metrics(request: Request):
        chosen = pick(request)
        if isinstance(chosen, JSONResponse):
            return chosen
        t = now()
        parts = []
        for n in chosen:
            samples = n.sample(t)
            parts.append(render_npu_exporter(samples) if n.kind == "npu" else render_dcgm(samples))
        return PlainTextResponse(_merge_expositions(parts), media_type="text/plain; version=0.0.4")

    async def npu_smi(request: Request):
        chosen = pick(request)
        if isinstance(chosen, JSONResponse):
            return chosen
        npus = [n for n in chosen if n.kind == "npu"]
        if not npus:
            return JSONResponse({"error": "no NPU node here"}, status_code=404)
        return PlainTextResponse(render_npu_smi(npus[0].sample(now())))

    async def telemetry(request: Request):
        chosen = pick(request)
        if isinstance(chosen, JSONResponse):
            return chosen
        t = now()
        return JSONResponse([s.model_dump(mode="json") for n in chosen for s in n.sample(t)])

    return Starlette(routes=[Route("/metrics", metrics), Route("/npu-smi", npu_smi),
                             Route("/telemetry", telemetry)])


def _merge_expositions(parts: list[str]) -> str:
    """Join several expositions, keeping one HELP/TYPE header per metric family."""
    if len(parts) == 1:
        return parts[0]
    order: list[str] = []
    header: dict[str, list[str]] = {}
    body: dict[str, list[str]] = {}
    current = None
    for text in parts:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                if name not in header:
                    header[name] = []
                    body[name] = []
                    order.append(name)
                if line not in header[name]:
                    header[name].append(line)
                current = name
            elif line and current is not None:
                body[current].append(line)
    out = []
    for name in order:
        out += header[name] + body[name]
    return "\n".join(out) + "\n"
