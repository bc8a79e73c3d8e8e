"""KV index query latency against index size: the same queries on 100k and on 5M resident blocks.

    PYTHONPATH=. python -P bench/kv_query_size.py [--sizes 100000,5000000] [--queries 4000] [--before-ref main]

The queried part is the same in every index: 16 pods, 32 shared system prompts of 128 blocks and
256 conversations of 384 more blocks (~102k distinct blocks; each conversation held by 2 pods).
The larger index adds never-queried blocks (other conversations) on the same pods until it holds
``size`` distinct blocks, so only the table size changes. Queries are 128-512-block prefixes of
those conversations (popular ones more often), as bench/kv_index.py's. ``match_keys`` is timed
on each index in turn, query by query, with this tree's ``streams/kv_core.py`` and
(``--before-ref``) the one at that git ref, each building its own tables (allocation is part of
the layout), the two taking turns query by query (never both on one query, the second would
find the prompt's keys in the cache): before/after in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = sys.path[0]

from schemas.kv import BlockStored, KvEventBatch
from streams import kv_index
from streams.clock import ManualClock
from streams.kv_index import KvIndex, block_keys, warm_up

BS, PODS, FAMILIES, FAMILY_BLOCKS, CONVS, CONV_BLOCKS = 16, 16, 32, 128, 256, 384


def stored(pod: int, keys: list[int], seq: int) -> KvEventBatch:
    ev = BlockStored.model_construct(type="stored", block_hashes=keys, parent_block_hash=None, token_ids=[],
                                     block_size=BS, lora_id=None, lora_name=None, medium=None, parent_key=None,
                                     block_keys=keys)
    return KvEventBatch.model_construct(schema_version=1, pod=f"pod-{pod:02d}", model="bench", dp_rank=0, epoch=0,
                                        seq=seq, ts=0.0, events=[ev])


def build(size: int, convs: list[np.ndarray], holders: list[tuple[int, int]], seed: int,
          dynamo_out=None) -> KvIndex:
    """The index of ``size`` distinct blocks; with ``dynamo_out`` (a text file) each stored chain is
    also written as a Dynamo ``KvCacheEvent`` line (``pod<TAB>json``: block hash = tokens hash =
    our key, the parent the chain's previous block), for Dynamo's RadixTree to build the same."""
    idx = KvIndex(ManualClock())
    held: list[set[int]] = [set() for _ in range(PODS)]
    batches, seq = [], 0

    def dyn(pod: int, parent: int | None, keys: list[int]) -> None:
        if dynamo_out is not None:
            ev = {"event_id": seq, "data": {"stored": {"parent_hash": parent, "blocks": [
                {"block_hash": k, "tokens_hash": k} for k in keys]}}}
            dynamo_out.write(f"{pod}\t{json.dumps(ev)}\n")

    for keys, pods in zip(convs, holders):
        all_keys = keys.tolist()
        for p in pods:
            first = next(i for i, k in enumerate(all_keys) if k not in held[p])
            new = all_keys[first:]  # a pod holds a prefix of the conversation's chain or none of it
            held[p].update(new)
            seq += 1
            batches.append(stored(p, new, seq))
            dyn(p, all_keys[first - 1] if first else None, new)
    idx.apply_many(batches)
    rng = np.random.default_rng(seed)
    left = size - len(idx)
    p = 0
    while left > 0:
        n = min(left, 200_000)
        cold = rng.integers(1, 2**63, size=n, dtype=np.uint64).tolist()
        batches = []
        for i in range(0, n, 512):
            seq += 1
            batches.append(stored(p % PODS, cold[i:i + 512], seq))
            dyn(p % PODS, None, cold[i:i + 512])
            p += 1
        idx.apply_many(batches)
        left = size - len(idx)
    return idx


def load_core(ref: str):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:streams/kv_core.py"], check=True, capture_output=True,
                         text=True).stdout
    d = tempfile.mkdtemp(prefix="kv_core_before_")
    path = os.path.join(d, "kv_core_before.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kv_core_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,5000000")
    ap.add_argument("--queries", type=int, default=6000)
    ap.add_argument("--before-ref", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dynamo-python", default="auto",
                    help="python of a venv with ai-dynamo-runtime (its RadixTree on the same blocks and queries); "
                         "auto: bench/peers.py's cached venv, created on first use; none: leave Dynamo out")
    args = ap.parse_args()
    from bench.peers import dynamo_python, peer_version

    args.dynamo_python = dynamo_python(args.dynamo_python)
    if args.dynamo_python:
        print(f"peer: ai-dynamo-runtime {peer_version(args.dynamo_python, 'ai-dynamo-runtime')} (dynamo.llm.RadixTree)")
    warm_up()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rng = np.random.default_rng(args.seed)
    fam = rng.integers(0, 150_000, size=(FAMILIES, FAMILY_BLOCKS * BS), dtype=np.uint32)
    own = rng.integers(0, 150_000, size=(CONVS, CONV_BLOCKS * BS), dtype=np.uint32)
    conv_family = rng.integers(0, FAMILIES, size=CONVS)
    tokens = [np.concatenate([fam[conv_family[c]], own[c]]) for c in range(CONVS)]
    convs = [np.asarray(block_keys(t.tolist(), BS).array) for t in tokens]
    holders = [tuple(int(x) for x in rng.choice(PODS, size=2, replace=False)) for _ in range(CONVS)]
    sizes = [int(s) for s in args.sizes.split(",")]
    # variants: (name, kernel module, keys as a plain Python list as Dynamo's binding takes them)
    kernels = [("after", kv_index.core, False), ("after, list keys", kv_index.core, True)]
    if args.before_ref:
        kernels.append((f"before ({args.before_ref})", load_core(args.before_ref), False))
    new_core = kv_index.core
    built = {}  # each variant builds its own tables (allocation and layout are part of the change)
    dyn_files = {}
    for name, mod, as_list in kernels:
        kv_index.core = mod
        for s in sizes:
            t = time.perf_counter()
            out = None
            if args.dynamo_python and name == "after":
                out = dyn_files[s] = tempfile.NamedTemporaryFile("w", suffix=f"-{s}.tsv", delete=False)
            idx = built[(name, s)] = build(s, convs, holders, args.seed + s, out)
            if out is not None:
                out.close()
            print(f"{name}: index of {len(idx):,} distinct blocks built in {time.perf_counter() - t:.1f}s "
                  f"(key table {idx._models['bench'].kt.nbytes / 2**20:.0f} MiB)", flush=True)
    qrng = np.random.default_rng(args.seed + 7)
    queries = []
    for _ in range(args.queries):
        c = min(int(qrng.pareto(1.2)), CONVS - 1) if qrng.random() < 0.5 else int(qrng.integers(CONVS))
        n = int(qrng.integers(128, 513))
        queries.append(convs[c][:n].copy())
    dyn = None
    if dyn_files:
        qfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump([q.tolist() for q in queries], qfile)
        qfile.close()
        dyn = subprocess.Popen([args.dynamo_python, "-c", DYNAMO_SERVER, qfile.name,
                                *(f"{s}={f.name}" for s, f in dyn_files.items())],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in sizes:
            print("dynamo: " + dyn.stdout.readline().strip(), flush=True)
    lat = {(k, s): [] for k, _, _ in kernels for s in sizes}
    walked = {(k, s): [] for k, _, _ in kernels for s in sizes}
    dlat = {s: [] for s in sizes}
    dwalked = {s: [] for s in sizes}
    for name, mod, _ in kernels:  # compile + first touch outside the timing
        kv_index.core = mod
        for s in sizes:
            for q in queries[:50]:
                built[(name, s)].match_keys("bench", q)
    rounds = 4
    for r in range(rounds):  # ours and Dynamo take turns by rounds of queries (Dynamo is another process)
        lo, hi = r * len(queries) // rounds, (r + 1) * len(queries) // rounds
        for i in range(lo, hi):
            q = queries[i]
            # one variant per query (taking turns), both sizes per query, the order alternating
            name, mod, as_list = kernels[i % len(kernels)]
            kv_index.core = mod
            order = list(sizes) if (i // len(kernels)) % 2 == 0 else list(reversed(sizes))
            for s in order:
                idx = built[(name, s)]
                qq = q.tolist() if as_list else q
                t = time.perf_counter()
                res = idx.match_keys("bench", qq)
                lat[(name, s)].append(time.perf_counter() - t)
                walked[(name, s)].append(max((m.matched_blocks for m in res.values()), default=0))
        if dyn is not None:
            dyn.stdin.write(f"{lo} {hi}\n")
            dyn.stdin.flush()
            got = json.loads(dyn.stdout.readline())
            for s in sizes:
                dlat[s] += got[str(s)]["lat"]
                dwalked[s] += got[str(s)]["walked"]
    kv_index.core = new_core
    if dyn is not None:
        dyn.stdin.close()
        dyn.wait(60)
        for f in dyn_files.values():
            os.unlink(f.name)
        os.unlink(qfile.name)
    for name, _, _ in kernels:
        assert all(walked[(name, s)] == walked[(name, sizes[0])] for s in sizes), "indexes answered differently"
    allw = [w for v in walked.values() for w in v]
    print(f"{args.queries} queries of 128-512 blocks, mean best match {statistics.mean(allw):.0f} blocks")
    for name, _, _ in kernels:
        base = pct(lat[(name, sizes[0])], 50)
        for s in sizes:
            xs = lat[(name, s)]
            print(f"{name:<16} {s:>10,} blocks: match_keys p50 {pct(xs, 50) * 1e6:6.1f} us  "
                  f"p99 {pct(xs, 99) * 1e6:7.1f} us  ({pct(xs, 50) / base:.2f}x the smallest)")
    if dyn is not None:
        # the answers must agree: Dynamo's best pod match, on the same queries, is ours
        ours_all = {s: [] for s in sizes}
        for i, q in enumerate(queries):
            for s in sizes:
                m = built[("after", s)].match_keys("bench", q)
                ours_all[s].append(max((x.matched_blocks for x in m.values()), default=0))
        base = pct(dlat[sizes[0]], 50)
        for s in sizes:
            same = sum(a == b for a, b in zip(ours_all[s], dwalked[s]))
            print(f"{'dynamo':<16} {s:>10,} blocks: find_matches p50 {pct(dlat[s], 50) * 1e6:6.1f} us  "
                  f"p99 {pct(dlat[s], 99) * 1e6:7.1f} us  ({pct(dlat[s], 50) / base:.2f}x the smallest); "
                  f"best match equal to ours on {same}/{len(queries)} queries")
        for s in sizes:
            ours = pct(lat[("after, list keys", s)], 50)
            print(f"at {s:,} blocks, plain-list keys: ours p50 / dynamo p50 = {ours / pct(dlat[s], 50):.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


# Dynamo's RadixTree (ai-dynamo-runtime) in its own venv: builds one tree per size from the files
# build() wrote, then answers "lo hi" lines with the latencies and best matches of those queries.
DYNAMO_SERVER = r"""
import json, sys, time
from dynamo.llm import RadixTree
queries = json.load(open(sys.argv[1]))
trees = {}
for arg in sys.argv[2:]:
    size, path = arg.split("=", 1)
    tree = RadixTree()
    t0 = time.perf_counter()
    n = 0
    for line in open(path):
        w, payload = line.split("	", 1)
        tree.apply_event(int(w), payload.encode())
        n += 1
    trees[size] = tree
    print(f"RadixTree of {size} blocks built from {n} events in {time.perf_counter() - t0:.1f}s", flush=True)
for line in sys.stdin:
    lo, hi = map(int, line.split())
    out = {}
    for size, tree in trees.items():
        lat, walked = [], []
        for q in queries[lo:hi]:
            t0 = time.perf_counter()
            m = tree.find_matches(q)
            lat.append(time.perf_counter() - t0)
            walked.append(max(m.scores.values(), default=0) if hasattr(m, "scores") else 0)
        out[size] = {"lat": lat, "walked": walked}
    print(json.dumps(out), flush=True)
"""

if __name__ == "__main__":
    main()
