"""KV index bench: in-process ingest (blocks/s) and query latency (p50/p99), and optionally
NVIDIA Dynamo's RadixTree on the same workload.

Workload (issue 4): 16 pods, N stored events of 16-64 blocks sharing prefixes (32 system
prompts of 128 blocks, 2048 conversations of 384 more blocks; each pod stores conversations
progressively and evicts the least recently used one past 40k blocks), then Q queries of
128-512 blocks. Events are built before timing, in chunks of ``--chunk`` (2000) events, and
folded two ways side by side, each into its own index: as the indexer's decoder hands them over
(``consumers.indexer.decode_batch`` of the JSON, block hashes and token ids as numpy arrays; the
decoding is not timed here, the service bench times it), and as pydantic objects holding Python
int lists (a fresh token-id list per event; a 20k-event chunk would be ~0.5 GB of int objects,
so the timed part would mostly measure cache misses on data the service never holds that long). Then ``dump()`` and a
restore by applying it, for the final state and for twice as many pods (>= 1M pod blocks), and
a side-by-side summary with Dynamo's figures from the same job.

    /work/venv/bin/python bench/kv_index.py [--events 200000] [--queries 20000]
        [--dynamo-python auto|none|PYTHON]

Dynamo (``ai-dynamo-runtime``, ``dynamo.llm.RadixTree``) pins an older pydantic, so it runs in
its own venv as a subprocess fed the same workload (engine hashes + our block keys as its
local hashes, JSON events as its ``apply_event`` expects).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from schemas.kv import BlockRemoved, BlockStored, KvEventBatch  # noqa: E402
from streams.clock import ManualClock  # noqa: E402
from streams.kv_index import KvIndex, block_keys, warm_up  # noqa: E402

BS = 16
PODS = 16
FAMILIES, FAMILY_BLOCKS = 32, 128
CONVS, CONV_BLOCKS = 2048, 384
CAPACITY = 40_000


def build_corpus(rng: np.random.Generator):
    fam = rng.integers(0, 150_000, size=(FAMILIES, FAMILY_BLOCKS * BS), dtype=np.uint32)
    own = rng.integers(0, 150_000, size=(CONVS, CONV_BLOCKS * BS), dtype=np.uint32)
    conv_family = rng.integers(0, FAMILIES, size=CONVS)
    return fam, own, conv_family


def conv_tokens(fam, own, conv_family, c: int) -> np.ndarray:
    return np.concatenate([fam[conv_family[c]], own[c]])


def ehash(conv_family, c: int, i: int) -> int:
    """Engine hash: family blocks are shared by every conversation of the family."""
    if i < FAMILY_BLOCKS:
        return (1 << 62) | (int(conv_family[c]) << 20) | i
    return (1 << 61) | (c << 20) | i


class Gen:
    def __init__(self, seed: int = 1):
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.fam, self.own, self.conv_family = build_corpus(self.np_rng)
        self.tokens = {}  # conv -> its tokens (numpy: an event gets a fresh list, as decoded off the wire)
        self.progress = [dict() for _ in range(PODS)]  # conv -> stored blocks (LRU order)
        self.lru = [OrderedDict() for _ in range(PODS)]
        self.size = [0] * PODS
        self.fam_prog = [dict() for _ in range(PODS)]  # family -> prefix blocks stored
        self.seq = [-1] * PODS
        self.stored_events = 0

    def conv(self, c):
        t = self.tokens.get(c)
        if t is None:
            t = self.tokens[c] = conv_tokens(self.fam, self.own, self.conv_family, c)
        return t

    def batch(self) -> KvEventBatch:
        rng = self.rng
        pod = rng.randrange(PODS)
        c = min(int(rng.paretovariate(1.2)) - 1, CONVS - 1) if rng.random() < 0.5 else rng.randrange(CONVS)
        prog = self.progress[pod]
        events = []
        total = FAMILY_BLOCKS + CONV_BLOCKS
        for _ in range(100):
            have = prog.get(c, 0)
            start = have if have >= FAMILY_BLOCKS else max(have, self.fam_prog[pod].get(self.conv_family[c], 0))
            if start < total:
                break
            c = rng.randrange(CONVS)
        else:
            return self.batch()
        n = min(rng.randint(16, 64), total - start)
        toks = self.conv(c)
        hashes = [ehash(self.conv_family, c, i) for i in range(start, start + n)]
        parent = ehash(self.conv_family, c, start - 1) if start > 0 else None
        events.append(BlockStored.model_construct(
            type="stored", block_hashes=hashes, parent_block_hash=parent, token_ids=toks[start * BS:(start + n) * BS].tolist(),
            block_size=BS, lora_id=None, lora_name=None, medium=None, parent_key=None))
        self.stored_events += 1
        f = self.conv_family[c]
        self.fam_prog[pod][f] = max(self.fam_prog[pod].get(f, 0), min(start + n, FAMILY_BLOCKS))
        own_new = max(0, start + n - max(start, FAMILY_BLOCKS))
        prog[c] = start + n
        self.lru[pod][c] = True
        self.lru[pod].move_to_end(c)
        self.size[pod] += own_new
        while self.size[pod] > CAPACITY:
            victim, _ = self.lru[pod].popitem(last=False)
            if victim == c:
                self.lru[pod][c] = True
                continue
            got = prog.pop(victim, 0)
            own_blocks = list(range(FAMILY_BLOCKS, got))
            if own_blocks:
                events.append(BlockRemoved.model_construct(
                    type="removed", block_hashes=[ehash(self.conv_family, victim, i) for i in own_blocks], medium=None))
                self.size[pod] -= len(own_blocks)
        self.seq[pod] += 1
        return KvEventBatch.model_construct(schema_version=1, pod=f"pod-{pod:02d}", model="bench", dp_rank=0,
                                            epoch=0, seq=self.seq[pod], ts=0.0, events=events)

    def query(self) -> list[int]:
        rng = self.rng
        c = min(int(rng.paretovariate(1.2)) - 1, CONVS - 1) if rng.random() < 0.5 else rng.randrange(CONVS)
        n = rng.randint(128, 512)
        toks = self.conv(c)[: n * BS].tolist()
        if len(toks) < n * BS:
            toks = toks + [7] * (n * BS - len(toks))
        return toks


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--chunk", type=int, default=2_000, help="events generated per timed chunk")
    ap.add_argument("--dynamo-python", default="auto",
                    help="python of a venv with ai-dynamo-runtime; auto: bench/peers.py's cached venv, created on "
                         "first use; none: leave Dynamo out")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--group-max", type=int, default=None, help="batches per group message (default: the bridge's)")
    ap.add_argument("--service", action="store_true",
                    help="instead: through JetStream into the indexer service (embedded nats-server)")
    ap.add_argument("--rate", type=float, default=0, help="--service: paced publishing, batches/s (0 = flat out)")
    ap.add_argument("--paced-workload", choices=("bench", "steps"), default="bench",
                    help="--service --rate: the paced batches are this bench's (16-64 blocks per stored event) "
                         "or vLLM-like scheduler steps (bench/replay.py's simulated engine histories: a few "
                         "small events per batch)")
    args = ap.parse_args()
    if args.service:
        import asyncio

        asyncio.run(service_bench(args))
        return

    from bench.peers import dynamo_python
    from consumers.indexer import decode_batch

    args.dynamo_python = dynamo_python(args.dynamo_python)
    dyn_file = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) if args.dynamo_python else None

    from schemas import kv_binary

    from consumers import index_columns, kv_digests
    from consumers.index_codec import fold_group
    from consumers.kv_bridge import BridgeConfig

    group_max = args.group_max or BridgeConfig.group_max

    index_columns.warm_up()
    kv_digests.warm_up()

    def groups(chunk) -> list[bytes]:
        """The chunk's batches as a bridge publishes them: the stores' token ids turned into block
        digests (the bridge's work, not timed), each pod's consecutive batches in group messages of
        at most ``--group-max`` batches and the bridge's byte cap."""
        per: dict[str, list[bytes]] = {}
        for b in chunk:
            w = kv_binary.to_wire(b)
            w.events = kv_digests.with_digests(w.events)
            per.setdefault(b.pod, []).append(kv_binary.encode_wire(w))
        out = []
        for parts in per.values():
            cur, size = [], 0
            for data in parts:
                if cur and (len(cur) >= group_max or size + len(data) > BridgeConfig.group_max_bytes):
                    out.append(kv_binary.group(cur) if len(cur) > 1 else cur[0])
                    cur, size = [], 0
                cur.append(data)
                size += len(data)
            if cur:
                out.append(kv_binary.group(cur) if len(cur) > 1 else cur[0])
        return out

    def read_groups(msgs):
        """As the indexer reads them: a group straight into columns, else its batches decoded."""
        for m in msgs:
            run = index_columns.wire_run(m, fold_group)
            if run is not None:
                yield run
            else:
                yield from (fold_group(m) or [decode_batch(m)])

    def ingest(decoded: bool, wire: bool | str = False):
        """One pass over the workload (same seed, same events) into a fresh index. ``wire``: from the
        bus's binary messages, their decoding timed too (as Dynamo's ``apply_event`` parses JSON);
        ``"groups"``: from the group messages a bridge publishes (:func:`groups`), read as the
        indexer reads them."""
        gen = Gen(args.seed)
        idx = KvIndex(ManualClock())
        wall = cpu = 0.0
        stored = removed = done = 0
        while gen.stored_events < args.events:
            chunk = []
            while gen.stored_events < args.events and len(chunk) < args.chunk:
                chunk.append(gen.batch())
            if wire == "groups":
                feed = groups(chunk)
            elif wire:
                feed = [kv_binary.encode(b) for b in chunk]
            else:
                feed = [decode_batch(b.model_dump_json().encode()) for b in chunk] if decoded else chunk
            t0, c0 = time.perf_counter(), time.process_time()
            st = idx.apply_many(read_groups(feed) if wire == "groups" else map(decode_batch, feed) if wire else feed)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            assert st.unknown_parent == 0 and st.duplicates == 0, f"workload bug: {st}"
            stored += st.blocks_stored
            removed += st.blocks_removed
            done += len(chunk)
            if dyn_file is not None and decoded:
                for b in chunk:
                    dyn_file.write(json.dumps(to_dynamo(idx, b)) + "\n")
        return idx, gen, wall, cpu, stored, removed, done

    # one pass after the other (two big indexes folded alternately would evict each other's tables)
    idx, gen, ingest_s, ingest_cpu, stored_blocks, removed_blocks, done = ingest(True)
    print(f"ingest (decoded events): {done} batches, {gen.stored_events} stored events, {stored_blocks} stored + "
          f"{removed_blocks} removed blocks in {ingest_s:.2f}s -> {stored_blocks / ingest_s / 1e6:.2f}M stored "
          f"blocks/s, {(stored_blocks + removed_blocks) / ingest_s / 1e6:.2f}M block ops/s; "
          f"{len(idx)} distinct blocks held; by CPU time {stored_blocks / ingest_cpu / 1e6:.2f}M stored blocks/s")
    fp = idx.fingerprint()
    del idx
    idx_lists, _, lists_s, _, lists_stored, _, _ = ingest(False)
    print(f"ingest (pydantic events, int lists): {lists_s:.2f}s -> {lists_stored / lists_s / 1e6:.2f}M stored "
          f"blocks/s; same final state: {idx_lists.fingerprint() == fp}")
    del idx_lists
    idx, _, wire_s, wire_cpu, wire_stored, _, _ = ingest(False, wire=True)
    print(f"ingest (binary bus messages, decoding timed): {wire_s:.2f}s -> {wire_stored / wire_s / 1e6:.2f}M stored "
          f"blocks/s, by CPU time {wire_stored / wire_cpu / 1e6:.2f}M; same final state: {idx.fingerprint() == fp}")
    del idx
    idx, _, grp_s, grp_cpu, grp_stored, _, _ = ingest(False, wire="groups")
    print(f"ingest (the bridge's group messages, read as the indexer reads them, decoding timed): {grp_s:.2f}s -> "
          f"{grp_stored / grp_s / 1e6:.2f}M stored blocks/s, by CPU time {grp_stored / grp_cpu / 1e6:.2f}M; same final "
          f"state: {idx.fingerprint() == fp}")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    queries = [gen.query() for _ in range(args.queries)]
    keys = [block_keys(q, BS) for q in queries]
    lat_keys, lat_tokens, lat_hash, matched = [], [], [], []
    cpu_keys = []
    for q, k in zip(queries, keys):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        r = idx.match_keys("bench", k)
        t1 = time.perf_counter()
        cpu_keys.append(time.thread_time() - c0)
        idx.match_tokens("bench", q)
        t2 = time.perf_counter()
        block_keys(q, BS)
        t3 = time.perf_counter()
        lat_keys.append(t1 - t0)
        lat_tokens.append(t2 - t1)
        lat_hash.append(t3 - t2)
        matched.append(max((m.matched_blocks for m in r.values()), default=0))
    us = 1e6
    print(f"query match_keys (pre-hashed, 128-512 blocks, {PODS} pods): p50 {pct(lat_keys, 50) * us:.1f}us "
          f"p99 {pct(lat_keys, 99) * us:.1f}us; mean best match {statistics.mean(matched):.0f} blocks, "
          f"mean pods matching {statistics.mean(len(idx.match_keys('bench', k)) for k in keys[:500]):.1f}")
    print(f"query match_keys by CPU time: p50 {pct(cpu_keys, 50) * us:.1f}us p99 {pct(cpu_keys, 99) * us:.1f}us")
    lat_list = []
    for k in keys:
        plain = list(k)  # keys as a client would send them: converting 64-bit ints is part of the query
        t0 = time.perf_counter()
        idx.match_keys("bench", plain)
        lat_list.append(time.perf_counter() - t0)
    print(f"query match_keys with a plain list of keys (no carried array): p50 {pct(lat_list, 50) * us:.1f}us "
          f"p99 {pct(lat_list, 99) * us:.1f}us")
    big = [lat for lat, k in zip(lat_keys, keys) if len(k) >= 480]
    if big:
        print(f"query match_keys 480-512 blocks: p50 {pct(big, 50) * us:.1f}us p99 {pct(big, 99) * us:.1f}us")
    print(f"query match_tokens (hashing included): p50 {pct(lat_tokens, 50) * us:.1f}us "
          f"p99 {pct(lat_tokens, 99) * us:.1f}us; block_keys alone p50 {pct(lat_hash, 50) * us:.1f}us")

    dump_restore(idx, "final state")
    # twice the pods (the dump applied again under other pod names): >= 1M pod blocks
    big = KvIndex(ManualClock())
    dump = idx.dump()
    big.apply_many(dump)
    big.apply_many([b.model_copy(update={"pod": b.pod + "-b"}) for b in dump])
    dump_restore(big, "doubled state")
    ours = {"ingest": stored_blocks / ingest_s, "ingest_cpu": stored_blocks / ingest_cpu,
            "wire_cpu": wire_stored / wire_cpu, "groups_cpu": grp_stored / grp_cpu,
            "p50": pct(lat_keys, 50), "p99": pct(lat_keys, 99)}
    print(f"load average after our part: {os.getloadavg()[0]:.1f}")

    if dyn_file is not None:
        dyn_file.close()
        qfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(keys, qfile)
        qfile.close()
        try:
            out = subprocess.run([args.dynamo_python, "-c", DYNAMO_SCRIPT, dyn_file.name, qfile.name],
                                 capture_output=True, text=True, timeout=3600)
            lines = out.stdout.strip().splitlines()
            print("\n".join(line for line in lines if not line.startswith("{")) or out.stderr.strip()[-2000:])
            dyn = next((json.loads(line) for line in lines if line.startswith("{")), None)
        finally:
            os.unlink(dyn_file.name)
            os.unlink(qfile.name)
        if dyn is not None:
            print(f"load average after Dynamo's part: {os.getloadavg()[0]:.1f}")
            print("side by side (same workload, same job):")
            print(f"  ingest, M stored blocks/s (wall): ours {ours['ingest'] / 1e6:.2f}  dynamo {dyn['ingest'] / 1e6:.2f}"
                  f"  ratio {ours['ingest'] / dyn['ingest']:.2f}x (goal >= 3x, ours >= 2M)")
            print(f"  ingest, M stored blocks/s (CPU): ours {ours['ingest_cpu'] / 1e6:.2f}  dynamo "
                  f"{dyn['ingest_cpu'] / 1e6:.2f}  ratio {ours['ingest_cpu'] / dyn['ingest_cpu']:.2f}x")
            print(f"  ingest from wire bytes (ours: binary messages decoded, Dynamo: JSON events parsed), M stored "
                  f"blocks/s (CPU): ours {ours['wire_cpu'] / 1e6:.2f}  dynamo {dyn['ingest_cpu'] / 1e6:.2f}  "
                  f"ratio {ours['wire_cpu'] / dyn['ingest_cpu']:.2f}x")
            print(f"  ingest from the bridge's group messages (ours: read into columns as the indexer does; Dynamo: JSON "
                  f"events parsed), M stored blocks/s (CPU): ours {ours['groups_cpu'] / 1e6:.2f}  dynamo "
                  f"{dyn['ingest_cpu'] / 1e6:.2f}  ratio {ours['groups_cpu'] / dyn['ingest_cpu']:.2f}x")
            print(f"  query 128-512 blocks, us: ours p50 {ours['p50'] * us:.1f} p99 {ours['p99'] * us:.1f}  "
                  f"dynamo p50 {dyn['p50'] * us:.1f} p99 {dyn['p99'] * us:.1f} (goal p99 <= 50)")


def dump_restore(idx: KvIndex, label: str) -> None:
    """dump() and restoring by applying it (what the service's recovery does after decoding)."""
    blocks = sum(sum(p.blocks.values()) for p in idx.pods().values())
    t0, c0 = time.perf_counter(), time.process_time()
    dump = idx.dump()
    t1, c1 = time.perf_counter(), time.process_time()
    restored = KvIndex(ManualClock())
    restored.apply_many(dump)
    t2, c2 = time.perf_counter(), time.process_time()
    events = sum(len(b.events) for b in dump)
    print(f"{label}: dump {t1 - t0:.2f}s (CPU {c1 - c0:.2f}s), restore {t2 - t1:.2f}s (CPU {c2 - c1:.2f}s) for "
          f"{blocks} pod blocks in {events} events; equal: {restored == idx}")


async def service_bench(args) -> None:
    """JetStream -> IndexerService: throughput, apply lag, HTTP query latency, recovery time.

    Phases, one nats-server (embedded, file storage) and one indexer, in this order:
    drain (``--events`` batches published first, then the indexer reads the backlog), live
    (half as many new batches published flat out by a separate publisher process, as a bridge
    would, while the indexer consumes), paced (with ``--rate``: batches/s for ~10 s, apply lag),
    HTTP queries, then stop (final snapshot) and restart from the snapshot. Pods keep up to
    62.5k own blocks here, so the restart covers ~1M pod blocks.
    """
    import asyncio
    import gc

    import httpx
    import msgpack
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.indexer import IndexerConfig, IndexerService, decode_batch
    from infernex.embedded_nats import EmbeddedNats
    from schemas import subjects as S
    from schemas.config import NatsConfig
    from streams.topology import build_topology

    global CAPACITY
    CAPACITY = 62_500  # 16 pods x 62.5k blocks: the 1M-block recovery point
    gen = Gen(args.seed)

    def make(n_events):
        out = []
        end = gen.stored_events + n_events
        while gen.stored_events < end:
            out.append(gen.batch())
        return out

    def encode(bs):
        return [(S.kv_events(b.model, b.pod), b.model_dump_json().encode(), b.msg_id) for b in bs]

    def stored_blocks(bs):
        return sum(len(e.block_hashes) for b in bs for e in b.events if e.type == "stored")

    def lag_counts(svc):
        fam = svc.metrics.lag.collect()[0]
        return [(float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")]

    def lag_report(before, after):
        diff = [(le, a - b) for (le, a), (_, b) in zip(after, before)]
        total = diff[-1][1]
        if not total:
            return "no batches"
        parts = []
        for q in (0.5, 0.99):
            bound = next(le for le, c in diff if c >= q * total)
            parts.append(f"p{int(q * 100)} <= {bound * 1e3:g} ms")
        return ", ".join(parts) + " (histogram bucket bounds)"

    drain = make(args.events)
    live = make(max(1, args.events // 2))
    paced = []
    if args.rate and args.paced_workload == "steps":
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "bench_replay", os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.py"))
        replay_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(replay_bench)
        want = int(min(args.rate * 10, 200_000))
        msgs, _ = replay_bench.history(int(want * 1.2) + 100, 16, 4)
        for subject, data in msgs:  # the KV batches only, engine time zeroed for the lag stamp
            if subject.startswith("kv.events.") and len(paced) < want:
                paced.append(KvEventBatch.model_validate_json(data).model_copy(update={"ts": 0.0}))
    elif args.rate:
        paced = make(int(min(args.rate * 10, 100_000)))
    # as `infernex indexer` does after start: long-lived objects (here the workload) are left out
    # of the cyclic GC's scans
    gc.collect()
    gc.freeze()
    store = tempfile.mkdtemp(prefix="bench-kv-index-")
    server = EmbeddedNats(store)
    server.start()
    procs = []
    try:
        ncfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(ncfg)
        js = nc.jetstream()
        await bus.apply_topology(js, build_topology())
        cfg = IndexerConfig(http_port=0, durable="bench", snapshot_every_events=10**9, snapshot_every_s=10**6)
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        # -- drain: the backlog is in the stream before the indexer starts
        now = time.time()
        for i in range(0, len(drain), 2000):
            acks = await asyncio.gather(*(
                js.publish(subj, data.replace(b'"ts":0.0', f'"ts":{now}'.encode(), 1), headers={"Nats-Msg-Id": mid})
                for subj, data, mid in encode(drain[i:i + 2000])))
        last = acks[-1].seq
        svc = IndexerService(cfg, ncfg, registry=CollectorRegistry())
        warm_up()  # the kernels' one-time load (~0.4 s; the service does it at start) is not consumption
        t0, c0 = time.perf_counter(), time.process_time()
        await svc.start()
        while svc.applied_seq < last:
            await asyncio.sleep(0.005)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        blocks = stored_blocks(drain)
        print(f"drain (JetStream backlog -> indexer): {len(drain)} batches / {blocks} stored blocks in {dt:.2f}s -> "
              f"{blocks / dt / 1e6:.2f}M blocks/s, {len(drain) / dt:.0f} batches/s; indexer CPU {dc:.2f}s -> "
              f"{blocks / dc / 1e6:.2f}M blocks per CPU-second; load {os.getloadavg()[0]:.1f}")
        # the same messages decoded and folded in process: how the service's CPU splits
        ref = KvIndex(ManualClock())
        dec_cpu = fold_cpu = 0.0
        for i in range(0, len(drain), 2000):
            datas = [data.replace(b'"ts":0.0', f'"ts":{now}'.encode(), 1) for _, data, _ in encode(drain[i:i + 2000])]
            for j in range(0, len(datas), 256):  # in queues of the service's size (GC work alike)
                c0 = time.process_time()
                chunk = [decode_batch(d) for d in datas[j:j + 256]]
                c1 = time.process_time()
                ref.apply_many(chunk)
                dec_cpu += c1 - c0
                fold_cpu += time.process_time() - c1
        assert ref == svc.index
        print(f"  the same messages decoded and folded in process: decode {dec_cpu:.2f}s + fold {fold_cpu:.2f}s CPU "
              f"(fold alone {blocks / fold_cpu / 1e6:.2f}M blocks per CPU-second)")

        # -- live / paced: a publisher process (the bridge's JetStream leg) while the indexer consumes
        async def run_publisher(batches, rate, label):
            path = os.path.join(store, f"{label}.msgpack")
            with open(path, "wb") as f:
                f.write(msgpack.packb(encode(batches)))
            proc = subprocess.Popen([sys.executable, "-P", "-c", PUBLISHER_SCRIPT, server.url, path, str(rate)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout.readline().strip() == "ready"
            before = lag_counts(svc)
            t0, c0 = time.perf_counter(), time.process_time()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = await asyncio.to_thread(proc.stdout.readline)
            proc.wait(timeout=30)
            pub = json.loads(out)
            while svc.applied_seq < pub["last_seq"]:
                await asyncio.sleep(0.002)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            blocks = stored_blocks(batches)
            events = sum(len(b.events) for b in batches)
            if rate:
                print(f"{label}: {events / len(batches):.2f} events per batch, offered {rate * events / len(batches):,.0f} "
                      f"events/s")
            print(f"{label} (publisher process -> JetStream -> indexer{', paced at %g batches/s' % rate if rate else ', flat out'}): "
                  f"{len(batches)} batches / {blocks} stored blocks in {dt:.2f}s (published in {pub['seconds']:.2f}s) -> "
                  f"{blocks / dt / 1e6:.2f}M blocks/s, {len(batches) / dt:.0f} batches/s; indexer CPU "
                  f"{blocks / dc / 1e6:.2f}M blocks per CPU-second; apply lag {lag_report(before, lag_counts(svc))}; "
                  f"load {os.getloadavg()[0]:.1f}")

        await run_publisher(live, 0, "live")
        if paced:
            await run_publisher(paced, args.rate, "paced")

        # -- HTTP queries: bodies encoded beforehand; a raw keep-alive client, then httpx for comparison
        bodies = [json.dumps({"model": "bench", "token_ids": gen.query()}).encode() for _ in range(2000)]
        reader, writer = await asyncio.open_connection("127.0.0.1", svc.http_port)
        def served():
            return svc.registry.get_sample_value("infernex_indexer_query_seconds_sum", {"via": "http"}) or 0.0

        served0 = served()
        raw = []
        for body in bodies:
            t1 = time.perf_counter()
            writer.write(b"POST /v1/index/query HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
            raw.append(time.perf_counter() - t1)
            assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
        server_side = (served() - served0) / len(bodies)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.http_port}") as http:
            lats = []
            for _ in range(500):
                body = {"model": "bench", "token_ids": gen.query()}
                t1 = time.perf_counter()
                r = await http.post("/v1/index/query", json=body)
                lats.append(time.perf_counter() - t1)
                assert r.status_code == 200
        print(f"HTTP query (128-512 blocks as token ids, 16 pods): raw client p50 {pct(raw, 50) * 1e3:.2f} ms "
              f"p99 {pct(raw, 99) * 1e3:.2f} ms (server-side mean {server_side * 1e3:.2f} ms); httpx client with "
              f"json= p50 {pct(lats, 50) * 1e3:.2f} ms p99 {pct(lats, 99) * 1e3:.2f} ms; load {os.getloadavg()[0]:.1f}")

        # -- a snapshot (consumption pauses for the dump only), then stop and restart from it
        held = sum(sum(p.blocks.values()) for p in svc.index.pods().values())
        t0 = time.perf_counter()
        async with svc._lock:  # as the consumer takes it: no batch is applied meanwhile
            task = await svc._start_snapshot()
        t1 = time.perf_counter()
        await task
        t2 = time.perf_counter()
        how = "fork; a child dumps and encodes" if cfg.snapshot_fork else "dump; encoding follows"
        print(f"snapshot of {held} pod blocks: consumption paused {t1 - t0:.2f}s ({how}), then stored "
              f"{t2 - t1:.2f}s later alongside; load {os.getloadavg()[0]:.1f}")
        await svc.stop()
        t2 = time.perf_counter()
        svc2 = IndexerService(cfg, ncfg, registry=CollectorRegistry())
        await svc2.start()
        t3 = time.perf_counter()
        ok = svc2.index == svc.index
        await svc2.stop()
        timings = ", ".join(f"{k} {v:.2f}s" if k != "bytes" else f"{v / 1e6:.1f} MB" for k, v in svc2.restore_timings.items())
        print(f"restart at {held} pod blocks (connect, read snapshot, decode, apply, resume) {t3 - t2:.2f}s "
              f"({timings}); restored index equal: {ok}; load {os.getloadavg()[0]:.1f}")
        await nc.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        server.stop()
        server.cleanup()


PUBLISHER_SCRIPT = r"""
import asyncio, json, sys, time
import msgpack, nats
url, path, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
payloads = msgpack.unpackb(open(path, "rb").read())
async def main():
    nc = await nats.connect(url)
    js = nc.jetstream()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    window = max(1, int(rate / 100)) if rate else 1000
    last = None
    for i in range(0, len(payloads), window):
        chunk = payloads[i:i + window]
        if rate:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        now = f'"ts":{time.time()}'.encode()  # the engine time, so the indexer's lag is publish -> applied
        acks = await asyncio.gather(*(js.publish(s, d.replace(b'"ts":0.0', now, 1), headers={"Nats-Msg-Id": m})
                                      for s, d, m in chunk))
        last = acks[-1].seq
    print(json.dumps({"last_seq": last, "seconds": time.perf_counter() - t0}), flush=True)
    await nc.close()
asyncio.run(main())
"""


def to_dynamo(idx: KvIndex, batch: KvEventBatch) -> dict:
    """The batch as Dynamo KvCacheEvents: block hashes = engine hashes, tokens_hash = our keys."""
    out = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            # our keys of these blocks, looked up from the index (already applied)
            keys = idx.keys_of(batch.pod, ev.block_hashes)
            blocks = [{"block_hash": h, "tokens_hash": k or h} for h, k in zip(ev.block_hashes, keys)]
            out.append({"stored": {"parent_hash": ev.parent_block_hash, "blocks": blocks}})
        else:
            out.append({"removed": {"block_hashes": list(ev.block_hashes)}})
    return {"w": int(batch.pod.split("-")[1]), "e": out}


DYNAMO_SCRIPT = r"""
import json, sys, time
from dynamo.llm import RadixTree
events = []
for line in open(sys.argv[1]):
    d = json.loads(line)
    for data in d["e"]:
        events.append((d["w"], data))
payloads = []
for i, (w, data) in enumerate(events):
    payloads.append((w, json.dumps({"event_id": i, "data": data}).encode()))
blocks = sum(len(d["stored"]["blocks"]) for _, d in events if "stored" in d)
tree = RadixTree()
t0, c0 = time.perf_counter(), time.process_time()
for w, p in payloads:
    tree.apply_event(w, p)
dt = time.perf_counter() - t0
dc = time.process_time() - c0
print(f"dynamo RadixTree ingest: {blocks} stored blocks in {dt:.2f}s -> {blocks / dt / 1e6:.2f}M stored blocks/s "
      f"(by CPU time {blocks / dc / 1e6:.2f}M; its tree runs on its own thread, so CPU time counts both)")
keys = json.load(open(sys.argv[2]))
lat = []
for k in keys:
    t0 = time.perf_counter()
    tree.find_matches(k)
    lat.append(time.perf_counter() - t0)
lat.sort()
print(f"dynamo find_matches: p50 {lat[len(lat)//2]*1e6:.1f}us p99 {lat[int(len(lat)*0.99)]*1e6:.1f}us")
print(json.dumps({"ingest": blocks / dt, "ingest_cpu": blocks / dc, "p50": lat[len(lat)//2],
                  "p99": lat[int(len(lat)*0.99)]}))
"""


if __name__ == "__main__":
    main()
