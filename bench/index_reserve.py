"""The KV index filling up, its tables grown as blocks arrive against sized ahead
(``KvIndex.reserve``, which the router calls with the engines' reported ``num_gpu_blocks``).

    python -P bench/index_reserve.py [--blocks 2000000] [--pods 8] [--batch 40] [--reps 3]

Each rep folds the same ``--blocks`` stored blocks (``--batch`` per event batch, chained per pod,
as a KV bridge sends them: block digests) into a fresh index, once as it is and once reserved
for that many blocks first, in turn. A table that fills up is doubled by rehashing every row in
the call that found it full: that call stalls whatever else the process does (a router's every
request). Reported per way: the longest single ``apply`` (wall), how many took over 10 ms, and
CPU per stored block (process time); medians over reps.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from schemas.kv import BlockStored, KvEventBatch  # noqa: E402
from streams.clock import SystemClock  # noqa: E402
from streams.kv_index import KvIndex, warm_up  # noqa: E402


def batches(n: int, pods: int, per: int, seed: int = 1) -> list[KvEventBatch]:
    rnd = random.Random(seed)
    out, last, seq = [], {}, {}
    for i in range(n // per):
        pod = f"p{i % pods}"
        hashes = [rnd.getrandbits(63) | 1 for _ in range(per)]
        ev = BlockStored.model_construct(type="stored", block_hashes=hashes, parent_block_hash=last.get(pod),
                                         token_ids=[], block_size=16, lora_id=None, lora_name=None, medium=None,
                                         parent_key=None, block_keys=None,
                                         block_digests=[rnd.getrandbits(64) for _ in range(per)], block_salts=None)
        last[pod] = hashes[-1]
        seq[pod] = seq.get(pod, -1) + 1
        out.append(KvEventBatch.model_construct(pod=pod, model="m", epoch=0, seq=seq[pod], ts=float(i),
                                                events=[ev], dp_rank=None))
    return out


def fold(bs: list[KvEventBatch], reserve: int) -> tuple[float, int, float]:
    index = KvIndex(SystemClock())
    if reserve:
        index.reserve("m", reserve)
    worst, slow = 0.0, 0
    c0 = time.process_time()
    for b in bs:
        t = time.perf_counter()
        index.apply(b)
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        slow += dt > 0.010
    cpu = time.process_time() - c0
    blocks = sum(len(b.events[0].block_hashes) for b in bs)
    assert index.models().get("m", 0) >= blocks * 0.99, index.models()
    return worst, slow, cpu / blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2_000_000)
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    warm_up()
    bs = batches(args.blocks, args.pods, args.batch)
    print(f"{len(bs)} batches of {args.batch} blocks from {args.pods} pods; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows: dict[str, list[tuple[float, int, float]]] = {"grown as they fill": [], "reserved ahead": []}
    for rep in range(args.reps):
        order = list(rows) if rep % 2 == 0 else list(rows)[::-1]
        for name in order:
            rows[name].append(fold(bs, args.blocks if name == "reserved ahead" else 0))
    for name, rs in rows.items():
        worst = statistics.median(r[0] for r in rs)
        slow = statistics.median(r[1] for r in rs)
        cpu = statistics.median(r[2] for r in rs)
        print(f"{name:<20} longest apply {worst * 1e3:7.1f} ms  applies over 10 ms {slow:4.0f}  "
              f"CPU {cpu * 1e9:6.0f} ns/block  (longest by rep: {', '.join(f'{r[0] * 1e3:.0f}' for r in rs)} ms)")


if __name__ == "__main__":
    main()
