"""The indexer service on a real JetStream with a bridge's group messages: it reads them into columns
(``consumers.index_columns``), and the index, the batch count and the lag histogram (one observation
per batch of a group) come out as folding the same batches one by one gives."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from test_index_columns import _bridge_groups

from consumers import index_columns
from consumers.index_codec import fold_group
from consumers.indexer import IndexerConfig, IndexerService
from schemas import kv_binary
from schemas import subjects as S
from streams.clock import ManualClock
from streams.kv_index import KvIndex
from streams.topology import stream_for_subject

pytestmark = pytest.mark.skipif(not index_columns.AVAILABLE, reason="needs numba")


async def test_group_messages_fold_in_columns_as_batch_by_batch(nats_config, nc, prefix, topology, monkeypatch):
    groups = _bridge_groups(3, frames=160, per_group=16)
    read = []
    orig = index_columns.wire_run

    def counting(data, decode):
        run = orig(data, decode)
        read.append(run is not None)
        return run

    monkeypatch.setattr(index_columns, "wire_run", counting)
    truth = KvIndex(ManualClock(1.0))
    batches = 0
    for data in groups:
        whole = fold_group(data)
        truth.apply_many(whole)
        batches += len(whole)
    registry = CollectorRegistry()
    service = IndexerService(IndexerConfig(http_port=None, durable="ix-columns"), nats_config, registry=registry)
    js = nc.jetstream()
    subject = S.with_prefix(prefix, S.kv_events("m", "pod-a"))
    seq = 0
    try:
        await service.start()
        for data in groups:
            n = len(fold_group(data))
            await js.publish(subject, data, headers=kv_binary.group_headers("pod-a", "m", 0, seq, seq + n - 1, n))
            seq += n
        last = (await js.stream_info(stream_for_subject(topology, subject).name)).state.last_seq
        deadline = time.monotonic() + 30
        while service.applied_seq < last:
            assert time.monotonic() < deadline, "the messages were not all applied"
            await asyncio.sleep(0.05)
        assert read.count(True) == len(groups)  # every message went through the columns path (and the
        # service's warm-up call, a group the reader refuses, did not)
        got, want = service.index.pods()["pod-a"], truth.pods()["pod-a"]
        assert (got.blocks, got.epoch, got.seq, got.last_event_ts) == (want.blocks, want.epoch, want.seq,
                                                                      want.last_event_ts)
        for name in ("blocks_stored", "blocks_removed", "batches", "events", "unknown_parent", "unknown_removed"):
            assert getattr(service.index.totals, name) == getattr(truth.totals, name), name
        assert registry.get_sample_value("infernex_indexer_batches_total") == batches
        assert registry.get_sample_value("infernex_indexer_apply_lag_seconds_count") == batches
        # and the service says so: every message read in columns
        assert registry.get_sample_value("infernex_indexer_kv_messages_total", {"path": "columns"}) == len(groups)
        assert not registry.get_sample_value("infernex_indexer_kv_messages_total", {"path": "parts"})
    finally:
        await service.stop()
        try:
            await js.delete_object_store(service.bucket)
        except Exception:  # noqa: BLE001
            pass
