"""The KV index fold: keys, matching, tiers, bad input, predictions, dump/restore (Hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodGone, PodReset
from streams.clock import ManualClock
from streams.kv_index import LOST_GRACE_S, KvIndex, block_keys

BS = 4


def toks(*blocks: int) -> list[int]:
    """Token ids for blocks named by small ints (block b is [b*10, b*10+1, ...])."""
    out = []
    for b in blocks:
        out.extend(range(b * 10, b * 10 + BS))
    return out


def stored(hashes, blocks, parent=None, medium=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=toks(*blocks),
                       block_size=BS, medium=medium)


class Feed:
    """Builds batches per pod with increasing sequence numbers."""

    def __init__(self, index: KvIndex, model: str = "m"):
        self.index = index
        self.model = model
        self.seq: dict[str, int] = {}

    def __call__(self, pod: str, *events, epoch: int = 0, seq: int | None = None):
        if seq is None:
            seq = self.seq.get(pod, -1) + 1
        self.seq[pod] = seq
        return self.index.apply(KvEventBatch(pod=pod, model=self.model, epoch=epoch, seq=seq, ts=float(seq),
                                             events=list(events)))


@pytest.fixture
def idx():
    return KvIndex(ManualClock())


def matched(index, blocks, model="m", pods=None):
    return {p: m.matched_blocks for p, m in index.match_tokens(model, toks(*blocks), pods).items()}


def test_block_keys_are_chained_and_stable():
    t = toks(1, 2, 3)
    k = block_keys(t, BS)
    assert len(k) == 3 and len(set(k)) == 3
    assert block_keys(t + [7, 7], BS) == k  # partial trailing block ignored
    assert block_keys(toks(2, 3), BS, parent=k[0]) == k[1:]  # chaining from a parent key
    assert block_keys(toks(2), BS) != [k[1]]  # same tokens, other prefix: other key
    assert block_keys(t, BS, lora="a") != k
    import numpy as np

    assert block_keys(np.array(t), BS) == k
    with pytest.raises(ValueError):
        block_keys([-1] * BS, BS)
    with pytest.raises(ValueError):
        block_keys(np.array([-1] * BS), BS)


def test_prefix_match_per_pod(idx):
    f = Feed(idx)
    f("a", stored([11, 12, 13], [1, 2, 3]))
    f("b", stored([21], [1]))
    f("c", stored([31, 32], [9, 2]))
    assert matched(idx, [1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert matched(idx, [1, 2], pods=["a", "c", "zz"]) == {"a": 2, "c": 0, "zz": 0}
    assert matched(idx, [5]) == {}
    assert idx.block_size("m") == BS
    # chaining over two events equals one event
    f("b", stored([22, 23], [2, 3], parent=21))
    assert matched(idx, [1, 2, 3]) == {"a": 3, "b": 3}


def test_removed_and_cleared_and_reset(idx):
    f = Feed(idx)
    f("a", stored([1, 2, 3], [1, 2, 3]))
    f("b", stored([1, 2], [1, 2]))
    st = f("a", BlockRemoved(block_hashes=[2]))
    assert st.blocks_removed == 1
    assert matched(idx, [1, 2, 3]) == {"a": 1, "b": 2}
    f("b", AllBlocksCleared())
    assert matched(idx, [1, 2, 3]) == {"a": 1}
    f("a", PodReset())
    assert matched(idx, [1]) == {}
    f("a", stored([1], [1]))
    f("a", PodGone())
    assert "a" not in idx.pods() and matched(idx, [1]) == {}
    assert len(idx) == 0


@pytest.mark.parametrize(
    "case,events,expect_stats,expect_match",
    [
        ("unknown parent", [stored([5], [5], parent=999)], {"unknown_parent": 1, "blocks_stored": 0}, {"a": 2}),
        ("unknown removal", [BlockRemoved(block_hashes=[77, 78])], {"unknown_removed": 2}, {"a": 2}),
        ("duplicate store", [stored([1, 2], [1, 2])], {"duplicates": 2}, {"a": 2}),
        ("alias hash", [stored([9], [1])], {"aliases": 1}, {"a": 2}),
        ("other block size", [BlockStored(block_hashes=[3], token_ids=[1, 2], block_size=2)], {"rejected": 1},
         {"a": 2}),
    ],
)
def test_bad_input_is_counted_not_corrupting(idx, case, events, expect_stats, expect_match):
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))
    before = idx.state()
    st = f("a", *events)
    for k, v in expect_stats.items():
        assert getattr(st, k) == v, case
    assert matched(idx, [1, 2]) == expect_match
    if case not in ("alias hash", "duplicate store"):
        assert idx.state()["pods"]["a"][4] == before["pods"]["a"][4]


def test_a_hash_held_by_two_physical_blocks_is_reference_counted(idx):
    """vLLM can compute one block twice (two requests missed the cache at once): two
    BlockStored with the same hash, later one BlockRemoved per physical block."""
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))
    f("a", stored([1, 2], [1, 2]))  # the second physical copy of both blocks
    restored = KvIndex(ManualClock(0))
    restored.apply_many(idx.dump())
    assert restored == idx
    for index in (idx, restored):
        g = Feed(index)
        g.seq = dict(f.seq)
        g("a", BlockRemoved(block_hashes=[2]))
        assert matched(index, [1, 2]) == {"a": 2}  # one copy of block 2 is still there
        g("a", BlockRemoved(block_hashes=[2]))
        assert matched(index, [1, 2]) == {"a": 1}
        st = g("a", BlockRemoved(block_hashes=[2]))
        assert st.unknown_removed == 1


def test_alias_is_reference_counted(idx):
    f = Feed(idx)
    f("a", stored([1], [1]))
    f("a", stored([9], [1]))  # another engine hash for the same tokens
    f("a", BlockRemoved(block_hashes=[1]))
    assert matched(idx, [1]) == {"a": 1}
    f("a", BlockRemoved(block_hashes=[9]))
    assert matched(idx, [1]) == {}


def test_stale_and_out_of_order_batches(idx):
    f = Feed(idx)
    f("a", stored([1], [1]), seq=5)
    assert f("a", BlockRemoved(block_hashes=[1]), seq=5).stale_batches == 1  # redelivery
    assert f("a", BlockRemoved(block_hashes=[1]), seq=3).stale_batches == 1  # older
    assert matched(idx, [1]) == {"a": 1}
    assert f("a", stored([2], [2], parent=1), seq=9).gaps == 1
    assert matched(idx, [1, 2]) == {"a": 2}
    # a newer epoch is a restarted engine: its old blocks are gone
    st = f("a", stored([7], [7]), epoch=1, seq=0)
    assert st.epoch_resets == 1
    assert matched(idx, [1]) == {} and matched(idx, [7]) == {"a": 1}
    # a gone pod's old batches are not resurrected
    f("a", PodGone(), epoch=1, seq=1)
    assert f("a", stored([1], [1]), epoch=1, seq=1).stale_batches == 1
    assert idx.pods() == {}


def test_tiers_weighted_and_removal_per_medium(idx):
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))
    f("a", stored([2], [2], parent=1, medium="CPU"))  # offloaded copy of block 2
    f("a", stored([3], [3], parent=2, medium="CPU"))
    f("b", stored([1, 2, 3], [1, 2, 3], medium="CPU"))
    m = idx.match_tokens("m", toks(1, 2, 3))
    assert m["a"].matched_blocks == 3 and m["a"].tiers == {"GPU": 2, "CPU": 1}
    assert m["a"].score == pytest.approx(2 * 1.0 + 0.8)
    assert m["b"].tiers == {"CPU": 3} and m["b"].score == pytest.approx(2.4)
    f("a", BlockRemoved(block_hashes=[2]))  # GPU copy evicted; CPU copy remains
    m = idx.match_tokens("m", toks(1, 2, 3))
    assert m["a"].tiers == {"GPU": 1, "CPU": 2}
    f("a", AllBlocksCleared(medium="CPU"))
    assert matched(idx, [1, 2, 3]) == {"a": 1, "b": 3}
    assert idx.pods()["a"].blocks == {"GPU": 1}


def test_predictions_merge_and_expire():
    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=2)
    f = Feed(idx)
    f("a", stored([1], [1]))
    idx.record_route("m", "a", toks(1, 2, 3))  # exact pod: short TTL
    idx.record_route("m", "x", toks(1, 2))  # approximate pod: long TTL
    m = idx.match_tokens("m", toks(1, 2, 3, 4))
    assert (m["a"].matched_blocks, m["a"].predicted_blocks, m["a"].tiers) == (3, 2, {"GPU": 1})
    assert m["a"].score == pytest.approx(1 * 1.0 + 2 * idx.predicted_weight)
    assert (m["x"].matched_blocks, m["x"].predicted_blocks) == (2, 2)
    clock.advance(3)
    assert matched(idx, [1, 2, 3]) == {"a": 1, "x": 2}
    clock.advance(200)
    assert matched(idx, [1, 2, 3]) == {"a": 1}
    assert idx.pods()["x"].predicted_blocks == 0


def test_a_forgotten_route_ends_its_predictions_on_that_pod_only():
    from streams.kv_index import block_keys

    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=30)
    f = Feed(idx)
    f("a", stored([1], [1]))  # the engine reported the first block
    idx.record_route("m", "a", toks(1, 2, 3))
    idx.record_route("m", "b", toks(1, 2, 3))
    assert matched(idx, [1, 2, 3]) == {"a": 3, "b": 3}
    keys = block_keys(toks(1, 2, 3), BS)
    assert idx.forget_route("m", "a", keys) == 3  # the route's three (record_route predicts a held block too)
    assert matched(idx, [1, 2, 3]) == {"a": 1, "b": 3}  # what a's events said stays; b's prediction too
    assert idx.forget_route("m", "a", keys) == 0 and idx.forget_route("m", "nobody", keys) == 0
    clock.advance(200)  # (the route's own expiry later finds nothing left to drop)
    assert matched(idx, [1, 2, 3]) == {"a": 1}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("xy"), st.integers(1, 6), st.sampled_from([1.0, 5.0, 30.0]),
                          st.sampled_from([0.0, 0.5, 2.0, 7.0])), min_size=1, max_size=30))
def test_predictions_expire_as_the_latest_route_says(routes):
    """Routes with mixed TTLs (a shorter one after a longer one keeps the longer expiry): the
    predicted blocks always equal a reference that keeps each (pod, block)'s latest expiry."""
    clock = ManualClock()
    idx = KvIndex(clock, default_block_size=BS)
    ref: dict[tuple[str, int], float] = {}
    prompt = toks(1, 2, 3, 4, 5, 6)
    for pod, n, ttl, wait in routes:
        idx.record_route("m", pod, prompt[: n * BS], ttl_s=ttl)
        for i in range(n):
            ref[(pod, i)] = max(ref.get((pod, i), 0.0), clock.now() + ttl)
        clock.advance(wait)
        now = clock.now()
        m = idx.match_tokens("m", prompt)
        for q in "xy":
            live = 0  # a prediction is a prefix: count its leading live blocks
            while live < 6 and ref.get((q, live), 0.0) > now:
                live += 1
            got = m[q].matched_blocks if q in m else 0
            assert got == live, (q, now, ref)


