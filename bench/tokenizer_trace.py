"""The toy tokenizer on a trace's prompts in arrival order (long texts sharing prefixes, as the router
and the simulated engines see them): CPU per prompt now and at a git ref, alternating, same ids.

    PYTHONPATH=. python bench/tokenizer_trace.py [--skip 3000] [--requests 400] [--before-ref 2399c74] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from tokenizer_speed import load_before  # noqa: E402

from simulator.tokenizer import SimpleTokenizer  # noqa: E402
from simulator.workloads import load_trace  # noqa: E402
from simulator.workloads.synth import synthesize_text  # noqa: E402

TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "mooncake_synthetic_trace.jsonl")


def run(cls, texts) -> tuple[float, int]:
    tok = cls()
    t0 = time.process_time()
    ids = [tok.encode(t) for t in texts]
    return (time.process_time() - t0) / len(texts), hash(tuple(map(tuple, ids)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--skip", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--before-ref", default="2399c74")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = load_trace(args.trace)[args.skip:args.skip + args.requests]
    texts = [synthesize_text(r) for r in rows]
    before = load_before(args.before_ref).SimpleTokenizer
    print(f"{len(texts)} prompts, {sum(map(len, texts)) / len(texts):,.0f} characters each on average; "
          f"load average {os.getloadavg()[0]:.2f}")
    for r in range(args.rounds):
        for name, cls in ((f"before ({args.before_ref})", before), ("now", SimpleTokenizer))[:: 1 if r % 2 == 0 else -1]:
            per, digest = run(cls, texts)
            print(f"round {r + 1} {name:<18} {per * 1000:6.2f} ms CPU per prompt  ids digest {digest}")


if __name__ == "__main__":
    main()
