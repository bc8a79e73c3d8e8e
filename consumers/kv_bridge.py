"""vLLM KV events (ZMQ) -> JetStream: one bus batch per vLLM frame, several per message.

Pipeline: a ZMQ SUB socket receives ``(topic, seq, msgpack KVEventBatch)`` frames.

* Runs of in-order frames in vLLM's current shape go through :mod:`consumers.kv_transcode`,
  which writes each frame's binary batch (:mod:`schemas.kv_binary`) in one compiled call.
* Every other frame, and any frame the transcoder leaves, is decoded by :mod:`consumers.kv_wire`
  (every shape vLLM 0.11-0.33 and SGLang send; an event the index cannot key is skipped and
  counted, the rest of its batch goes on) and encoded the same way. ``encoding="json"``
  publishes the schema's JSON instead.
* Batches ready together (frames already queued on the socket, or arriving within
  ``group_wait_s`` while frames flow) go out as one group message.
* :class:`consumers.ordered_publisher.OrderedPublisher` publishes them to
  ``kv.events.<model>.<pod>`` with ``Nats-Msg-Id = <pod>:<epoch>:<seq>`` (a group:
  ``<first>-<last>``), with pod / model / epoch / seq and the content type in headers, up to
  ``max_inflight`` acks outstanding, in the queue's order.

Sequence handling (:class:`SequenceTracker`, pure):

* ``seq == last + 1``: in order;
* ``seq > last + 1``: a gap; the missing frames are asked for on the replay socket
  (vLLM's ROUTER: ``[b"", start_seq]`` -> ``[b"", topic, seq, payload]`` per batch in vLLM
  >= 0.33, ``[b"", seq, payload]`` before, then the end marker with seq -1) and published
  first, in order. Frames the engine no longer buffers are lost: they are counted and
  logged, and with the default ``gap_policy="keep"`` the pod's blocks stay (one lost frame
  must not erase all a pod's routing knowledge; the few blocks it named are corrected by
  later events or expire with the pod); ``gap_policy="reset"`` makes the next published
  batch start with a ``PodReset`` instead;
* ``seq <= last``: the engine restarted; ``epoch`` goes up by one and the first batch of
  the new epoch starts with a ``PodReset``; a new incarnation whose first frames were
  missed is replayed from 0.

On start the bridge reads the last message it stored for the pod from JetStream, so a
restarted bridge continues the epoch and sequence (and fills what it missed meanwhile)
instead of reusing message ids the stream would drop as duplicates.

Undecodable frames go to ``dlq.kv-events`` with the reason; the bridge keeps going.
A NATS outage stalls the sender; the bounded queue then stalls the reader and the
engine's PUB socket buffers (and, past its high-water mark, drops - which the next
frame shows as a gap that is replayed). Publishes that fail are retried in order with
the same message id, so nothing is stored twice. After a broker restart the stream may still hold
a pod's batches out of order (a batch lost in flight is re-sent after later ones the client had
buffered); the folds put them back in order per pod (``KvIndex(reorder_window_s=...)``).
While the engine is quiet, an empty batch at the last position is sent every ``heartbeat_s``
(the indexer's liveness signal for ``pod_timeout_s``). Sequences past 2**63-1 are dead-lettered.

One :class:`KvBridge` serves one engine endpoint. vLLM gives every data-parallel rank its own
endpoint and its own sequence, so a pod with several DP ranks needs one bridge per rank
with distinct ``--pod`` names (``(pod, epoch, seq)`` must stay unique); :func:`run_bridges`
runs several of them in one process (one event loop, one NATS connection).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import nats
import zmq
import zmq.asyncio
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from consumers import bus, kv_digests, kv_transcode, kv_wire_compiled
from consumers.kv_wire import (  # noqa: F401 - FrameError, Normalized and decode_frame are re-exported
    FrameDecoder,
    FrameError,
    Normalized,
    OutBatch,
    OutReset,
    decode_frame,
)
from consumers.ordered_publisher import Item as _Item
from consumers.ordered_publisher import OrderedPublisher
from schemas import kv_binary
from schemas import subjects as S
from schemas.kv import MAX_EPOCH, MAX_SEQ

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: the flag enum costs a construction per call
GAP_POLICIES = ("keep", "reset")

_json_enc = msgspec.json.Encoder()


# --- sequence tracking (pure) -------------------------------------------------------------------

@dataclass
class SeqDecision:
    kind: str  # "first" | "next" | "gap" | "restart"
    replay_from: int | None = None  # first missing seq to ask the replay socket for


@dataclass
class SequenceTracker:
    """Where the bridge is in an engine's sequence, and which epoch (incarnation) it is in."""

    last_seq: int | None = None
    epoch: int = 0
    reset_reason: str | None = None  # a PodReset is owed at the head of the next batch

    def observe(self, seq: int) -> SeqDecision:
        last = self.last_seq
        if last is None:
            return SeqDecision("first")
        if seq == last + 1:
            return SeqDecision("next")
        if seq > last + 1:
            return SeqDecision("gap", last + 1)
        return SeqDecision("restart", 0 if seq > 0 else None)

    def start_epoch(self, reason: str = "engine restart") -> None:
        self.epoch += 1
        self.last_seq = None
        self.reset_reason = reason

    def lost(self, first: int, last: int) -> None:
        """Frames ``first..last`` are gone for good: owe the indexer a reset (``gap_policy="reset"``)."""
        reason = f"lost KV events seq {first}..{last}"
        self.reset_reason = reason if self.reset_reason is None else f"{self.reset_reason}; {reason}"

    def accept(self, seq: int) -> str | None:
        """Record ``seq`` as handled; returns the reset reason owed before it (once)."""
        self.last_seq = seq
        reason, self.reset_reason = self.reset_reason, None
        return reason


