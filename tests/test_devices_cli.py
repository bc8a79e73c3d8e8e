"""``infernex sim-devices`` serves telemetry the real collectors read."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx

from consumers.device_collector import make_reader
from consumers.parsers import parse_npu_exporter
from infernex.embedded_nats import free_port

from proctools import INFERNEX
from proctools import stop_process as _stop


async def test_cli_sim_devices_serves_npu_exporter_text():
    port = free_port()
    proc = subprocess.Popen([INFERNEX, "sim-devices", "--node", "npu-a", "--devices", "4", "--port", str(port),
                             "--fault", "2:link_down@0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as c:
            while True:
                assert proc.poll() is None, _stop(proc)
                try:
                    r = await c.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "sim-devices never answered"
                    await asyncio.sleep(0.2)
        samples = {s.device: s for s in parse_npu_exporter(r.text, "npu-a", 0)}
        assert sorted(samples) == ["0", "1", "2", "3"]
        assert samples["2"].link_status == "DOWN" and samples["1"].link_status == "UP"
        # the collectors read the same endpoints
        via_collector = await make_reader("npu-exporter", "npu-a", f"http://127.0.0.1:{port}/metrics")()
        assert [s.link_status for s in via_collector] == ["UP", "UP", "DOWN", "UP"]
        smi = await make_reader("npu-smi", "npu-a", f"http://127.0.0.1:{port}/npu-smi")()
        assert [s.device for s in smi] == ["0", "1", "2", "3"] and smi[2].health == "Alarm"
    finally:
        _stop(proc)