def test_approximate_only_cluster_uses_the_default_block_size():
    clock = ManualClock()
    idx = KvIndex(clock, default_block_size=BS)
    assert idx.match_tokens("m", toks(1, 2)) == {}
    idx.record_route("m", "x", toks(1, 2, 3))
    m = idx.match_tokens("m", toks(1, 2, 9))["x"]
    assert (m.matched_blocks, m.predicted_blocks, m.tiers) == (2, 2, {})
    assert m.score == pytest.approx(2 * idx.predicted_weight) and idx.predicted_weight > 0
    assert idx.block_size("m") == BS
    assert KvIndex(clock).block_size("m") is None


def test_silent_pods_are_left_out():
    clock = ManualClock()
    idx = KvIndex(clock, pod_timeout_s=30)
    f = Feed(idx)
    f("a", stored([1], [1]))
    clock.advance(20)
    f("b", stored([1], [1]))
    clock.advance(15)
    assert matched(idx, [1]) == {"b": 1}
    assert idx.pods()["a"].live is False
    f("a", BlockRemoved(block_hashes=[5]))  # any event revives it
    assert matched(idx, [1]) == {"a": 1, "b": 1}


def test_dump_keeps_orphans_and_tombstones(idx):
    f = Feed(idx)
    f("a", stored([1, 2, 3], [1, 2, 3]))
    f("a", BlockRemoved(block_hashes=[2]))  # 3 is unreachable until 2 comes back
    f("b", stored([1], [1]))
    f("b", PodGone())
    restored = KvIndex(ManualClock())
    restored.apply_many(idx.dump())
    assert restored == idx
    assert matched(restored, [1, 2, 3]) == matched(idx, [1, 2, 3]) == {"a": 1}
    assert restored.state()["gone"] == {"b": ("m", 0, 1, 1.0)}
    for index in (idx, restored):
        Feed(index)("a", stored([2], [2], parent=1), seq=2)
    assert matched(restored, [1, 2, 3]) == matched(idx, [1, 2, 3]) == {"a": 3}


