"""SLA history throughput and query latency.

1. Sink: ``N`` request records are published to a file-backed JetStream stream of a fresh
   nats-server; then the SLA sink (this process) drains them into chDB: decode + validate,
   batched JSONEachRow inserts, ack after insert. Reported: records/s from start to the last
   insert, and the CPU-only decode/encode rate.
2. Queries: a large ``request_records`` table is generated inside chDB (``numbers()``; as many
   rows as fit in ``--gen-seconds``, up to ``--rows``) spread over 24 h, 4 pools x 2 roles; the SLA
   queries the report and planner use are timed (``FINAL`` dedupe included): p50/p99 over runs.

Both sink consumer modes run (``--consume pull,push``); for each, the bare nats-py consume+ack
rate on the same backlog is printed too, since that, not the store, bounds the sink.

Usage: python bench/sla.py [--records 200000] [--rows 10000000] [--gen-seconds 60] [--runs 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from consumers import bus  # noqa: E402
from consumers import sla_queries as Q  # noqa: E402
from consumers.sla_sink import SlaSink  # noqa: E402
from consumers.sla_store import ChdbStore, SlaConfig  # noqa: E402
from infernex.embedded_nats import EmbeddedNats  # noqa: E402
from schemas import RequestRecord  # noqa: E402
from schemas import subjects as S  # noqa: E402
from schemas.config import NatsConfig  # noqa: E402
from streams.topology import build_topology  # noqa: E402


BATCH = 10000


def make_records(n: int, t0: float) -> list[bytes]:
    out = []
    for i in range(n):
        out.append(RequestRecord(
            request_id=f"bench-{i}", ts=t0 + i * 0.001, pool=f"pool-{i % 4}", role="pd", model="m",
            pods=["p-prefill-1", "p-decode-3"], prefill_pod="p-prefill-1", decode_pod="p-decode-3",
            prompt_tokens=512 + i % 700, output_tokens=128 + i % 90, cached_tokens=i % 300,
            ttft_s=0.05 + (i % 97) / 500, itl_s=0.01 + (i % 13) / 1000, e2e_s=1.0 + (i % 31) / 10,
            status="ok" if i % 50 else "error",
        ).to_json())
    return out


async def bench_sink(n: int, tmp: Path, consume: str) -> None:
    server = EmbeddedNats(tmp / f"nats-{consume}").start()
    store = ChdbStore(tmp / f"chdb-sink-{consume}", "infernex")
    try:
        Q.migrate(store)
        prefix = "bench"
        cfg = NatsConfig(servers=[server.url], subject_prefix=prefix)
        nc = await bus.connect(cfg)
        js = nc.jetstream()
        topo = build_topology(prefix=prefix)
        await bus.apply_topology(js, topo)

        t0 = time.time() - 3600
        payloads = make_records(n, t0)
        t = time.perf_counter()
        for p in payloads[:2000]:
            RequestRecord.from_json(p).model_dump_json()
        cpu = 2000 / (time.perf_counter() - t)

        subject = S.with_prefix(prefix, S.router_requests("pool-0"))
        t = time.perf_counter()
        for i, p in enumerate(payloads):
            await js.publish_async(subject, p, headers={"Nats-Msg-Id": f"bench-{i}"})
            if i % 5000 == 4999:
                await js.publish_async_completed()
        await js.publish_async_completed()
        pub_s = time.perf_counter() - t

        # the nats-py ceiling on the same backlog: consume + ack only, nothing else
        ceiling = await _raw_ceiling(js, prefix, topo, n, consume)

        sink_cfg = SlaConfig(batch_rows=BATCH, flush_interval_s=0.5, consume=consume)
        reg = CollectorRegistry()
        sink = SlaSink(js, store, sink_cfg, topology=topo, prefix=prefix, registry=reg)
        stop = asyncio.Event()
        t = time.perf_counter()
        task = asyncio.create_task(sink.run(stop, fetch_batch=2000))
        while sink.inserted["request_records"] < n:
            await asyncio.sleep(0.05)
            if task.done():
                task.result()
        drain_s = time.perf_counter() - t
        stop.set()
        await task
        count = Q.table_counts(store)["request_records"]
        await nc.drain()
        print(f"sink[{consume}]: {n:,} records published in {pub_s:.1f} s ({n / pub_s:,.0f}/s, async acks)")
        print(f"sink[{consume}]: nats-py consume+ack only, same backlog: {ceiling:,.0f} msgs/s")
        print(f"sink[{consume}]: drained into chDB in {drain_s:.2f} s = {n / drain_s:,.0f} records/s "
              f"(batch {BATCH}; rows in table: {count:,})")
        flush_s = reg.get_sample_value("infernex_sla_sink_flush_seconds_sum", {"table": "request_records"})
        print(f"sink[{consume}]: time inside chDB inserts: {flush_s:.2f} s")
        print(f"sink[{consume}]: CPU-only validate+encode {cpu:,.0f} records/s (one core)")
    finally:
        store.close()
        server.cleanup()


async def _raw_ceiling(js, prefix: str, topo, n: int, consume: str) -> float:  # noqa: ANN001
    from nats.js.api import ConsumerConfig

    stream = next(s.name for s in topo if s.name.endswith("_ROUTER"))
    subject = S.with_prefix(prefix, S.ALL_ROUTER_REQUESTS)
    t = time.perf_counter()
    if consume == "pull":
        await bus.ensure_durable(js, stream, "ceiling", subject)
        sub = await js.pull_subscribe_bind(durable="ceiling", stream=stream)
        got = 0
        while got < n:
            msgs = await sub.fetch(2000, timeout=2)
            got += len(msgs)
            for m in msgs:
                await m.ack()
    else:
        done = asyncio.Event()
        got = 0

        async def cb(m) -> None:  # noqa: ANN001
            nonlocal got
            await m.ack()
            got += 1
            if got >= n:
                done.set()

        sub = await js.subscribe(subject, stream=stream, durable="ceiling-push", cb=cb, manual_ack=True,
                                 config=ConsumerConfig(max_ack_pending=2 * BATCH), pending_msgs_limit=65536)
        await done.wait()
    rate = n / (time.perf_counter() - t)
    await sub.unsubscribe()
    return rate


GEN_SQL = """
INSERT INTO {db}.request_records
SELECT
    concat('r', toString(number)) AS request_id,
    toDateTime64({t0:Float64} + number * {step:Float64}, 3, 'UTC') AS ts,
    concat('pool-', toString(number % 4)) AS pool,
    if(number % 8 < 4, 'pd', 'aggregated') AS role,
    'm' AS model, '' AS profile, [] AS pods, NULL AS prefill_pod, NULL AS decode_pod,
    toUInt32(100 + rand(1) % 4000) AS prompt_tokens,
    toUInt32(1 + rand(2) % 800) AS output_tokens,
    toUInt32(rand(3) % 100) AS cached_tokens,
    exp(randNormal(-1.5, 0.6)) AS ttft_s,
    exp(randNormal(-3.5, 0.3)) AS itl_s,
    exp(randNormal(1.0, 0.5)) AS e2e_s,
    if(rand(4) % 50 = 0, 'error', 'ok') AS status,
    200 AS http_status, NULL AS error, 0, 0, 0, 0, false, 1
