"""The router's prediction tables at steady state: routes whose blocks the engines' events then
confirm, with and without dropping the confirmed predictions (KvIndex, in-process).

    python -P bench/prediction_tables.py [--routes 3000] [--blocks 1000] [--rate 30] [--ttl 30]

Each route predicts ``--blocks`` new blocks on one of 8 pods that send KV events, and that pod's
``BlockStored`` event for them follows at once; the clock advances ``1/--rate`` s a route, and a
route's predictions last ``--ttl`` s (``router.route_prediction_ttl_s``). Printed for both modes:
the (key, pod) prediction pairs held at the end, the prediction tables' size and the CPU time.
"without" replaces ``streams.kv_core.pred_confirm`` with a no-op, as the index was before.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(routes: int, blocks: int, rate: float, ttl: float, confirm: bool) -> str:
    sys.path.insert(0, ROOT)
    import numpy as np

    import streams.kv_core as core
    from schemas.kv import BlockStored, KvEventBatch
    from streams.clock import ManualClock
    from streams.kv_index import KvIndex, block_keys

    if not confirm:
        core.pred_confirm = lambda *a: 0
    clock = ManualClock()
    idx = KvIndex(clock, predicted_ttl_s=120, predict_on_route_ttl_s=ttl)
    bs, seq, rng = 16, {}, np.random.default_rng(1)
    t0 = time.process_time()
    for r in range(routes):
        pod = f"p{r % 8}"
        toks = rng.integers(16, 30000, blocks * bs).tolist()
        idx.record_route("m", pod, keys=block_keys(toks, bs))
        seq[pod] = seq.get(pod, -1) + 1
        idx.apply(KvEventBatch(pod=pod, model="m", seq=seq[pod], ts=clock.now(), events=[
            BlockStored(block_hashes=list(range(r * blocks + 1, (r + 1) * blocks + 1)), token_ids=toks,
                        block_size=bs)]))
        clock.advance(1 / rate)
    cpu = time.process_time() - t0
    m = idx._models["m"]
    return (f"{'with' if confirm else 'without':<8} confirming: prediction pairs held {int(m.psz[1]):,}, tables "
            f"{(m.pk.nbytes + m.pe.nbytes) / 2**20:.1f} MiB, CPU {cpu:.2f} s ({cpu / routes * 1e6:.0f} us a route)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", type=int, default=3000)
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--ttl", type=float, default=30.0)
    ap.add_argument("--mode", choices=["with", "without"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(run(args.routes, args.blocks, args.rate, args.ttl, args.mode == "with"))
        return
    print(f"{args.routes} routes of {args.blocks} blocks, {args.rate:g}/s, TTL {args.ttl:g} s; load average "
          f"{os.getloadavg()[0]:.2f}")
    for mode in ("without", "with"):  # each in its own process (a fresh heap and kernel cache)
        out = subprocess.run([sys.executable, "-P", __file__, "--routes", str(args.routes), "--blocks", str(args.blocks),
                              "--rate", str(args.rate), "--ttl", str(args.ttl), "--mode", mode],
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
