"""The replay reader returns a stored window in order, across streams, and leaves no consumer."""

from __future__ import annotations

import asyncio
import time

from consumers import bus
from consumers.replay import read_window
from schemas import DeviceTelemetry, KvEventBatch, subjects as S


async def _fill(js, prefix, n):
    stamps = []
    for i in range(n):
        b = KvEventBatch(pod=f"p{i % 2}", model="m", seq=i, ts=float(i), events=[])
        await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", b.pod)), b.to_json(), msg_id=b.msg_id)
        t = DeviceTelemetry(node="n", device="0", kind="npu", source="sim", ts=float(i), temperature_c=40 + i)
        await bus.publish(js, S.with_prefix(prefix, S.device_telemetry("n", "0")), t.to_json())
        stamps.append(time.time())
    return stamps


async def test_window_in_order_across_streams(nc, prefix, topology):
    js = nc.jetstream()
    await _fill(js, prefix, 20)
    got = [m async for m in read_window(nc, topology, ["kv.events.>", "device.telemetry.>"], prefix=prefix)]
    assert len(got) == 40
    assert [m.ts for m in got] == sorted(m.ts for m in got)
    kinds = [S.parse(m.subject)["kind"] for m in got]
    assert kinds.count("kv.events") == 20 and kinds.count("device.telemetry") == 20
    # one subject filter only, from a sequence
    only = [m async for m in read_window(nc, topology, [S.kv_events("m", "p1")], prefix=prefix, start_seq=5)]
    assert [KvEventBatch.from_bytes(m.data).seq for m in only] == [5, 7, 9, 11, 13, 15, 17, 19]
    # no consumer left behind on the streams
    for spec in topology:
        info = await js.stream_info(spec.name)
        assert info.state.consumer_count == 0 or spec.name.endswith("DLQ"), spec.name


async def test_window_by_time(nc, prefix, topology):
    js = nc.jetstream()
    stamps = await _fill(js, prefix, 10)
    await asyncio.sleep(0.05)
    mid = stamps[4]
    got = [m async for m in read_window(nc, topology, ["kv.events.>"], prefix=prefix, end_time=mid)]
    assert 4 <= len(got) <= 6
    later = [m async for m in read_window(nc, topology, ["kv.events.>"], prefix=prefix, start_time=mid)]
    assert len(got) + len(later) in (10, 11)


async def test_slow_fold_loses_nothing(nc, prefix, topology):
    js = nc.jetstream()
    n = 3000
    subject = S.with_prefix(prefix, S.kv_events("m", "p"))
    for i in range(0, n, 500):
        await asyncio.gather(*(js.publish(subject, KvEventBatch(pod="p", model="m", seq=j, ts=1.0, events=[]).to_json())
                               for j in range(i, i + 500)))
    seqs = []
    async for m in read_window(nc, topology, ["kv.events.>"], prefix=prefix, buffer=16):
        seqs.append(KvEventBatch.from_bytes(m.data).seq)
        if len(seqs) % 100 == 0:
            await asyncio.sleep(0.01)  # a fold slower than the server
    assert sorted(seqs) == list(range(n))