FROM numbers({start:UInt64}, {count:UInt64})
"""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_queries(rows: int, gen_seconds: float, runs: int, tmp: Path) -> None:
    store = ChdbStore(tmp / "chdb-q", "infernex")
    try:
        Q.migrate(store)
        now = time.time()
        t0 = now - 86400
        step = 86400 / rows
        chunk = 1_000_000
        made = 0
        t = time.perf_counter()
        while made < rows and time.perf_counter() - t < gen_seconds:
            c = min(chunk, rows - made)
            store.command(GEN_SQL.replace("{db}", store.database),
                          {"t0": t0, "step": step, "start": made, "count": c})
            made += c
        gen_s = time.perf_counter() - t
        n = Q.table_counts(store)["request_records"]
        parts = store.rows("SELECT count() AS n FROM system.parts WHERE database = 'infernex' "
                           "AND table = 'request_records' AND active")[0]["n"]
        print(f"queries: generated {made:,} rows in {gen_s:.1f} s (spread over 24 h; count FINAL {n:,}; "
              f"{parts} active parts)")

        t = time.perf_counter()
        Q.refresh_minutes(store, t0, now)
        roll_bytes = store.rows("SELECT sum(bytes_on_disk) AS b FROM system.parts WHERE database = 'infernex' "
                                "AND table = 'request_minutes' AND active")[0]["b"]
        print(f"queries: per-minute rollup of all {made:,} rows built in {time.perf_counter() - t:.1f} s "
              f"({int(roll_bytes) / 1e6:.1f} MB; the sink refreshes only the minutes each batch touched)")

        cases = {
            "sla_summary last 1h, all pools": lambda: Q.sla_summary(store, now - 3600, now),
            "sla_summary last 1h, one pool": lambda: Q.sla_summary(store, now - 3600, now, pool="pool-1"),
            "planner interval (last 30 s)": lambda: Q.sla_summary(store, now - 30, now),
            "sla_by_minute last 1h": lambda: Q.sla_by_minute(store, now - 3600, now),
            "sla_summary whole 24 h (exact)": lambda: Q.sla_summary(store, t0, now),
            "sla_summary whole 24 h (t-digest)": lambda: Q.sla_summary(store, t0, now, exact=False),
            "sla_summary_rollup whole 24 h": lambda: Q.sla_summary_rollup(store, t0, now),
            "sla_summary_rollup last 1h": lambda: Q.sla_summary_rollup(store, now - 3600, now),
        }
        for name, fn in cases.items():
            fn()  # warm
            times = []
            k = runs if "24 h" not in name or "rollup" in name else max(5, runs // 5)
            for _ in range(k):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1000)
            print(f"query {name:<36} p50 {statistics.median(times):8.1f} ms   p99 {_pct(times, 0.99):8.1f} ms"
                  f"   ({k} runs, {made:,} rows)")
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--gen-seconds", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--consume", default="pull,push", help="sink consumer modes to run")
    ap.add_argument("--skip-sink", action="store_true")
    ap.add_argument("--skip-queries", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.skip_sink:
            for consume in a.consume.split(","):
                asyncio.run(bench_sink(a.records, tmp, consume))
        if not a.skip_queries:
            bench_queries(a.rows, a.gen_seconds, a.runs, tmp)


if __name__ == "__main__":
    main()
