"""The router's record publisher against a real nats-server: every record is stored exactly once
(checked against what was submitted, by Nats-Msg-Id), a record whose ack is lost is published
again under the same id, a subject no stream stores is counted unconfirmed without stopping the
publisher, and a kill -9 of the server loses nothing."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from consumers import bus
from infernex.embedded_nats import EmbeddedNats, free_port
from router.records import BusRecordSink
from schemas import subjects as S
from schemas.config import NatsConfig
from schemas.records import RequestRecord
from streams.topology import build_topology


def _record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", ts=1.0 + i, pool="default", model="m", pods=["a"])


def _submit(sink: BusRecordSink, lo: int, hi: int) -> set[str]:
    ids = set()
    for i in range(lo, hi):
        rec = _record(i)
        sink.submit_request(lambda rec=rec: rec, msg_id=f"req:{rec.request_id}")  # built by the publisher
        sink.submit_decision(lambda i=i: b'{"request_id": "r%d"}' % i, msg_id=f"dec:r{i}")  # bytes, as the router's
        ids |= {f"req:r{i}", f"dec:r{i}"}
    return ids


async def _stored_ids(js, stream: str) -> list[str]:
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        out.append(msg.headers["Nats-Msg-Id"])
    return out


async def _drained(sink: BusRecordSink, timeout: float) -> None:
    await sink.flush(timeout=timeout)
    assert sink.queue.empty() and sink.inflight == 0, (sink.queue.qsize(), sink.inflight)


async def test_every_record_is_stored_once_and_a_resubmitted_id_is_not_stored_again(nc, topology, prefix):
    js = nc.jetstream()
    sink = BusRecordSink(js, "default", prefix=prefix, registry=CollectorRegistry(), window=16)
    sink.start()
    try:
        ids = _submit(sink, 0, 400)  # far more than the window: the publisher waits for slots
        await _drained(sink, 20)
        assert sink.published == 800 and sink.unconfirmed == 0
        stream = next(s.name for s in topology if s.logical == S.ROUTER)
        stored = await _stored_ids(js, stream)
        assert sorted(stored) == sorted(ids)
        _submit(sink, 0, 10)  # the same ids again (a retry after a lost ack looks like this)
        await _drained(sink, 10)
        assert len(await _stored_ids(js, stream)) == 800 and sink.published == 820
    finally:
        await sink.stop()


async def test_a_subject_no_stream_stores_is_unconfirmed_and_the_publisher_goes_on(nc, prefix):
    js = nc.jetstream()
    sink = BusRecordSink(js, "default", prefix=prefix, registry=CollectorRegistry(), ack_timeout=0.5, retries=1)
    sink.start()
    try:
        _submit(sink, 0, 5)  # no topology yet: nothing stores router.* under this prefix
        await _drained(sink, 15)
        assert sink.unconfirmed == 10 and sink.published == 0
        await bus.apply_topology(js, build_topology(prefix=prefix))
        _submit(sink, 5, 10)
        await _drained(sink, 15)
        assert sink.published == 10 and sink.unconfirmed == 10
    finally:
        await sink.stop()
        for spec in build_topology(prefix=prefix):
            try:
                await js.delete_stream(spec.name)
            except Exception:  # noqa: BLE001 - the first part of the test made none
                pass


async def test_kill9_of_nats_loses_no_record_and_stores_none_twice(tmp_path):
    server = EmbeddedNats(tmp_path / "store", port=free_port()).start()
    nc = await bus.connect(NatsConfig(servers=[server.url], connect_timeout_s=2))
    topo = build_topology()
    sink = None
    try:
        js = nc.jetstream()
        await bus.apply_topology(js, topo)
        sink = BusRecordSink(js, "default", registry=CollectorRegistry(), ack_timeout=1.0, retries=8)
        sink.start()
        ids: set[str] = set()
        n = 0
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:  # records flowing when the server dies
            ids |= _submit(sink, n, n + 20)
            n += 20
            await asyncio.sleep(0.02)
        server.kill()
        for _ in range(10):  # and while it is down
            ids |= _submit(sink, n, n + 20)
            n += 20
            await asyncio.sleep(0.1)
        assert sink.inflight > 0  # some were waiting for acks that could not come
        server.start()
        ids |= _submit(sink, n, n + 20)
        await _drained(sink, 60)
        stream = next(s.name for s in topo if s.logical == S.ROUTER)
        stored = await _stored_ids(js, stream)
        assert len(stored) == len(set(stored)), "a record was stored twice"
        assert set(stored) == ids, f"lost {len(ids - set(stored))} of {len(ids)}"
        assert sink.unconfirmed == 0 and sink.published >= len(ids)
    finally:
        if sink is not None:
            await sink.stop()
        await nc.close()
        server.cleanup()
