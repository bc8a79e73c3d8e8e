"""ReplayState folds KV batches in groups (one index call per group): at every instant its
state equals folding each message on its own, as the live services do; a batch the index
rejects is reported and does not take the queued ones with it. No NATS here: the messages
are built in memory."""

from __future__ import annotations

import random

from consumers.indexer import decode_batch
from consumers.replay import ReplayMsg
from infernex import incident
from infernex.incident import ReplayState
from schemas import AllBlocksCleared, BlockRemoved, BlockStored, DeviceTelemetry, EngineMetrics, KvEventBatch
from schemas import PodGone, PodReset
from schemas import subjects as S
from streams.clock import ManualClock
from streams.kv_index import KvIndex


def _messages(pods: int = 5, steps: int = 40, seed: int = 3) -> list[ReplayMsg]:
    rng = random.Random(seed)
    out: list[ReplayMsg] = []
    ts = 1000.0
    seq = 0
    for step in range(steps):
        for p in range(pods):
            pod = f"pod-{p}"
            base = p * 1_000_000 + step * 10
            evs = [BlockStored(block_hashes=[base, base + 1], parent_block_hash=None if step % 4 == 0 else base - 9,
                               token_ids=[rng.randrange(50_000) for _ in range(8)], block_size=4)]
            if step % 3 == 2:
                evs.append(BlockRemoved(block_hashes=[base - 20]))
            if step == 11 and p == 1:
                evs = [PodReset()]
            if step == 17 and p == 0:
                evs.append(AllBlocksCleared())
            if step == steps - 1 and p == 4:
                evs = [PodGone()]
            b = KvEventBatch(pod=pod, model="m", seq=step + (1 if p == 3 and step >= 9 else 0), ts=ts, events=evs)
            # store times are not strictly increasing everywhere: the clock never goes back
            out.append(ReplayMsg(ts - (0.5 if step == 20 and p == 2 else 0.0), "KV", seq, S.kv_events("m", pod),
                                 b.to_json()))
            seq += 1
            if (step + p) % 6 == 0:
                out.append(ReplayMsg(ts, "ENGINE", seq, S.engine_metrics(pod), EngineMetrics(
                    pod=pod, model="m", ts=ts, num_requests_running=step % 5, num_requests_waiting=1,
                    kv_cache_usage_perc=0.25).to_json()))
            ts += 0.01
        out.append(ReplayMsg(ts, "DEV", seq, S.device_telemetry("n1", "0"), DeviceTelemetry(
            node="n1", device="0", kind="npu", source="sim", ts=ts, temperature_c=40 + step).to_json()))
    return out


def _live(msgs: list[ReplayMsg]) -> KvIndex:
    """The KV fold as a live consumer runs it: one batch per call, the clock at the message."""
    clock = ManualClock(0.0)
    index = KvIndex(clock)
    for m in msgs:
        if m.subject.startswith("kv."):
            clock.set(max(clock.now(), m.ts))
            try:
                index.apply(decode_batch(m.data))
            except ValueError:
                pass
    return index


def test_grouped_kv_fold_equals_one_by_one_at_every_cut(monkeypatch):
    monkeypatch.setattr(incident, "FLUSH_EVERY", 7)  # groups end mid-history as well as by reads
    msgs = _messages()
    late = next(i for i, m in enumerate(msgs) if i and m.ts < msgs[i - 1].ts)  # a store time behind the clock
    for cut in (1, 9, 50, 111, 163, late + 1, len(msgs) // 2, len(msgs) - 4, len(msgs)):
        grouped = ReplayState()
        grouped.apply_many(msgs[:cut])
        single = ReplayState()
        for m in msgs[:cut]:
            single.apply(m)
            single.flush()  # nothing queued: one index call per batch
        live = _live(msgs[:cut])
        assert grouped.index.fingerprint() == live.fingerprint() == single.index.fingerprint(), cut
        assert grouped.index.pods() == live.pods()  # last_seen included
        assert grouped.state() == single.state(), cut
        assert grouped.timeline == single.timeline and grouped.counts == single.counts
    assert {e.kind for e in grouped.timeline} >= {"engine-reset", "kv-gap", "cache-cleared"}
    assert "pod-4" not in grouped.index.pods()  # gone


def test_reads_see_every_batch_applied_so_far():
    msgs = [m for m in _messages(pods=2, steps=3) if m.subject.startswith("kv.")]
    st = ReplayState()
    st.apply_many(msgs[:1])
    assert st._pending  # queued, not folded yet
    assert set(st.state()["pods"]) == {"pod-0"}  # a read folds the queue first
    assert not st._pending
    st.apply_many(msgs[1:])
    part = st.kv_part()
    assert not st._pending and {b.pod for b in map(decode_batch, part["dump"])} == {"pod-0", "pod-1"}


def test_a_batch_the_index_rejects_is_reported_alone():
    msgs = [m for m in _messages(pods=3, steps=6) if m.subject.startswith("kv.")]
    # token ids the fold cannot key (>= 2**32): the schema admits them, the index raises
    bad = KvEventBatch(pod="pod-1", model="m", seq=6, ts=2000.0, events=[
        BlockStored(block_hashes=[77], token_ids=[1, 2, 3, 1 << 33], block_size=4)])
    tail = KvEventBatch(pod="pod-0", model="m", seq=6, ts=2000.0, events=[
        BlockStored(block_hashes=[88], token_ids=[5, 6, 7, 8], block_size=4)])
    msgs = msgs + [ReplayMsg(2000.0, "KV", 900, S.kv_events("m", "pod-1"), bad.to_json()),
                   ReplayMsg(2000.0, "KV", 901, S.kv_events("m", "pod-0"), tail.to_json())]
    st = ReplayState()
    st.apply_many(msgs)
    assert st.counts["rejected"] == 1 and st.counts["KvEventBatch"] == len(msgs)
    assert any("rejected by the index" in why for _, why in st.undecodable)
    live = _live(msgs)
    assert st.index.fingerprint() == live.fingerprint()
    assert st.index.pods()["pod-0"].seq == 6  # the batches around it were folded
