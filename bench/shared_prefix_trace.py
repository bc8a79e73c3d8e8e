"""A Mooncake-format trace of shared-prefix bursts: the case where router replicas must know each
other's routes.

    python -P bench/shared_prefix_trace.py --out /tmp/bursts.jsonl [--groups 50] [--per-group 8]
        [--prefix-blocks 40] [--gap-ms 80] [--group-every-ms 1000]

Each group is a new prefix of ``--prefix-blocks`` 512-token blocks (a long system prompt or
document nobody has sent before) followed by one block of its own per request. Its
``--per-group`` requests arrive ``--gap-ms`` apart, and a new group starts every
``--group-every-ms``. A router that sends a group's requests to one engine prefills the prefix
once. Two replicas taking requests in turn, each knowing only its own routes, prefill it twice.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.workloads.trace import TraceRow, write_trace  # noqa: E402


def rows(groups: int, per_group: int, prefix_blocks: int, gap_ms: float, every_ms: float) -> list[TraceRow]:
    out = []
    next_id = 0
    for g in range(groups):
        prefix = list(range(next_id, next_id + prefix_blocks))
        next_id += prefix_blocks
        for i in range(per_group):
            out.append(TraceRow(timestamp=int(g * every_ms + i * gap_ms), input_length=(prefix_blocks + 1) * 512,
                                output_length=32, hash_ids=prefix + [next_id]))
            next_id += 1
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-blocks", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=80.0)
    ap.add_argument("--group-every-ms", type=float, default=1000.0)
    a = ap.parse_args()
    n = write_trace(a.out, rows(a.groups, a.per_group, a.prefix_blocks, a.gap_ms, a.group_every_ms))
    print(f"wrote {n} requests to {a.out}")
