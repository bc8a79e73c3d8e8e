"""Replay throughput: messages/s from JetStream through the ordered reader into the folds.

    python -P bench/replay.py [--events 100000]     (-P: bench/router.py must not shadow the router package)

Publishes a synthetic history (KV event batches with stored/removed blocks for 16 pods, engine
metrics and device telemetry) to an embedded nats-server, then measures, in one run:
  - reader only: ``consumers.replay.read_window`` messages/s (no decoding),
  - reader + folds: ``infernex.incident.ReplayState.apply`` for every message (decode + fold).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from consumers import bus
from consumers.replay import read_window
from infernex.commands.replay import ALL_SUBJECTS
from infernex.embedded_nats import EmbeddedNats
from infernex.incident import ReplayState
from schemas import BlockRemoved, BlockStored, DeviceTelemetry, EngineMetrics, KvEventBatch
from schemas import subjects as S
from schemas.config import NatsConfig
from streams.topology import build_topology


def history(n: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        pod = f"pod-{i % 16}"
        k = i % 10
        if k < 8:
            base = (i // 16) * 4
            evs = [BlockStored(block_hashes=[base, base + 1, base + 2, base + 3], parent_block_hash=None,
                               token_ids=list(range(base, base + 64)), block_size=16)]
            if i % 7 == 0:
                evs.append(BlockRemoved(block_hashes=[base]))
            b = KvEventBatch(pod=pod, model="m", seq=i // 16, ts=float(i), events=evs)
            out.append((S.kv_events("m", pod), b.to_json()))
        elif k == 8:
            m = EngineMetrics(pod=pod, model="m", ts=float(i), num_requests_running=3, num_requests_waiting=1,
                              kv_cache_usage_perc=0.4)
            out.append((S.engine_metrics(pod), m.to_json()))
        else:
            t = DeviceTelemetry(node=f"n{i % 4}", device=str(i % 8), kind="npu", source="sim", ts=float(i),
                                temperature_c=50, power_w=300, health="OK")
            out.append((S.device_telemetry(f"n{i % 4}", str(i % 8)), t.to_json()))
    return out


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as d, EmbeddedNats(d) as server:
        cfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(cfg)
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        msgs = history(n)
        t = time.perf_counter()
        for i in range(0, len(msgs), 1000):
            await asyncio.gather(*(js.publish(s, d) for s, d in msgs[i:i + 1000]))
        print(f"published {n} messages in {time.perf_counter() - t:.1f}s")

        t = time.perf_counter()
        count = 0
        async for _ in read_window(nc, topo, ALL_SUBJECTS):
            count += 1
        dt = time.perf_counter() - t
        print(f"reader only:   {count} msgs in {dt:.2f}s = {count / dt:,.0f} msgs/s")

        st = ReplayState()
        t = time.perf_counter()
        count = 0
        async for m in read_window(nc, topo, ALL_SUBJECTS):
            st.apply(m)
            count += 1
        dt = time.perf_counter() - t
        print(f"reader + folds: {count} msgs in {dt:.2f}s = {count / dt:,.0f} msgs/s "
              f"({sum(sum(p.blocks.values()) for p in st.index.pods().values())} blocks indexed)")
        await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    asyncio.run(main(ap.parse_args().events))
