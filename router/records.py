"""Routing decisions and request records to the bus, never blocking a request.

``submit_*`` puts the event in a bounded queue and returns at once; when the queue is full the
event is dropped and counted (``infernex_router_records_dropped_total``). A background task
publishes to JetStream (``router.decisions.<pool>``, ``router.requests.<pool>``); a publish that
gets no ack after its retries is counted as ``infernex_router_records_unconfirmed_total`` (it may
have been stored: the ack, not the record, may be what was lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from operator import attrgetter
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter

from schemas import subjects as S
from schemas.base import SCHEMA_VERSION, Event
from schemas.records import RequestRecord, RoutingDecision, pack_keys
from streams.kv_keys import KEY_SCHEME

log = logging.getLogger(__name__)


#: :class:`schemas.records.BackendInput` fields that change only with ``ClusterState.epoch`` (load,
#: device utilisation, health, identity) and those the router changes per request (its own counters)
STATIC_FIELDS = ("pod", "model", "role", "group", "pool", "loras", "node", "waiting", "running", "kv_usage",
                 "num_gpu_blocks", "cpu_util", "mem_util", "health", "draining")
VOLATILE_FIELDS = ("inflight", "active_tokens", "pending_prefill_tokens", "circuit_open")
BACKEND_FIELDS = STATIC_FIELDS + VOLATILE_FIELDS
_static = attrgetter(*STATIC_FIELDS)
_volatile = attrgetter(*VOLATILE_FIELDS)


class BackendCapture:
    """Copies the backends a decision read, synchronously at the decision (the objects change
    afterwards). The epoch-tracked fields are copied once per ``ClusterState.epoch`` and shared by
    the decisions of that epoch; only the router's own counters are copied every time."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: list[tuple] = []

    def __call__(self, backends: Sequence[Any], epoch: int | None) -> tuple[list[tuple], list[tuple]]:
        key = (epoch, id(backends), len(backends))
        if epoch is None or key != self._key:
            self._rows = list(map(_static, backends))
            self._key = key
        return self._rows, list(map(_volatile, backends))


def capture_backends(backends: Sequence[Any]) -> tuple[list[tuple], list[tuple]]:
    """One capture without epoch sharing (tests, tools)."""
    return BackendCapture()(backends, None)


_SETTINGS: dict[int, tuple[Any, dict[str, Any]]] = {}


def strategy_settings(strategy) -> dict[str, Any]:
    """A :class:`router.profiles.Strategy` written back as the EndpointPickerConfig mapping it was
    built from (plugins with their validated parameters, profiles with weights), so
    ``build_strategy(name, settings)`` rebuilds one that decides the same. Cached per strategy."""
    hit = _SETTINGS.get(id(strategy))
    if hit is not None and hit[0] is strategy:
        return hit[1]
    plugins: dict[str, dict[str, Any]] = {}

    def spec(p) -> None:
        plugins.setdefault(p.name, {"name": p.name, "type": p.type_name,
                                    "parameters": p.params.model_dump(mode="json")})

    if strategy.handler.type_name != "single-profile-handler":
        spec(strategy.handler)
    profiles = []
    for prof in strategy.profiles.values():
        refs = []
        for f in prof.filters:
            spec(f)
            refs.append({"pluginRef": f.name})
        for s, w in prof.scorers:
            spec(s)
            refs.append({"pluginRef": s.name, "weight": w})
        spec(prof.picker)
        refs.append({"pluginRef": prof.picker.name})
        profiles.append({"name": prof.name, "plugins": refs})
    out = {"description": strategy.description, "plugins": list(plugins.values()), "schedulingProfiles": profiles}
    _SETTINGS[id(strategy)] = (strategy, out)
    return out


