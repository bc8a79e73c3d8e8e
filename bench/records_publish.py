"""The router's record publishing: CPU per record, publisher awaiting each ack against the async
publisher (router.records.BusRecordSink), and decision records with JSON-integer block keys
against packed ones.

    python -P bench/records_publish.py [--records 2000] [--keys 2200] [--rounds 3]

A nats-server (-js, file store) is started on a free port. Each round publishes ``--records``
request records and as many decision records (with ``--keys`` block keys: a 35k-token prompt of the
Mooncake trace has about 2,200 blocks of 16) through each publisher in turn, in one process, and
reads this process's CPU time (user + system) around it; nats-server's CPU is read from /proc
the same way. "awaited" is the publisher before this change: 8 tasks, each awaiting its publish's
ack (consumers.bus.publish) before the next. Medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import uvloop  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from consumers import bus  # noqa: E402
from infernex.embedded_nats import EmbeddedNats  # noqa: E402
from router.records import BusRecordSink, RecordSink  # noqa: E402
from schemas.config import NatsConfig  # noqa: E402
from schemas.records import RequestRecord, pack_keys  # noqa: E402
from streams.topology import build_topology  # noqa: E402


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")


class AwaitedSink(RecordSink):
    """The publisher as it was: ``workers`` tasks, each awaiting one publish's ack at a time."""

    def __init__(self, js, pool: str, *, workers: int = 8, **kw):
        super().__init__(pool, **kw)
        self._js, self._workers, self._tasks, self.inflight = js, workers, [], 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run()) for _ in range(self._workers)]

    async def _run(self) -> None:
        while True:
            subject, ev, msg_id = await self.queue.get()
            self.inflight += 1
            try:
                ev = self.build(ev)
                data = ev if isinstance(ev, bytes) else ev.to_json()
                await bus.publish(self._js, subject, data, msg_id=msg_id, retries=2, timeout=2.0)
                self.published += 1
            finally:
                self.inflight -= 1

    async def flush(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while (not self.queue.empty() or self.inflight) and time.monotonic() < end:
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()


def decision_builder(i: int, keys: np.ndarray, packed: bool):
    def build() -> bytes:  # what decision_json writes, with the keys in the chosen form
        k = pack_keys(keys) if packed else keys.tolist()
        return msgspec.json.encode({"schema_version": 1, "request_id": f"r{i}", "ts": 1.0, "pool": "p", "model": "m",
                                    "profile": "kv-aware", "stage": "aggregated", "picked": "a", "reason": "",
                                    "candidates": [], "inputs": {"now": 1.0, "prefix_keys": k, "key_scheme": 2}})
    return build


async def one(js, kind: str, packed: bool, n: int, keys: np.ndarray, tag: str, server_pid: int) -> tuple[float, float]:
    cls = AwaitedSink if kind == "awaited" else BusRecordSink
    sink = cls(js, "p", registry=CollectorRegistry(), buffer=4 * n)
    sink.start()
    c0, s0 = time.process_time(), proc_cpu(server_pid)
    for i in range(n):
        rec = RequestRecord(request_id=f"r{i}", ts=1.0, pool="p", model="m", pods=["a"])
        sink.submit_request(lambda rec=rec: rec, msg_id=f"{tag}:req:{i}")
        sink.submit_decision(decision_builder(i, keys, packed), msg_id=f"{tag}:dec:{i}")
    await sink.flush(timeout=120)
    c1, s1 = time.process_time(), proc_cpu(server_pid)
    assert sink.published == 2 * n, (kind, sink.published)
    await sink.stop()
    return 1e6 * (c1 - c0) / n, 1e6 * (s1 - s0) / n


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as srv:
        nc = await bus.connect(NatsConfig(servers=[srv.url]))
        js = nc.jetstream()
        await bus.apply_topology(js, build_topology())
        keys = np.array([random.getrandbits(64) for _ in range(args.keys)], dtype=np.uint64)
        size = {p: len(decision_builder(0, keys, p)()) for p in (False, True)}
        print(f"decision record with {args.keys} keys: {size[False]:,} bytes as JSON integers, {size[True]:,} packed; "
              f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        variants = [("awaited", False), ("awaited", True), ("async", False), ("async", True)]
        got = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants:
                got[v].append(await one(js, *v, args.records, keys, f"{r}{v[0]}{v[1]}", srv.proc.pid))
        for (kind, packed), xs in got.items():
            us = statistics.median(x[0] for x in xs)
            srv_us = statistics.median(x[1] for x in xs)
            print(f"{kind:8s} {'packed' if packed else 'JSON ints':9s} publisher CPU {us:7.1f} us per request "
                  f"(one request record + one decision) | nats-server {srv_us:6.1f} us")
        await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--keys", type=int, default=2200)
    ap.add_argument("--rounds", type=int, default=3)
    uvloop.run(main(ap.parse_args()))
