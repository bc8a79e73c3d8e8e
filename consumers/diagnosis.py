"""``infernex diagnose``: durable consumer of ``device.telemetry.>`` that publishes findings.

Decodes each telemetry sample, feeds :class:`streams.diagnosis.DiagnosisEngine`, publishes the
resulting :class:`schemas.Diagnosis` messages to ``diagnosis.<node>.<device>`` with
``Nats-Msg-Id = finding id + revision`` (a redelivered sample never stores a finding twice), then acks.
Malformed telemetry goes to ``dlq.device-telemetry`` with the reason; the consumer keeps going.
Optionally reads ``engine.metrics.>`` so the stuck-device rule knows how many requests wait.
At start it reads back the findings published in the last ``adopt_window_s`` and adopts the open ones,
so a restart neither forgets nor duplicates them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone

from nats.errors import ConnectionClosedError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError
from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from consumers import bus
from schemas import DeviceTelemetry, Diagnosis, EngineMetrics, ValidationFailure
from schemas import subjects as S
from schemas.config import NatsConfig
from streams.clock import Clock, SystemClock
from streams.diagnosis import DiagnosisEngine, RuleSet, load_ruleset, msg_id
from streams.diagnosis.rules import DiagnosisConfig
from streams.health import FutureSample
from streams.topology import StreamSpec, build_topology, stream_for_subject

log = logging.getLogger(__name__)


class DiagnosisMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        self.open_findings = Gauge("infernex_diagnosis_open_findings", "Open findings by severity", ["severity"],
                                   registry=registry)
        self.published = Counter("infernex_diagnosis_findings_published_total",
                                 "Finding messages published, by fault mode and status", ["fault_mode", "status"],
                                 registry=registry)
        self.telemetry = Counter("infernex_diagnosis_telemetry_total", "Telemetry samples consumed", ["result"],
                                 registry=registry)
        self.latency = Histogram("infernex_diagnosis_latency_seconds",
                                 "Telemetry sample time to finding published",
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                 registry=registry)
        self.processing = Histogram("infernex_diagnosis_processing_seconds",
                                    "Telemetry stored in JetStream to finding published (this service's share)",
                                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                    registry=registry)
        self.devices = Gauge("infernex_diagnosis_devices", "Devices by health status", ["status"], registry=registry)
        self.publish_failures = Counter("infernex_diagnosis_publish_failures_total",
                                        "Finding publishes that failed and were queued for retry", registry=registry)


class DiagnosisService:
    """Embeddable service: ``await start()`` ... ``await stop()``."""

    def __init__(self, nats: NatsConfig, config: DiagnosisConfig | None = None, *,
                 rules: RuleSet | None = None, registry: CollectorRegistry | None = None,
                 clock: Clock | None = None, topology: tuple[StreamSpec, ...] | None = None):
        self.nats_cfg = nats
        self.cfg = config or DiagnosisConfig()
        self.prefix = nats.subject_prefix
        self.rules = rules or load_ruleset(self.cfg.rules_files)
        self.clock = clock or SystemClock()
        self.engine = DiagnosisEngine(self.rules, self.clock, warning_score=self.cfg.warning_score)
        self.registry = registry
        self.metrics = DiagnosisMetrics(registry)
        self.topology = topology or build_topology(prefix=self.prefix)
        self._telemetry_subject = S.with_prefix(self.prefix, S.ALL_DEVICE_TELEMETRY)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._unpublished: list[tuple[Diagnosis, float]] = []
        self.nc = None
        self.js = None
        self.dlq: bus.DeadLetters | None = None
        self.published: int = 0

    def _stream(self, subject: str) -> str:
        spec = stream_for_subject(self.topology, subject)
        if spec is None:
            raise RuntimeError(f"no stream covers {subject}; run `infernex streams apply`")
        return spec.name

    def _strip(self, subject: str) -> str:
        return subject[len(self.prefix) + 1:] if self.prefix and subject.startswith(self.prefix + ".") else subject

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await bus.connect(self.nats_cfg, name=f"{self.nats_cfg.name}-diagnose")
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.js = self.nc.jetstream()
        needed = [S.ALL_DEVICE_TELEMETRY, S.ALL_DIAGNOSIS, S.ALL_DLQ]
        if self.cfg.watch_engine_metrics:
            needed.append(S.ALL_ENGINE_METRICS)
        for subj in needed:
            stream = self._stream(S.with_prefix(self.prefix, subj))
            try:
                await bus.while_unanswered(lambda stream=stream: self.js.stream_info(stream), f"stream info {stream}")
            except NotFoundError:
                raise RuntimeError(f"JetStream stream {stream} does not exist; run `infernex streams apply` "
                                   f"(or `infernex up`) first") from None
        self.dlq = bus.DeadLetters(self.js, consumer=self.cfg.durable, registry=self.registry, prefix=self.prefix)
        if self.cfg.adopt_window_s > 0:
            await self._adopt()
        self._refresh_gauges()
        tele_stream = self._stream(self._telemetry_subject)
        policy = DeliverPolicy.NEW if self.cfg.start == "new" else DeliverPolicy.ALL
        sub = await self._bind(tele_stream, self.cfg.durable, self._telemetry_subject, policy)
        self._tasks.append(asyncio.create_task(self._consume(sub, self._on_telemetry, self.cfg.fetch_timeout_s),
                                               name="diagnosis-telemetry"))
        if self.cfg.watch_engine_metrics:
            subj = S.with_prefix(self.prefix, S.ALL_ENGINE_METRICS)
            sub = await self._bind(self._stream(subj), f"{self.cfg.durable}-load", subj, DeliverPolicy.NEW)
            self._tasks.append(asyncio.create_task(self._consume(sub, self._on_metrics, 0.5), name="diagnosis-load"))
        self._tasks.append(asyncio.create_task(self._ticker(), name="diagnosis-tick"))

    async def _bind(self, stream: str, durable: str, subject: str, policy: DeliverPolicy):
        """Create the durable on first start (with ``policy``), then bind to it as it is.

        (``bus.run_durable`` would create it with DeliverPolicy.ALL; hence this small variant.
        ``bus.ensure_durable`` leaves an existing durable as it is.)
        """
        await bus.ensure_durable(self.js, stream, durable, subject, deliver_policy=policy)
        return await self.js.pull_subscribe_bind(durable=durable, stream=stream)

    async def _consume(self, sub, handle, fetch_timeout: float) -> None:
        """Pull until stopped; ``handle`` acks each message after applying it.

        Adaptive: while messages flow, pull batches of ``cfg.batch`` waiting at most ``fetch_timeout``
        for a batch to fill (bounded latency); once idle, park on a pull of one message with a long
        wait, which returns as soon as anything arrives (no polling while idle).
        """
        busy = True
        try:
            while not self._stop.is_set():
                try:
                    if busy:
                        msgs = await sub.fetch(self.cfg.batch, timeout=fetch_timeout)
                    else:
                        msgs = await sub.fetch(1, timeout=1.0)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    busy = False
                    continue
                except ConnectionClosedError:
                    break
                busy = True
                if msgs:
                    await handle(msgs)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            try:
                await asyncio.wait_for(t, timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                t.cancel()
            except Exception:  # noqa: BLE001 - a crashed task was already logged; keep stopping
                log.exception("diagnosis task %s failed", t.get_name())
        self._tasks.clear()
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    async def wait(self) -> None:
        """Until stopped or a task fails (the failure is raised)."""
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()

    # -- handlers ---------------------------------------------------------------------------------
    async def _on_telemetry(self, msgs) -> None:
        for msg in msgs:
            subject = self._strip(msg.subject)
            try:
                t = DeviceTelemetry.from_json(msg.data)
                parts = S.parse(subject)
                if (parts.get("node"), parts.get("device")) != (t.node, t.device):
                    raise ValueError(f"payload is for {t.node}/{t.device} but arrived on {subject}")
            except (ValidationFailure, ValueError) as exc:
                self.metrics.telemetry.labels("invalid").inc()
                await self.dlq.send(S.DEVICE_TELEMETRY, msg.subject, msg.data, str(exc),
                                    headers=dict(msg.headers or {}), stream_seq=bus.stream_seq_of(msg))
                await msg.ack()
                continue
            try:
                diags = self.engine.observe(t)
            except FutureSample as exc:
                self.metrics.telemetry.labels("future").inc()
                await self.dlq.send(S.DEVICE_TELEMETRY, msg.subject, msg.data, str(exc),
                                    headers=dict(msg.headers or {}), reason_class="clock",
                                    stream_seq=bus.stream_seq_of(msg))
                await msg.ack()
                continue
            self.metrics.telemetry.labels("ok").inc()
            for d in diags:
                await self._publish(d, t.ts)
            if diags:
                try:
                    stored = msg.metadata.timestamp.timestamp()
                    self.metrics.processing.observe(max(0.0, time.time() - stored))
                except (AttributeError, ValueError):  # not a JetStream message
                    pass
            await msg.ack()
        self._refresh_open_gauge()

    async def _on_metrics(self, msgs) -> None:
        for msg in msgs:
            try:
                self.engine.apply_load(EngineMetrics.from_json(msg.data))
            except ValidationFailure:
                pass  # the engine-metrics consumers dead-letter these; here they are only a hint
            await msg.ack()

    async def _publish(self, d: Diagnosis, sample_ts: float | None) -> None:
        subject = S.with_prefix(self.prefix, S.diagnosis(d.node, d.device))
        try:
            await bus.publish(self.js, subject, d.to_json(), msg_id=msg_id(d), retries=2)
        except Exception as exc:  # noqa: BLE001 - kept and retried on the next tick, never dropped silently
            self.metrics.publish_failures.inc()
            log.warning("publishing %s failed (%s); will retry", msg_id(d), exc)
            self._unpublished.append((d, sample_ts or time.time()))
            return
        self.published += 1
        self.metrics.published.labels(d.fault_mode, d.status).inc()
        if sample_ts is not None:
            self.metrics.latency.observe(max(0.0, time.time() - sample_ts))

    async def _ticker(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.cfg.tick_s)
                break
            except asyncio.TimeoutError:
                pass
            if self._unpublished:
                pending, self._unpublished = self._unpublished, []
                for d, ts in pending:
                    await self._publish(d, None)
            for d in self.engine.tick():
                await self._publish(d, None)
            self._refresh_open_gauge()
            n += 1
            if n % 5 == 0:
                self._refresh_gauges()

    # -- start-up ---------------------------------------------------------------------------------
    async def _adopt(self) -> None:
        subj = S.with_prefix(self.prefix, S.ALL_DIAGNOSIS)
        stream = self._stream(subj)
        info = await self.js.stream_info(stream)
        if info.state.messages == 0:
            return
        start = datetime.fromtimestamp(time.time() - self.cfg.adopt_window_s, tz=timezone.utc)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                             opt_start_time=start.isoformat().replace("+00:00", "Z"))
        sub = await self.js.subscribe(subj, ordered_consumer=True, stream=stream, config=cfg)
        latest: dict[str, Diagnosis] = {}
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=2.0)
                except (NatsTimeoutError, asyncio.TimeoutError):
                    break
                try:
                    d = Diagnosis.from_json(msg.data)
                except ValidationFailure:
                    continue
                prev = latest.get(d.finding_id)
                if prev is None or d.revision >= prev.revision:
                    latest[d.finding_id] = d
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        n = 0
        for d in latest.values():
            if d.status != "resolved":
                self.engine.adopt(d)
                n += 1
        if n:
            log.info("adopted %d open finding(s) from %s", n, stream)

    # -- gauges -----------------------------------------------------------------------------------
    def _refresh_open_gauge(self) -> None:
        for sev, n in self.engine.counts_by_severity().items():
            self.metrics.open_findings.labels(sev).set(n)

    def _refresh_gauges(self) -> None:
        counts = {"ok": 0, "warning": 0, "critical": 0, "unknown": 0}
        hs = self.engine.health
        for node, device in list(hs.devices):
            status = hs.device_status(node, device)
            if status is not None:
                counts[status] = counts.get(status, 0) + 1
        for status, n in counts.items():
            self.metrics.devices.labels(status).set(n)
        self._refresh_open_gauge()
