"""The one place that talks to NATS: connect, apply topology, publish, dead-letter, consume."""

from __future__ import annotations

import asyncio
import weakref
import base64
import hashlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError
from prometheus_client import CollectorRegistry, Counter

from schemas import DeadLetter
from schemas.deadletter import MAX_DEAD_LETTER_PAYLOAD, MAX_DEAD_LETTER_REASON
from schemas import subjects as S
from schemas.config import NatsConfig
from streams.topology import StreamSpec

log = logging.getLogger(__name__)

NANOS = 1_000_000_000


async def connect(cfg: NatsConfig, *, name: str | None = None, no_echo: bool = False) -> NatsClient:
    """Connect with the configured auth; raise a clear error if no server answers. ``no_echo``:
    the server does not deliver this connection's own messages to its own subscriptions."""
    opts: dict = {
        "servers": cfg.servers,
        "name": name or cfg.name,
        "no_echo": no_echo,
        "connect_timeout": cfg.connect_timeout_s,
        "max_reconnect_attempts": cfg.max_reconnect_attempts,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
    }
    if cfg.token is not None:
        opts["token"] = cfg.token.get_secret_value()
    if cfg.user is not None:
        opts["user"] = cfg.user
        opts["password"] = cfg.password.get_secret_value() if cfg.password else ""
    if cfg.credentials_file is not None:
        opts["user_credentials"] = str(cfg.credentials_file)
    if cfg.tls is not None:
        ctx = ssl.create_default_context(cafile=str(cfg.tls.ca_file) if cfg.tls.ca_file else None,
                                         cadata=cfg.tls.ca_pem or None)
        if cfg.tls.cert_file:
            ctx.load_cert_chain(str(cfg.tls.cert_file), str(cfg.tls.key_file) if cfg.tls.key_file else None)
        if not cfg.tls.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        opts["tls"] = ctx
        if cfg.tls.server_name:
            opts["tls_hostname"] = cfg.tls.server_name

    first: list[Exception] = []  # errors before the first connection: the reason if it never comes

    async def _err(e: Exception) -> None:
        if connected:
            log.warning("nats: %s", e)
        else:
            first.append(e)
            log.debug("nats (connecting): %s", e)

    connected = False
    opts["error_cb"] = _err
    try:
        # nats-py keeps retrying the first connect when reconnects are allowed; bound it.
        nc = await asyncio.wait_for(nats.connect(**opts), timeout=cfg.connect_timeout_s * 2)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        from schemas.redact import redact, redact_url

        reason = str(exc) or (str(first[-1]) if first else "") or type(exc).__name__
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) and first:
            reason = f"{first[-1]} (gave up after {cfg.connect_timeout_s * 2:g} s)"
        where = ", ".join(redact_url(s) for s in cfg.servers)
        raise ConnectionError(redact(f"cannot connect to NATS at {where}: {reason}")) from None
    connected = True
    return nc


def to_stream_config(spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE if spec.storage == "file" else StorageType.MEMORY,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        num_replicas=spec.replicas,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.OLD if spec.discard == "old" else DiscardPolicy.NEW,
    )


@dataclass
class ApplyResult:
    stream: str
    action: str  # created | updated | unchanged


def _differs(have: StreamConfig, want: StreamConfig) -> bool:
    fields = ("subjects", "max_age", "max_bytes", "max_msgs", "num_replicas", "duplicate_window", "description")
    for f in fields:
        a, b = getattr(have, f), getattr(want, f)
        if f == "subjects":
            a, b = sorted(a or []), sorted(b or [])
        if isinstance(a, float) or isinstance(b, float):
            if abs(float(a or 0) - float(b or 0)) > 1e-6:
                return True
        elif a != b:
            return True
    return False


async def apply_topology(js: JetStreamContext, specs: tuple[StreamSpec, ...]) -> list[ApplyResult]:
    """Create missing streams and update changed ones; running it twice changes nothing."""
    results = []
    for spec in specs:
        want = to_stream_config(spec)
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            await js.add_stream(want)
            results.append(ApplyResult(spec.name, "created"))
            continue
        if info.config.storage != want.storage:
            raise RuntimeError(
                f"stream {spec.name} exists with storage {info.config.storage}; JetStream cannot change "
                f"storage in place (wanted {want.storage}); migrate it by hand"
            )
        if _differs(info.config, want):
            await js.update_stream(want)
            results.append(ApplyResult(spec.name, "updated"))
        else:
            results.append(ApplyResult(spec.name, "unchanged"))
    return results


async def topology_info(js: JetStreamContext, specs: tuple[StreamSpec, ...]) -> list[dict]:
    rows = []
    for spec in specs:
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            rows.append({"stream": spec.name, "exists": False, "subjects": list(spec.subjects)})
            continue
        st = info.state
        rows.append(
            {
                "stream": spec.name,
                "exists": True,
                "subjects": list(info.config.subjects or []),
                "messages": st.messages,
                "bytes": st.bytes,
                "first_seq": st.first_seq,
                "last_seq": st.last_seq,
                "consumers": st.consumer_count,
                "max_age_s": info.config.max_age,
                "replicas": info.config.num_replicas,
                "duplicate_window_s": info.config.duplicate_window,
            }
        )
    return rows


