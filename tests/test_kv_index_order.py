"""The KV index fold under disorder and corrupt positions: per-pod reordering, bounds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.kv import MAX_EPOCH, BlockRemoved, BlockStored, KvEventBatch, PodReset
from streams.clock import ManualClock
from streams.kv_index import MAX_EPOCH_JUMP, KvIndex

BS = 4


def toks(b: int) -> list[int]:
    return list(range(b * 10, b * 10 + BS))


def history(n: int, pod: str = "p") -> list[KvEventBatch]:
    """An engine's batches: store block i at seq i, remove block i-2 at seq i (so order matters:
    a removal applied before its store leaves a block the engine does not hold)."""
    out = []
    for i in range(n):
        ev: list = [BlockStored(block_hashes=[100 + i], token_ids=toks(i), block_size=BS)]
        if i >= 2:
            ev.append(BlockRemoved(block_hashes=[100 + i - 2]))
        out.append(KvEventBatch(pod=pod, model="m", epoch=0, seq=i, ts=float(i), events=ev))
    return out


def in_order(batches) -> KvIndex:
    idx = KvIndex(ManualClock())
    idx.apply_many(batches)
    return idx


def test_out_of_order_batches_fold_in_the_engines_order():
    h = history(6)
    idx = KvIndex(ManualClock(), reorder_window_s=30)
    st0 = idx.apply_many([h[0], h[1], h[3], h[4]])  # 2 was stored later (a publisher's retry)
    assert st0.held == 2 and idx.waiting_count == 2
    st1 = idx.apply_many([h[2], h[5], h[3]])  # h[3] again: a redelivery, applied once
    assert idx.waiting_count == 0 and st1.gaps == 0
    assert idx == in_order(h)
    assert idx.pods()["p"].seq == 5 and idx.pods()["p"].blocks == {"GPU": 2}
    # without reordering the same arrival order loses the removal of block 2 for good
    plain = KvIndex(ManualClock())
    plain.apply_many([h[0], h[1], h[3], h[4], h[2], h[5]])
    assert plain != in_order(h)


def test_a_real_gap_is_accepted_after_the_window():
    clock = ManualClock()
    h = history(4)
    idx = KvIndex(clock, reorder_window_s=10)
    idx.apply_many([h[0], h[2], h[3]])  # seq 1 is lost for good
    assert idx.pods()["p"].seq == 0
    clock.advance(5)
    assert idx.release_expired().batches == 0 and idx.waiting_count == 2
    clock.advance(6)
    st = idx.release_expired()
    assert idx.waiting_count == 0 and st.gaps == 1 and idx.pods()["p"].seq == 3
    assert idx.pods()["p"].blocks == {"GPU": 2}  # 0, 2, 3 stored; seq 2 removed block 0


def test_too_many_waiting_are_released_in_order():
    h = history(8)
    idx = KvIndex(ManualClock(), reorder_window_s=60, reorder_max=3)
    idx.apply_many([h[0], h[2], h[3], h[4]])
    assert idx.waiting_count == 3
    idx.apply(h[5])  # a fourth would wait: all are applied, the gap accepted
    assert idx.waiting_count == 0 and idx.pods()["p"].seq == 5


def test_a_new_epoch_waits_for_its_first_batch():
    h = history(3)
    idx = KvIndex(ManualClock(), reorder_window_s=60)
    idx.apply_many(h)
    e1 = [KvEventBatch(pod="p", model="m", epoch=1, seq=0, ts=9.0, events=[PodReset()]),
          KvEventBatch(pod="p", model="m", epoch=1, seq=1, ts=9.5,
                       events=[BlockStored(block_hashes=[7], token_ids=toks(7), block_size=BS)])]
    idx.apply(e1[1])
    assert idx.waiting_count == 1 and idx.pods()["p"].epoch == 0
    idx.apply(e1[0])
    assert idx.pods()["p"].epoch == 1 and idx.pods()["p"].blocks == {"GPU": 1}


def test_corrupt_positions_cannot_freeze_a_pod():
    h = history(4)
    for window in (0.0, 30.0):
        idx = KvIndex(ManualClock(), reorder_window_s=window)
        idx.apply_many(h[:2])
        bad = [KvEventBatch.model_construct(**{**h[2].__dict__, "epoch": 10 ** 30}),
               KvEventBatch.model_construct(**{**h[2].__dict__, "epoch": MAX_EPOCH + 1}),
               KvEventBatch.model_construct(**{**h[2].__dict__, "seq": 1 << 63}),
               KvEventBatch.model_construct(**{**h[2].__dict__, "epoch": MAX_EPOCH_JUMP + 1})]
        st = idx.apply_many(bad)
        assert st.out_of_bounds == 4
        idx.apply_many(h[2:])
        assert idx == in_order(h), window


def test_schema_bounds_epoch_and_seq():
    from schemas import ValidationFailure, decode_event

    ok = b'{"pod":"p","model":"m","epoch":4294967295,"seq":9223372036854775807,"ts":1,"events":[]}'
    assert decode_event(KvEventBatch, ok).epoch == MAX_EPOCH
    for bad in (b'{"pod":"p","model":"m","epoch":1000000000000000000000000000000,"seq":1,"ts":1,"events":[]}',
                b'{"pod":"p","model":"m","epoch":4294967296,"seq":1,"ts":1,"events":[]}',
                b'{"pod":"p","model":"m","seq":9223372036854775808,"ts":1,"events":[]}'):
        with pytest.raises(ValidationFailure):
            decode_event(KvEventBatch, bad)
        from consumers.index_codec import decode_batch

        with pytest.raises(ValidationFailure):
            decode_batch(bad)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.permutations(range(10)), st.integers(0, 3))
def test_any_arrival_order_within_the_window_gives_the_engines_state(order, dup):
    h = history(10)
    idx = KvIndex(ManualClock(), reorder_window_s=30)
    idx.apply(h[0])  # the pod's position is known (as after a snapshot)
    arrivals = [h[i] for i in order] + [h[i] for i in order[:dup]]  # and some redeliveries
    idx.apply_many(arrivals)
    assert idx.waiting_count == 0
    assert idx == in_order(h)


def test_heartbeats_keep_a_quiet_pod_live_and_a_silent_one_expires():
    clock = ManualClock()
    h = history(2)
    idx = KvIndex(clock, pod_timeout_s=60, reorder_window_s=10)
    idx.apply_many(h + [KvEventBatch(pod="q", model="m", seq=0, ts=0.0, events=[
        BlockStored(block_hashes=[9], token_ids=toks(9), block_size=BS)])])
    for _ in range(5):  # p's bridge re-states p's position every 20 s; q's bridge is gone
        clock.advance(20)
        st = idx.apply(KvEventBatch(pod="p", model="m", seq=1, ts=0.0, events=[]))
        assert st.heartbeats == 1 and st.stale_batches == 0
    assert idx.pods()["p"].live and not idx.pods()["q"].live
    assert idx.match_tokens("m", toks(9)).get("q") is None or idx.match_tokens("m", toks(9))["q"].matched_blocks == 0
    idx.pod_timeout_s = None
    assert idx.match_tokens("m", toks(9))["q"].matched_blocks == 1  # its blocks are kept, only left out
    assert idx == in_order(h + [KvEventBatch(pod="q", model="m", seq=0, ts=0.0, events=[
        BlockStored(block_hashes=[9], token_ids=toks(9), block_size=BS)])])  # nothing else changed
