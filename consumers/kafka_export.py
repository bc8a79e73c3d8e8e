"""Mirror chosen JetStream subjects to Kafka topics (at-least-once).

One durable JetStream consumer per stream the subjects fall in; each pulled batch is
sent to Kafka and flushed, and only then are the NATS messages acked. A crash or restart
therefore resumes from the durable consumer's position: nothing is skipped, and the
messages of the batch in flight at the crash may be delivered to Kafka a second time
(at least once, never at most once). Consumers that need exactly-once dedupe on the
``nats-msg-id`` / ``nats-stream-seq`` headers.

Record key: the pod (KV events, engine metrics), ``node/device`` (telemetry, diagnoses),
or the pool (router records, hints). Value: the original bytes (``raw``) or a JSON
envelope with subject, stream sequence, time and the decoded payload (``envelope``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge

from consumers import bus
from schemas import kv_binary
from schemas import subjects as S
from schemas.config import NatsConfig
from streams.topology import build_topology, stream_for_subject

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KafkaExportConfig:
    bootstrap: str
    subjects: tuple[str, ...]
    durable: str = "kafka-export"
    topic_prefix: str = "infernex"
    value_format: str = "raw"  # raw | envelope
    batch: int = 500
    client_id: str = "infernex-export"
    extra_producer_args: dict = field(default_factory=dict, repr=False)  # may hold credentials
    security: "KafkaSecurity | None" = None


@dataclass(frozen=True)
class KafkaSecurity:
    """TLS and SASL towards the brokers (aiokafka's ``security_protocol``, ``sasl_*``, ``ssl_context``).

    The password is never printed: ``repr`` hides it; pass it through the environment."""

    protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str | None = None  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    check_hostname: bool = True

    def __post_init__(self) -> None:
        protocols = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
        if self.protocol not in protocols:
            raise ValueError(f"security protocol must be one of {', '.join(protocols)}, not {self.protocol!r}")
        if self.protocol.startswith("SASL"):
            mechanisms = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
            if self.sasl_mechanism not in mechanisms:
                raise ValueError(f"{self.protocol} needs a SASL mechanism: {', '.join(mechanisms)}")
            if not self.username or self.password is None:
                raise ValueError(f"{self.protocol} needs a username and a password")

    def producer_args(self) -> dict:
        args: dict = {"security_protocol": self.protocol}
        if self.protocol.startswith("SASL"):
            args.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.username,
                        sasl_plain_password=self.password)
        if self.protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            ctx = create_ssl_context(cafile=self.cafile, certfile=self.certfile, keyfile=self.keyfile)
            ctx.check_hostname = self.check_hostname
            args["ssl_context"] = ctx
        return args


def topic_for(subject: str, prefix: str) -> str:
    """``kv.events.m.p`` -> ``infernex.kv.events``: one topic per kind of subject."""
    kind = S.parse(subject)["kind"]
    return f"{prefix}.{kind}" if prefix else kind


def key_for(subject: str) -> bytes | None:
    parts = S.parse(subject)
    if "pod" in parts:
        return parts["pod"].encode()
    if "device" in parts:
        return f"{parts['node']}/{parts['device']}".encode()
    if "pool" in parts:
        return parts["pool"].encode()
    if "stream" in parts:
        return parts["stream"].encode()
    return None


class KafkaExporter:
    def __init__(self, cfg: KafkaExportConfig, nats: NatsConfig, *, registry: CollectorRegistry | None = None,
                 health=None):
        if cfg.value_format not in ("raw", "envelope"):
            raise ValueError("value_format must be raw or envelope")
        self.cfg = cfg
        self.nats = nats
        self.prefix = nats.subject_prefix
        self.exported = Counter("infernex_kafka_exported_total", "Messages mirrored to Kafka", ["topic"],
                                registry=registry)
        self.lag = Gauge("infernex_kafka_export_pending", "Messages pulled but not yet acked", registry=registry)
        self._stop = asyncio.Event()
        self.count = 0
        self.health = health  # a consumers.health.Health: NATS, consumer lag, Kafka producer
        self._producer_ok = False

    def _strip(self, subject: str) -> str:
        return subject[len(self.prefix) + 1:] if self.prefix else subject

    def _record(self, msg: Msg) -> tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]:
        subject = self._strip(msg.subject)
        meta = msg.metadata
        headers = [(k, v.encode()) for k, v in (msg.headers or {}).items() if isinstance(v, str)]
        headers += [("nats-subject", subject.encode()), ("nats-stream", meta.stream.encode()),
                    ("nats-stream-seq", str(meta.sequence.stream).encode())]
        if msg.headers and "Nats-Msg-Id" in msg.headers:
            headers.append(("nats-msg-id", msg.headers["Nats-Msg-Id"].encode()))
        if self.cfg.value_format == "raw":
            value = msg.data
        else:
            try:
                if kv_binary.is_binary(msg.data):  # a binary KV batch is exported as its JSON document
                    docs = kv_binary.to_docs(msg.data)  # (a group of batches: the list of them)
                    payload = docs if kv_binary.is_group(msg.data) else docs[0]
                else:
                    payload = json.loads(msg.data)
            except ValueError:
                payload = msg.data.decode(errors="replace")
            value = json.dumps({"subject": subject, "stream_seq": meta.sequence.stream,
                                "time": meta.timestamp.isoformat() if meta.timestamp else None,
                                "payload": payload}).encode()
        return topic_for(subject, self.cfg.topic_prefix), key_for(subject), value, headers

    async def run(self) -> None:
        topo = build_topology(prefix=self.prefix)
        groups: dict[str, list[str]] = {}
        for subj in self.cfg.subjects:
            full = S.with_prefix(self.prefix, subj)
            spec = stream_for_subject(topo, full.replace(">", "x").replace("*", "x"))
            if spec is None:
                raise ValueError(f"no stream holds {subj!r}")
            groups.setdefault(spec.name, []).append(full)
        nc = await bus.connect(self.nats, name="infernex-kafka-export")
        security = self.cfg.security.producer_args() if self.cfg.security else {}
        producer = AIOKafkaProducer(bootstrap_servers=self.cfg.bootstrap, client_id=self.cfg.client_id,
                                    acks="all", enable_idempotence=False, linger_ms=5,
                                    **security, **self.cfg.extra_producer_args)
        await producer.start()
        self._producer_ok = True
        js = nc.jetstream()
        if self.health is not None:
            from consumers.health import Check, lag_check, nats_check

            self.health.add("nats", nats_check(nc)).add("consumer_lag", lag_check(js, self.cfg.durable))
            self.health.add("kafka", lambda: Check(self._producer_ok, {"bootstrap": self.cfg.bootstrap}))

        async def handle(msgs: list[Msg]) -> None:
            self.lag.set(len(msgs))
            futures = []
            for m in msgs:
                topic, key, value, headers = self._record(m)
                futures.append((topic, await producer.send(topic, value=value, key=key, headers=headers)))
            for topic, fut in futures:
                try:
                    await fut  # raises if Kafka rejected: nothing acked, JetStream redelivers
                except Exception:
                    self._producer_ok = False
                    raise
                self._producer_ok = True
                self.exported.labels(topic).inc()
            for m in msgs:
                await m.ack()
            self.count += len(msgs)
            self.lag.set(0)

        try:
            tasks = []
            for stream, subjects in groups.items():
                for i, subj in enumerate(subjects):
                    durable = f"{self.cfg.durable}-{stream.lower()}-{i}".replace(".", "_")
                    tasks.append(asyncio.create_task(bus.run_durable(
                        js, stream=stream, durable=durable, filter_subject=subj, handle=handle,
                        stop=self._stop, batch=self.cfg.batch)))
            await asyncio.gather(*tasks)
        finally:
            await producer.stop()
            await nc.close()

    def stop(self) -> None:
        self._stop.set()
