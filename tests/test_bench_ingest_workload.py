"""bench/ingest_path.py's engines send KV events an index really folds: every stored chain starts at
the root or continues a block the engine holds, every removal names a block it holds, so the index
ends holding what the engine holds. (Until session 26 every store had a parent no engine had
stored and the bench compared two indexes that skipped all of it.)"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from test_bridge_decode import to_batch

from consumers.kv_wire import decode_frame
from streams.clock import ManualClock
from streams.kv_index import KvIndex

_spec = importlib.util.spec_from_file_location("ingest_path", Path(__file__).resolve().parents[1] / "bench" / "ingest_path.py")
ingest_path = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ingest_path)


def _fold(index: KvIndex, pod: str, frames: list[bytes], first_seq: int = 0):
    stats = [index.apply(to_batch(decode_frame(f), first_seq + i, pod=pod)) for i, f in enumerate(frames)]
    return sum(s.unknown_parent for s in stats), sum(s.unknown_removed for s in stats), sum(s.blocks_stored for s in stats)


def test_flat_out_frames_fold_with_nothing_skipped():
    args = argparse.Namespace(stored=8, removed=3, block_size=16, frames=120)
    warm, fill, flat, eng = ingest_path._workload(args)
    index = KvIndex(ManualClock(1000.0))
    assert fill == []  # (no --capacity: nothing to fill)
    unknown_parent, unknown_removed, stored = _fold(index, "pod-0", [warm, warm, *flat])  # warm-up sent twice
    assert (unknown_parent, unknown_removed) == (0, 0)
    assert stored >= args.frames * args.stored
    held = index.pods()["pod-0"]
    assert sum(held.blocks.values()) == eng.resident == ingest_path._workload_resident(args)
    # the chains really continue one another half the time, and blocks really go
    assert eng.resident < args.stored * (args.frames + 1)
    # the HTTP queries' system chain is held whole by the pod
    tokens = ingest_path._system_chain(args)[1]
    assert index.match_tokens("m", tokens)["pod-0"].matched_blocks == args.stored


def test_paced_engines_go_on_from_the_flat_out_state():
    args = argparse.Namespace(stored=4, removed=2, block_size=16, frames=30)
    warm, fill, flat, eng = ingest_path._workload(args)
    index = KvIndex(ManualClock(1000.0))
    for k in range(2):
        _fold(index, f"pod-{k}", [warm, *flat])
    from simulator.kv_events import encode_batch

    engines = [eng.reseed(100 + k) for k in range(2)]
    for k, e in enumerate(engines):
        frames = [encode_batch(e.next_events(), ts=1.0) for _ in range(40)]
        unknown_parent, unknown_removed, _ = _fold(index, f"pod-{k}", frames, first_seq=len(flat) + 1)
        assert (unknown_parent, unknown_removed) == (0, 0)
        assert sum(index.pods()[f"pod-{k}"].blocks.values()) == e.resident
    assert engines[0].resident != engines[1].resident or engines[0].convs != engines[1].convs


def test_with_a_capacity_the_cache_is_filled_first_and_then_evicts_a_block_per_block_stored():
    args = argparse.Namespace(stored=8, removed=3, block_size=16, frames=200, capacity=600)
    warm, fill, flat, eng = ingest_path._workload(args)
    assert len(fill) == ingest_path._fill_frames(args) > 0
    index = KvIndex(ManualClock(1000.0))
    unknown_parent, unknown_removed, _ = _fold(index, "pod-0", [warm, *fill])
    assert (unknown_parent, unknown_removed) == (0, 0)
    full = sum(index.pods()["pod-0"].blocks.values())
    assert args.capacity - args.stored < full <= args.capacity  # filled to the capacity
    unknown_parent, unknown_removed, stored = _fold(index, "pod-0", flat, first_seq=1 + len(fill))
    assert (unknown_parent, unknown_removed) == (0, 0)
    assert stored == args.frames * args.stored
    held = sum(index.pods()["pod-0"].blocks.values())
    assert held == eng.resident == ingest_path._workload_resident(args)
    assert abs(held - full) <= args.stored  # steady: as many blocks evicted as stored