# ------------------------------------------------------------------------- property tests

MEDIA = [None, None, None, "CPU"]


@st.composite
def workloads(draw, media=tuple(MEDIA)):
    """A random but valid per-pod event history over a small block universe."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    n_events = draw(st.integers(1, 40))
    pods = ["p0", "p1", "p2"]
    held: dict[tuple[str, str | None], dict[int, list[int]]] = {}  # (pod, medium) -> hash -> path
    events: list[tuple[str, object]] = []
    for _ in range(n_events):
        pod = rng.choice(pods)
        medium = rng.choice(media)
        mine = held.setdefault((pod, medium), {})
        r = rng.random()
        if r < 0.55:
            if mine and rng.random() < 0.6:
                parent = rng.choice(sorted(mine))
                path = mine[parent]
            else:
                parent, path = None, []
            n = rng.randint(1, 3)
            blocks = [rng.randint(0, 3) for _ in range(n)]
            hashes = []
            for b in blocks:
                path = path + [b]
                h = hash(tuple(path)) & 0xFFFFFFFF  # engine hash: content-defined, per prefix
                hashes.append(h)
                mine[h] = path
            if len(set(hashes)) != len(hashes):
                continue
            events.append((pod, stored(hashes, blocks, parent=parent, medium=medium)))
        elif r < 0.8 and mine:
            gone = rng.sample(sorted(mine), rng.randint(1, len(mine)))
            for h in gone:
                mine.pop(h)
            events.append((pod, BlockRemoved(block_hashes=gone + [rng.randint(1 << 40, 1 << 41)], medium=medium)))
        elif r < 0.88:
            for key in list(held):
                if key[0] == pod and (medium is None or key[1] == medium):
                    held[key] = {}
            events.append((pod, AllBlocksCleared(medium=medium)))
        elif r < 0.93:
            for key in list(held):
                if key[0] == pod:
                    held[key] = {}
            events.append((pod, PodReset()))
        else:
            events.append((pod, stored([rng.randint(1, 99)], [1], parent=12345678901)))  # unknown parent
    return events


def batches_one_by_one(events):
    seq: dict[str, int] = {}
    out = []
    for pod, ev in events:
        seq[pod] = seq.get(pod, -1) + 1
        out.append(KvEventBatch(pod=pod, model="m", seq=seq[pod], ts=1.0, events=[ev]))
    return out


def batches_grouped(events):
    """Consecutive events of the same pod in one batch; last seq equals the one-by-one count."""
    seq: dict[str, int] = {}
    out = []
    group: list = []
    cur = None
    for pod, ev in events + [(None, None)]:
        if pod != cur and group:
            seq[cur] = seq.get(cur, -1) + len(group)
            out.append(KvEventBatch(pod=cur, model="m", seq=seq[cur], ts=1.0, events=group))
            group = []
        cur = pod
        if ev is not None:
            group.append(ev)
    return out


def model_truth(events) -> dict[str, set[tuple[int, ...]]]:
    """Reference: per pod, the block paths it holds reachably (any medium), by replaying naively.
    A hash stored again with the same content is one more physical copy (one removal each)."""
    held: dict[tuple[str, str], dict[int, tuple]] = {}
    copies: dict[tuple[str, str, int], int] = {}
    for pod, ev in events:
        if isinstance(ev, BlockStored):
            tier = ev.medium or "GPU"
            parent_path: tuple = ()
            if ev.parent_block_hash is not None:
                found = None
                for (p, t), hs in sorted(held.items(), key=lambda kv: kv[0][1] != tier):
                    if p == pod and ev.parent_block_hash in hs:
                        found = hs[ev.parent_block_hash]
                        break
                if found is None:
                    continue
                parent_path = found
            mine = held.setdefault((pod, tier), {})
            path = parent_path
            for i, h in enumerate(ev.block_hashes):
                path = path + (tuple(ev.token_ids[i * BS:(i + 1) * BS]),)
                same = mine.get(h) == path
                copies[(pod, tier, h)] = copies.get((pod, tier, h), 0) + 1 if same else 1
                mine[h] = path
        elif isinstance(ev, BlockRemoved):
            tier = ev.medium or "GPU"
            mine = held.get((pod, tier), {})
            for h in ev.block_hashes:
                if h not in mine:
                    continue
                left = copies.get((pod, tier, h), 1) - 1
                copies[(pod, tier, h)] = left
                if left <= 0:
                    mine.pop(h, None)
        elif isinstance(ev, AllBlocksCleared):
            for key in list(held):
                if key[0] == pod and (ev.medium is None or key[1] == ev.medium):
                    held[key] = {}
        elif isinstance(ev, PodReset):
            for key in list(held):
                if key[0] == pod:
                    held[key] = {}
    out: dict[str, set] = {}
    for (pod, _), hs in held.items():
        out.setdefault(pod, set()).update(hs.values())
    # reachable: every proper prefix held too
    return {p: {path for path in paths if all(path[:i] in paths for i in range(1, len(path)))}
            for p, paths in out.items()}


PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(workloads())
def test_restore_of_dump_equals_original(events):
    a = KvIndex(ManualClock())
    a.apply_many(batches_one_by_one(events))
    b = KvIndex(ManualClock())
    b.apply_many(a.dump())
    assert b == a
    assert b.dump() == a.dump()


@PROP
@given(st.one_of(workloads(), workloads(media=(None,))), st.floats(0, 1))
def test_restore_mid_stream_then_continue_equals_uninterrupted(events, where):
    batches = batches_one_by_one(events)
    cut = int(len(batches) * where)
    a = KvIndex(ManualClock())
    a.apply_many(batches)
    b = KvIndex(ManualClock())
    b.apply_many(batches[:cut])
    c = KvIndex(ManualClock())
    c.apply_many(b.dump())
    c.apply_many(batches[cut:])
    assert c == a
    c.apply_many(batches)  # replaying everything again changes nothing
    assert c == a


@PROP
@given(workloads())
def test_one_batch_or_one_by_one_same_state(events):
    a = KvIndex(ManualClock())
    a.apply_many(batches_one_by_one(events))
    b = KvIndex(ManualClock())
    b.apply_many(batches_grouped(events))
    assert a == b


@PROP
@given(st.one_of(workloads(), workloads(media=(None,))))
def test_matches_agree_with_naive_replay_and_removed_never_reported(events):
    idx = KvIndex(ManualClock())
    idx.apply_many(batches_one_by_one(events))
    truth = model_truth(events)
    paths = set()
    for ps in truth.values():
        paths |= ps
    paths |= {(tuple(toks(b)),) for b in range(4)}
    for path in paths:
        tokens = [t for blk in path for t in blk]
        got = idx.match_tokens("m", tokens)
        for pod in ("p0", "p1", "p2"):
            expect = 0
            for i in range(1, len(path) + 1):
                if path[:i] in truth.get(pod, set()):
                    expect = i
                else:
                    break
            assert (got[pod].matched_blocks if pod in got else 0) == expect, (pod, path)


# ------------------------------------------------------------- fast paths and kept events


def test_fast_store_undoes_itself_on_a_partial_alias(idx):
    """One event mixing new blocks and a block the pod already holds under another hash."""
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))
    f("b", stored([5], [1]))  # shared with another pod: its bit must survive the undo
    st = f("a", stored([7, 8, 9], [1, 2, 3]))  # hashes 7, 8 alias keys a holds; 9 is new
    assert (st.aliases, st.duplicates, st.blocks_stored) == (2, 0, 3)
    assert matched(idx, [1, 2, 3]) == {"a": 3, "b": 1}
    f("a", BlockRemoved(block_hashes=[1, 2]))  # the aliases keep the keys held
    assert matched(idx, [1, 2, 3]) == {"a": 3, "b": 1}
    f("a", BlockRemoved(block_hashes=[7]))
    assert matched(idx, [1, 2, 3]) == {"b": 1}
    assert sorted(idx.state()["pods"]["a"][4]["GPU"])[0][0] == 8
    restored = KvIndex(ManualClock())
    restored.apply_many(idx.dump())
    assert restored == idx


def test_same_hash_twice_in_one_event_takes_the_careful_path(idx):
    f = Feed(idx)
    st = f("a", stored([4, 4], [1, 2]))  # the engine reused a hash inside one event
    assert st.blocks_removed == 1  # the first content is replaced by the second
    assert idx.state()["pods"]["a"][4]["GPU"] == [(4, block_keys(toks(1, 2), BS)[1])]
    assert matched(idx, [1, 2]) == {}  # block 2 is held but its parent is not
    restored = KvIndex(ManualClock())
    restored.apply_many(idx.dump())
    assert restored == idx


def test_removal_of_shared_and_exclusive_blocks(idx):
    f = Feed(idx)
    f("a", stored([1, 2, 3], [1, 2, 3]))
    f("b", stored([1, 2], [1, 2]))
    st = f("a", BlockRemoved(block_hashes=[3, 2, 99]))  # 3 only a holds, 2 shared with b
    assert (st.blocks_removed, st.unknown_removed) == (2, 1)
    assert matched(idx, [1, 2, 3]) == {"a": 1, "b": 2}
    assert len(idx) == 2  # block 3 left the index entirely


def test_tables_shrink_with_evictions_and_dump_stays_exact():
    """Thousands of stored-then-evicted blocks (tables grow and rows are deleted): the index
    holds exactly the live blocks afterwards, and dump still restores it."""
    idx = KvIndex(ManualClock())
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))  # a prefix kept throughout
    rng = random.Random(7)
    live: list[list[int]] = []
    kept_tails = 0
    h = 100
    for i in range(1500):
        hashes = list(range(h, h + 8))
        h += 8
        f("a", BlockStored(block_hashes=hashes, parent_block_hash=2,
                           token_ids=[rng.randrange(1000) for _ in range(8 * BS)], block_size=BS))
        live.append(hashes)
        if len(live) > 20:  # evict an old chain, sometimes only its tail (a partly held event)
            old = live.pop(rng.randrange(len(live) - 5))
            cut = rng.choice([0, 3])
            kept_tails += cut
            f("a", BlockRemoved(block_hashes=old[cut:]))
    held = 2 + 8 * len(live) + kept_tails
    assert idx.pods()["a"].blocks == {"GPU": held}
    assert len(idx) == held  # random tokens: every held block is a distinct key
    assert idx.totals.blocks_removed == 2 + 1500 * 8 - held
    restored = KvIndex(ManualClock())
    restored.apply_many(idx.dump())
    assert restored == idx
    assert matched(restored, [1, 2]) == matched(idx, [1, 2]) == {"a": 2}
    assert restored.dump() == idx.dump()


def test_lora_root_chain_survives_dump(idx):
    f = Feed(idx)
    f("a", BlockStored(block_hashes=[1, 2], token_ids=toks(1, 2), block_size=BS, lora_name="ad"))
    f("a", BlockRemoved(block_hashes=[2]))
    keys = block_keys(toks(1, 2), BS, lora="ad")
    assert {p: m.matched_blocks for p, m in idx.match_keys("m", keys).items()} == {"a": 1}
    restored = KvIndex(ManualClock())
    restored.apply_many(idx.dump())
    assert restored == idx
    assert {p: m.matched_blocks for p, m in restored.match_keys("m", keys).items()} == {"a": 1}
    assert idx.match_keys("m", block_keys(toks(1, 2), BS)) == {}  # without the adapter: no match


def test_query_results_per_pod_with_many_pods(idx):
    f = Feed(idx)
    for i in range(20):  # pod i holds the first i % 5 + 1 blocks
        n = i % 5 + 1
        f(f"p{i:02d}", stored(range(1, n + 1), range(1, n + 1)))
    got = idx.match_tokens("m", toks(1, 2, 3, 4, 5, 6))
    assert {p: m.matched_blocks for p, m in got.items()} == {f"p{i:02d}": i % 5 + 1 for i in range(20)}
    assert all(m.tiers == {"GPU": m.matched_blocks} and m.score == m.matched_blocks for m in got.values())
    f("p03", PodGone())  # slot freed: the pod leaves the answers
    got = idx.match_tokens("m", toks(1, 2), pods=["p03", "p04"])
    assert {p: m.matched_blocks for p, m in got.items()} == {"p03": 0, "p04": 2}


@PROP
@given(st.one_of(workloads(), workloads(media=(None,))))
def test_eager_compaction_keeps_state_dump_and_matches(events):
    """With compaction after every stored event, everything equals the uncompacted index."""
    a = KvIndex(ManualClock())
    a.apply_many(batches_one_by_one(events))
    b = KvIndex(ManualClock())
    b._compact_slack = -(10**9)  # compact on every stored event
    b.apply_many(batches_one_by_one(events))
    assert b == a
    c = KvIndex(ManualClock())
    c.apply_many(b.dump())
    assert c == a
    assert sorted(e.block_hashes for bt in c.dump() for e in bt.events if isinstance(e, BlockStored)) == \
        sorted(e.block_hashes for bt in b.dump() for e in bt.events if isinstance(e, BlockStored))
    for path in {tuple(toks(x, y)) for x in range(4) for y in range(4)}:
        assert a.match_tokens("m", list(path)) == b.match_tokens("m", list(path)) == c.match_tokens("m", list(path))


def test_token_ids_may_come_as_a_uint32_array():
    """A snapshot loader may hand token ids over as array('I') (copied in C, no list needed)."""
    from array import array

    a, b = KvIndex(ManualClock()), KvIndex(ManualClock())
    ev = stored([1, 2], [1, 2])
    fast = BlockStored.model_construct(**{**dict(ev), "token_ids": array("I", ev.token_ids)})
    a.apply(KvEventBatch(pod="p", model="m", seq=0, ts=0.0, events=[ev]))
    b.apply(KvEventBatch.model_construct(schema_version=1, pod="p", model="m", dp_rank=0, epoch=0, seq=0, ts=0.0,
                                         events=[fast]))
    assert a == b and matched(b, [1, 2]) == {"p": 2}


def test_keys_of_names_the_prefix_each_engine_block_ends():
    idx = KvIndex(ManualClock())
    f = Feed(idx)
    f("a", stored([1, 2], [1, 2]))
    f("a", BlockStored(block_hashes=[9], token_ids=toks(5), block_size=BS, medium="CPU"))
    keys = block_keys(toks(1, 2), BS)
    assert idx.keys_of("a", [1, 2, 3]) == [keys[0], keys[1], None]
    assert idx.keys_of("a", [9], "CPU") == block_keys(toks(5), BS)
    assert idx.keys_of("a", [9]) == [None]  # not in the GPU tier
    assert idx.keys_of("nobody", [1]) == [None]
    f("a", BlockRemoved(block_hashes=[2]))
    assert idx.keys_of("a", [1, 2]) == [keys[0], None]


def test_more_than_64_pods_exact_and_predicted():
    """Pod masks span several 64-bit words once a model has more than 64 pod slots."""
    idx = KvIndex(ManualClock())
    f = Feed(idx)
    for i in range(70):
        f(f"p{i:02d}", stored([i * 10 + 1, i * 10 + 2], [1, 2 + i % 3]))
    res = idx.match_tokens("m", toks(1, 2))
    assert {p for p, r in res.items() if r.matched_blocks == 2} == {f"p{i:02d}" for i in range(0, 70, 3)}
    assert len(res) == 70 and all(r.matched_blocks >= 1 for r in res.values())
    idx.record_route("m", "q99", token_ids=toks(1, 2, 3))  # a prediction-only pod past slot 64
    res = idx.match_tokens("m", toks(1, 2, 3), pods=["q99", "p69", "p68"])
    assert res["q99"].matched_blocks == 3 and res["q99"].predicted_blocks == 3
    assert res["p69"].matched_blocks == 2 and res["p68"].matched_blocks == 1
    idx.remove_pod("p69")
    assert "p69" not in idx.match_tokens("m", toks(1, 2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 69), st.integers(0, 7), st.integers(1, 40), st.sampled_from([1.0, 5.0, 30.0]),
                          st.sampled_from([0.0, 0.5, 2.0, 7.0]), st.booleans()), min_size=1, max_size=60))
def test_predictions_across_many_pods_match_a_reference(ops):
    """Predictions kept in the compiled tables, against a plain reference of (pod, key) -> latest
    expiry: up to 70 pods (the masks widen past 64), prompts of up to 40 blocks sharing prefixes
    (the tables grow), pods removed on the way. Every pod's matched prefix and predicted count
    equal the reference's."""
    clock = ManualClock()
    idx = KvIndex(clock, default_block_size=BS)
    ref: dict[tuple[str, int], float] = {}
    prompts = [block_keys(toks(*range(d * 100, d * 100 + 40)), BS) for d in range(8)]
    for i in range(70):  # every pod gets a slot now, in order: p64..p69 need a second mask word
        idx.record_route("m", f"p{i}", keys=[10_000 + i], ttl_s=0.5)
    clock.advance(1.0)
    for podn, doc, n, ttl, wait, remove in ops:
        pod = f"p{podn}"
        if remove and podn % 5 == 0:
            idx.remove_pod(pod)
            for k in [k for k in ref if k[0] == pod]:
                del ref[k]
        else:
            keys = prompts[doc][:n]
            idx.record_route("m", pod, keys=keys, ttl_s=ttl)
            for k in keys:
                ref[(pod, k)] = max(ref.get((pod, k), 0.0), clock.now() + ttl)
        clock.advance(wait)
        now = clock.now()
        pods = {p for p, _ in ref}
        for doc_keys in prompts:
            m = idx.match_keys("m", doc_keys)
            for p in pods:
                live = 0
                while live < len(doc_keys) and ref.get((p, doc_keys[live]), 0.0) > now:
                    live += 1
                got = m[p].matched_blocks if p in m else 0
                assert got == live, (p, now)
                if p in m:
                    assert m[p].predicted_blocks == m[p].matched_blocks
        info = idx.pods()
        for p in pods:
            if p in info:
                assert info[p].predicted_blocks == sum(1 for (q, _), e in ref.items() if q == p and e > now)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.tuples(st.sampled_from(["p0", "p1", "x", "y"]), st.lists(st.integers(0, 3), min_size=1,
                                                                                       max_size=4)), max_size=6),
       st.sampled_from([None, "p1", "x"]), st.lists(st.integers(0, 3), min_size=1, max_size=5))
