"""Engine-core speed in virtual time: how many trace requests per second of wall time one
``EngineCore`` serves.

Synthetic trace: Poisson arrivals, prompts = one of ``--prefixes`` shared system prompts
(``--prefix-len`` tokens) + a unique suffix, output lengths uniform in [out/2, 3*out/2].

    /work/venv/bin/python bench/sim_core.py --requests 20000
    /work/venv/bin/python bench/sim_core.py --requests 20000 --tokenless --block-size 512 --no-events

``--tokenless``: requests carry only precomputed block keys and a length (the what-if
simulation's coarse KV model, with ``--block-size 512`` = one trace block per cache unit;
the KV capacity in tokens stays that of 16-token blocks).
"""

from __future__ import annotations

import argparse
import random
import time

from simulator.config import EngineConfig
from simulator.engine_core import EngineCore


def build_trace(n: int, rate: float, prefixes: int, prefix_len: int, suffix_len: int, out_len: int, seed: int):
    rng = random.Random(seed)
    systems = [[rng.randrange(20, 30000) for _ in range(prefix_len)] for _ in range(prefixes)]
    t = 0.0
    trace = []
    for i in range(n):
        t += rng.expovariate(rate)
        sfx = [rng.randrange(20, 30000) for _ in range(rng.randint(suffix_len // 2, suffix_len * 3 // 2))]
        trace.append((t, f"r{i}", systems[rng.randrange(prefixes)] + sfx,
                      rng.randint(max(1, out_len // 2), out_len * 3 // 2)))
    return trace


def run(core: EngineCore, trace, keys=None) -> dict:
    now, i, n = 0.0, 0, len(trace)
    ttfts: list[float] = []
    events = 0
    steps = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while i < n or core.has_work:
        while i < n and trace[i][0] <= now:
            arr, rid, prompt, out = trace[i]
            if keys is None:
                core.add_request(rid, prompt, out, arr)
            else:
                core.add_request(rid, None, out, arr, block_hashes=keys[i], num_prompt_tokens=len(prompt))
            i += 1
        res = core.step(now, trace[i][0] if i < n else float("inf"))
        steps += 1
        events += len(res.events)
        ttfts.extend(res.ttft)
        if res.idle:
            nxt = [x for x in (res.next_wakeup, trace[i][0] if i < n else None) if x is not None]
            if not nxt:
                break
            now = max(now, min(nxt))
        else:
            now = res.end
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    ttfts.sort()
    return {
        "requests": n, "wall_s": wall, "req_per_s_wall": n / wall, "cpu_s": cpu, "req_per_cpu_s": n / cpu, "virtual_s": now, "steps": steps,
        "steps_per_s_wall": steps / wall, "kv_event_batches_events": events,
        "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2], "ttft_p99_ms": 1e3 * ttfts[int(len(ttfts) * 0.99)],
        "prefix_hit_rate": core.stats.prefix_cache_hits / max(1, core.stats.prefix_cache_queries),
        "preemptions": core.stats.preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rate", type=float, default=20.0, help="arrivals per virtual second")
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--model-profile", default="llama-3.1-8b")
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--no-events", action="store_true", help="do not build KV events")
    ap.add_argument("--stream-outputs", action="store_true", help="one output record per token (server mode)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (cache unit)")
    ap.add_argument("--tokenless", action="store_true", help="requests with precomputed keys and no token ids")
    args = ap.parse_args()
    trace = build_trace(args.requests, args.rate, args.prefixes, args.prefix_len, args.suffix_len, args.out_len, 1)
    # same KV capacity in tokens whatever the block size
    blocks16 = EngineConfig(hardware=args.profile, model_profile=args.model_profile).resolved_num_gpu_blocks()
    cfg = EngineConfig(hardware=args.profile, model_profile=args.model_profile, block_size=args.block_size,
                       num_gpu_blocks=max(1, blocks16 * 16 // args.block_size),
                       prefix_caching_hash_algo=args.hash_algo, emit_kv_events=not args.no_events)
    core = EngineCore(cfg, stream_outputs=args.stream_outputs)
    keys = [core.hasher.hash_blocks(p) for _, _, p, _ in trace] if args.tokenless else None
    res = run(core, trace, keys)
    print(f"engine_core ({args.profile} x {args.model_profile}, {core.num_blocks} blocks of {args.block_size}, "
          f"events={'off' if args.no_events else 'on'}, hash={args.hash_algo}, "
          f"{'token-less' if args.tokenless else 'token ids'})")
    for k, v in res.items():
        print(f"  {k:28s} {v:,.3f}" if isinstance(v, float) else f"  {k:28s} {v:,}")


if __name__ == "__main__":
    main()
