"""What the router's KV feed costs per message: the KV events of a routing run, fed again.

    python -P bench/routing_http.py ... -r kv-aware --keep-kv /tmp/kv.msgpack   # capture once
    python -P bench/router_feed.py /tmp/kv.msgpack [--rounds 3] [--profile]

``routing_http.py --keep-kv`` writes every message of the KV stream of that bench (subject,
headers, payload: the bridges' binary groups as the router's feed read them) to a file. This bench
then measures, on the same messages, interleaved over ``--rounds``:

* ``fold``: the router's feed callback alone, in process (no NATS): decode and fold into the
  router's embedded :class:`streams.kv_index.KvIndex` (configured as ``router.app`` does);
* ``bus``: the whole feed: the messages published to a fresh JetStream stream on an embedded
  nats-server, then a :class:`router.feeds.BusFeeds` reading them from the start (ordered push
  consumer, as the router does) until it has applied them all.

Reported: CPU (user + system of this process) per message and per block event, and, for ``bus``,
what nats-py's delivery adds over the fold. ``--profile`` prints cProfile's top entries of one
``bus`` pass.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Msg(msgspec.Struct, array_like=True):
    subject: str
    headers: dict[str, str] | None
    data: bytes


async def dump_stream(js, stream: str, path: Path) -> int:
    """Every message of ``stream`` (from its first) to ``path``; how many."""
    return save(path, await read_stream(js, stream))


def save(path: Path, msgs: list[Msg]) -> int:
    """``msgs`` to ``path`` (:func:`load` reads them back); how many."""
    path.write_bytes(msgspec.msgpack.encode(msgs))
    return len(msgs)


async def read_stream(js, stream: str) -> list[Msg]:
    """Every message of ``stream``, from its first."""
    info = await js.stream_info(stream)
    last = info.state.last_seq
    out: list[Msg] = []
    if info.state.messages:
        sub = await js.subscribe(">", ordered_consumer=True, stream=stream)
        try:
            while True:
                m = await sub.next_msg(timeout=10)
                out.append(Msg(m.subject, dict(m.headers) if m.headers else None, m.data))
                if m.metadata.sequence.stream >= last:
                    break
        finally:
            await sub.unsubscribe()
    return out


def load(path: Path) -> list[Msg]:
    return msgspec.msgpack.decode(path.read_bytes(), type=list[Msg])


def _cpu() -> float:
    return time.process_time()  # (user + system of this process, at the clock's resolution, not os.times' 10 ms)


def _index():
    from router.config import RouterConfig
    from streams.clock import SystemClock
    from streams.kv_index import KvIndex

    cfg = RouterConfig()
    return KvIndex(SystemClock(), default_block_size=cfg.block_size, predict_on_route_ttl_s=cfg.route_prediction_ttl_s)


def blocks_of(msgs: list[Msg]) -> int:
    """Stored + removed block events of the messages (a group's batches and single batches alike)."""
    from consumers.index_codec import decode_batch, message_parts

    n = 0
    for m in msgs:
        for part in message_parts(m.data):
            for e in decode_batch(part).events:
                hashes = getattr(e, "block_hashes", None)
                if hashes is not None:
                    n += len(hashes)
    return n


class _Fake:
    __slots__ = ("subject", "data", "headers", "reply")

    def __init__(self, m: Msg):
        self.subject, self.data, self.headers, self.reply = m.subject, m.data, m.headers, ""


async def fold_pass(msgs: list[Msg]) -> float:
    """The feed's own callback on each message (no NATS): decode and fold."""
    from prometheus_client import CollectorRegistry

    from router.config import RouterConfig
    from router.feeds import BusFeeds
    from router.state import ClusterState
    from schemas import KvEventBatch

    class _NoBus:
        def jetstream(self):
            return None

    feeds = BusFeeds(_NoBus(), ClusterState(RouterConfig()), index=_index(), registry=CollectorRegistry())
    cb = feeds._callback("KV_EVENTS", KvEventBatch, feeds._apply_kv)
    fakes = [_Fake(m) for m in msgs]
    c0 = _cpu()
    for f in fakes:
        await cb(f)
    return _cpu() - c0


async def bus_pass(msgs: list[Msg], profile: bool = False) -> float:
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from infernex.embedded_nats import EmbeddedNats
    from infernex.settings import NatsConfig
    from router.config import RouterConfig
    from router.feeds import BusFeeds
    from router.state import ClusterState
    from streams.topology import build_topology

    tmp = Path(tempfile.mkdtemp(prefix="router-feed-"))
    server = EmbeddedNats(tmp / "nats")
    server.start()
    nc = feeds = None
    try:
        nc = await bus.connect(NatsConfig(servers=[server.url]), name="feed-bench-pub")
        js = nc.jetstream()
        await bus.apply_topology(js, build_topology())
        for m in msgs:
            await js.publish(m.subject, m.data, headers=m.headers)
        index = _index()
        reg = CollectorRegistry()
        rnc = await bus.connect(NatsConfig(servers=[server.url]), name="feed-bench-router", no_echo=True)
        feeds = BusFeeds(rnc, ClusterState(RouterConfig()), index=index, registry=reg)
        counter = feeds.applied.labels("KvEventBatch")
        from consumers.index_codec import fold_group

        want = sum(len(fold_group(m.data) or [0]) for m in msgs)  # batches: a group counts each of its batches
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        c0 = _cpu()
        await feeds.start()
        while counter._value.get() < want:
            await asyncio.sleep(0.002)
        cpu = _cpu() - c0
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        await feeds.stop()
        await rnc.close()
        return cpu
    finally:
        if nc is not None:
            await nc.close()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    msgs = load(args.file)
    nb = blocks_of(msgs)
    print(f"{len(msgs)} messages, {nb} stored/removed block events, "
          f"{sum(len(m.data) for m in msgs) / len(msgs) / 1024:.1f} KiB a message; load {os.getloadavg()[0]:.2f}")
    asyncio.run(fold_pass(msgs))  # compile / warm caches
    rows: dict[str, list[float]] = {"fold": [], "bus": []}
    for _ in range(args.rounds):
        rows["fold"].append(asyncio.run(fold_pass(msgs)))
        rows["bus"].append(asyncio.run(bus_pass(msgs)))
    for k, v in rows.items():
        s = statistics.median(v)
        print(f"{k:5} {1e6 * s / len(msgs):8.1f} us/message  {1e9 * s / max(nb, 1):8.1f} ns/block  "
              f"(CPU {s:.3f} s, rounds {', '.join(f'{x:.3f}' for x in v)})")
    if args.profile:
        asyncio.run(bus_pass(msgs, profile=True))


if __name__ == "__main__":
    main()