def test_match_counts_equal_match_keys(events, routes, removed, query):
    """The router's lean query (counts per pod, predicted apart) says what match_keys says, with
    tiers, predictions on exact and approximate pods, and a removed pod's slot."""
    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=2)
    for b in batches_one_by_one(events):
        idx.apply(b)
    for pod, blocks in routes:
        idx.record_route("m", pod, toks(*blocks))
    if removed is not None:
        idx.remove_pod(removed)
    keys = block_keys(toks(*query), BS)
    for _ in range(2):  # before and after the exact pods' predictions expire
        full = idx.match_keys("m", keys)
        want = {p: m.matched_blocks for p, m in full.items() if m.matched_blocks}
        want_pred = {p: m.predicted_blocks for p, m in full.items() if m.predicted_blocks}
        assert idx.match_counts("m", keys) == (want, want_pred)
        assert idx.match_counts("m", keys.array) == (want, want_pred)
        clock.advance(5)
    assert idx.match_counts("other-model", keys) == ({}, {})
    assert idx.match_counts("m", []) == ({}, {})



@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.lists(st.integers(0, 3), min_size=1, max_size=5),
       st.lists(st.sampled_from(["none", "batch", "route", "expire", "remove", "tiny-wait", "wait"]), min_size=1,
                max_size=12))
