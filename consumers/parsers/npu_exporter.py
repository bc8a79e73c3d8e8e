"""MindCluster npu-exporter ``/metrics`` -> DeviceTelemetry (one per chip ``id``)."""

from __future__ import annotations

from schemas import DeviceTelemetry

from consumers.parsers.common import ParseError, prom_samples

_HEALTH = {1: "OK", 0: "Alarm"}


def _model_name(raw: str) -> str:
    # the exporter writes "Ascend910B4"; the telemetry uses "Ascend 910B4" like npu-smi docs
    if raw.startswith("Ascend") and not raw.startswith("Ascend "):
        return "Ascend " + raw[len("Ascend"):]
    return raw


def parse_npu_exporter(text: str, node: str, ts: float) -> list[DeviceTelemetry]:
    chips = prom_samples(text, ("npu_chip_info_",), "id")
    if not chips:
        raise ParseError("no npu_chip_info_* samples with an 'id' label found")
    out = []
    for dev in sorted(chips, key=lambda d: (len(d), d)):
        m = chips[dev]

        def val(name: str) -> float | None:
            v = m.get("npu_chip_info_" + name)
            return None if v is None else v[1]

        labels = next(iter(m.values()))[0]
        codes = []
        for name in sorted(k for k in m if k.startswith("npu_chip_info_error_code")):
            code = int(m[name][1])
            if code:
                codes.append(f"0x{code:08X}")
        health = val("health_status")
        link = val("link_status")
        pod = labels.get("pod_name") or ""
        out.append(DeviceTelemetry(
            node=node, device=dev, kind="npu", source="npu-exporter", ts=ts,
            device_model=_model_name(labels.get("model_name", "")) or None,
            temperature_c=val("temperature"),
            power_w=val("power"),
            utilization_pct=val("utilization"),
            memory_used_mb=val("hbm_used_memory"),
            memory_total_mb=val("hbm_total_memory"),
            ecc_single_bit_total=val("hbm_ecc_single_bit_error_cnt"),
            ecc_double_bit_total=val("hbm_ecc_double_bit_error_cnt"),
            health=None if health is None else _HEALTH.get(int(health), "UNKNOWN"),
            link_status=None if link is None else ("UP" if int(link) == 1 else "DOWN"),
            error_codes=codes,
            pods=[pod] if pod else [],
        ))
    return out
