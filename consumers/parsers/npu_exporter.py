"""MindCluster npu-exporter ``/metrics`` -> DeviceTelemetry (one per chip ``id``).

What the exporter emits (``component/npu-exporter`` of Ascend/mind-cluster; sample in
``tests/fixtures/devices/``): one family per metric, every sample with the card labels
``id`` (the chip's physical id), ``model_name`` (``<name>-<type>-<version>``, e.g.
``910B4-Ascend-V1``), ``vdie_id``, ``pcie_bus_info``, ``namespace``, ``pod_name``,
``container_name``; ``npu_chip_info_name`` carries the model in ``name`` instead of
``model_name``. Families come in any order (the Go client sorts them by name; other builds and
our simulator do not), so nothing here depends on which family comes first. Memory: HBM
(``npu_chip_info_hbm_*_memory``) on 910 chips; DDR (``npu_chip_info_total_memory`` /
``used_memory``) on 310P, which has no HBM. Health: 1 healthy, 0 unhealthy, -1 query failed.
A chip shared by several pods shows ``not_displayed_for_multi_pod`` in its pod labels.
"""

from __future__ import annotations

from schemas import DeviceTelemetry

from consumers.parsers.common import ParseError, prom_samples

_HEALTH = {1: "OK", 0: "Alarm", -1: "UNKNOWN"}
_MULTI_POD = "not_displayed_for_multi_pod"  # the pod labels of a chip shared by several pods


def model_name(raw: str) -> str:
    """The exporter's chip name as the rules name models: ``910B4-Ascend-V1`` and ``Ascend910B4``
    -> ``Ascend 910B4``; ``310P3-Ascend-V1`` -> ``Ascend 310P3``."""
    raw = raw.strip()
    parts = raw.split("-")
    if len(parts) >= 2 and parts[1] == "Ascend" and parts[0]:
        return "Ascend " + parts[0]
    if raw.startswith("Ascend") and not raw.startswith("Ascend "):
        return "Ascend " + raw[len("Ascend"):]
    return raw


def _label(m: dict, name: str) -> str:
    """A card label's value from whichever family carries it non-empty."""
    for labels, _ in m.values():
        v = labels.get(name)
        if v:
            return v
    return ""


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

        codes = []
        for name in sorted(k for k in m if k.startswith("npu_chip_info_error_code")):
            code = int(m[name][1])
            if code:
                codes.append(f"0x{code:08X}")
        health = val("health_status")
        link = val("link_status")
        pod = _label(m, "pod_name")
        raw_model = _label(m, "model_name")
        if not raw_model:
            name_fam = m.get("npu_chip_info_name")
            raw_model = name_fam[0].get("name", "") if name_fam else ""
        used, total = val("hbm_used_memory"), val("hbm_total_memory")
        if not total:  # no HBM (310P) or not reported: the DDR series
            ddr_used, ddr_total = val("used_memory"), val("total_memory")
            if ddr_total:
                used, total = ddr_used, ddr_total
        if not total:
            used = total = None
        out.append(DeviceTelemetry(
            node=node, device=dev, kind="npu", source="npu-exporter", ts=ts,
            device_model=model_name(raw_model) or None,
            temperature_c=val("temperature"),
            power_w=val("power"),
            utilization_pct=val("utilization"),
            memory_used_mb=used,
            memory_total_mb=total,
            ecc_single_bit_total=val("hbm_ecc_single_bit_error_cnt"),
            ecc_double_bit_total=val("hbm_ecc_double_bit_error_cnt"),
            health=None if health is None else _HEALTH.get(int(health), "UNKNOWN"),
            link_status=None if link is None else ("UP" if int(link) == 1 else "DOWN"),
            error_codes=codes,
            bus_id=_label(m, "pcie_bus_info") or None,
            pods=[pod] if pod and pod != _MULTI_POD else [],
        ))
    return out
