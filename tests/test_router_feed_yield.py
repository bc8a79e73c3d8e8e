"""The router's KV feed lets the event loop serve requests while it folds a burst of KV messages.

A JetStream subscription hands its callback every message it holds without a pause, so a burst of
KV events (engines storing long prompts, or the backlog at start) was folded back to back while
requests waited: the conversation-trace bench's router profile showed its loop held 14-48 ms at a
time (bench/RESULTS.md, session 28). The feed now yields to the loop once it has folded for
``router.feeds.KV_YIELD_AFTER_S``.

Ground truth: a backlog of the bridge's group messages on a real JetStream, and a probe task that
counts the event loop's turns; each fold records the probe's count. With the budget at 0 the probe
runs between every two messages; with no budget (the old behaviour) the messages the subscription
holds are folded in one turn. Either way the index ends as folding the batches one by one gives."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from test_index_columns import _bridge_groups

from consumers import index_columns
from consumers.index_codec import fold_group
from router import feeds as feeds_mod
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from router.testing import wait_for
from schemas import kv_binary
from schemas import subjects as S
from streams.clock import ManualClock, SystemClock
from streams.kv_index import KvIndex

pytestmark = pytest.mark.skipif(not index_columns.AVAILABLE, reason="needs numba")

GROUPS = _bridge_groups(11, frames=240, per_group=4)  # 60 messages


async def _fold_backlog(nc, prefix, monkeypatch, budget: float) -> tuple[list[int], KvIndex]:
    monkeypatch.setattr(feeds_mod, "KV_YIELD_AFTER_S", budget)
    js = nc.jetstream()
    seq = 0
    for g in GROUPS:
        n = len(fold_group(g))
        await js.publish(S.with_prefix(prefix, S.kv_events("m", "pod-a")), g,
                         headers=kv_binary.group_headers("pod-a", "m", 0, seq, seq + n - 1, n))
        seq += n
    index = KvIndex(SystemClock())
    turns = 0
    at: list[int] = []  # the probe's count at each fold
    apply_many = index.apply_many

    def watched(batches, **kw):
        at.append(turns)
        return apply_many(batches, **kw)

    index.apply_many = watched

    async def probe() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=index, registry=CollectorRegistry())
    task = asyncio.create_task(probe())
    try:
        await feeds.start()
        assert await wait_for(lambda: len(at) >= len(GROUPS), timeout=30)
    finally:
        task.cancel()
        await feeds.stop()
    return at, index


def _truth() -> KvIndex:
    truth = KvIndex(ManualClock(1.0))
    for g in GROUPS:
        truth.apply_many(fold_group(g))
    return truth


def _same(index: KvIndex, truth: KvIndex) -> None:
    got, want = index.pods()["pod-a"], truth.pods()["pod-a"]
    assert (got.blocks, got.seq) == (want.blocks, want.seq)
    assert index.totals.blocks_stored == truth.totals.blocks_stored


async def test_a_burst_of_kv_messages_leaves_the_loop_turns_between_folds(nats_config, nc, topology, prefix,
                                                                          monkeypatch):
    at, index = await _fold_backlog(nc, prefix, monkeypatch, 0.0)
    assert len(at) == len(GROUPS)
    assert all(b > a for a, b in zip(at, at[1:])), at  # the loop turned between every two folds
    _same(index, _truth())


async def test_without_a_budget_the_subscription_s_messages_fold_in_one_turn(nats_config, nc, topology, prefix,
                                                                            monkeypatch):
    """What the budget prevents (and that the probe sees it): folds with no turn of the loop between."""
    at, index = await _fold_backlog(nc, prefix, monkeypatch, float("inf"))
    back_to_back = sum(1 for a, b in zip(at, at[1:]) if a == b)
    assert back_to_back > len(GROUPS) // 2, at
    _same(index, _truth())