UNANSWERED = (NatsTimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
              nats.js.errors.ServiceUnavailableError)  # no stream leader yet, a server restarting


async def while_unanswered(call: Callable[[], Awaitable], what: str, deadline_s: float = 30.0):
    """Run a JetStream API ``call``, again while JetStream does not answer it (:data:`UNANSWERED`):
    on a cluster a request made while a stream's leader is being elected, or while the servers
    restart, gets no answer within nats-py's timeout. For calls that are safe to repeat (reads;
    creating or deleting the same consumer); the last error is raised once ``deadline_s`` is up."""
    end = time.monotonic() + deadline_s
    delay = 0.25
    while True:
        try:
            return await call()
        except UNANSWERED as exc:
            if time.monotonic() + delay > end:
                raise
            log.warning("JetStream did not answer (%s: %s); asking again in %.2g s", what, type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)


#: what a JetStream publish may meet while the bus comes back (nats-py turns "no responders" to a
#: publish into NoStreamResponseError, not a NoRespondersError)
_TRANSIENT = (NatsTimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
              nats.js.errors.NoStreamResponseError)


async def publish(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    *,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
    retries: int = 5,
    timeout: float = 5.0,
):
    """Publish to JetStream and wait for the ack; retry with the same ``Nats-Msg-Id``.

    Because the id is reused on retry, a retry after a lost ack never stores the
    event twice (within the stream's duplicate window). No stream answering (nats-py's
    ``NoStreamResponseError``: a stream electing its leader, a cluster restarting, the topology
    not applied yet) is retried too, and raised once the retries are spent.
    """
    hdrs = dict(headers or {})
    if msg_id is not None:
        hdrs["Nats-Msg-Id"] = msg_id
    delay = 0.1
    for attempt in range(retries + 1):
        try:
            return await js.publish(subject, data, timeout=timeout, headers=hdrs or None)
        except _TRANSIENT as exc:
            if attempt == retries:
                raise
            log.warning("publish to %s failed (%s); retry %d", subject, type(exc).__name__, attempt + 1)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def stream_seq_of(msg) -> int | None:  # noqa: ANN001
    """The JetStream stream sequence of a delivered message (None for a plain NATS message)."""
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:  # noqa: BLE001 - not a JetStream delivery
        return None


def dead_letter_id(stream: str, subject: str, data: bytes, stream_seq: int | None = None) -> str:
    """The ``Nats-Msg-Id`` of the dead letter for one bad message: the same for every consumer
    that rejects that message (the DLQ stream's duplicate window keeps one), different for two
    messages. From the original's stream sequence when known, else from its subject and bytes."""
    if stream_seq is not None:
        return f"dlq:{stream}:{stream_seq}"
    h = hashlib.sha256(subject.encode() + b"\x00" + data).hexdigest()[:32]
    return f"dlq:{stream}:{h}"


def make_dead_letter(stream: str, subject: str, data: bytes, reason: str, *, consumer: str = "",
                     headers: dict[str, str] | None = None, stream_seq: int | None = None,
                     now: float | None = None) -> DeadLetter:
    """A bounded dead letter: at most the first ``MAX_DEAD_LETTER_PAYLOAD`` bytes of the
    original (base64), its size and sha256, the reason cut to ``MAX_DEAD_LETTER_REASON``, and
    string headers up to 4 KiB in all; whatever the input, the letter stays well under 32 KiB."""
    keep: dict[str, str] = {}
    room = 4096
    for k, v in (headers or {}).items():
        if isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= room:
            keep[k] = v
            room -= len(k) + len(v)
    reason = reason.strip() or "rejected"
    return DeadLetter(
        stream=stream,
        subject=subject[:512],
        reason=reason[:MAX_DEAD_LETTER_REASON],
        ts=time.time() if now is None else now,
        consumer=consumer,
        payload=base64.b64encode(data[:MAX_DEAD_LETTER_PAYLOAD]).decode(),
        payload_size=len(data),
        payload_sha256=hashlib.sha256(data).hexdigest(),
        truncated=len(data) > MAX_DEAD_LETTER_PAYLOAD,
        stream_seq=stream_seq,
        headers=keep,
    )


_DLQ_COUNTERS: "weakref.WeakKeyDictionary[CollectorRegistry, tuple[Counter, Counter]]" = weakref.WeakKeyDictionary()


def _dead_letter_counters(registry: CollectorRegistry | None) -> tuple[Counter, Counter]:
    """The DLQ counters of ``registry``, shared by every :class:`DeadLetters` of one process
    (a sink and its planner both dead-letter; the ``consumer`` label tells them apart)."""
    if registry is not None and registry in _DLQ_COUNTERS:
        return _DLQ_COUNTERS[registry]
    pair = (
        Counter("infernex_dead_letters_total",
                "Dead letters stored in the DLQ stream (bad input skipped), by stream and reason class",
                ["stream", "consumer", "reason"], registry=registry),
        Counter("infernex_dead_letter_publish_failures_total",
                "Bad messages skipped whose dead letter could not be published, by stream",
                ["stream", "consumer"], registry=registry),
    )
    if registry is not None:
        _DLQ_COUNTERS[registry] = pair
    return pair