def test_match_counts_asked_again_answers_for_the_index_as_it_is_now(events, query, steps):
    """The same keys asked again (the router's lazy tokenizing, then its decision) may get the
    last answer back without a walk, but only while nothing a query reads has changed: after each
    kind of change in between, the answer is a fresh walk's (match_keys)."""
    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=2)
    todo = list(batches_one_by_one(events))
    half = len(todo) // 2
    for b in todo[:half]:
        idx.apply(b)
    later = iter(todo[half:])
    keys = block_keys(toks(*query), BS)
    arr = keys.array
    for step in steps:
        got = idx.match_counts("m", arr)
        if step == "batch":
            b = next(later, None)
            if b is not None:
                idx.apply(b)
        elif step == "route":
            idx.record_route("m", "p1", keys=arr, ttl_s=0.01)
        elif step == "expire":
            clock.advance(0.02)
        elif step == "remove":
            idx.remove_pod("p0")
        elif step == "tiny-wait":
            clock.advance(0.001)
        elif step == "wait":
            clock.advance(1.0)
        full = idx.match_keys("m", keys)
        want = ({p: m.matched_blocks for p, m in full.items() if m.matched_blocks},
                {p: m.predicted_blocks for p, m in full.items() if m.predicted_blocks})
        again = idx.match_counts("m", arr)
        assert again == want, step
        again[0]["somebody"] = 1  # a caller's change to an answer is not seen by the next caller
        assert idx.match_counts("m", arr) == want
        del got