# --- metrics ------------------------------------------------------------------------------------

class _BridgeFamilies:
    """The bridge metrics of one registry, shared by every bridge of the process (one bridge process
    may serve several engines): labelled counters and the latency histogram, and one collector that
    reads every bridge's plain counts at scrape time."""

    def __init__(self, registry: CollectorRegistry | None):
        self.bridges: list[BridgeMetrics] = []
        self.gaps = Counter("infernex_kv_bridge_gaps_total", "sequence gaps, by outcome",
                            ["pod", "outcome"], registry=registry)
        self.restarts = Counter("infernex_kv_bridge_engine_restarts_total",
                                "engine restarts seen (sequence went back)", ["pod"], registry=registry)
        self.dead = Counter("infernex_kv_bridge_dead_letters_total", "frames sent to the dead-letter subject",
                            ["pod"], registry=registry)
        self.retries = Counter("infernex_kv_bridge_publish_retries_total", "JetStream publishes retried",
                               ["pod"], registry=registry)
        self.skipped = Counter("infernex_kv_bridge_skipped_events_total",
                               "events left out of their batch because the index cannot key them, by reason",
                               ["pod", "reason"], registry=registry)
        self.latency = Histogram("infernex_kv_bridge_publish_latency_seconds",
                                 f"time from ZMQ receive to JetStream ack (1 in {BridgeMetrics.LATENCY_SAMPLE} "
                                 "batches sampled)", ["pod"], registry=registry,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                          2.5, 5, 10, 30))
        if registry is not None:
            registry.register(self)

    def collect(self):
        frames = CounterMetricFamily("infernex_kv_bridge_frames", "vLLM KV-event frames received",
                                     labels=["pod", "path"])
        blocks = CounterMetricFamily("infernex_kv_bridge_blocks", "blocks in published KV events",
                                     labels=["pod", "event"])
        published = CounterMetricFamily("infernex_kv_bridge_published", "batches acknowledged by JetStream",
                                        labels=["pod"])
        messages = CounterMetricFamily("infernex_kv_bridge_messages", "JetStream messages acknowledged (a group "
                                       "message carries several batches)", labels=["pod"])
        queue = GaugeMetricFamily("infernex_kv_bridge_queue_depth", "messages waiting to be published",
                                  labels=["pod"])
        for m in self.bridges:
            pod = m.pod
            frames.add_metric([pod, "live"], m.frames_live)
            frames.add_metric([pod, "replay"], m.frames_replay)
            blocks.add_metric([pod, "stored"], m.stored)
            blocks.add_metric([pod, "removed"], m.removed)
            published.add_metric([pod], m.published)
            messages.add_metric([pod], m.messages)
            queue.add_metric([pod], m.queue_depth)
        return [frames, blocks, published, messages, queue]

    def describe(self):
        return self.collect()


_FAMILIES: "weakref.WeakKeyDictionary[CollectorRegistry, _BridgeFamilies]" = weakref.WeakKeyDictionary()


