"""The compiled reader of group messages (``consumers.index_columns.wire_run``) and the fold's columns
path (``KvIndex._apply_wire_run``):

- the columns hold what the checked decoder (``fold_group``) reads from the same bytes, on the
  bridges' own output (frames encoded as vLLM sends them, through the bridge's transcoder);
- the reader never accepts a message the checked decoder refuses (random byte mutations), and it
  leaves every shape it does not read (LoRA, keys, salts, clears, token ids, mixed pods) to it;
- histories with gaps, stale batches, restarts, heartbeats, tiers, LoRA, salts, clears and resets,
  sent as the bridge groups them, fold to the same stats, pods, dump and matches as the schema's
  batches through the general path.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from consumers import index_columns, kv_transcode
from consumers.index_codec import fold_group
from consumers.kv_digests import with_digests
from schemas import AllBlocksCleared, BlockStored, KvEventBatch, PodReset
from schemas import kv_binary
from simulator.kv_events import block_removed, block_stored, encode_batch
from streams.clock import ManualClock
from streams.kv_index import KvIndex
from test_kv_index_wire_path import _history, _stats, assert_same_index

pytestmark = pytest.mark.skipif(not (index_columns.AVAILABLE and kv_transcode.AVAILABLE), reason="needs numba")


def _bridge_groups(seed: int, frames: int = 200, per_group: int = 16) -> list[bytes]:
    """Group messages as a bridge publishes them: vLLM-shaped frames through its transcoder."""
    rng = random.Random(seed)
    held: list[int] = []
    payloads = []
    for _ in range(frames):
        events = []
        nb = rng.randint(1, 6)
        hashes = [rng.getrandbits(64) for _ in range(nb)]
        parent = rng.choice(held) if held and rng.random() < 0.5 else None
        events.append(block_stored(hashes, parent, [rng.randrange(150_000) for _ in range(nb * 16)], 16,
                                   medium=rng.choice(["GPU", "CPU", None])))
        held.extend(hashes)
        if held and rng.random() < 0.6:
            gone = rng.sample(held, min(len(held), rng.randint(1, 3)))
            events.append(block_removed(gone, medium=rng.choice(["GPU", None])))
        payloads.append(encode_batch(events, ts=1.5))
    tc = kv_transcode.Transcoder("pod-a", "m", 0, {}, digests=True)
    out = [d for d, _, _ in tc.transcode(payloads, 0, 0)]
    assert len(out) == frames
    return [kv_binary.group(out[i:i + per_group]) for i in range(0, frames, per_group)]


def _columns_of(batches: list[kv_binary.WBatch]) -> dict:
    """What the columns should hold, from the checked decoder's structs."""
    kinds, hashes, digests, parents, mediums = [], [], [], [], []
    for b in batches:
        for e in b.events:
            stored = type(e) is kv_binary.WStored
            kinds.append(0 if stored else 1)
            hashes.extend(np.frombuffer(e.block_hashes, dtype=np.uint64).tolist())
            if stored:
                digests.extend(np.frombuffer(e.block_digests, dtype=np.uint64).tolist())
            parents.append(e.parent_block_hash if stored else None)
            mediums.append(e.medium)
    return {"kinds": kinds, "hashes": hashes, "digests": digests, "parents": parents, "mediums": mediums,
            "pod": batches[0].pod, "model": batches[0].model, "epoch": batches[0].epoch,
            "seqs": [b.seq for b in batches], "ts": [b.ts for b in batches]}


def _columns(run: kv_binary.WRun) -> dict:
    return {"kinds": run.kind.tolist(), "hashes": run.hashes.tolist(), "digests": run.digests.tolist(),
            "parents": [int(p) if h else None for p, h in zip(run.parent.tolist(), run.has_parent.tolist())],
            "mediums": [run.mediums[m] if m >= 0 else None for m in run.medium.tolist()],
            "pod": run.pod, "model": run.model, "epoch": run.epoch,
            "seqs": list(range(run.first_seq, run.seq + 1)), "ts": run.ts.tolist()}


@pytest.mark.parametrize("seed", range(3))
def test_the_columns_hold_what_the_checked_decoder_reads(seed):
    for data in _bridge_groups(seed):
        run = index_columns.wire_run(data, fold_group)
        assert run is not None  # the bridge's own output is the shape read this way
        want = fold_group(data)
        assert _columns(run) == _columns_of(want)
        assert run.stored == sum(len(e.block_hashes) for b in want for e in b.events if type(e) is kv_binary.WStored)
        assert run.block_size == 16
        assert [b.seq for b in run.batches()] == [b.seq for b in want]
        # the cumulative ends the fold's buffers need (digests counted in uint32 halves)
        ends = np.cumsum([len(e.block_hashes) for b in want for e in b.events]).tolist()
        assert run.hash_end.tolist() == ends
        dig = np.cumsum([2 * len(e.block_digests) if type(e) is kv_binary.WStored else 0
                         for b in want for e in b.events]).tolist()
        assert run.digest_end.tolist() == dig


def test_groups_of_frames_vllm_encoded_itself_hold_what_the_checked_decoder_reads():
    """Frames vLLM 0.11 / 0.22 / 0.33 encoded with their own classes (tests/fixtures/vllm), through the
    bridge's transcoder and grouped as a bridge groups them: where the reader takes a group, it holds
    what the checked decoder reads; vLLM 0.33's plain stores and removals are taken."""
    from fixtures import vllm as fx

    taken = set()
    for f in fx.all_frames():
        got = kv_transcode.Transcoder("pod-a", "m", 0, {}, digests=True).transcode([f.payload, f.payload], 5, 1)
        if len(got) != 2:
            continue  # a frame the transcoder leaves to the Python path
        data = kv_binary.group([d for d, _, _ in got])
        run = index_columns.wire_run(data, fold_group)
        if run is not None:
            taken.add(f.version)
            assert _columns(run) == _columns_of(fold_group(data)), f.name
            assert run.first_seq == 5 and run.seq == 6 and run.epoch == 1
    assert "0.33.0" in taken


