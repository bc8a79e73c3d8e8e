"""The index's short path for a binary message's batch (``KvIndex._apply_next``: the next batch of
a pod already folding, stores with digests, removals) does what the general path does: the same
histories folded as the schema's batches and as the bridge's binary batches (digests in place of
token ids) give equal stats, pods, dumps and matches, with gaps, stale and late batches, restarts,
heartbeats, tiers, LoRA, salts, clears, resets and a block size the model does not have."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest

from consumers.index_codec import fold_batch
from consumers.kv_digests import with_digests
from schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodReset
from schemas import kv_binary
from streams.clock import ManualClock
from streams.kv_index import ApplyStats, KvIndex

BS = 4


def _history(seed: int, n: int) -> list[KvEventBatch]:
    rng = random.Random(seed)
    pods = [f"p{k}" for k in range(3)]
    state = {p: {"epoch": 0, "seq": -1, "held": []} for p in pods}
    out = []
    for _ in range(n):
        pod = rng.choice(pods)
        s = state[pod]
        r = rng.random()
        if r < 0.02:
            s["epoch"] += 1  # an engine restart
            s["seq"] = -1
            s["held"] = []
        seq = s["seq"] + 1
        r = rng.random()
        if r < 0.04:
            seq += rng.randint(1, 3)  # a gap
        elif r < 0.07 and s["seq"] > 2:
            seq = s["seq"] - rng.randint(0, 2)  # stale: a copy or an older batch
        events: list = []
        if rng.random() < 0.05:
            pass  # a heartbeat (or an empty batch at a new position)
        else:
            for _ in range(rng.randint(1, 3)):
                k = rng.random()
                held = s["held"]
                if k < 0.6:
                    nb = rng.randint(1, 5)
                    hashes = [rng.getrandbits(63) + 1 for _ in range(nb)]
                    parent = rng.choice(held) if held and rng.random() < 0.6 else (
                        rng.getrandbits(63) if rng.random() < 0.05 else None)
                    extra = {}
                    if parent is None and rng.random() < 0.1:
                        extra = {"lora_name": "ad"} if rng.random() < 0.5 else {"lora_id": 3}
                    if rng.random() < 0.05:
                        extra["block_salts"] = [0] * (nb - 1) + [rng.getrandbits(32)]
                    bsz = BS if rng.random() > 0.03 else BS * 2  # (another block size: refused)
                    events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                              token_ids=[rng.randrange(500) for _ in range(nb * bsz)], block_size=bsz,
                                              medium=rng.choice(["GPU", "GPU", "GPU", "CPU", None]), **extra))
                    held.extend(hashes)
                elif k < 0.9:
                    gone = rng.sample(held, min(len(held), rng.randint(1, 4))) if held else []
                    if rng.random() < 0.2 or not gone:
                        gone.append(rng.getrandbits(63) + 1)  # one the pod does not hold
                    events.append(BlockRemoved(block_hashes=gone, medium=rng.choice(["GPU", "GPU", "CPU", None, "DISK"])))
                elif k < 0.95:
                    events.append(AllBlocksCleared(medium=rng.choice([None, "CPU"])))
                else:
                    events.append(PodReset())
        s["seq"] = max(s["seq"], seq)
        out.append(KvEventBatch(pod=pod, model="m", epoch=s["epoch"], seq=seq, ts=1.0, events=events))
    return out


def _wire(b: KvEventBatch):
    """The batch as the indexer gets it from a bridge: binary, digests in place of token ids."""
    w = kv_binary.to_wire(b)
    w.events = with_digests(w.events)
    got = fold_batch(kv_binary.encode_wire(w))
    assert got is not None and type(got) is not KvEventBatch
    return got


def _stats(st: ApplyStats) -> dict:
    return {f.name: getattr(st, f.name) for f in fields(st)}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [0.0, 5.0])
def test_the_short_path_folds_as_the_general_one(seed, window):
    history = _history(seed, 700)
    clock_a, clock_b = ManualClock(100.0), ManualClock(100.0)
    general = KvIndex(clock_a, reorder_window_s=window)
    short = KvIndex(clock_b, reorder_window_s=window)
    taken = 0
    orig = short._apply_next

    def counting(b, st, now):
        nonlocal taken
        ok = orig(b, st, now)
        taken += ok
        return ok

    short._apply_next = counting
    rng = random.Random(seed)
    i = 0
    while i < len(history):
        n = rng.randint(1, 40)
        chunk = history[i:i + n]
        i += n
        a = general.apply_many(chunk)
        b = short.apply_many([_wire(x) for x in chunk])
        assert _stats(a) == _stats(b)
        dt = rng.random() * 3
        clock_a.advance(dt)
        clock_b.advance(dt)
        if window:
            assert _stats(general.release_expired()) == _stats(short.release_expired())
    assert taken > 20  # the short path really ran
    assert_same_index(general, short, history)


def assert_same_index(general: KvIndex, other: KvIndex, history: list[KvEventBatch]) -> None:
    """The same dump, pods and matches (for every 7th batch's root chains) in both indexes."""
    assert general.dump() == other.dump()
    assert {p: (i.blocks, i.epoch, i.seq, i.last_event_ts) for p, i in general.pods().items()} == \
        {p: (i.blocks, i.epoch, i.seq, i.last_event_ts) for p, i in other.pods().items()}
    for b in history[::7]:
        for e in b.events:
            if isinstance(e, BlockStored) and e.parent_block_hash is None:
                got_a = general.match_tokens("m", e.token_ids, lora=e.lora_name or e.lora_id)
                got_b = other.match_tokens("m", e.token_ids, lora=e.lora_name or e.lora_id)
                assert {p: (x.matched_blocks, x.tiers) for p, x in got_a.items()} == \
                    {p: (x.matched_blocks, x.tiers) for p, x in got_b.items()}