class BridgeMetrics:
    """One bridge's Prometheus metrics (its ``pod`` label; the families are the registry's, shared by
    the bridges of one process). Per-frame counts are plain ints read at scrape time (a custom
    collector), so the hot path pays no metric-object overhead; the publish latency histogram
    samples one acknowledged batch in ``LATENCY_SAMPLE``."""

    LATENCY_SAMPLE = 8

    def __init__(self, registry: CollectorRegistry | None, pod: str):
        fam = _FAMILIES.get(registry) if registry is not None else None
        if fam is None:
            fam = _BridgeFamilies(registry)
            if registry is not None:
                _FAMILIES[registry] = fam
        if any(m.pod == pod for m in fam.bridges):
            raise ValueError(f"a bridge for pod {pod!r} already reports to this registry")
        fam.bridges.append(self)
        self.pod = pod
        self.frames_live = 0
        self.frames_replay = 0
        self.stored = 0
        self.removed = 0
        self.published = 0  # batches
        self.messages = 0  # JetStream messages (a group holds several batches)
        self.queue_depth = 0
        self.skipped = fam.skipped  # (labelled per event: the family)
        self.gap_filled = fam.gaps.labels(pod, "filled")
        self.gap_lost = fam.gaps.labels(pod, "lost")
        self.restart = fam.restarts.labels(pod)
        self.dead_pod = fam.dead.labels(pod)
        self.retry = fam.retries.labels(pod)
        self.lat = fam.latency.labels(pod)


# --- the bridge ---------------------------------------------------------------------------------

@dataclass
class BridgeConfig:
    endpoint: str
    pod: str
    model: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0
    max_inflight: int = 256
    queue_size: int = 4096
    replay_timeout_s: float = 2.0
    ack_timeout_s: float = 5.0
    recover: bool = True  # continue from the last batch stored for this pod
    recover_wait_s: float = 60.0  # keep asking for it this long while JetStream does not answer
    backfill: bool = True  # on a fresh start, replay what the engine still buffers
    gap_policy: str = "keep"  # frames lost for good: "keep" the pod's blocks, or "reset" them
    heartbeat_s: float = 10.0  # while the engine is quiet, re-state the last position this often (0 = never)
    encoding: str = "binary"  # on the bus: "binary" (schemas.kv_binary) or "json" (the schema's JSON)
    # binary: batches that are ready at once (frames already queued on the socket) go out as one
    # group message of at most this many batches / bytes (1 = a message per batch)
    group_max: int = 128  # (64 before session 31: 128 measured 1.05x the blocks/s, bench/RESULTS.md)
    group_max_bytes: int = 96 * 1024  # below glibc's mmap threshold (128 KiB): larger messages fault their pages in on every copy
    # while frames arrive faster than one per group_wait_s, the bridge waits up to this long for more
    # before it publishes a group that is not full: a busy engine's frames go out in fewer, larger
    # messages (less CPU per block in the bridge, nats-server and every consumer); a quiet engine's
    # frame is published at once (0 = never wait)
    group_wait_s: float = 0.002
    # binary: runs of in-order frames in vLLM's current shape go through the compiled transcoder
    # (consumers.kv_transcode; needs numba); False: every frame through the Python decoder
    transcode: bool = True
    # binary: stores carry each block's digest (8 bytes, streams.kv_core.block_digests) in place of
    # its token ids (4 bytes per token), a quarter of the bytes on the bus and in the stream; False
    # (or an install without numba): token ids, e.g. for consumers older than block digests
    digests: bool = True

    def __post_init__(self) -> None:
        if self.gap_policy not in GAP_POLICIES:
            raise ValueError(f"gap_policy must be one of {', '.join(GAP_POLICIES)}, not {self.gap_policy!r}")
        if self.encoding not in kv_binary.ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(kv_binary.ENCODINGS)}, not {self.encoding!r}")
        if self.group_max < 1 or self.group_max_bytes < 1:
            raise ValueError("group_max and group_max_bytes must be at least 1")
        if not 0 <= self.group_wait_s <= 1:
            raise ValueError("group_wait_s must be between 0 and 1 second")


@dataclass
class BridgeStats:
    frames: int = 0
    replayed: int = 0
    dead_letters: int = 0
    gaps_filled: int = 0
    gaps_lost: int = 0
    skipped_events: int = 0
    restarts: int = 0
    published: int = 0
    blocks: int = 0
    last_frame_at: float | None = None  # time.monotonic() of the last live frame (for /readyz)


def encode_batch(batch: OutBatch, *, binary: bool = True, digests: bool = True) -> tuple[bytes, dict[str, str]]:
    """The message body and headers of one batch: binary (stores with block digests in place of
    token ids when ``digests`` and this install can compute them), or JSON when not ``binary`` or
    when the batch does not fit the binary layout (token ids past 32 bits)."""
    if binary:
        try:
            w = kv_binary.to_wire(batch)
            if digests and kv_digests.available():
                w.events = kv_digests.with_digests(w.events)
            data = kv_binary.encode_wire(w)
        except (OverflowError, ValueError, TypeError):
            pass
        else:
            return data, kv_binary.headers(batch.pod, batch.model, batch.epoch, batch.seq)
    return _json_enc.encode(batch), kv_binary.headers(batch.pod, batch.model, batch.epoch, batch.seq,
                                                      kv_binary.JSON_CONTENT_TYPE)