def test_mutated_messages_are_never_read_past_the_checked_decoder():
    rng = random.Random(5)
    base = _bridge_groups(9, frames=48, per_group=6)
    read = refused = 0
    for _ in range(3000):
        data = bytearray(rng.choice(base))
        for _ in range(rng.randint(1, 3)):
            k = rng.random()
            i = rng.randrange(len(data))
            if k < 0.6:
                data[i] = rng.randrange(256)
            elif k < 0.8:
                del data[i:i + rng.randint(1, 9)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        data = bytes(data)
        run = index_columns.wire_run(data, fold_group)
        if run is None:
            refused += 1
            continue
        read += 1
        want = fold_group(data)
        assert want is not None, "the reader took a message the checked decoder refuses"
        assert _columns(run) == _columns_of(want)
    assert read > 50 and refused > 1000  # both outcomes really happened


def _wire_batch(b: KvEventBatch) -> bytes:
    w = kv_binary.to_wire(b)
    w.events = with_digests(w.events)
    return kv_binary.encode_wire(w)


@pytest.mark.parametrize("event", [
    BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_name="ad"),
    BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, block_salts=[7]),
    AllBlocksCleared(),
    PodReset(),
])
def test_other_shapes_are_left_to_the_checked_decoder(event):
    ok = KvEventBatch(pod="p", model="m", epoch=0, seq=0, ts=1.0,
                      events=[BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                          block_size=4)])
    odd = KvEventBatch(pod="p", model="m", epoch=0, seq=1, ts=1.0, events=[event])
    assert index_columns.wire_run(kv_binary.group([_wire_batch(ok), _wire_batch(ok.model_copy(update={"seq": 1}))]),
                                  fold_group) is not None
    assert index_columns.wire_run(kv_binary.group([_wire_batch(ok), _wire_batch(odd)]), fold_group) is None
    # token ids in place of digests, another pod, a gap in the sequence, an empty (heartbeat) batch
    plain = kv_binary.encode(ok.model_copy(update={"seq": 1}))
    other = _wire_batch(ok.model_copy(update={"seq": 1, "pod": "q"}))
    gap = _wire_batch(ok.model_copy(update={"seq": 2}))
    empty = _wire_batch(ok.model_copy(update={"seq": 1, "events": []}))
    # a tier name the schema refuses (the JSON schema cannot even build it)
    w = kv_binary.to_wire(ok.model_copy(update={"seq": 1}))
    w.events = with_digests(w.events) + [kv_binary.WRemoved(memoryview(kv_binary.pack([5], "Q")), "lower")]
    bad_tier = kv_binary.encode_wire(w)
    assert fold_group(kv_binary.group([_wire_batch(ok), bad_tier])) is None
    for second in (plain, other, gap, empty, bad_tier):
        assert index_columns.wire_run(kv_binary.group([_wire_batch(ok), second]), fold_group) is None


def _grouped(chunk: list[KvEventBatch], rng: random.Random) -> list[bytes]:
    """The chunk's batches as a bridge would send them: runs of one pod's batches as group messages."""
    out, i = [], 0
    while i < len(chunk):
        j = i + 1
        while j < len(chunk) and chunk[j].pod == chunk[i].pod and j - i < rng.randint(1, 12):
            j += 1
        parts = [_wire_batch(b) for b in chunk[i:j]]
        out.append(kv_binary.group(parts))
        i = j
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [0.0, 5.0])
def test_runs_fold_as_the_general_path(seed, window):
    history = _history(seed, 700)
    clock_a, clock_b = ManualClock(100.0), ManualClock(100.0)
    general = KvIndex(clock_a, reorder_window_s=window)
    columns = KvIndex(clock_b, reorder_window_s=window)
    rng = random.Random(seed)
    runs = fallbacks = i = 0
    orig = columns._apply_next

    def counting(b, st, now):  # batch by batch: a message not read as a run, or a run the pod was not at
        nonlocal fallbacks
        fallbacks += 1
        return orig(b, st, now)

    columns._apply_next = counting
    # the history's batches of one pod are rarely consecutive: re-order them so runs happen, as a
    # bridge's group would (each pod's own order kept)
    by_pod: dict[str, list[KvEventBatch]] = {}
    for b in history:
        by_pod.setdefault(b.pod, []).append(b)
    merged = []
    while any(by_pod.values()):
        pod = rng.choice([p for p, v in by_pod.items() if v])
        take = rng.randint(1, 10)
        merged.extend(by_pod[pod][:take])
        del by_pod[pod][:take]
    merged = [b.model_copy(update={"ts": 1.0 + k / 4}) for k, b in enumerate(merged)]  # (each its own time)
    while i < len(merged):
        n = rng.randint(1, 40)
        chunk = merged[i:i + n]
        i += n
        a = general.apply_many(chunk)
        items = []
        for data in _grouped(chunk, rng):
            run = index_columns.wire_run(data, fold_group)
            if run is not None:
                runs += 1
                items.append(run)
            else:
                whole = fold_group(data)
                assert whole is not None
                items.extend(whole)
        b = columns.apply_many(items)
        assert _stats(a) == _stats(b)
        dt = rng.random() * 3
        clock_a.advance(dt)
        clock_b.advance(dt)
        if window:
            assert _stats(general.release_expired()) == _stats(columns.release_expired())
    assert runs > 20 and fallbacks > 20  # both paths really ran
    assert_same_index(general, columns, history)
