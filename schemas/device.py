"""Device telemetry samples from npu-smi, npu-exporter, DCGM or the simulator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Event

DeviceKind = Literal["npu", "gpu"]
NpuHealth = Literal["OK", "Warning", "Alarm", "Critical", "UNKNOWN"]
LinkStatus = Literal["UP", "DOWN"]
Source = Literal["npu-smi", "npu-exporter", "dcgm", "sim"]


class DeviceTelemetry(Event):
    """One reading of one accelerator. Counters are cumulative as the tools report them."""

    node: str = Field(min_length=1)
    device: str = Field(min_length=1, description="device id on the node, e.g. '0' or 'npu3'")
    kind: DeviceKind
    source: Source
    ts: float = Field(ge=0)
    device_model: str | None = Field(default=None, description="e.g. 'Ascend 910B4', 'H100'")
    driver: str | None = None
    firmware: str | None = None
    temperature_c: float | None = Field(default=None, ge=-50, le=250)
    power_w: float | None = Field(default=None, ge=0)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    memory_used_mb: float | None = Field(default=None, ge=0, description="HBM (NPU) or FB (GPU) used")
    memory_total_mb: float | None = Field(default=None, ge=0)
    ecc_single_bit_total: float | None = Field(default=None, ge=0)
    ecc_double_bit_total: float | None = Field(default=None, ge=0)
    health: NpuHealth | None = None
    link_status: LinkStatus | None = None
    error_codes: list[str] = Field(default_factory=list, description="Ascend error codes, hex as reported")
    xid_errors: list[int] = Field(default_factory=list, description="NVIDIA XIDs seen since the last sample")
    xid_last: int | None = Field(default=None, ge=0, description="dcgm-exporter DCGM_FI_DEV_XID_ERRORS: the last "
                                 "XID the GPU reported (a gauge: a change is an event, 0 = none since reset)")
    remapped_rows_uncorrectable: float | None = Field(default=None, ge=0, description="GPU rows remapped for "
                                                      "uncorrectable errors (DCGM, cumulative)")
    remapped_rows_correctable: float | None = Field(default=None, ge=0, description="GPU rows remapped for "
                                                    "correctable errors (DCGM, cumulative)")
    row_remap_failure: bool | None = Field(default=None, description="GPU row remapping failed (DCGM)")
    bus_id: str | None = Field(default=None, description="PCIe bus id, the same in every tool's output")
    pods: list[str] = Field(default_factory=list, description="pods using this device")