def test_match_counts_asked_again_sees_batches_the_reorder_window_let_through():
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=1.0)
    stored = [BlockStored(block_hashes=[10 + i], token_ids=toks(i), block_size=BS,
                          parent_block_hash=(9 + i) if i else None) for i in range(3)]
    idx.apply(KvEventBatch(pod="p0", model="m", seq=0, ts=1.0, events=[stored[0]]))
    idx.apply(KvEventBatch(pod="p0", model="m", seq=2, ts=1.0, events=[stored[2]]))  # held: seq 1 is missing
    keys = block_keys(toks(0, 1, 2), BS).array
    assert idx.match_counts("m", keys) == ({"p0": 1}, {})
    clock.advance(0.01)
    idx.apply(KvEventBatch(pod="p0", model="m", seq=1, ts=1.0, events=[stored[1]]))  # releases seq 2 too
    assert idx.match_counts("m", keys) == ({"p0": 3}, {})
    idx.apply(KvEventBatch(pod="p0", model="m", seq=4, ts=1.0, events=[BlockRemoved(block_hashes=[11])]))
    assert idx.match_counts("m", keys) == ({"p0": 3}, {})  # held: seq 3 is missing
    clock.advance(0.01)
    assert idx.waiting_count == 1
    clock.advance(2.0)  # past the window
    assert idx.match_counts("m", keys) == ({"p0": 3}, {})  # (asked just before the release)
    idx.release_expired()
    assert idx.match_counts("m", keys) == ({"p0": 1}, {})