async def last_stored_position(js: JetStreamContext, stream: str, subject: str, *,
                               wait_s: float = 0.0) -> tuple[int, int] | None:
    """``(epoch, seq)`` of the last batch stored on ``subject``, or None. While JetStream does not
    answer (a replicated stream electing its leader, the servers restarting) it is asked again for
    up to ``wait_s`` seconds: a bridge must not start numbering batches afresh because the stream
    was briefly unavailable, nor give up on it."""
    try:
        msg = await bus.while_unanswered(lambda: js.get_last_msg(stream, subject),
                                         f"last batch stored on {subject}", deadline_s=wait_s)
    except nats.js.errors.NotFoundError:
        return None
    try:
        if kv_binary.is_binary(msg.data):
            parts = kv_binary.split(msg.data)  # a group: its last batch
            w = kv_binary.decode(parts[-1] if parts else msg.data)
            return w.epoch, w.seq
        data = msgspec.json.decode(msg.data)
        return int(data["epoch"]), int(data["seq"])
    except Exception:  # noqa: BLE001 - an unreadable last message: start fresh
        return None


class KvBridge:
    """One engine (one PUB endpoint, one pod) -> JetStream.

    ``nc`` is a connected NATS client; ``stream`` the JetStream stream holding the pod's
    subject (used to continue after the last stored batch). ``drop`` is a test hook:
    frames whose sequence it returns True for are discarded on arrival (once each), as if
    the network had lost them.
    """

    def __init__(self, cfg: BridgeConfig, nc: NatsClient, *, subject_prefix: str | None = None,
                 registry: CollectorRegistry | None = None, dead_letters: bus.DeadLetters | None = None,
                 stream: str | None = None, context: zmq.asyncio.Context | None = None,
                 drop: Callable[[int], bool] | None = None):
        self.cfg = cfg
        self.nc = nc
        self.js = js = nc.jetstream()
        self.subject = S.with_prefix(subject_prefix, S.kv_events(cfg.model, cfg.pod))
        self.stream = stream
        self.metrics = BridgeMetrics(registry, cfg.pod)
        self.dlq = dead_letters or bus.DeadLetters(js, consumer=f"kv-bridge:{cfg.pod}", registry=registry,
                                                   prefix=subject_prefix)
        self.tracker = SequenceTracker()
        self.stats = BridgeStats()
        self.publisher = OrderedPublisher(nc, self.metrics, max_inflight=cfg.max_inflight,
                                          queue_size=cfg.queue_size, ack_timeout=cfg.ack_timeout_s,
                                          on_ack=self._acked)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._drop = drop
        self._dropped: set[int] = set()
        self._pod, self._model = cfg.pod, cfg.model
        self._binary = cfg.encoding == "binary"
        self._decoder = FrameDecoder(compiled=self._binary)  # numpy arrays straight into the binary encoding
        # plain runs of frames in vLLM's current shape: compiled straight into binary batches
        self._digests = self._binary and cfg.digests and kv_digests.available()
        if self._binary and cfg.digests and not self._digests:
            log.warning("kv-bridge %s: this install has no numba: token ids on the bus instead of block digests "
                        "(install infernex[router] for a quarter of the bytes)", cfg.pod)
        self._transcoder = (kv_transcode.Transcoder(cfg.pod, cfg.model, cfg.dp_rank, self._decoder.groups,
                                                    digests=self._digests)
                            if self._binary and cfg.transcode and kv_transcode.AVAILABLE else None)
        self._group = self._binary and cfg.group_max > 1
        self._pending: list[tuple[bytes, int, int, float, int, int]] = []  # (data, epoch, seq, t0, stored, removed)
        self._pending_bytes = 0
        self._last_put = time.monotonic()
        self._hb = 0
        self.ready = asyncio.Event()

    def _acked(self, item: _Item) -> None:
        self.stats.published += item.batches
        self.stats.blocks += item.stored + item.removed

    # -- frame handling --

    async def _dead_letter(self, data: bytes, reason: str, seq: int | None) -> None:
        self.stats.dead_letters += 1
        self.metrics.dead_pod.inc()
        log.warning("kv-bridge %s: dead letter (seq %s): %s", self._pod, seq, reason)
        headers = {"pod": self._pod, "model": self._model}
        if seq is not None:
            headers["vllm-seq"] = str(seq)
        try:
            await self.dlq.send(S.KV_EVENTS, self.subject, data, reason, headers=headers)
        except Exception as exc:  # noqa: BLE001 - NATS down: the letter is logged above, keep bridging
            log.error("kv-bridge %s: dead letter for seq %s not stored (%s: %s)", self._pod, seq,
                      type(exc).__name__, exc)

    async def _emit(self, seq: int, payload: bytes, t0: float) -> None:
        """Decode one in-order frame and queue its batch (or dead-letter it)."""
        try:
            norm = self._decoder.decode(payload)
        except FrameError as exc:
            reason = self.tracker.reset_reason
            self.tracker.accept(seq)
            self.tracker.reset_reason = reason  # still owed to the next good batch
            await self._dead_letter(payload, str(exc), seq)
            return
        if norm.skipped:
            for reason, n in norm.skipped.items():
                self.stats.skipped_events += n
                self.metrics.skipped.labels(self._pod, reason).inc(n)
            log.debug("kv-bridge %s: seq %d: skipped %s", self._pod, seq, norm.skipped)
        owed = self.tracker.accept(seq)
        events = norm.events
        if owed is not None:
            events = [OutReset(owed), *events]
        epoch = self.tracker.epoch
        self._last_put = time.monotonic()
        batch = OutBatch(self._pod, self._model, self.cfg.dp_rank if norm.dp_rank is None else norm.dp_rank,
                         epoch, seq, norm.ts, events)
        data, hdrs = self._encode(batch)
        await self._queue(data, hdrs, epoch, seq, t0, norm.blocks_stored, norm.blocks_removed)

    async def _queue(self, data: bytes, hdrs: dict[str, str] | None, epoch: int, seq: int, t0: float,
                     stored: int, removed: int) -> None:
        """Hold an encoded batch to be grouped, or publish it (``hdrs`` None: the binary encoding)."""
        binary = hdrs is None or hdrs[kv_binary.HDR_CONTENT_TYPE] == kv_binary.CONTENT_TYPE
        if self._group and binary:
            if self._pending and (len(self._pending) >= self.cfg.group_max
                                  or self._pending_bytes + len(data) > self.cfg.group_max_bytes):
                await self.flush()
            self._pending.append((data, epoch, seq, t0, stored, removed))
            self._pending_bytes += len(data)
            return
        await self.flush()  # (a JSON batch: the ones before it first)
        if hdrs is None:
            hdrs = kv_binary.headers(self._pod, self._model, epoch, seq)
        await self.publisher.put(_Item(self.subject, data, f"{self._pod}:{epoch}:{seq}", t0, stored, removed,
                                       headers=hdrs))

    async def _queue_run(self, got: list[tuple[bytes, int, int]], epoch: int, first: int, t0: float) -> None:
        """:meth:`_queue` for the transcoder's consecutive binary batches from ``first``, without a
        coroutine per batch: they are held to be grouped, a group published whenever one is full."""
        if not self._group:
            for k, (data, stored, removed) in enumerate(got):
                await self._queue(data, None, epoch, first + k, t0, stored, removed)
            return
        most, most_bytes = self.cfg.group_max, self.cfg.group_max_bytes
        pending = self._pending
        for k, (data, stored, removed) in enumerate(got):
            if pending and (len(pending) >= most or self._pending_bytes + len(data) > most_bytes):
                await self.flush()
                pending = self._pending
            pending.append((data, epoch, first + k, t0, stored, removed))
            self._pending_bytes += len(data)

    def _plain_run(self, drained: list[list[bytes]], i: int) -> int:
        """How many frames from ``drained[i]`` continue the sequence with nothing to decide: no gap,
        no restart, no reset owed (the transcoder's case)."""
        t = self.tracker
        if t.last_seq is None or t.reset_reason is not None or self._drop is not None:
            return 0
        want = t.last_seq + 1
        k = i
        while k < len(drained):
            f = drained[k]
            if len(f) != 3 or len(f[1]) != 8 or int.from_bytes(f[1], "big") != want or want > MAX_SEQ:
                break
            want += 1
            k += 1
        return k - i

    async def _handle_frames(self, drained: list[list[bytes]], t0: float) -> None:
        """The frames read together, in order: runs of plain in-order frames through the compiled
        transcoder (when there is one), everything else (and any frame it leaves) one by one."""
        tc = self._transcoder
        i = 0
        while i < len(drained):
            run = self._plain_run(drained, i) if tc is not None else 0
            if run:
                first, epoch = self.tracker.last_seq + 1, self.tracker.epoch
                got = tc.transcode([f[2] for f in drained[i:i + run]], first, epoch)
                if got:
                    self.stats.last_frame_at = t0
                    self._last_put = time.monotonic()
                    self.stats.frames += len(got)
                    self.metrics.frames_live += len(got)
                    self.tracker.accept(first + len(got) - 1)  # (a plain run: no reset owed, none skipped)
                    await self._queue_run(got, epoch, first, t0)
                i += len(got)
                if len(got) == run:
                    continue
            await self._handle_frame(drained[i], t0)  # (the frame the transcoder left, or not a plain one)
            i += 1

    async def flush(self) -> None:
        """Publish the batches held back to be grouped: one as itself, several as one group message
        (id ``<pod>:<first epoch>:<first seq>-<epoch>:<seq>``, headers naming the last batch)."""
        p = self._pending
        if not p:
            return
        self._pending, self._pending_bytes = [], 0
        if len(p) == 1:
            data, epoch, seq, t0, st, rm = p[0]
            await self.publisher.put(_Item(self.subject, data, f"{self._pod}:{epoch}:{seq}", t0, st, rm,
                                           headers=kv_binary.headers(self._pod, self._model, epoch, seq)))
            return
        first, last = p[0], p[-1]
        await self.publisher.put(_Item(
            self.subject, kv_binary.group([x[0] for x in p]), f"{self._pod}:{first[1]}:{first[2]}-{last[1]}:{last[2]}",
            first[3], sum(x[4] for x in p), sum(x[5] for x in p),
            headers=kv_binary.group_headers(self._pod, self._model, last[1], first[2], last[2], len(p)),
            batches=len(p)))

    def _encode(self, batch: OutBatch) -> tuple[bytes, dict[str, str]]:
        return encode_batch(batch, binary=self._binary, digests=self._digests)

    async def _heartbeat(self) -> None:
        """While the engine sends nothing, publish an empty batch at the last position every
        ``heartbeat_s``: the indexer refreshes the pod's liveness from it (and applies nothing),
        so a pod whose bridge and engine are gone expires after ``pod_timeout_s`` while a quiet
        one does not. Its message id is distinct (``...:hb<n>``) and it is queued behind every
        real batch, so it never overtakes one."""
        every = self.cfg.heartbeat_s
        t = self.tracker
        if not every or t.last_seq is None or time.monotonic() - self._last_put < every:
            return
        await self.flush()
        self._hb += 1
        self._last_put = time.monotonic()
        batch = OutBatch(self._pod, self._model, self.cfg.dp_rank, t.epoch, t.last_seq, time.time(), [])
        data, hdrs = self._encode(batch)
        await self.publisher.put(_Item(self.subject, data, f"{self._pod}:{t.epoch}:{t.last_seq}:hb{self._hb}",
                                       self._last_put, headers=hdrs))

    async def handle_frame(self, frames: list[bytes], t0: float | None = None, *, flush: bool = True) -> None:
        """Handle one live frame from the SUB socket (public for tests and benches). ``flush=False``:
        more frames are ready, so the batch may wait to be grouped with theirs (:meth:`flush`)."""
        await self._handle_frames([frames], time.monotonic() if t0 is None else t0)
        if flush:
            await self.flush()

    async def _handle_frame(self, frames: list[bytes], t0: float | None = None) -> None:
        t0 = time.monotonic() if t0 is None else t0
        self.stats.last_frame_at = t0
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.frames += 1
            await self._dead_letter(b"".join(frames[-1:]),
                                    f"frame has {len(frames)} parts (want topic, 8-byte seq, payload)", None)
            return
        seq = int.from_bytes(frames[1], "big")
        if seq > MAX_SEQ:  # vLLM's seq is a signed int64: this is a corrupt frame, not a position
            self.stats.frames += 1
            await self._dead_letter(frames[2], f"sequence {seq} is past 2**63-1", None)
            return
        if self._drop is not None and seq not in self._dropped and self._drop(seq):
            self._dropped.add(seq)
            return
        self.stats.frames += 1
        self.metrics.frames_live += 1
        d = self.tracker.observe(seq)
        if d.kind == "restart":
            self.stats.restarts += 1
            self.metrics.restart.inc()
            log.info("kv-bridge %s: engine restarted (seq %d after %s); epoch %d", self._pod, seq,
                     self.tracker.last_seq, self.tracker.epoch + 1)
            self.tracker.start_epoch("engine restart")
            if d.replay_from is not None:
                await self._fill(d.replay_from, seq)
        elif d.kind == "gap":
            await self._fill(d.replay_from, seq)
        elif d.kind == "first" and seq > 0 and self.cfg.backfill and self.cfg.replay_endpoint:
            # a fresh bridge: take what the engine still buffers from its start
            await self._fill(0, seq, backfill=True)
        await self._emit(seq, frames[2], t0)

    async def _fill(self, first: int, upto: int, backfill: bool = False) -> None:
        """Replay ``first..upto-1`` and emit them in order; what is missing is lost
        (when back-filling a fresh start, missing history is simply not there)."""
        got = await self._replay(first, upto) if self.cfg.replay_endpoint else {}
        if backfill:
            for s in sorted(got):
                self.stats.replayed += 1
                self.metrics.frames_replay += 1
                await self._emit(s, got[s], time.monotonic())
            return
        expected = first
        for s in range(first, upto):
            if s not in got:
                continue
            if s > expected:
                self._lost(expected, s - 1)
            self.stats.replayed += 1
            self.metrics.frames_replay += 1
            await self._emit(s, got[s], time.monotonic())
            expected = s + 1
        if expected < upto:
            self._lost(expected, upto - 1)
        elif upto > first:
            self.stats.gaps_filled += 1
            self.metrics.gap_filled.inc()

    def _lost(self, first: int, last: int) -> None:
        self.stats.gaps_lost += 1
        self.metrics.gap_lost.inc()
        log.warning("kv-bridge %s: KV events seq %d..%d are lost (not in the replay buffer); %s", self._pod,
                    first, last, "the pod's blocks are reset" if self.cfg.gap_policy == "reset"
                    else "the pod's blocks are kept")
        if self.cfg.gap_policy == "reset":
            self.tracker.lost(first, last)
        self.tracker.last_seq = last

    async def _replay(self, first: int, upto: int) -> dict[int, bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: dict[int, bytes] = {}
        try:
            sock.connect(self.cfg.replay_endpoint)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + self.cfg.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    log.warning("kv-bridge %s: replay from %d timed out", self._pod, first)
                    break
                frames = await sock.recv_multipart()
                if len(frames) == 4:  # vLLM >= 0.33: [b"", topic, seq, payload]
                    _, _, seq_b, payload = frames
                elif len(frames) == 3:  # before: [b"", seq, payload]
                    _, seq_b, payload = frames
                else:
                    continue
                if seq_b == END_SEQ or not payload:
                    break
                s = int.from_bytes(seq_b, "big")
                if first <= s < upto:
                    out[s] = payload
        finally:
            sock.close(linger=0)
        return out

    # -- running --

    async def recover(self) -> None:
        if not self.cfg.recover or self.stream is None:
            return
        pos = await last_stored_position(self.js, self.stream, self.subject, wait_s=self.cfg.recover_wait_s)
        if pos is not None and not (0 <= pos[0] <= MAX_EPOCH and 0 <= pos[1] <= MAX_SEQ):
            log.warning("kv-bridge %s: the last stored batch has epoch %d seq %d, out of bounds; starting fresh",
                        self._pod, *pos)
            pos = None
        if pos is not None:
            self.tracker.epoch, self.tracker.last_seq = pos
            log.info("kv-bridge %s: continuing after epoch %d seq %d", self._pod, *pos)

    async def run(self, stop: asyncio.Event) -> BridgeStats:
        if self._decoder.compiled:
            kv_wire_compiled.warm_up()  # compile (or load) the kernels before the first frame, not on it
        if self._digests:
            kv_digests.warm_up()  # (the frames the transcoder leaves: their stores' digests in Python)
        if self._transcoder is not None:
            kv_transcode.warm_up()
        elif self._binary:
            log.info("kv-bridge %s: numba is not installed; KV frames are decoded in Python "
                     "(about 4x the CPU; install infernex[router] for the compiled decoder)", self._pod)
        await self.recover()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        sub.connect(self.cfg.endpoint)
        raw = zmq.Socket.shadow(sub.underlying)  # sync view for draining without awaits
        recv = raw.recv
        await self.publisher.start()
        sender = asyncio.create_task(self.publisher.run(), name=f"kv-bridge-sender-{self._pod}")
        self.ready.set()
        wait = self.cfg.group_wait_s if self._group else 0.0
        flushed_at = 0.0
        try:
            while not stop.is_set():
                if sender.done():
                    sender.result()  # surface a crash
                timeout_ms = 100
                if self._pending:  # lingering for a fuller group: until the oldest batch has waited `wait`
                    timeout_ms = max(0.0, (self._pending[0][3] + wait - time.monotonic()) * 1000)
                if not await sub.poll(timeout_ms):
                    if self._pending:
                        await self.flush()
                        flushed_at = time.monotonic()
                    else:
                        await self._heartbeat()
                    continue
                t0 = time.monotonic()
                drained = []
                for _ in range(1000):
                    try:
                        f = recv(_NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames = [f.bytes]
                    while f.more:  # (recv_multipart, without the option enum its RCVMORE test builds per part)
                        f = recv(_NOBLOCK, copy=False)
                        frames.append(f.bytes)
                    drained.append(frames)
                await self._handle_frames(drained, t0)  # the ones ready together may go as one group
                if self._pending and t0 - flushed_at < wait:
                    # frames are flowing: let more queue up on the socket (until the oldest held batch
                    # has waited `wait`) and take them in one drain, instead of waking for each
                    await asyncio.sleep(max(0.0, self._pending[0][3] + wait - time.monotonic()))
                    continue
                await self.flush()
                flushed_at = time.monotonic()
        finally:
            sub.close(linger=0)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - stopping anyway; what was not queued is counted below
                log.warning("kv-bridge %s: %d batches not queued at shutdown (%s)", self._pod, len(self._pending), exc)
            await self.publisher.queue.put(None)
            try:
                await asyncio.wait_for(sender, timeout=self.cfg.ack_timeout_s * 3)
            except asyncio.TimeoutError:
                log.warning("kv-bridge %s: %d batches not acknowledged at shutdown", self._pod,
                            self.publisher.queue.qsize())
                sender.cancel()
        return self.stats


async def run_bridge(cfg: BridgeConfig, nats_cfg, *, topology=None, registry: CollectorRegistry | None = None,
                     stop: asyncio.Event | None = None, health=None,
                     max_frame_age_s: float | None = None) -> BridgeStats:
    """Connect to NATS and run one bridge until ``stop`` (CLI entry); ``health`` (a
    :class:`consumers.health.Health`) gets its checks: NATS connected, age of the last frame."""
    (stats,) = await run_bridges([cfg], nats_cfg, topology=topology, registry=registry, stop=stop, health=health,
                                 max_frame_age_s=max_frame_age_s)
    return stats


async def run_bridges(cfgs: list[BridgeConfig], nats_cfg, *, topology=None,
                      registry: CollectorRegistry | None = None, stop: asyncio.Event | None = None, health=None,
                      max_frame_age_s: float | None = None) -> list[BridgeStats]:
    """Several engines' bridges in this process, on one event loop and one NATS connection, until
    ``stop``: e.g. one sidecar for every data-parallel rank of a pod, or one process for a node's
    engines. Each keeps its own socket, sequence, recovery and subject; they share the process's
    fixed costs (the interpreter, the loop's wake-ups, the compiled kernels), which made four
    engines' ingest cost a third less CPU a block than four bridge processes (bench/RESULTS.md,
    session 30). ``health`` gets the NATS check and one frame-age check per engine (``kv_frames``
    alone, ``kv_frames:<pod>`` for several). A bridge that fails stops the others."""
    from streams.topology import build_topology, stream_for_subject

    if not cfgs:
        raise ValueError("no engine to bridge")
    pods = [c.pod for c in cfgs]
    if len(set(pods)) != len(pods):
        raise ValueError(f"each engine needs its own pod name: {sorted({p for p in pods if pods.count(p) > 1})} "
                         "given twice (batches of two engines under one name would collide)")
    stop = stop or asyncio.Event()
    name = f"kv-bridge-{cfgs[0].pod}" + (f"+{len(cfgs) - 1}" if len(cfgs) > 1 else "")
    nc = await bus.connect(nats_cfg, name=name)
    try:
        topo = topology or build_topology(prefix=nats_cfg.subject_prefix)
        bridges = []
        for cfg in cfgs:
            subject = S.with_prefix(nats_cfg.subject_prefix, S.kv_events(cfg.model, cfg.pod))
            spec = stream_for_subject(topo, subject)
            bridges.append(KvBridge(cfg, nc, subject_prefix=nats_cfg.subject_prefix, registry=registry,
                                    stream=spec.name if spec else None))
        if health is not None:
            from consumers.health import age_check, nats_check

            health.add("nats", nats_check(nc))
            for b in bridges:
                health.add("kv_frames" if len(bridges) == 1 else f"kv_frames:{b.cfg.pod}",
                           age_check(lambda b=b: b.stats.last_frame_at, max_age_s=max_frame_age_s))
        if len(bridges) == 1:
            return [await bridges[0].run(stop)]
        inner = asyncio.Event()  # the caller's stop, or one bridge failing: the others stop too
        watch = asyncio.create_task(stop.wait())
        watch.add_done_callback(lambda _t: inner.set())
        tasks = [asyncio.create_task(b.run(inner), name=f"kv-bridge-{b.cfg.pod}") for b in bridges]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            inner.set()  # (each one hands over what it holds before it returns)
            await asyncio.gather(*tasks, return_exceptions=True)
            watch.cancel()
        for t in tasks:
            if t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        await nc.close()
