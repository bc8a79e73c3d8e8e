"""Device telemetry from npu-smi, npu-exporter, dcgm-exporter or the simulator ->
:class:`schemas.DeviceTelemetry` on ``device.telemetry.<node>.<device>``.

Sources: ``npu-smi`` runs the command (or reads a file or URL holding its output);
``npu-exporter`` and ``dcgm`` scrape a ``/metrics`` URL (or read a file); ``sim`` samples
:class:`simulator.devices.SimulatedNode` directly. Parsing lives in
:mod:`consumers.parsers`. A source that fails is reported (log, counter, status) and
read again next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge

from consumers import bus
from consumers.parsers import PARSERS, ParseError
from schemas import DeviceTelemetry
from schemas import subjects as S

log = logging.getLogger(__name__)


class SourceError(RuntimeError):
    pass


async def read_text(location: str, *, timeout_s: float = 5.0, command: list[str] | None = None) -> str:
    """Text from an http(s) URL, a file path, or (``command``) a program's stdout."""
    if command is not None:
        try:
            proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
        except FileNotFoundError:
            raise SourceError(f"command {command[0]!r} not found") from None
        try:
            out, errb = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            raise SourceError(f"{' '.join(command)} timed out after {timeout_s}s") from None
        if proc.returncode != 0:
            raise SourceError(f"{' '.join(command)} exited {proc.returncode}: {errb.decode(errors='replace')[:200]}")
        return out.decode(errors="replace")
    if location.startswith(("http://", "https://")):
        try:
            async with httpx.AsyncClient() as client:
                resp = await client.get(location, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise SourceError(f"{location} unreachable: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise SourceError(f"{location} answered HTTP {resp.status_code}")
        return resp.text
    path = Path(location)
    if not path.is_file():
        raise SourceError(f"{location} is neither a URL nor a readable file")
    return path.read_text()


Reader = Callable[[], Awaitable[list[DeviceTelemetry]]]


def make_reader(source: str, node: str, location: str | None = None, *, timeout_s: float = 5.0,
                sim_node=None, clock=time.time, chip_ids_from: str | None = None) -> Reader:
    """A coroutine factory giving one round of samples from ``source``.

    ``chip_ids_from`` (npu-smi only): the node's npu-exporter ``/metrics`` (URL or file); its chip
    ids name npu-smi's chips (joined by PCIe bus id), so both sources report one device under one
    name on A3 servers whose npu-smi prints no Phy-ID column."""
    if source == "sim":
        if sim_node is None:
            raise ValueError("source 'sim' needs a simulated node")

        async def read_sim() -> list[DeviceTelemetry]:
            return sim_node.sample(clock())

        return read_sim
    if source not in PARSERS:
        raise ValueError(f"unknown source {source!r}; use npu-smi, npu-exporter, dcgm or sim")
    parse = PARSERS[source]
    if source != "npu-smi" and not location:
        raise ValueError(f"source {source} needs --url (the exporter's /metrics) or a file")
    command = ["npu-smi", "info"] if source == "npu-smi" and not location else None

    async def read() -> list[DeviceTelemetry]:
        text = await read_text(location or "", timeout_s=timeout_s, command=command)
        if chip_ids_from and source == "npu-smi":
            from consumers.parsers.npu_smi import chip_ids_from_exporter

            ids = chip_ids_from_exporter(await read_text(chip_ids_from, timeout_s=timeout_s))
            return parse(text, node, clock(), chip_ids=ids)
        return parse(text, node, clock())

    return read


class DeviceCollector:
    def __init__(self, reader: Reader, js: JetStreamContext, *, node: str, source: str,
                 subject_prefix: str | None = None, registry: CollectorRegistry | None = None):
        self.reader = reader
        self.js = js
        self.node = node
        self.source = source
        self.prefix = subject_prefix
        self.last_error: str | None = None
        self.errors = Counter("infernex_device_collect_errors_total", "failed device reads", ["node", "source"],
                              registry=registry)
        self.up = Gauge("infernex_device_source_up", "1 if the last read of the source worked",
                        ["node", "source"], registry=registry)
        self.samples = Counter("infernex_device_samples_total", "device samples published", ["node"],
                               registry=registry)

    async def collect_once(self) -> list[DeviceTelemetry]:
        try:
            samples = await self.reader()
        except (SourceError, ParseError, ValueError) as exc:
            self.last_error = str(exc)
            self.errors.labels(self.node, self.source).inc()
            self.up.labels(self.node, self.source).set(0)
            log.warning("device source %s on %s failed: %s", self.source, self.node, exc)
            return []
        self.last_error = None
        self.up.labels(self.node, self.source).set(1)
        for s in samples:
            subject = S.with_prefix(self.prefix, S.device_telemetry(s.node, s.device))
            await bus.publish(self.js, subject, s.to_json(), msg_id=f"{s.node}:{s.device}:{s.source}:{s.ts:.6f}")
            self.samples.labels(self.node).inc()
        return samples

    async def run(self, stop: asyncio.Event, interval_s: float = 5.0) -> None:
        await bus.run_periodically(self.collect_once, stop, interval_s)