def test_match_counts_asked_again_leaves_out_a_pod_that_timed_out_meanwhile():
    clock = ManualClock()
    idx = KvIndex(clock, pod_timeout_s=1.0)
    idx.apply(KvEventBatch(pod="p0", model="m", seq=0, ts=1.0,
                           events=[BlockStored(block_hashes=[10], token_ids=toks(0), block_size=BS)]))
    keys = block_keys(toks(0), BS).array
    assert idx.match_counts("m", keys) == ({"p0": 1}, {})
    clock.advance(2.0)  # nothing applied since: only the time says the pod went quiet
    assert idx.match_counts("m", keys) == ({}, {})


def _seq_batches(n: int, pod: str = "p0") -> list[KvEventBatch]:
    """One stored block per batch, each chained to the one before."""
    return [KvEventBatch(pod=pod, model="m", seq=i, ts=1.0, events=[BlockStored(
        block_hashes=[100 + i], token_ids=toks(i % 4), block_size=BS, parent_block_hash=(99 + i) if i else None)])
        for i in range(n)]


def _truth(batches: list[KvEventBatch]) -> KvIndex:
    t = KvIndex(ManualClock())
    t.apply_many(batches)
    return t


def test_batches_behind_a_refused_one_wait_the_grace_not_the_window():
    """Ground truth: the engine's batches less the refused one, once the grace is over."""
    b = _seq_batches(4)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.apply(b[0])
    idx.lost("p0", 0, 1)  # batch 1 was dead-lettered
    idx.apply(b[2])
    idx.apply(b[3])
    assert idx.waiting_count == 2
    clock.advance(LOST_GRACE_S / 2)
    idx.release_expired()
    assert idx.waiting_count == 2  # a good copy could still come
    clock.advance(LOST_GRACE_S)
    idx.release_expired()
    assert idx.waiting_count == 0 and idx == _truth([b[0], b[2], b[3]])


def test_without_the_refusal_they_wait_the_whole_window():
    b = _seq_batches(3)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.apply(b[0])
    idx.apply(b[2])
    clock.advance(LOST_GRACE_S * 2)
    idx.release_expired()
    assert idx.waiting_count == 1


def test_a_good_copy_within_the_grace_is_applied_as_any_batch():
    b = _seq_batches(3)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.apply(b[0])
    idx.lost("p0", 0, 1)  # a corrupt copy of batch 1 came first
    idx.apply(b[2])
    clock.advance(LOST_GRACE_S / 2)
    idx.apply(b[1])  # then the good one
    assert idx.waiting_count == 0 and idx == _truth(b)


def test_a_refused_batch_behind_a_missing_one_leaves_that_one_the_whole_window():
    b = _seq_batches(5)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.apply(b[0])
    idx.lost("p0", 0, 3)  # refused; batch 1 is merely late
    idx.apply(b[2])
    idx.apply(b[4])
    clock.advance(LOST_GRACE_S * 2)
    idx.release_expired()
    assert idx.waiting_count == 2  # waiting for batch 1: no grace for it
    idx.apply(b[1])  # batch 2 follows it; 3 is the refused one, so 4 waits no longer than its grace
    assert idx.waiting_count == 1
    idx.release_expired()
    assert idx.waiting_count == 0 and idx == _truth([b[0], b[1], b[2], b[4]])



def test_the_grace_ends_at_the_next_gap_of_batches_merely_late():
    b = _seq_batches(6)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.apply(b[0])
    idx.lost("p0", 0, 1)
    idx.lost("p0", 0, 2)  # two refused in a row
    for i in (3, 5):  # batch 4 is late, not refused
        idx.apply(b[i])
    clock.advance(LOST_GRACE_S * 2)
    idx.release_expired()
    assert idx.waiting_count == 1  # 3 went after the grace; 5 waits for 4 its whole window
    idx.apply(b[4])
    assert idx.waiting_count == 0 and idx == _truth([b[0], b[3], b[4], b[5]])

def test_a_refusal_the_index_does_not_wait_on_changes_nothing():
    b = _seq_batches(3)
    clock = ManualClock()
    idx = KvIndex(clock, reorder_window_s=10.0)
    idx.lost("nobody", 0, 1)
    idx.apply(b[0])
    idx.apply(b[1])
    idx.lost("p0", 0, 1)  # a position already passed
    idx.apply(b[2])
    assert idx.waiting_count == 0 and idx == _truth(b)
    plain = KvIndex(clock)  # no reorder window: gaps are accepted at once anyway
    plain.apply(b[0])
    plain.lost("p0", 0, 1)
    plain.apply(b[2])
    assert plain.waiting_count == 0

def test_a_zero_key_is_never_predicted():
    """0 marks an empty row in the tables: a route's zero key is skipped, the others recorded."""
    idx = KvIndex(ManualClock())
    keys = block_keys(toks(1, 2), BS)
    idx.record_route("m", "x", keys=[keys[0], 0, keys[1]])
    assert idx.match_counts("m", keys) == ({"x": 2}, {"x": 2})
    assert idx.match_counts("m", [0]) == ({}, {})
    assert idx.pods()["x"].predicted_blocks == 2


