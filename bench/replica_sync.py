"""CPU of the router replicas' load sharing (router/replica_sync.py), without routers or engines.

    python -P bench/replica_sync.py [--seconds 5] [--changes 200] [--interval 0.01]

Two ReplicaSync instances, each with its own NATS connection (no echo, as the router connects) to a
nats-server started here, and a ClusterState of 8 engines each. A task changes each replica's own
counts ``--changes`` times a second (a request starting or finishing). The process's CPU over
``--seconds`` is compared with the same churn and no sync. Also idle: no changes, heartbeats only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import uvloop  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from consumers import bus  # noqa: E402
from infernex.embedded_nats import EmbeddedNats  # noqa: E402
from router.config import RouterConfig, StaticBackend  # noqa: E402
from router.replica_sync import ReplicaSync  # noqa: E402
from router.state import ClusterState  # noqa: E402
from schemas.config import NatsConfig  # noqa: E402


async def one(url: str, *, sync: bool, changes: float, seconds: float, interval: float) -> tuple[float, float]:
    ncs = [await bus.connect(NatsConfig(servers=[url]), no_echo=True) for _ in range(2)]
    cfg = RouterConfig(backends=[StaticBackend(pod=f"e{i}", url=f"http://e{i}", model="m") for i in range(8)])
    states = [ClusterState(cfg) for _ in range(2)]
    syncs = [ReplicaSync(nc, st, pool="p", interval_s=interval, registry=CollectorRegistry())
             for nc, st in zip(ncs, states)]
    if sync:
        for s in syncs:
            await s.start()

    async def churn() -> None:
        i = 0
        while True:
            await asyncio.sleep(1.0 / changes)
            for st in states:
                b = st.get(f"e{i % 8}")
                st.started(b, 100, 50) if i % 2 == 0 else st.finished(b, 100, 50)
            i += 1

    task = asyncio.create_task(churn()) if changes > 0 else None
    c0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    sent = sum(s._seq for s in syncs) if sync else 0
    if task is not None:
        task.cancel()
    if sync:
        for s in syncs:
            await s.stop()
    for nc in ncs:
        await nc.close()
    return 1000 * cpu / wall, sent / wall


async def main(args) -> None:
    with EmbeddedNats() as srv:
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; 2 replicas, 8 engines, "
              f"interval {args.interval * 1000:.0f} ms")
        for changes in (0.0, args.changes):
            off, _ = await one(srv.url, sync=False, changes=changes, seconds=args.seconds, interval=args.interval)
            on, rate = await one(srv.url, sync=True, changes=changes, seconds=args.seconds, interval=args.interval)
            per = (on - off) / rate * 1000 / 2 if rate else float("nan")
            print(f"{changes:5.0f} changes/s per replica: CPU of both {off:6.1f} ms/s without sync, {on:6.1f} with "
                  f"({rate:5.1f} messages/s from both; {per:5.0f} us per message per replica)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--changes", type=float, default=200.0)
    ap.add_argument("--interval", type=float, default=0.01)
    uvloop.run(main(ap.parse_args()))
