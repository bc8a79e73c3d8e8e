"""dcgm-exporter ``/metrics`` -> DeviceTelemetry (one per ``gpu`` label)."""

from __future__ import annotations

from schemas import DeviceTelemetry

from consumers.parsers.common import ParseError, prom_samples

_MODELS = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA A100-SXM4-80GB": "A100"}


def parse_dcgm(text: str, node: str, ts: float) -> list[DeviceTelemetry]:
    gpus = prom_samples(text, ("DCGM_FI_",), "gpu")
    if not gpus:
        raise ParseError("no DCGM_FI_* samples with a 'gpu' label found")
    out = []
    for dev in sorted(gpus, key=lambda d: (len(d), d)):
        m = gpus[dev]

        def val(name: str) -> float | None:
            v = m.get("DCGM_FI_DEV_" + name)
            return None if v is None else v[1]

        labels = next(iter(m.values()))[0]
        used, free = val("FB_USED"), val("FB_FREE")
        xid = val("XID_ERRORS")
        raw_model = labels.get("modelName", "")
        pod = labels.get("pod") or ""
        out.append(DeviceTelemetry(
            node=node, device=dev, kind="gpu", source="dcgm", ts=ts,
            device_model=_MODELS.get(raw_model, raw_model) or None,
            driver=labels.get("DCGM_FI_DRIVER_VERSION") or None,
            temperature_c=val("GPU_TEMP"),
            power_w=val("POWER_USAGE"),
            utilization_pct=val("GPU_UTIL"),
            memory_used_mb=used,
            memory_total_mb=None if used is None or free is None else used + free,
            ecc_single_bit_total=val("ECC_SBE_VOL_TOTAL"),
            ecc_double_bit_total=val("ECC_DBE_VOL_TOTAL"),
            xid_errors=[int(xid)] if xid else [],
            pods=[pod] if pod else [],
        ))
    return out
