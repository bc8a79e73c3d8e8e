"""The router's KV feed callback on each kind of message, without a bus: single binary batches, groups
and JSON fold to the index the batches give when applied directly; a bad batch (alone, or inside a
group) is dead-lettered with its reason and the good ones around it still apply."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from schemas import kv_binary
from schemas.kv import BlockRemoved, BlockStored, KvEventBatch
from streams.clock import ManualClock
from streams.kv_index import KvIndex

BS = 4
MODEL = "m"


class _NoBus:
    def jetstream(self):
        return None


class _Letters:
    def __init__(self):
        self.sent: list[tuple[bytes, str]] = []

    async def send(self, stream, subject, data, reason, **_kw):
        self.sent.append((data, reason))


class _Msg:
    def __init__(self, data: bytes):
        self.subject, self.data, self.headers, self.reply = f"kv.events.{MODEL}.p", data, None, ""


def _batches(n: int) -> list[KvEventBatch]:
    out, held = [], []
    for seq in range(n):
        if held and seq % 4 == 3:
            ev = BlockRemoved(block_hashes=[held.pop(0)])
        else:
            hashes = [1000 + 2 * seq, 1001 + 2 * seq]
            held.extend(hashes)
            ev = BlockStored(block_hashes=hashes, token_ids=list(range(seq, seq + 2 * BS)), block_size=BS,
                             parent_block_hash=held[-3] if len(held) > 2 else None)
        out.append(KvEventBatch(pod="p", model=MODEL, seq=seq, ts=1.0, events=[ev]))
    return out


def _bad_binary(b: KvEventBatch) -> bytes:
    """A binary batch whose stored event has one token fewer than its blocks need (decodes, fails the checks)."""
    w = kv_binary.to_wire(b)
    w.events[0].token_ids = bytes(w.events[0].token_ids)[:-4]
    return kv_binary.encode_wire(w)


def _feed():
    index = KvIndex(ManualClock())  # (the feed gives it the router's reorder window)
    registry = CollectorRegistry()
    feeds = BusFeeds(_NoBus(), ClusterState(RouterConfig()), index=index, registry=registry)
    feeds.dead = letters = _Letters()
    return feeds, index, letters, feeds._callback("KV_EVENTS", KvEventBatch, feeds._apply_kv), registry


def _past_the_gap(index: KvIndex) -> None:
    """A dead-lettered batch leaves a gap in its pod's sequence: the index holds the later batches
    back for the reorder window, then applies them."""
    assert index.waiting_count > 0
    index.clock.advance(index.reorder_window_s + 1)
    index.release_expired()


def _applied(registry) -> float:
    return registry.get_sample_value("infernex_router_feed_messages_total", {"kind": "KvEventBatch"}) or 0.0


def test_singles_groups_and_json_fold_to_the_batches_index():
    batches = _batches(24)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches)
    feeds, index, letters, cb, registry = _feed()
    msgs = []
    i = 0
    while i < len(batches):
        if i % 3 == 0:  # a group of two binary batches
            msgs.append(kv_binary.group([kv_binary.encode(b) for b in batches[i:i + 2]]))
            i += 2
        elif i % 3 == 1:
            msgs.append(batches[i].to_json())
            i += 1
        else:
            msgs.append(kv_binary.encode(batches[i]))
            i += 1
    for m in msgs:
        asyncio.run(cb(_Msg(m)))
    assert index == truth
    assert _applied(registry) == len(batches) and not letters.sent


def test_a_bridges_groups_with_digests_fold_in_columns_to_the_batches_index():
    """What a bridge sends all day (groups of binary batches, block digests in place of token ids)
    goes through the compiled columns path (consumers.index_columns) and gives the same index."""
    from consumers.index_codec import fold_group
    from consumers.index_columns import AVAILABLE, wire_run
    from consumers.kv_digests import with_digests

    if not AVAILABLE:
        import pytest
        pytest.skip("needs numba")
    batches = _batches(40)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches)
    feeds, index, letters, cb, registry = _feed()

    def enc(b: KvEventBatch) -> bytes:
        w = kv_binary.to_wire(b)
        w.events = with_digests(w.events)
        return kv_binary.encode_wire(w)

    msgs = [kv_binary.group([enc(b) for b in batches[i:i + 5]]) for i in range(0, len(batches), 5)]
    assert all(wire_run(m, fold_group) is not None for m in msgs)  # the columns path takes every one
    for m in msgs:
        asyncio.run(cb(_Msg(m)))
    assert index == truth
    assert _applied(registry) == len(batches) and not letters.sent


def test_a_bad_single_binary_batch_is_dead_lettered_with_its_reason_and_the_rest_applies():
    batches = _batches(6)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches[:2] + batches[3:])  # the third is the bad one: never applied
    feeds, index, letters, cb, registry = _feed()
    for i, b in enumerate(batches):
        data = _bad_binary(b) if i == 2 else kv_binary.encode(b)
        asyncio.run(cb(_Msg(data)))
    assert len(letters.sent) == 1
    payload, reason = letters.sent[0]
    assert payload == _bad_binary(batches[2]) and "token_ids" in reason
    assert _applied(registry) == len(batches) - 1
    _past_the_gap(index)
    assert index == truth


def test_a_bad_batch_inside_a_group_loses_only_itself():
    batches = _batches(5)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches[:1] + batches[2:])
    feeds, index, letters, cb, registry = _feed()
    group = kv_binary.group([kv_binary.encode(batches[0]), _bad_binary(batches[1]), kv_binary.encode(batches[2])])
    asyncio.run(cb(_Msg(group)))
    for b in batches[3:]:
        asyncio.run(cb(_Msg(kv_binary.encode(b))))
    assert len(letters.sent) == 1 and "batch 1 of a group of 3" in letters.sent[0][1]
    _past_the_gap(index)
    assert index == truth and _applied(registry) == len(batches) - 1


def test_batches_behind_a_dead_lettered_one_wait_only_the_grace():
    """The refused message's headers name its position: the pod's later batches are folded once
    the grace is over, not after the whole reorder window (ground truth: the batches less the bad one)."""
    from streams.kv_index import LOST_GRACE_S

    batches = _batches(6)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches[:2] + batches[3:])
    feeds, index, letters, cb, registry = _feed()
    assert index.reorder_window_s > 2 * LOST_GRACE_S
    for i, b in enumerate(batches):
        m = _Msg(_bad_binary(b) if i == 2 else kv_binary.encode(b))
        m.headers = kv_binary.headers(b.pod, b.model, b.epoch, b.seq)
        asyncio.run(cb(m))
    assert len(letters.sent) == 1 and index.waiting_count == 3
    index.clock.advance(LOST_GRACE_S + 0.1)
    index.release_expired()
    assert index.waiting_count == 0 and index == truth


def test_headers_that_do_not_add_up_leave_the_whole_window():
    from streams.kv_index import LOST_GRACE_S

    batches = _batches(5)
    feeds, index, letters, cb, registry = _feed()
    for i, b in enumerate(batches):
        m = _Msg(_bad_binary(b) if i == 2 else kv_binary.encode(b))
        if i == 2:  # a group's headers on a single message: three positions claimed for one batch
            m.headers = kv_binary.group_headers(b.pod, b.model, b.epoch, 2, 4, 1)
        asyncio.run(cb(m))
    index.clock.advance(LOST_GRACE_S + 0.1)
    index.release_expired()
    assert index.waiting_count == 2


def _on(subject_pod: str, data: bytes) -> _Msg:
    m = _Msg(data)
    m.subject = f"kv.events.{MODEL}.{subject_pod}"
    return m


def _for_pod(b: KvEventBatch, pod: str) -> KvEventBatch:
    return b.model_copy(update={"pod": pod})


def test_a_batch_on_another_pods_subject_is_dead_lettered_as_the_indexer_does():
    """Pod p's batches, one of them published (binary, in a group, or as JSON) on pod q's subject:
    each such batch is refused with the subject's reason, the rest folds, and the index ends as the
    well-placed batches give it (and as consumers.indexer folds the same messages)."""
    batches = _batches(9)
    truth = KvIndex(ManualClock())
    truth.apply_many([b for i, b in enumerate(batches) if i not in (2, 4, 7)])
    feeds, index, letters, cb, registry = _feed()
    for i, b in enumerate(batches):
        if i == 2:
            m = _on("q", kv_binary.encode(b))
        elif i == 4:
            m = _on("q", b.to_json())
        elif i == 6:  # a group: the second batch misplaced (for pod q, sent on p's subject)
            m = _on("p", kv_binary.group([kv_binary.encode(b), kv_binary.encode(_for_pod(batches[7], "q"))]))
        elif i == 7:
            continue
        else:
            m = _on("p", kv_binary.encode(b))
        asyncio.run(cb(m))
    reasons = [r for _, r in letters.sent]
    assert len(reasons) == 3 and all("names pod" in r for r in reasons), reasons
    assert "batch 1 of a group of 2" in reasons[2]
    assert _applied(registry) == len(batches) - 3
    _past_the_gap(index)
    assert index == truth and "q" not in index.pods()


def test_a_refused_batchs_headers_for_another_pod_than_its_subjects_keep_the_whole_window():
    """A bad batch on pod q's subject whose headers claim pod p's next position: p's gap is not
    taken as lost (the message is not p's to speak for), so p's later batches wait the reorder
    window, not the grace."""
    from streams.kv_index import LOST_GRACE_S

    batches = _batches(5)
    feeds, index, letters, cb, registry = _feed()
    for i, b in enumerate(batches):
        if i == 2:
            m = _on("q", _bad_binary(b))
        else:
            m = _on("p", kv_binary.encode(b))
        m.headers = kv_binary.headers(b.pod, b.model, b.epoch, b.seq)
        asyncio.run(cb(m))
    assert len(letters.sent) == 1
    index.clock.advance(LOST_GRACE_S + 0.1)
    index.release_expired()
    assert index.waiting_count == 2