class DeadLetters:
    """Sends rejected input to ``dlq.<stream>`` with the reason, and counts what happened.

    :meth:`send` never raises: the caller acks the bad message and moves on whatever the DLQ
    does. ``infernex_dead_letters_total`` counts letters JetStream stored (or dropped as the
    duplicate of a letter another consumer stored for the same message);
    ``infernex_dead_letter_publish_failures_total`` counts letters that could not be published
    (NATS down, no DLQ stream): the bad message is skipped all the same.
    """

    def __init__(self, js: JetStreamContext, *, consumer: str, registry: CollectorRegistry | None = None,
                 prefix: str | None = None, timeout_s: float = 2.0):
        self._js = js
        self._consumer = consumer
        self._prefix = prefix
        self._timeout = timeout_s
        self.counter, self.failures = _dead_letter_counters(registry)
        self.count = 0  # letters stored
        self.failed = 0  # letters that could not be published

    async def send(self, stream: str, subject: str, data: bytes, reason: str,
                   headers: dict[str, str] | None = None, reason_class: str = "invalid",
                   *, stream_seq: int | None = None) -> bool:
        """Publish the dead letter; True when JetStream stored it. Never raises."""
        try:
            letter = make_dead_letter(stream, subject, data, reason, consumer=self._consumer, headers=headers,
                                      stream_seq=stream_seq)
            target = S.with_prefix(self._prefix, S.dead_letter(stream))
            msg_id = dead_letter_id(stream, subject, data, stream_seq)
            await asyncio.wait_for(
                publish(self._js, target, letter.to_json(), msg_id=msg_id, retries=1, timeout=self._timeout / 2),
                timeout=self._timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted; the bad message is skipped anyway
            self.failed += 1
            self.failures.labels(stream, self._consumer).inc()
            log.warning("dead letter for %s not published (%s: %s); the message is skipped", subject[:200],
                        type(exc).__name__, str(exc)[:200])
            return False
        self.count += 1
        self.counter.labels(stream, self._consumer, reason_class).inc()
        return True


Handler = Callable[[list[Msg]], Awaitable[None]]


async def ensure_durable(js: JetStreamContext, stream: str, durable: str, filter_subject: str | None,
                         *, ack_wait_s: float = 30.0, max_ack_pending: int = 20000,
                         deliver_policy: DeliverPolicy = DeliverPolicy.ALL) -> None:
    """Create the durable consumer unless it exists; an existing one is left as it is (its
    position, and any start point it was re-pointed to, are the durable state to keep). While
    JetStream does not answer (a cluster restarting) both requests are asked again
    (:func:`while_unanswered`): a service starting then waits for it instead of failing."""
    try:
        await while_unanswered(lambda: js.consumer_info(stream, durable), f"consumer {durable} on {stream}")
        return
    except NotFoundError:
        pass
    cfg = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=deliver_policy,
        filter_subject=filter_subject,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
        max_deliver=-1,
    )
    try:
        await while_unanswered(lambda: js.add_consumer(stream, cfg), f"create consumer {durable} on {stream}")
    except APIError as exc:
        if "already in use" not in str(exc) and getattr(exc, "err_code", None) != 10148:
            raise


async def run_durable(
    js: JetStreamContext,
    *,
    stream: str,
    durable: str,
    filter_subject: str | None,
    handle: Handler,
    stop: asyncio.Event,
    batch: int = 256,
    fetch_timeout: float = 0.5,
    ack_wait_s: float = 30.0,
) -> None:
    """Pull batches from a durable consumer until ``stop`` is set.

    ``handle`` receives the batch and is responsible for acking (after applying), so a
    crash before the ack means redelivery, never loss.
    """
    await ensure_durable(js, stream, durable, filter_subject, ack_wait_s=ack_wait_s)
    sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
    try:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=fetch_timeout)
            except (NatsTimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                break
            if msgs:
                await handle(msgs)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass


async def cancel_task(task: asyncio.Task | None, *, timeout: float = 5.0) -> None:
    """Cancel ``task`` and wait until it has really ended.

    On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that races with the inner
    operation finishing (fixed in 3.12); a task hit that way carries on and then waits forever.
    So cancel again until it is done, for up to ``timeout`` seconds.
    """
    if task is None or task.done():
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.done():
        log.warning("task %s did not end within %.1fs of being cancelled", task.get_name(), timeout)


async def run_periodically(tick: Callable[[], Awaitable[object]], stop: asyncio.Event, interval_s: float) -> None:
    """Call ``tick`` every ``interval_s`` (measured start to start) until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await tick()
        left = interval_s - (loop.time() - started)
        if left > 0:
            try:
                await asyncio.wait_for(stop.wait(), left)
            except asyncio.TimeoutError:
                pass
