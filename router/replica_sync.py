"""Router replicas of one pool share their own in-flight load per engine.

Each replica counts what it has sent to each engine and not yet seen finish: requests, their
prompt tokens, and their prompt tokens not yet prefilled (``ClusterState.started`` /
``first_token`` / ``finished``). kv-aware and the load scorers read these counts, which are exact
when a request is placed, while the engines' own metrics arrive only every scrape interval. With
two or more replicas behind one Service (the chart's default is two), each would see only its own
share, and replicas that get requests at the same moment would all pick the same engine that
looks idle.

So each replica publishes its own counts (:class:`schemas.records.ReplicaLoad`) on core NATS
``router.sync.<pool>``: when it starts, every ``heartbeat_s``, and, while it hears other replicas,
when its counts change, at most once every ``interval_s`` (a busy replica sends one message per
interval with all that changed). A replica alone sends only the heartbeat. It adds the other replicas' counts to its backends (``ClusterState.add_peer_load``).
The values are absolute, so a lost message is made good by the next. A replica that stops sends a
final message; one that goes silent for ``expire_s`` is forgotten.

With kv-aware's approximate prefix mode a replica also counts the prompts it just routed as the
engine's predicted blocks until the engine's KV events say what it holds. The same message
carries those routes (:class:`schemas.records.RoutedPrompt`, block keys packed, and the keys of
the text a lazily tokenized prompt left untokenized: :mod:`router.lazy_prompt`), and the others
record them in their own index (and piece routes). A second request with the same new prefix then goes to the same
engine whichever replica receives it.

A route ends earlier on the replica that made it: its untokenized text's routes ``SETTLE_S`` after
its request ends (:meth:`router.lazy_prompt.PieceRoutes.settle`), and its predicted blocks at once
when the request left the engine before its prefill ran there (``KvIndex.forget_route``). The
others must end it too, or they count blocks the engine does not hold for the route's whole time
to live. So the replica sends those ends (:class:`schemas.records.RouteEnds`: per route, the model,
the engine and the same packed piece or block keys) on ``router.sync.<pool>.ends``, batched like
the routes: at most one message per interval, after the load message that carried the routes. A
receiver settles the piece routes ``SETTLE_S`` after the end arrives, by its own clock (the
sender's may differ), and forgets the blocks on that engine only. A subject of its own, not a field of :class:`~schemas.records.ReplicaLoad`: during a rolling upgrade
a replica from before it (subscribed to ``router.sync.<pool>`` exactly) never sees these, where a
new field would make it refuse every load message; it sends no ends, and its routes last their time
to live on the others, as before. The two subjects are read by two subscriptions, which need not
deliver in order, so each ends message names the sender's last load message before it
(``load_seq``) and a receiver that has not applied that one yet holds the ends until it has.

A message that does not decode goes to the dead-letter subject with the reason and is counted, and
the rest carry on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge

from consumers.bus import DeadLetters, cancel_task
from router import lazy_prompt
from router.state import ClusterState
from schemas import ReplicaLoad, ValidationFailure, decode_event
from schemas import subjects as S
from schemas.records import RoutedPrompt, RouteEnd, RouteEnds, pack_keys, packed_bytes

#: a message carries at most this many routed prompts, and this many characters of their keys (a
#: 35k-token prompt is about 24 KB); beyond, a route is left to the engine's KV events
MAX_ROUTES = 256
MAX_ROUTE_BYTES = 512 * 1024
#: the same bounds for a message of route ends; beyond, a route lasts its time to live on the others
MAX_ENDS = MAX_ROUTES
MAX_END_BYTES = MAX_ROUTE_BYTES
#: ends messages held per replica until its load message they follow arrives (see the module's description)
MAX_HELD_ENDS = 64


def key_array(packed: str) -> np.ndarray:
    """The ``uint64`` keys of a packed string (:func:`schemas.records.pack_keys`)."""
    return np.frombuffer(packed_bytes(packed, "keys"), dtype="<u8").astype(np.uint64, copy=False)

log = logging.getLogger(__name__)


def replica_id() -> str:
    """Unique per process: the host name (the pod's name in Kubernetes), the pid and a random part."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ReplicaSync:
    def __init__(self, nc, state: ClusterState, *, pool: str, prefix: str | None = None,
                 replica: str | None = None, interval_s: float = 0.01, heartbeat_s: float = 1.0,
                 expire_s: float = 3.0, index: Any = None, registry: CollectorRegistry | None = None):
        if not 0 < interval_s <= heartbeat_s < expire_s:
            raise ValueError("replica sync needs 0 < interval_s <= heartbeat_s < expire_s")
        self.nc = nc
        self.state = state
        self.pool = pool
        self.replica = replica or replica_id()
        self.subject = S.with_prefix(prefix, S.router_sync(pool))
        self.ends_subject = S.with_prefix(prefix, S.router_sync_ends(pool))
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.expire_s = expire_s
        self.index = index  # the embedded KV index: the others' routes become predicted blocks there
        self.piece_routes = None  # router.lazy_prompt.PieceRoutes: the others' untokenized text, where it went
        self._routes: list[RoutedPrompt] = []  # this replica's routes not yet sent
        self._routes_bytes = 0
        self._ends: list[RouteEnd] = []  # ends of this replica's routes not yet sent
        self._ends_bytes = 0
        # peer replica -> its ends messages waiting for the load message they follow, with when they came
        self._held: dict[str, list[tuple[RouteEnds, float]]] = {}
        self.dead = DeadLetters(nc.jetstream(), consumer=f"router-sync-{self.replica}", registry=registry,
                                prefix=prefix)
        # peer replica -> (its last seq, when heard (monotonic), its pods' counts as added to the state)
        self.peers: dict[str, tuple[int, float, dict[str, tuple[int, int, int]]]] = {}
        self._seq = 0
        self._load_seq = 0  # the seq of this replica's last load message
        self._sent: dict[str, tuple[int, int, int]] | None = None
        self._sent_at = 0.0
        self._sub = None
        self._ends_sub = None
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._m_msgs = Counter("infernex_router_sync_messages_total", "Replica-sync messages, by direction",
                               ["direction"], registry=registry)
        self._m_peers = Gauge("infernex_router_sync_peers", "Other router replicas of this pool heard from",
                              registry=registry)
        self._m_routes = Counter("infernex_router_sync_routes_total", "Routed prompts shared with the other "
                                 "replicas (sent), taken as predicted blocks (received), or left out of a full "
                                 "message (dropped)", ["direction"], registry=registry)
        self._m_expired = Counter("infernex_router_sync_expired_total",
                                  "Replicas forgotten because they went silent (their load taken away)",
                                  registry=registry)
        self._m_ends = Counter("infernex_router_sync_route_ends_total", "Ends of routed prompts (a request "
                               "over, or gone before its prefill) shared with the other replicas (sent), applied "
                               "to their routes (received), or left out of a full message (dropped)",
                               ["direction"], registry=registry)
        for d in ("sent", "received", "dropped"):  # (at 0 from the start: a rate or an increase sees the first)
            self._m_ends.labels(d)

    async def start(self) -> None:
        self._changed = asyncio.Event()
        self.state.on_own_change = self._changed.set
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_msg)
        self._ends_sub = await self.nc.subscribe(self.ends_subject, cb=self._on_ends_msg)
        try:
            await self.tick(time.monotonic())  # say hello: replicas already running start sending to us
        except Exception as exc:  # noqa: BLE001 - the heartbeat says it again
            log.warning("replica sync: hello not sent: %s", type(exc).__name__)
        self._task = asyncio.create_task(self._run(), name="router-replica-sync")

    async def stop(self) -> None:
        """Stop publishing and tell the other replicas to forget this one's load."""
        self.state.on_own_change = None
        await cancel_task(self._task)
        self._task = None
        try:
            await self._publish_ends()  # the ends of routes sent already; the routes not sent are dropped
            await self._publish({}, final=True)
            await self.nc.flush(timeout=1)
        except Exception as exc:  # noqa: BLE001 - the others forget us after expire_s anyway
            log.debug("replica sync: final message not sent: %s", type(exc).__name__)
        for sub in (self._sub, self._ends_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection may be closing
                    pass
        self._sub = self._ends_sub = None
        for peer in list(self.peers):
            self._forget(peer)
        self._held.clear()

    # -- sending ------------------------------------------------------------------------
    async def _run(self) -> None:
        changed = self._changed
        while True:
            # with other replicas: woken by a change of this replica's own counts (no wake-ups while
            # nothing changes) or by the heartbeat, then at most one message per interval whatever
            # changed meanwhile; alone: the heartbeat only, for a replica that may join
            if self.peers:
                try:
                    await asyncio.wait_for(changed.wait(), self.heartbeat_s)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(self.heartbeat_s)
            changed.clear()
            try:
                await self.tick(time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - NATS down: the next tick tries again
                log.warning("replica sync: %s", type(exc).__name__)
            await asyncio.sleep(self.interval_s)

    def info(self) -> dict:
        """This replica's id and the others it hears, with how long ago (for /v1/router/backends)."""
        now = time.monotonic()
        return {"self": self.replica, "others": {r: {"heard_s_ago": round(now - heard, 3), "seq": seq}
                                                  for r, (seq, heard, _) in self.peers.items()}}

    def add_route(self, model: str, pod: str, keys: Any, pieces: Any = None) -> None:
        """Share a prompt this replica just sent to ``pod`` (its block keys, the ones it predicted
        there, and the keys of its text left untokenized: :mod:`router.lazy_prompt`) with the other
        replicas, in the next message; nothing while it is alone."""
        if not self.peers or not (len(keys) or pieces):
            return
        r = RoutedPrompt.model_construct(model=model, pod=pod, keys=pack_keys(keys),
                                         pieces=pack_keys(pieces) if pieces else None)  # made here: no re-check
        size = len(r.keys) + len(r.pieces or "")
        if len(self._routes) >= MAX_ROUTES or self._routes_bytes + size > MAX_ROUTE_BYTES:
            self._m_routes.labels("dropped").inc()  # the others learn it from the engine's KV events
            return
        self._routes.append(r)
        self._routes_bytes += size
        self._changed.set()

    def add_end(self, model: str, pod: str, kind: str, keys: Any = None, pieces: Any = None) -> None:
        """Tell the other replicas, in the next ends message, that a prompt this replica routed to
        ``pod`` stops counting there: ``settle`` (its request is over; ``pieces``, the keys of its
        untokenized text, as :meth:`add_route` had them) or ``forget`` (it left ``pod`` before its
        prefill ran; ``keys``, its block keys). ``keys`` and ``pieces`` may be packed already
        (:func:`schemas.records.pack_keys`), so one prompt's are packed once for all its engines.
        Nothing while this replica is alone: no other replica has its routes."""
        if not self.peers:
            return
        if kind == "settle":
            if pieces is None or not len(pieces):
                return
            e = RouteEnd.model_construct(model=model, pod=pod, kind=kind, keys=None,
                                         pieces=pieces if isinstance(pieces, str) else pack_keys(pieces))
        elif kind == "forget":
            if keys is None or not len(keys):
                return
            e = RouteEnd.model_construct(model=model, pod=pod, kind=kind, pieces=None,
                                         keys=keys if isinstance(keys, str) else pack_keys(keys))
        else:
            raise ValueError(f"route end kind {kind!r} is neither settle nor forget")
        size = len(e.keys or "") + len(e.pieces or "")
        if len(self._ends) >= MAX_ENDS or self._ends_bytes + size > MAX_END_BYTES:
            self._m_ends.labels("dropped").inc()  # the route lasts its time to live on the others
            return
        self._ends.append(e)
        self._ends_bytes += size
        self._changed.set()

    async def tick(self, now: float) -> None:
        """Publish this replica's load if the heartbeat is due, or if it changed and other replicas
        listen; forget replicas gone silent."""
        own = self.state.own_load()
        if ((own != self._sent or self._routes) and self.peers) or now - self._sent_at >= self.heartbeat_s:
            routes, self._routes, self._routes_bytes = self._routes, [], 0
            await self._publish(own, routes=routes)
            self._sent, self._sent_at = own, now
            if routes:
                self._m_routes.labels("sent").inc(len(routes))
        # after the load message: the routes these ends refer to have gone out before them
        if self.peers:
            await self._publish_ends()
        else:
            self._ends, self._ends_bytes = [], 0  # no other replica left that holds the routes
        for peer, (_, heard, _) in list(self.peers.items()):
            if now - heard > self.expire_s:
                log.warning("replica sync: %s silent for %.1fs; its load is forgotten", peer, now - heard)
                self._forget(peer)
                self._m_expired.inc()
        for peer, held in list(self._held.items()):  # the load message they waited for never came
            held[:] = [(m, t) for m, t in held if now - t <= self.expire_s]
            if not held:
                del self._held[peer]

    async def _publish(self, pods: dict[str, tuple[int, int, int]], final: bool = False,
                       routes: list[RoutedPrompt] | None = None) -> None:
        self._seq += 1
        msg = ReplicaLoad(replica=self.replica, pool=self.pool, seq=self._seq, ts=time.time(), pods=pods,
                          routes=routes or [], final=final)
        await self.nc.publish(self.subject, msg.to_json())
        self._load_seq = self._seq
        self._m_msgs.labels("sent").inc()

    async def _publish_ends(self) -> None:
        if not self._ends:
            return
        ends, self._ends, self._ends_bytes = self._ends, [], 0
        self._seq += 1
        msg = RouteEnds(replica=self.replica, pool=self.pool, seq=self._seq, load_seq=self._load_seq,
                        ts=time.time(), ends=ends)
        await self.nc.publish(self.ends_subject, msg.to_json())
        self._m_msgs.labels("sent").inc()
        self._m_ends.labels("sent").inc(len(ends))

    # -- receiving ----------------------------------------------------------------------
    async def _from_peer(self, model, msg):  # noqa: ANN001, ANN202 - a schema class, a nats-py message
        """``msg`` decoded as ``model`` when another replica of this pool sent it, else None (a
        message that does not decode is dead-lettered with the reason)."""
        try:
            ev = decode_event(model, msg.data)
        except ValidationFailure as exc:
            await self.dead.send(S.ROUTER, msg.subject, msg.data, str(exc))
            return None
        if ev.replica == self.replica or ev.pool != self.pool:
            return None  # our own (a connection with echo) or another pool's replica on a shared subject
        self._m_msgs.labels("received").inc()
        return ev

    async def _on_msg(self, msg) -> None:
        load = await self._from_peer(ReplicaLoad, msg)
        if load is not None:
            self.apply(load, time.monotonic())

    async def _on_ends_msg(self, msg) -> None:
        ends = await self._from_peer(RouteEnds, msg)
        if ends is not None:
            self.apply_ends(ends, time.monotonic())

    def apply_ends(self, ends: RouteEnds, now: float) -> None:
        """End the routes a replica recorded here that it says have ended; held until its load
        message ``ends.load_seq`` (which carried them, or one before) has been applied."""
        peer = self.peers.get(ends.replica)
        if peer is None or peer[0] < ends.load_seq:
            held = self._held.setdefault(ends.replica, [])
            if len(held) >= MAX_HELD_ENDS:
                held.pop(0)
            held.append((ends, now))
            return
        self._end_routes(ends, now)

    def _end_routes(self, ends: RouteEnds, now: float) -> None:
        forget = getattr(self.index, "forget_route", None)
        until = now + lazy_prompt.SETTLE_S  # the receiver's clock: the sender's may differ
        for e in ends.ends:
            try:
                if e.kind == "settle":
                    if self.piece_routes is not None:
                        self.piece_routes.settle(e.model, key_array(e.pieces).tolist(), e.pod, until)
                elif forget is not None:
                    forget(e.model, e.pod, key_array(e.keys))
            except (KeyError, ValueError) as exc:
                log.debug("replica sync: route end on %s not applied: %s", e.pod, exc)
        self._m_ends.labels("received").inc(len(ends.ends))

    def _release_held(self, replica: str, seq: int) -> None:
        """Apply the ends ``replica`` sent after its load message ``seq``, now applied."""
        held = self._held.get(replica)
        if not held:
            return
        keep = []
        for m, t in held:
            if m.load_seq <= seq:
                self._end_routes(m, t)
            else:
                keep.append((m, t))
        if keep:
            self._held[replica] = keep
        else:
            del self._held[replica]

    def apply(self, load: ReplicaLoad, now: float) -> None:
        """Fold one replica's message into the state (the difference from what it said before)."""
        old = self.peers.get(load.replica)
        if old is not None and load.seq <= old[0]:
            return  # older than what is held (one connection keeps its order; a restarted replica has a new id)
        before = old[2] if old is not None else {}
        after = {} if load.final else load.pods
        for pod in before.keys() | after.keys():
            b, a = before.get(pod, (0, 0, 0)), after.get(pod, (0, 0, 0))
            if a != b:
                self.state.add_peer_load(pod, a[0] - b[0], a[1] - b[1], a[2] - b[2])
        if load.final:
            self.peers.pop(load.replica, None)
        else:
            self.peers[load.replica] = (load.seq, now, dict(after))
        self._m_peers.set(len(self.peers))
        rec = getattr(self.index, "record_route", None)
        if rec is not None and load.routes:
            for r in load.routes:
                try:
                    keys = key_array(r.keys)
                    if len(keys):
                        rec(r.model, r.pod, keys=keys)
                    if r.pieces and self.piece_routes is not None:
                        self.piece_routes.add(r.model, key_array(r.pieces).tolist(), r.pod, now)
                except (KeyError, ValueError) as exc:  # e.g. a model this index has no block size for
                    log.debug("replica sync: route of %s not predicted: %s", r.pod, exc)
            self._m_routes.labels("received").inc(len(load.routes))
        if self._held:  # ends that came before this message, for routes in it or before it
            self._release_held(load.replica, load.seq)
            if load.final:
                self._held.pop(load.replica, None)

    def _forget(self, peer: str) -> None:
        self._held.pop(peer, None)
        _, _, pods = self.peers.pop(peer)
        for pod, (i, a, p) in pods.items():
            self.state.add_peer_load(pod, -i, -a, -p)
        self._m_peers.set(len(self.peers))
