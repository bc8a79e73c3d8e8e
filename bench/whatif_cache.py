"""How much of the fleet's KV cache holds copies, at the end of a what-if run per strategy.

    python -P bench/whatif_cache.py [--trace ../shared/traces/mooncake_synthetic_trace.jsonl] [-p kv-aware ...]

Prints, per strategy, the cached units (trace blocks of 512 tokens, the coarse KV model) summed over
the engines, how many are distinct, and the trace's own working set, to tell a routing limit (copies
crowd out other prefixes) from a capacity limit (every cached unit distinct, still far below the
working set).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import simulator.whatif as whatif
from simulator.engine_core import EngineCore
from simulator.workloads import load_trace

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"))
    ap.add_argument("-p", "--profile", action="append", default=None)
    args = ap.parse_args()
    rows = load_trace(args.trace)
    distinct_ids = {h for r in rows for h in r.hash_ids}
    refs = sum(len(r.hash_ids) for r in rows)
    print(f"trace: {len(rows)} requests, {refs} block references, {len(distinct_ids)} distinct blocks "
          f"({len(distinct_ids) * 512 / 1e6:.1f}M tokens); reuse bound {1 - len(distinct_ids) / refs:.1%}")
    cores: list[EngineCore] = []

    class Recorded(EngineCore):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            cores.append(self)

    whatif.EngineCore = Recorded  # the what-if builds its engines through this name
    for profile in args.profile or ["round-robin", "kv-aware"]:
        cores.clear()
        res = whatif.simulate(rows, profile)
        sets = [set(c.cached_block_hashes()) for c in cores]
        held = sum(len(s) for s in sets)
        distinct = len(set().union(*sets)) if sets else 0
        summ = res.summary()
        print(f"{profile:12s} cached units held {held:6d}, distinct {distinct:6d} ({1 - distinct / held if held else 0:.1%} "
              f"copies); hit rate {summ.hit_rate or 0.0:.1%}")


if __name__ == "__main__":
    main()
