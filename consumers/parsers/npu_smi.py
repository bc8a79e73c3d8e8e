"""``npu-smi info`` text -> DeviceTelemetry.

The table prints two rows per chip: ``NPU  Name | Health | Power(W) Temp(C)
Hugepages-Usage`` and ``Chip [Device] | Bus-Id | AICore(%) Memory-Usage(MB)
[HBM-Usage(MB)]`` (910B boards add the HBM column, 310P ones a Device column), then a
process table. Values may be ``NA``.

Device identity: npu-exporter names a chip by its physical id (``id``); npu-smi by NPU (card)
and chip. On A2 servers (910B: one chip per NPU) the NPU id is the device. On A3 (two chips per
NPU) the table's second header row reads ``Chip Phy-ID`` and each chip row carries its physical
id, which becomes the device; a table without it names the chip ``<npu>-<chip>`` unless
``chip_ids`` (PCIe bus id -> chip id, e.g. from :func:`chip_ids_from_exporter`) maps its Bus-Id,
the one identifier both tools print.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas import DeviceTelemetry

from consumers.parsers.common import ParseError

_HEALTH = {"OK", "Warning", "Alarm", "Critical"}
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")
_NUM = re.compile(r"^-?\d+(?:\.\d+)?$")
_VERSION = re.compile(r"npu-smi\s+(\S+)")


@dataclass
class NpuSmiRow:
    npu: str
    chip: str
    name: str
    health: str
    power_w: float | None
    temp_c: float | None
    bus_id: str
    aicore_pct: float | None
    memory: tuple[int, int] | None
    hbm: tuple[int, int] | None
    phy_id: str | None = None
    processes: list[tuple[int, str, int]] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _num(tok: str | None) -> float | None:
    if tok is None or tok.upper() == "NA" or not _NUM.match(tok):
        return None
    return float(tok)


def parse_npu_smi_rows(text: str) -> tuple[str | None, list[NpuSmiRow]]:
    """The chips of an ``npu-smi info`` table (and the tool version)."""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("|")]
    m = _VERSION.search(text)
    version = m.group(1) if m else None
    if not any("Health" in ln and "NPU" in ln for ln in lines):
        raise ParseError("not npu-smi info output: no 'NPU ... Health' header row")
    has_phy = any("Phy-ID" in ln for ln in lines[:8])  # A3: "| Chip    Phy-ID | Bus-Id | ..."
    rows: list[NpuSmiRow] = []
    by_npu: dict[str, NpuSmiRow] = {}
    i = 0
    in_proc = False
    while i < len(lines):
        cells = _cells(lines[i])
        first = cells[0].split()
        if "Process id" in lines[i]:
            in_proc = True
            i += 1
            continue
        if in_proc:
            if len(cells) >= 4 and len(first) >= 1 and first[0].isdigit() and cells[1].isdigit():
                r = by_npu.get(first[0])
                if r is not None:
                    mem = _num(cells[3].split()[0] if cells[3] else None)
                    r.processes.append((int(cells[1]), cells[2], int(mem or 0)))
            i += 1
            continue
        # first row of a chip: "| <npu id> <name> | <health word> | <power> <temp> ..."
        is_chip_row = len(cells) >= 3 and len(first) >= 2 and first[0].isdigit() and cells[1].isalpha()
        if is_chip_row and i + 1 < len(lines):
            nxt = _cells(lines[i + 1])
            if len(nxt) < 3:
                raise ParseError(f"npu-smi: chip row {i} has no second row")
            vals = cells[2].split()
            power, temp = (_num(vals[0]) if vals else None), (_num(vals[1]) if len(vals) > 1 else None)
            second = nxt[2]
            aicore = _num(second.split()[0]) if second.split() else None
            pairs = _PAIR.findall(second)
            memory = (int(pairs[0][0]), int(pairs[0][1])) if pairs else None
            hbm = (int(pairs[1][0]), int(pairs[1][1])) if len(pairs) > 1 else None
            chip_cells = nxt[0].split()
            phy = chip_cells[1] if has_phy and len(chip_cells) > 1 and chip_cells[1].isdigit() else None
            row = NpuSmiRow(npu=first[0], chip=chip_cells[0] if chip_cells else "0", name=" ".join(first[1:]),
                            health=cells[1], power_w=power, temp_c=temp, bus_id=nxt[1], aicore_pct=aicore,
                            memory=memory, hbm=hbm, phy_id=phy)
            rows.append(row)
            by_npu[row.npu] = row
            i += 2
            continue
        i += 1
    if not rows:
        raise ParseError("npu-smi info output holds no chip rows")
    return version, rows


def chip_ids_from_exporter(text: str) -> dict[str, str]:
    """PCIe bus id -> chip id (``id``) from an npu-exporter scrape."""
    from consumers.parsers.npu_exporter import parse_npu_exporter

    return {t.bus_id.upper(): t.device for t in parse_npu_exporter(text, "-", 0.0) if t.bus_id}


def device_id(r: NpuSmiRow, chips_per_npu: int, chip_ids: dict[str, str] | None = None) -> str:
    """The device name of a chip row, as npu-exporter names it where that can be known."""
    if r.phy_id is not None:
        return r.phy_id
    if chip_ids:
        hit = chip_ids.get(r.bus_id.upper())
        if hit is not None:
            return hit
    if chips_per_npu == 1 and r.chip == "0":
        return r.npu
    return f"{r.npu}-{r.chip}"


def parse_npu_smi(text: str, node: str, ts: float, chip_ids: dict[str, str] | None = None) -> list[DeviceTelemetry]:
    version, rows = parse_npu_smi_rows(text)
    per_npu: dict[str, int] = {}
    for r in rows:
        per_npu[r.npu] = per_npu.get(r.npu, 0) + 1
    out = []
    for r in rows:
        used_total = r.hbm if r.hbm is not None and r.hbm[1] > 0 else r.memory
        device = device_id(r, per_npu[r.npu], chip_ids)
        out.append(DeviceTelemetry(
            node=node, device=device, kind="npu", source="npu-smi", ts=ts,
            device_model=(r.name if r.name.startswith("Ascend") else f"Ascend {r.name}") if r.name else None,
            driver=version,
            temperature_c=r.temp_c,
            power_w=r.power_w,
            utilization_pct=r.aicore_pct,
            memory_used_mb=float(used_total[0]) if used_total else None,
            memory_total_mb=float(used_total[1]) if used_total else None,
            health=r.health if r.health in _HEALTH else "UNKNOWN",
            bus_id=r.bus_id or None,
        ))
    return out
