"""KV-event bridge throughput: vLLM ZMQ frames -> acknowledged JetStream storage.

A publisher process sends pre-encoded vLLM ``KVEventBatch`` frames (map-encoded, as
current vLLM) on a ZMQ PUB socket as fast as it can; the bridge (this process) decodes,
normalizes and publishes one JetStream message per batch to a file-backed stream of a
fresh nats-server, pipelining acks. Reported: frames/s and blocks/s from the first frame
received to the last ack, plus the CPU-only path (decode + normalize + JSON encode). The whole
path with JSON vs binary on the bus, interleaved: bench/ingest_path.py.

Usage: python bench/bridge.py [--frames 20000] [--stored 48] [--removed 48] [--block-size 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from consumers import bus  # noqa: E402
from consumers.kv_bridge import BridgeConfig, KvBridge, OutBatch, _json_enc, decode_frame  # noqa: E402
from infernex.embedded_nats import EmbeddedNats, free_port  # noqa: E402
from schemas import KvEventBatch  # noqa: E402
from schemas import subjects as S  # noqa: E402
from schemas.config import NatsConfig, TopologyConfig  # noqa: E402
from simulator.kv_publisher import block_removed, block_stored, encode_batch  # noqa: E402
from streams.topology import build_topology, stream_for_subject  # noqa: E402


def make_payloads(n: int, stored: int, removed: int, block_size: int, seed: int = 1) -> list[bytes]:
    """Realistic batches: one BlockStored chain of ``stored`` blocks (a prefill) and a
    BlockRemoved of ``removed`` evicted blocks, token ids from a 150k vocabulary."""
    rng = random.Random(seed)
    out = []
    pool = [rng.getrandbits(64) for _ in range(4096)]
    for _ in range(min(n, 512)):
        toks = [rng.randrange(151_000) for _ in range(stored * block_size)]
        hashes = [rng.getrandbits(64) for _ in range(stored)]
        events = [block_stored(hashes, rng.choice(pool), toks, block_size)] if stored else []
        if removed:
            events.append(block_removed(rng.sample(pool, removed)))
        out.append(encode_batch(events, ts=time.time()))
    return [out[i % len(out)] for i in range(n)]


def publisher_proc(port: int, n: int, stored: int, removed: int, block_size: int, ready, go) -> None:
    import zmq

    payloads = make_payloads(n, stored, removed, block_size)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, n + 10)
    pub.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    go.wait()
    for seq, p in enumerate(payloads):
        pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), p), copy=False)
    time.sleep(5)
    pub.close(linger=2000)
    ctx.term()


def cpu_path(stored: int, removed: int, block_size: int, n: int = 3000) -> float:
    payloads = make_payloads(n, stored, removed, block_size)
    t = time.process_time()
    for seq, p in enumerate(payloads):
        norm = decode_frame(p)
        _json_enc.encode(OutBatch("pod", "model", 0, 0, seq, norm.ts, norm.events))
    return n / (time.process_time() - t)


async def end_to_end(args) -> tuple[float, float, int, float]:
    tmp = tempfile.mkdtemp(prefix="bench-bridge-")
    server = EmbeddedNats(Path(tmp) / "store")
    server.start()
    prefix = "bench"
    try:
        cfg = NatsConfig(servers=[server.url], subject_prefix=prefix)
        nc = await bus.connect(cfg)
        js = nc.jetstream()
        topo = build_topology(TopologyConfig(storage=args.storage), prefix=prefix)
        await bus.apply_topology(js, topo)
        port = free_port()
        subject = S.with_prefix(prefix, S.kv_events("bench-model", "pod-0"))
        stream = stream_for_subject(topo, subject).name
        bridge = KvBridge(BridgeConfig(endpoint=f"tcp://127.0.0.1:{port}", pod="pod-0", model="bench-model",
                                       max_inflight=args.inflight, recover=False),
                          nc, subject_prefix=prefix, registry=CollectorRegistry(), stream=stream)
        ready, go = mp.Event(), mp.Event()
        proc = mp.Process(target=publisher_proc,
                          args=(port, args.frames, args.stored, args.removed, args.block_size, ready, go))
        proc.start()
        ready.wait(60)
        stop = asyncio.Event()
        task = asyncio.create_task(bridge.run(stop))
        await bridge.ready.wait()
        await asyncio.sleep(1.0)  # let the SUB join
        go.set()
        while bridge.stats.frames == 0:
            await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        c0 = time.process_time()
        last_change, seen = time.perf_counter(), -1
        while bridge.stats.published < args.frames:
            await asyncio.sleep(0.01)
            if bridge.stats.frames != seen:
                seen, last_change = bridge.stats.frames, time.perf_counter()
            elif bridge.stats.published >= bridge.stats.frames and time.perf_counter() - last_change > 3:
                break  # some frames were dropped before the join: count what arrived
        t1 = time.perf_counter()
        cpu = time.process_time() - c0
        stop.set()
        await task
        proc.join(10)
        info = await js.stream_info(stream)
        last = await js.get_last_msg(stream, subject)
        KvEventBatch.all_from_bytes(last.data)  # what was stored is valid (binary groups by default)
        await nc.close()
        n = bridge.stats.published
        per = args.stored + args.removed
        return n / (t1 - t0), n * per / (t1 - t0), info.state.messages, info.state.bytes / max(1, n), cpu / max(1, n)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=20000)
    ap.add_argument("--stored", type=int, default=48, help="blocks stored per batch")
    ap.add_argument("--removed", type=int, default=48, help="blocks removed per batch")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=512)
    ap.add_argument("--storage", default="file", choices=["file", "memory"])
    args = ap.parse_args()
    per = args.stored + args.removed
    f = cpu_path(args.stored, args.removed, args.block_size)
    print(f"batch: {args.stored} stored + {args.removed} removed blocks, block_size {args.block_size}")
    print(f"cpu path alone (decode+normalize+encode, per CPU second): {f:,.0f} frames/s, {f * per:,.0f} blocks/s")
    fps, bps, msgs, avg, cpu = asyncio.run(end_to_end(args))
    print(f"zmq -> jetstream ({args.storage}, acked): {fps:,.0f} frames/s, {bps:,.0f} blocks/s "
          f"({msgs} messages stored, {avg:,.0f} B/message)")
    print(f"bridge process CPU: {cpu * 1e6:.0f} us/frame -> single-core ceiling {1 / cpu:,.0f} frames/s, "
          f"{per / cpu:,.0f} blocks/s (nats-server and the publisher run on the other core)")


if __name__ == "__main__":
    main()
