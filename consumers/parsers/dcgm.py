"""dcgm-exporter ``/metrics`` -> DeviceTelemetry (one per ``gpu`` label).

What the exporter emits (NVIDIA/dcgm-exporter; samples and its ``etc/default-counters.csv`` in
``tests/fixtures/devices/``): every series labelled ``gpu``, ``UUID``, ``pci_bus_id``,
``device``, ``modelName``, ``hostname``, then label-type fields (``DCGM_FI_DRIVER_VERSION``)
and, in Kubernetes, ``container``/``namespace``/``pod``; families in no fixed order.

Semantics kept as the exporter defines them:

* ``DCGM_FI_DEV_XID_ERRORS`` is a gauge, "value of the last XID error encountered" (labels
  ``err_code``/``err_msg``): it is reported as ``xid_last``; the health fold turns a *change* into
  an event. It is not a count of new XIDs.
* The ECC counters (``DCGM_FI_DEV_ECC_*``) are commented out in the default counters: absent
  means unknown, never 0. The defaults do carry the row-remapping fields
  (``DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS``, ``..._CORRECTABLE_...``,
  ``DCGM_FI_DEV_ROW_REMAP_FAILURE``), which the rules use for memory errors.
* DCGM marks a field it could not read with a "blank" sentinel near 2**63 (the README's sample
  shows ``9223372036854775794``): such a value is no reading.
"""

from __future__ import annotations

import re

from schemas import DeviceTelemetry

from consumers.parsers.common import ParseError, prom_samples

_BLANK_MIN = 9223372036854775792.0  # DCGM_FT_INT64_BLANK and the other int64 sentinels above it
_MODEL = re.compile(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b")


def gpu_model(raw: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``; ``NVIDIA A100-SXM4-80GB`` -> ``A100``; else as given."""
    m = _MODEL.search(raw.replace("-", " "))
    return m.group(1) if m else raw


def parse_dcgm(text: str, node: str, ts: float) -> list[DeviceTelemetry]:
    gpus = prom_samples(text, ("DCGM_FI_",), "gpu")
    if not gpus:
        raise ParseError("no DCGM_FI_* samples with a 'gpu' label found")
    out = []
    for dev in sorted(gpus, key=lambda d: (len(d), d)):
        m = gpus[dev]

        def val(name: str) -> float | None:
            v = m.get("DCGM_FI_DEV_" + name)
            if v is None or v[1] >= _BLANK_MIN or v[1] != v[1]:
                return None
            return v[1]

        def label(name: str) -> str:
            for labels, _ in m.values():
                if labels.get(name):
                    return labels[name]
            return ""

        used, free = val("FB_USED"), val("FB_FREE")
        reserved = val("FB_RESERVED") or 0.0
        xid = val("XID_ERRORS")
        remap_fail = val("ROW_REMAP_FAILURE")
        pod = label("pod")
        out.append(DeviceTelemetry(
            node=node, device=dev, kind="gpu", source="dcgm", ts=ts,
            device_model=gpu_model(label("modelName")) or None,
            driver=label("DCGM_FI_DRIVER_VERSION") or None,
            firmware=label("DCGM_FI_DEV_VBIOS_VERSION") or None,
            temperature_c=val("GPU_TEMP"),
            power_w=val("POWER_USAGE"),
            utilization_pct=val("GPU_UTIL"),
            memory_used_mb=used,
            memory_total_mb=None if used is None or free is None else used + free + reserved,
            ecc_single_bit_total=val("ECC_SBE_VOL_TOTAL"),
            ecc_double_bit_total=val("ECC_DBE_VOL_TOTAL"),
            xid_last=None if xid is None else int(xid),
            remapped_rows_uncorrectable=val("UNCORRECTABLE_REMAPPED_ROWS"),
            remapped_rows_correctable=val("CORRECTABLE_REMAPPED_ROWS"),
            row_remap_failure=None if remap_fail is None else remap_fail > 0,
            bus_id=label("pci_bus_id") or None,
            pods=[pod] if pod else [],
        ))
    return out
