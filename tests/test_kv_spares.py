"""Tables made ahead (streams.kv_spares): a growing index takes them and holds, answers and dumps
exactly what an index that allocates on the spot does."""

from __future__ import annotations

import random
import time

import numpy as np

from schemas import BlockRemoved, BlockStored, KvEventBatch
from streams import kv_index as ki
from streams.clock import ManualClock
from streams.kv_index import KvIndex
from streams.kv_spares import PrefaultingSpares, Spares


def _until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the spare was not made"
        time.sleep(0.005)


def test_prefaulting_spares_make_zeroed_tables_and_drop_outgrown_ones():
    sp = PrefaultingSpares()
    assert sp.take(1024, 3) is None  # nothing asked for yet
    sp.want(1024, 3)
    sp.want(1024, 3)  # asked twice: made once
    sp.want(2048, 3)
    sp.want(1024, 2)
    _until(lambda: len(sp.ready()) == 3)
    assert sp.made == 3
    t = sp.take(2048, 3)
    assert t.shape == (2048, 3) and t.dtype == np.uint64 and not t.any()
    # the smaller table of the same columns was outgrown and dropped; the other kind stays
    assert sp.ready() == [(1024, 2)]
    assert sp.take(1024, 3) is None
    assert sp.taken == 1


def test_the_default_makes_nothing():
    sp = Spares()
    sp.want(1 << 20, 3)
    assert sp.take(1 << 20, 3) is None


def _history(seed: int, n: int):
    """Batches of 4 pods storing chains (from the root or their last block) and removing old blocks."""
    rng = random.Random(seed)
    held = {f"p{k}": [] for k in range(4)}
    out = []
    for i in range(n):
        pod = f"p{i % 4}"
        h = held[pod]
        parent = h[-1] if h and rng.random() < 0.5 else None
        hashes = [rng.getrandbits(63) for _ in range(rng.randint(8, 40))]
        toks = [rng.randrange(50_000) for _ in range(16 * len(hashes))]
        events = [BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=16)]
        h.extend(hashes)
        if len(h) > 600 and rng.random() < 0.7:
            gone = [h.pop(0) for _ in range(rng.randint(1, 30))]
            events.append(BlockRemoved(block_hashes=gone))
        out.append(KvEventBatch(pod=pod, model="m", seq=i // 4, ts=1.0, events=events))
    return out


def test_an_index_growing_into_spares_equals_one_that_allocates(monkeypatch):
    monkeypatch.setattr(ki, "SPARE_MIN_ROWS", 1024)  # spares from small sizes on, so this history grows into several
    batches = _history(3, 4000)
    plain = KvIndex(ManualClock(100.0))
    sp = PrefaultingSpares()
    ahead = KvIndex(ManualClock(100.0), spares=sp)
    for k in range(0, len(batches), 50):
        chunk = batches[k:k + 50]
        a, b = plain.apply_many(chunk), ahead.apply_many(chunk)
        assert (a.blocks_stored, a.blocks_removed, a.unknown_parent, a.unknown_removed) == \
            (b.blocks_stored, b.blocks_removed, b.unknown_parent, b.unknown_removed)
        _until(lambda: not sp._asked)  # (the service has the time between batches; here we wait for it)
    assert sp.taken >= 4  # the key table and the engine map doubled into tables made ahead
    assert len(plain) == len(ahead) > 50_000
    assert {p: i.blocks for p, i in plain.pods().items()} == {p: i.blocks for p, i in ahead.pods().items()}
    rng = random.Random(9)
    for b in rng.sample(batches, 200):  # each stored chain's tokens, asked from the root: the same matches
        toks = b.events[0].token_ids
        got_a, got_b = plain.match_tokens("m", toks), ahead.match_tokens("m", toks)
        assert {p: m.matched_blocks for p, m in got_a.items()} == {p: m.matched_blocks for p, m in got_b.items()}
    assert plain.dump() == ahead.dump()


def test_a_spare_left_unused_is_dropped_and_not_made_again():
    now = [0.0]
    sp = PrefaultingSpares(ttl_s=60.0, clock=lambda: now[0])
    sp.want(4096, 3)
    _until(lambda: sp.ready() == [(4096, 3)])
    now[0] = 59.0
    sp.want(4096, 2)  # (a want is when old spares are looked at)
    _until(lambda: len(sp.ready()) == 2)
    assert (4096, 3) in sp.ready()
    now[0] = 61.0
    sp.want(4096, 3)  # the index levelled off short of needing it: dropped, and not made again
    assert sp.ready() == [(4096, 2)] and sp.dropped == 1
    time.sleep(0.05)
    assert sp.take(4096, 3) is None and sp.made == 2
    assert sp.take(4096, 2) is not None  # (the other one is still young enough)
