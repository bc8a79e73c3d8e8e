"""Adapters from the text formats real tools produce to :class:`schemas.DeviceTelemetry`.

Pure functions of text (no I/O): :func:`parse_npu_smi` (``npu-smi info`` tables),
:func:`parse_npu_exporter` (MindCluster npu-exporter ``/metrics``), :func:`parse_dcgm`
(dcgm-exporter ``/metrics``). Each raises :class:`ParseError` with a clear message when
the text is not in its format.
"""

from consumers.parsers.common import ParseError
from consumers.parsers.dcgm import parse_dcgm
from consumers.parsers.npu_exporter import parse_npu_exporter
from consumers.parsers.npu_smi import NpuSmiRow, parse_npu_smi, parse_npu_smi_rows

PARSERS = {"npu-smi": parse_npu_smi, "npu-exporter": parse_npu_exporter, "dcgm": parse_dcgm}

__all__ = ["PARSERS", "NpuSmiRow", "ParseError", "parse_dcgm", "parse_npu_exporter", "parse_npu_smi",
           "parse_npu_smi_rows"]