def decision_inputs(*, strategy, request, exclude, backends: tuple[list[tuple], list[tuple]], now: float,
                    block_size: int, overlap: dict[str, int], predicted: dict[str, int] | None = None,
                    prompt_keys: Sequence[int] | None = None) -> dict[str, Any]:
    """A :class:`schemas.records.DecisionInputs` mapping from what :meth:`router.core.Router.decide`
    read (``backends`` from a :class:`BackendCapture`); the backends in the compact columnar form,
    the prompt's block keys in the packed form (:func:`schemas.records.pack_keys`).
    ``prompt_keys``: the whole prompt's block keys at ``block_size`` when already hashed."""
    static, volatile = backends
    rows = [s + v for s, v in zip(static, volatile)]  # loras stay a frozenset: msgspec writes it as an array
    keys = None
    ids = request.token_ids
    if prompt_keys is not None and ids is not None and len(ids) > 1:
        keys = pack_keys(prompt_keys[: (len(ids) - 1) // block_size])  # at most len-1 tokens, as the router reads
    elif ids is not None and len(ids) > 1 and block_size > 0:
        from streams.kv_index import block_keys
        from streams.kv_keys import request_salt

        # the prompt's reusable blocks as the index keys them (at most len-1 tokens, as the router reads)
        keys = pack_keys(block_keys(ids[: len(ids) - 1], block_size, lora=request.lora,
                                    salt=request_salt(request.cache_salt)))
    out = {"now": now, "strategy": strategy_settings(strategy), "prompt_tokens": request.prompt_tokens,
            "max_tokens": request.max_tokens, "lora": request.lora, "cache_salt_set": request.cache_salt is not None,
            "index_model": request.index_model, "exclude": sorted(exclude), "block_size": block_size,
            "overlap": dict(overlap), "prefix_keys": keys, "key_scheme": KEY_SCHEME if keys is not None else None,
            "backends": {"columns": BACKEND_FIELDS, "rows": rows}}
    if predicted:
        out["predicted"] = dict(predicted)
    return out


def decision_json(*, request_id: str, ts: float, pool: str, model: str, profile: str, stage,
                  inputs: dict[str, Any] | None = None) -> bytes:
    """A :class:`schemas.records.RoutingDecision` as JSON, written straight from a
    :class:`router.types.StageResult` with msgspec: building and validating the model with its
    64 candidates costs ~10x more, for data the router made itself (tests check the two agree).
    ``inputs``: :func:`decision_inputs` (the first stage carries them)."""
    return msgspec.json.encode({
        "schema_version": SCHEMA_VERSION, "request_id": request_id, "ts": ts, "pool": pool, "model": model,
        "profile": profile, "stage": stage.stage, "picked": stage.picked.pod if stage.picked else None,
        "reason": stage.reason[:1000], "candidates": stage.candidate_dicts(), "inputs": inputs})


class RecordSink:
    """Bounded in-memory buffer; ``drain_to`` consumes it (subclasses publish)."""

    def __init__(self, pool: str, *, buffer: int = 10_000, prefix: str | None = None,
                 registry: CollectorRegistry | None = None):
        self.pool = pool
        self.prefix = prefix
        self.queue: asyncio.Queue[tuple[str, Event, str]] = asyncio.Queue(maxsize=buffer)
        self.dropped = 0
        self.published = 0
        self._dropped = Counter("infernex_router_records_dropped_total",
                                "Records dropped because the publish buffer was full", ["kind"], registry=registry)
        self._published = Counter("infernex_router_records_published_total", "Records published", ["kind"],
                                  registry=registry)
        self.unconfirmed = 0
        self._unconfirmed = Counter("infernex_router_records_unconfirmed_total",
                                    "Records whose publish got no JetStream ack after retries (maybe stored, "
                                    "maybe not; a retry within the duplicate window would not store it twice)",
                                    ["kind"], registry=registry)
        self._dec_subject = S.with_prefix(prefix, S.router_decisions(pool))
        self._req_subject = S.with_prefix(prefix, S.router_requests(pool))

    def _put(self, kind: str, subject: str, ev, msg_id: str) -> None:
        try:
            self.queue.put_nowait((subject, ev, msg_id))
        except asyncio.QueueFull:
            self.dropped += 1
            self._dropped.labels(kind).inc()

    def submit_decision(self, d: RoutingDecision | Callable[[], RoutingDecision | bytes],
                        msg_id: str | None = None) -> None:
        """``d`` may be a zero-argument callable building the event or its JSON (called by the publisher)."""
        if msg_id is None:
            msg_id = f"dec:{d.request_id}:{d.stage}:{d.ts}"
        self._put("decision", self._dec_subject, d, msg_id)

    def submit_request(self, r: RequestRecord | Callable[[], RequestRecord], msg_id: str | None = None) -> None:
        """``r`` may be a zero-argument callable building the record (then ``msg_id`` is required)."""
        if msg_id is None:
            msg_id = f"req:{r.request_id}"
        self._put("request", self._req_subject, r, msg_id)

    @staticmethod
    def build(ev) -> Event:
        return ev() if callable(ev) else ev


class BusRecordSink(RecordSink):
    """Publishes to JetStream without waiting for each ack in turn: up to ``window`` records are in
    flight at once (JetStream's async publish: one reply subscription carries every ack). A record
    whose ack is an error or does not come within ``ack_timeout`` is published again with the same
    ``Nats-Msg-Id`` (the stream's duplicate window stores it once), with retries; if that fails too
    it is counted unconfirmed. Against awaiting each ack in turn this saves about a tenth of the
    publisher's CPU and a fifth of nats-server's per record (bench/records_publish.py)."""

    def __init__(self, js, pool: str, *, window: int = 256, ack_timeout: float = 2.0, retries: int = 2, **kw):
        super().__init__(pool, **kw)
        self._js = js
        self._window = window
        self._ack_timeout = ack_timeout
        self._retries = retries
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task | None = None
        self._again: set[asyncio.Task] = set()
        self._stopped = False
        self.inflight = 0  # taken from the queue, not yet acked or counted unconfirmed

    def start(self) -> None:
        self._slots = asyncio.Semaphore(self._window)
        self._task = asyncio.create_task(self._run(), name="router-records")

    def _kind(self, subject: str) -> str:
        return "decision" if subject == self._dec_subject else "request"

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        slots = self._slots
        while True:
            subject, ev, msg_id = await self.queue.get()
            await slots.acquire()
            self.inflight += 1
            try:
                ev = self.build(ev)
                data = ev if isinstance(ev, bytes) else ev.to_json()
            except Exception as exc:  # noqa: BLE001 - a record that cannot be built is lost, not fatal
                log.warning("record for %s could not be built: %s", subject, type(exc).__name__)
                self._settle(subject, False)
                continue
            try:
                fut = await self._js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id})
            except Exception:  # noqa: BLE001 - e.g. the connection is closed: the slow path retries
                self._publish_again(subject, data, msg_id)
                continue
            timer = loop.call_later(self._ack_timeout, fut.cancel)
            fut.add_done_callback(partial(self._acked, subject, data, msg_id, timer))

    def _acked(self, subject: str, data: bytes, msg_id: str, timer: asyncio.TimerHandle, fut: asyncio.Future) -> None:
        timer.cancel()
        if not fut.cancelled() and fut.exception() is None:
            self._settle(subject, True)
        elif self._stopped:  # an ack still pending when the publisher stopped: no retry any more
            self._settle(subject, False)
        else:  # no ack in time (the connection was down, the server restarted) or an error reply
            self._publish_again(subject, data, msg_id)

    def _publish_again(self, subject: str, data: bytes, msg_id: str) -> None:
        task = asyncio.create_task(self._again_task(subject, data, msg_id))
        self._again.add(task)
        task.add_done_callback(self._again.discard)

    async def _again_task(self, subject: str, data: bytes, msg_id: str) -> None:
        from consumers import bus

        try:
            await bus.publish(self._js, subject, data, msg_id=msg_id, retries=self._retries, timeout=self._ack_timeout)
        except Exception as exc:  # noqa: BLE001 - a lost record must not stop the publisher
            log.warning("record publish to %s failed: %s", subject, type(exc).__name__)
            self._settle(subject, False)
        else:
            self._settle(subject, True)

    def _settle(self, subject: str, ok: bool) -> None:
        self.inflight -= 1
        self._slots.release()
        if ok:
            self.published += 1
            self._published.labels(self._kind(subject)).inc()
        else:
            self.unconfirmed += 1
            self._unconfirmed.labels(self._kind(subject)).inc()

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued record is acked or counted unconfirmed (at most ``timeout``)."""
        end = asyncio.get_running_loop().time() + timeout
        while (not self.queue.empty() or self.inflight) and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        from consumers.bus import cancel_task

        self._stopped = True
        if self._task is not None:
            await cancel_task(self._task)
            self._task = None
        for t in list(self._again):
            await cancel_task(t)
