"""Builders for device telemetry used by the health/diagnosis tests (no tests here)."""

from __future__ import annotations

from schemas import DeviceTelemetry

NPU = dict(kind="npu", source="npu-exporter", device_model="Ascend 910B4", driver="24.1.rc3", firmware="7.5.0.1")
GPU = dict(kind="gpu", source="dcgm", device_model="H100 80GB HBM3", driver="550.54.15", firmware="96.00.99")


def sample(ts: float, node: str = "n1", device: str = "0", base: dict | None = None, **kw) -> DeviceTelemetry:
    """A healthy reading at ``ts``; keyword arguments override fields."""
    fields = dict(base or NPU)
    fields.update(node=node, device=device, ts=ts, temperature_c=55.0, power_w=250.0, utilization_pct=60.0,
                  memory_used_mb=52000.0, memory_total_mb=65536.0, ecc_single_bit_total=3.0,
                  ecc_double_bit_total=0.0, health="OK" if fields["kind"] == "npu" else None,
                  link_status="UP", pods=[f"pod-{node}-{device}"])
    fields.update(kw)
    return DeviceTelemetry(**fields)
