"""Replay throughput: messages/s and events/s from JetStream through the ordered reader into
the folds.

    python -P bench/replay.py [--messages 100000] [--pods 16] [--workers 1,2]

(-P: bench/router.py must not shadow the router package.)

Workload (stated by the run): the KV history of ``--histories`` simulated engines
(``simulator.engine_core.EngineCore``, llama-3.1-8b on h100, 4096 KV blocks so eviction
starts early; Poisson arrivals of prompts = one of 20 shared 1024-token system prompts + a
256-token suffix, 128 output tokens), one ``KvEventBatch`` per non-empty scheduler step as the
bridge stores vLLM's per-step batches (BlockStored with the blocks completed in the step and
their token ids, BlockRemoved for evictions). ``--pods`` pods replay those histories
round-robin, one step each in turn; per pod, one engine-metrics snapshot every 40 steps and
one device sample every 10 steps (vLLM runs tens of steps per second; metrics are scraped
about every second, devices sampled every few hundred ms).

Events: a KV message holds several events (counted); a metrics or device message is one.
Measured in one run, side by side:
  - reader only: ``consumers.replay.read_window_batches`` (no decoding),
  - reader + folds: ``infernex.commands.replay.fold_window`` into ``ReplayState`` (decode +
    KV index, load, health, timeline), in one process, then with the KV subjects split
    among N worker processes (``--workers``; each reads and folds its pods, the parts are
    merged),
  - folds only: the same messages already in memory (no NATS), to show the split.
The workload's objects are frozen out of the garbage collector's way (``gc.freeze``) after
the reader-only pass, since a replay process holds no such heap, and the KV kernels are
loaded (``warm_up``, timed on its own) before the fold runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import tempfile
import time

from consumers import bus
from consumers.replay import ReplayMsg, read_window_batches
from infernex.commands.replay import ALL_SUBJECTS, Window, fold_window
from infernex.embedded_nats import EmbeddedNats
from infernex.incident import ReplayState, warm_up
from infernex.settings import Settings
from schemas import BlockRemoved, BlockStored, DeviceTelemetry, EngineMetrics, KvEventBatch
from schemas import subjects as S
from schemas.config import NatsConfig
from simulator.config import EngineConfig
from simulator.engine_core import EngineCore
from streams.topology import build_topology

METRICS_EVERY, DEVICE_EVERY = 40, 10


def engine_steps(n: int, seed: int) -> list[list]:
    """The KV events of ``n`` non-empty scheduler steps of one simulated engine."""
    rng = random.Random(seed)
    systems = [[rng.randrange(20, 30000) for _ in range(1024)] for _ in range(20)]
    core = EngineCore(EngineConfig(hardware="h100", model_profile="llama-3.1-8b", emit_kv_events=True,
                                   num_gpu_blocks=4096))
    now, arrival, i, out = 0.0, 0.0, 0, []
    while len(out) < n:
        while arrival <= now:
            prompt = systems[rng.randrange(20)] + [rng.randrange(20, 30000) for _ in range(rng.randint(128, 384))]
            core.add_request(f"r{i}", prompt, rng.randint(64, 192), arrival)
            i += 1
            arrival += rng.expovariate(20.0)
        res = core.step(now)
        if res.events:
            out.append([BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                                    token_ids=e.token_ids, block_size=e.block_size, medium=e.medium)
                        if hasattr(e, "token_ids") else BlockRemoved(block_hashes=e.block_hashes, medium=e.medium)
                        for e in res.events])
        now = res.end if not res.idle else max(now, arrival)
    return out


def history(n: int, pods: int, histories: int) -> tuple[list[tuple[str, bytes]], dict]:
    """``n`` messages (subject, payload) in publish order, and the workload's mix."""
    kv_share = 1 / (1 + 1 / METRICS_EVERY + 1 / DEVICE_EVERY)
    steps = [engine_steps(int(n * kv_share / pods) + 2, seed) for seed in range(1, histories + 1)]
    out: list[tuple[str, bytes]] = []
    mix = {"kv_messages": 0, "kv_events": 0, "stored_events": 0, "removed_events": 0, "stored_blocks": 0,
           "metrics_messages": 0, "device_messages": 0}
    ts, step = 1.7e9, 0
    while len(out) < n:
        for p in range(pods):
            pod = f"pod-{p}"
            evs = steps[p % histories][step]
            out.append((S.kv_events("m", pod), KvEventBatch(pod=pod, model="m", seq=step, ts=ts, events=evs).to_json()))
            mix["kv_messages"] += 1
            mix["kv_events"] += len(evs)
            for e in evs:
                if isinstance(e, BlockStored):
                    mix["stored_events"] += 1
                    mix["stored_blocks"] += len(e.block_hashes)
                else:
                    mix["removed_events"] += 1
            if step % METRICS_EVERY == p % METRICS_EVERY:
                m = EngineMetrics(pod=pod, model="m", ts=ts, num_requests_running=24, num_requests_waiting=2,
                                  kv_cache_usage_perc=0.9)
                out.append((S.engine_metrics(pod), m.to_json()))
                mix["metrics_messages"] += 1
            if step % DEVICE_EVERY == p % DEVICE_EVERY:
                node, dev = f"node-{p // 2}", str((p % 2) * 4 + (step // DEVICE_EVERY) % 4)
                t = DeviceTelemetry(node=node, device=dev, kind="npu", source="sim", ts=ts, temperature_c=55,
                                    power_w=310, health="OK")
                out.append((S.device_telemetry(node, dev), t.to_json()))
                mix["device_messages"] += 1
            ts += 0.0005
        step += 1
    return out, mix


async def main(n: int, pods: int, histories: int, buffer: int, workers: list[int]) -> None:
    t = time.perf_counter()
    msgs, mix = history(n, pods, histories)
    n = len(msgs)
    events = mix["kv_events"] + mix["metrics_messages"] + mix["device_messages"]
    size = sum(len(d) for _, d in msgs)
    print(f"workload: {n} messages ({mix['kv_messages']} KV batches, {mix['metrics_messages']} metrics, "
          f"{mix['device_messages']} device), {events} events = {events / n:.2f} events/message; "
          f"KV batch = {mix['kv_events'] / mix['kv_messages']:.2f} events "
          f"({mix['stored_events']} stored of {mix['stored_blocks'] / max(1, mix['stored_events']):.1f} blocks, "
          f"{mix['removed_events']} removed); {size / n:.0f} bytes/message; built in {time.perf_counter() - t:.1f}s")
    with tempfile.TemporaryDirectory() as d, EmbeddedNats(d) as server:
        nc = await bus.connect(NatsConfig(servers=[server.url]))
        js = nc.jetstream()
        topo = build_topology()
        await bus.apply_topology(js, topo)
        t = time.perf_counter()
        for i in range(0, n, 1000):
            await asyncio.gather(*(js.publish(s, d) for s, d in msgs[i:i + 1000]))
        print(f"published in {time.perf_counter() - t:.1f}s; load average {os.getloadavg()[0]:.2f}")

        def server_cpu() -> float:
            """nats-server's CPU seconds so far (it pushes every message: part of the cost)."""
            with open(f"/proc/{server.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        def line(label: str, count: int, dt: float) -> None:
            assert count == n, f"{label}: read {count} of {n} messages"
            print(f"{label:28s} {count} msgs in {dt:6.2f}s = {count / dt:9,.0f} msgs/s = "
                  f"{events / dt:9,.0f} events/s  (load {os.getloadavg()[0]:.2f})")

        t, cpu0, srv0 = time.perf_counter(), time.process_time(), server_cpu()
        count = 0
        stored = []
        async for run in read_window_batches(nc, topo, ALL_SUBJECTS, buffer=buffer):
            count += len(run)
            stored.extend(run)
        line("reader only", count, time.perf_counter() - t)
        cpu = time.process_time() - cpu0
        print(f"{'':28s} CPU s {cpu:.2f} (nats-server {server_cpu() - srv0:.2f}): with a free core, "
              f"{n / cpu:,.0f} msgs/s = {events / cpu:,.0f} events/s")
        # the bench's own baggage (the workload and the messages just read, 200k objects) out of
        # the collector's way: a replay process holds nothing of the kind
        gc.freeze()

        t, cpu0 = time.perf_counter(), time.process_time()
        warm_up()
        print(f"kernels loaded in {time.perf_counter() - t:.2f}s ({time.process_time() - cpu0:.2f} CPU s; once per "
              f"process, before the runs below)")
        settings = Settings(nats=NatsConfig(servers=[server.url]))
        st = None
        for w in workers:
            s = ReplayState()
            fs: dict = {}
            srv0 = server_cpu()
            t = time.perf_counter()
            count = await fold_window(settings, Window(None, None, None, ALL_SUBJECTS, workers=w), s, fs)
            line(f"reader + folds, {w} workers" if w > 1 else "reader + folds, 1 process", count,
                 time.perf_counter() - t)
            cpu = fs["cpu_s"]
            how = f"; workers by {fs['start_method']}" if "start_method" in fs else ""
            print(f"{'':28s} CPU s per process {', '.join(f'{c:.2f}' for c in cpu)}{how} (nats-server "
                  f"{server_cpu() - srv0:.2f}): with a free core each, "
                  f"{n / max(cpu):,.0f} msgs/s = {events / max(cpu):,.0f} events/s")
            if st is None:
                st = s
            assert s.index.fingerprint() == st.index.fingerprint() and s.state() == st.state(), "parallel != sequential"
        blocks = sum(sum(p.blocks.values()) for p in st.index.pods().values())

        mem = ReplayState()
        t = time.perf_counter()
        mem.apply_many(ReplayMsg(*m) for m in stored)
        mem.flush()
        line("folds only", len(stored), time.perf_counter() - t)
        assert mem.index.fingerprint() == st.index.fingerprint()
        print(f"{blocks} blocks indexed at the end; undecodable {st.counts.get('undecodable', 0)}")
        await nc.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", "--events", type=int, default=100_000, dest="messages",
                    help="messages to store and replay (--events: old name)")
    ap.add_argument("--pods", type=int, default=16)
    ap.add_argument("--histories", type=int, default=4, help="distinct simulated engine histories")
    ap.add_argument("--buffer", type=int, default=8192, help="read-ahead per stream (messages)")
    ap.add_argument("--workers", default="1,2", help="process counts to measure reader + folds with")
    a = ap.parse_args()
    asyncio.run(main(a.messages, a.pods, a.histories, a.buffer, [int(w) for w in a.workers.split(",")]))