def test_predictions_the_events_confirm_are_dropped():
    """A route predicts blocks on a pod; once the pod's events store them, the predictions are
    dropped (the tables keep only what is unconfirmed), so after the engine evicts them the index
    no longer counts them there: it says what the engine holds."""
    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=30)
    f = Feed(idx)
    f("a", stored([1], [1]))  # "a" sends events: an exact pod
    idx.record_route("m", "a", toks(1, 2, 3, 4))
    keys = block_keys(toks(1, 2, 3, 4), BS)
    assert idx.match_counts("m", keys) == ({"a": 4}, {"a": 3})
    f("a", stored([2, 3], [2, 3], parent=1))  # the prefill ran: its events confirm blocks 2 and 3
    assert idx.match_counts("m", keys) == ({"a": 4}, {"a": 1})  # block 4 is still only predicted
    assert idx.pods()["a"].predicted_blocks == 2  # blocks 1 (routed after its event) and 4
    f("a", BlockRemoved(block_hashes=[2, 3]))  # evicted, well within the route's 30 s
    assert idx.match_counts("m", keys) == ({"a": 1}, {})  # what "a" holds: block 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["route", "store", "remove"]), st.sampled_from(["a", "b"]),
                          st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=25))
def test_the_index_counts_the_events_and_the_unconfirmed_routes(steps):
    """Against a reference: a pod's matched prefix is the longest run of the query's blocks that
    it either stores (by its events) or was routed and has not stored since."""
    idx = KvIndex(ManualClock(), predicted_ttl_s=120, predict_on_route_ttl_s=30)
    f = Feed(idx)
    held = {"a": set(), "b": set()}  # blocks each pod's events say it stores
    pred = {"a": set(), "b": set()}  # routed and not stored since
    for i, (kind, pod, x, y) in enumerate(steps):
        lo, hi = min(x, y), max(x, y)
        if i == 0 and kind != "store":
            kind, lo = "store", 1  # make each pod's first step an event, so both are exact pods
        if kind == "route":
            idx.record_route("m", pod, toks(*range(1, hi + 1)))
            pred[pod] |= set(range(1, hi + 1))
        elif kind == "store":
            if lo > 1 and lo - 1 not in held[pod]:
                lo = 1  # a stored run starts at the root or after a block the pod holds
            run = []
            for blk in range(lo, hi + 1):
                if blk in held[pod]:
                    break  # an engine stores a block it does not hold (a hash once)
                run.append(blk)
            if not run:
                continue
            f(pod, stored(run, run, parent=lo - 1 if lo > 1 else None))
            held[pod] |= set(run)
            pred[pod] -= set(run)
        else:
            gone = [b for b in range(lo, hi + 1) if b in held[pod]]
            if gone:
                f(pod, BlockRemoved(block_hashes=gone))
                held[pod] -= set(gone)
    keys = block_keys(toks(1, 2, 3, 4, 5, 6), BS)
    want, want_pred = {}, {}
    for pod in ("a", "b"):
        n = 0
        while n < 6 and (n + 1 in held[pod] or n + 1 in pred[pod]):
            n += 1
        if n:
            want[pod] = n
            p = sum(1 for b in range(1, n + 1) if b not in held[pod])
            if p:
                want_pred[pod] = p
    assert idx.match_counts("m", keys) == (want, want_pred)


def test_reserved_tables_take_the_engines_blocks_without_growing():
    """``reserve(model, blocks)`` sizes the key table and engine map ahead: storing that many blocks
    (several pods, chained and duplicated prefixes) then grows neither (no rehash stall), and the
    index answers as one that grew as it went."""
    rnd = random.Random(3)
    grown, reserved = KvIndex(ManualClock()), KvIndex(ManualClock())
    n_blocks = 6000
    assert reserved.reserve("m", n_blocks) and not reserved.reserve("m", n_blocks // 2)  # (only grows)
    m = reserved._models["m"]
    shapes = (m.kt.shape[0], m.em.shape[0])
    assert min(shapes) * 0.6 >= n_blocks
    feeds = [Feed(grown), Feed(reserved)]
    docs = [[rnd.randrange(1, 10**6) for _ in range(400)] for _ in range(8)]
    held = 0
    for i in range(n_blocks // 100):
        pod, doc = f"p{i % 6}", docs[rnd.randrange(8)]
        start = rnd.randrange(0, 300)
        blocks = doc[start:start + 100]
        hashes = [hash((pod, i, j)) & (2**63 - 1) or 1 for j in range(len(blocks))]
        for f in feeds:
            f(pod, stored(hashes, blocks))
        held += len(blocks)
    assert held == n_blocks
    assert (m.kt.shape[0], m.em.shape[0]) == shapes  # nothing grew
    assert grown._models["m"].em.shape[0] > 4 * 1024  # (the other grew from its small start, several times)
    for doc in docs:
        for cut in (50, 200, 400):
            assert matched(grown, doc[:cut]) == matched(reserved, doc[:cut])


@pytest.mark.parametrize("pods", [20, 200])  # a query's result is read two ways: up to 128 pod slots, and past them
@pytest.mark.parametrize("tiers", [False, True])
def test_query_results_per_pod_equal_a_reference_at_any_pod_count(pods, tiers):
    """Pod i holds the first i % 7 + 1 blocks of one chain (with ``tiers``: its last block only in
    the CPU tier, on every third pod holding two or more); every pod's match, tiers and score equal
    a plain reference."""
    idx = KvIndex(ManualClock())
    f = Feed(idx)
    expect = {}
    for i in range(pods):
        n = i % 7 + 1
        cpu = tiers and i % 3 == 0 and n > 1
        f(f"p{i:03d}", stored(range(1, n + (not cpu)), range(1, n + (not cpu))))
        if cpu:
            f(f"p{i:03d}", stored([n], [n], parent=n - 1, medium="CPU"))
        expect[f"p{i:03d}"] = (n, {"GPU": n - 1, "CPU": 1} if cpu else {"GPU": n}, (n - 1) + 0.8 if cpu else float(n))
    got = idx.match_tokens("m", toks(*range(1, 9)))
    assert {p: (m.matched_blocks, m.tiers, pytest.approx(m.score)) for p, m in got.items()} == expect
    asked = ["p001", f"p{pods - 1:03d}", "nobody"]
    got = idx.match_keys("m", block_keys(toks(1, 2), BS), pods=asked)
    assert {p: m.matched_blocks for p, m in got.items()} == {"p001": 2, f"p{pods - 1:03d}": min(2, (pods - 1) % 7 + 1),
                                                              "nobody": 0}
