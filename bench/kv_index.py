"""KV index bench: in-process ingest (blocks/s) and query latency (p50/p99), and optionally
NVIDIA Dynamo's RadixTree on the same workload.

Workload (issue 4): 16 pods, N stored events of 16-64 blocks sharing prefixes (32 system
prompts of 128 blocks, 2048 conversations of 384 more blocks; each pod stores conversations
progressively and evicts the least recently used one past 40k blocks), then Q queries of
128-512 blocks. Events are built before timing (pydantic construction is not measured).

    /work/venv/bin/python bench/kv_index.py [--events 200000] [--queries 20000]
        [--dynamo-python /tmp/dynamo-venv/bin/python]

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
from streams.kv_index import KvIndex, block_keys  # noqa: E402

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
        self.tokens = {}
        self.progress = [dict() for _ in range(PODS)]  # conv -> stored blocks (LRU order)
        self.lru = [OrderedDict() for _ in range(PODS)]
        self.size = [0] * PODS
        self.fam_prog = [dict() for _ in range(PODS)]  # family -> prefix blocks stored
        self.seq = [-1] * PODS
        self.stored_events = 0

    def conv(self, c):
        t = self.tokens.get(c)
        if t is None:
            t = self.tokens[c] = conv_tokens(self.fam, self.own, self.conv_family, c).tolist()
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
            type="stored", block_hashes=hashes, parent_block_hash=parent, token_ids=toks[start * BS:(start + n) * BS],
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
        toks = self.conv(c)[: n * BS]
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
    ap.add_argument("--chunk", type=int, default=20_000, help="events generated per timed chunk")
    ap.add_argument("--dynamo-python", default=None, help="python of a venv with ai-dynamo-runtime")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--service", action="store_true",
                    help="instead: through JetStream into the indexer service (embedded nats-server)")
    ap.add_argument("--rate", type=float, default=0, help="--service: paced publishing, batches/s (0 = flat out)")
    args = ap.parse_args()
    if args.service:
        import asyncio

        asyncio.run(service_bench(args))
        return

    gen = Gen(args.seed)
    idx = KvIndex(ManualClock())
    dyn_file = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) if args.dynamo_python else None
    ingest_s = ingest_cpu = 0.0
    stored_blocks = removed_blocks = stored_events = 0
    done = 0
    while gen.stored_events < args.events:
        chunk = []
        while gen.stored_events < args.events and len(chunk) < args.chunk:
            chunk.append(gen.batch())
        t0, c0 = time.perf_counter(), time.process_time()
        st = idx.apply_many(chunk)
        ingest_s += time.perf_counter() - t0
        ingest_cpu += time.process_time() - c0
        assert st.unknown_parent == 0 and st.duplicates == 0, f"workload bug: {st}"
        stored_blocks += st.blocks_stored
        removed_blocks += st.blocks_removed
        done += len(chunk)
        if dyn_file is not None:
            for b in chunk:
                dyn_file.write(json.dumps(to_dynamo(idx, b)) + "\n")
    print(f"ingest: {done} batches, {gen.stored_events} stored events, {stored_blocks} stored + "
          f"{removed_blocks} removed blocks in {ingest_s:.2f}s -> {stored_blocks / ingest_s / 1e6:.2f}M stored "
          f"blocks/s, {(stored_blocks + removed_blocks) / ingest_s / 1e6:.2f}M block ops/s; "
          f"{len(idx)} distinct blocks held; by CPU time {stored_blocks / ingest_cpu / 1e6:.2f}M stored blocks/s")
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
    big = [lat for lat, k in zip(lat_keys, keys) if len(k) >= 480]
    if big:
        print(f"query match_keys 480-512 blocks: p50 {pct(big, 50) * us:.1f}us p99 {pct(big, 99) * us:.1f}us")
    print(f"query match_tokens (hashing included): p50 {pct(lat_tokens, 50) * us:.1f}us "
          f"p99 {pct(lat_tokens, 99) * us:.1f}us; block_keys alone p50 {pct(lat_hash, 50) * us:.1f}us")

    t0 = time.perf_counter()
    dump = idx.dump()
    t1 = time.perf_counter()
    restored = KvIndex(ManualClock())
    restored.apply_many(dump)
    t2 = time.perf_counter()
    print(f"dump {t1 - t0:.2f}s, restore {t2 - t1:.2f}s for {sum(sum(p.blocks.values()) for p in idx.pods().values())} "
          f"pod blocks; equal: {restored == idx}")

    if dyn_file is not None:
        dyn_file.close()
        qfile = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(keys, qfile)
        qfile.close()
        try:
            out = subprocess.run([args.dynamo_python, "-c", DYNAMO_SCRIPT, dyn_file.name, qfile.name],
                                 capture_output=True, text=True, timeout=3600)
            print(out.stdout.strip() or out.stderr.strip()[-2000:])
        finally:
            os.unlink(dyn_file.name)
            os.unlink(qfile.name)


async def service_bench(args) -> None:
    """JetStream -> IndexerService: throughput, apply lag, HTTP query latency, recovery time."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry

    from consumers import bus
    from consumers.indexer import IndexerConfig, IndexerService
    from infernex.embedded_nats import EmbeddedNats
    from schemas import subjects as S
    from schemas.config import NatsConfig
    from streams.topology import build_topology

    gen = Gen(args.seed)
    batches = []
    while gen.stored_events < args.events:
        batches.append(gen.batch())
    payloads = [(S.kv_events(b.model, b.pod), b.model_dump_json().encode(), b.msg_id) for b in batches]
    blocks = sum(len(e.block_hashes) for b in batches for e in b.events if e.type == "stored")
    store = tempfile.mkdtemp(prefix="bench-kv-index-")
    server = EmbeddedNats(store)
    server.start()
    try:
        ncfg = NatsConfig(servers=[server.url])
        nc = await bus.connect(ncfg)
        js = nc.jetstream()
        await bus.apply_topology(js, build_topology())
        cfg = IndexerConfig(http_port=0, durable="bench", snapshot_every_events=10**9, snapshot_every_s=10**6,
                            fetch_batch=1024)
        svc = IndexerService(cfg, ncfg, registry=CollectorRegistry())
        await svc.start()
        t0 = time.perf_counter()
        window = max(1, int(args.rate / 50)) if args.rate else 2000
        for i in range(0, len(payloads), window):
            chunk = payloads[i:i + window]
            if args.rate:
                target = t0 + (i + len(chunk)) / args.rate
                await asyncio.sleep(max(0.0, target - time.perf_counter()))
            # stamp the engine time at publish, so the indexer's lag histogram is publish -> applied
            acks = await asyncio.gather(*(js.publish(subj, data.replace(b'"ts":0.0', f'"ts":{time.time()}'.encode(), 1),
                                                     headers={"Nats-Msg-Id": mid}) for subj, data, mid in chunk))
        last = acks[-1].seq
        while svc.applied_seq < last:
            await asyncio.sleep(0.005)
        dt = time.perf_counter() - t0
        print(f"service: {len(batches)} batches / {blocks} stored blocks published and applied in {dt:.2f}s -> "
              f"{blocks / dt / 1e6:.2f}M blocks/s, {len(batches) / dt:.0f} batches/s"
              + (f" (paced at {args.rate:.0f}/s)" if args.rate else " (flat out)"))
        lag = svc.metrics.lag.collect()[0]
        buckets = [(float(s.labels["le"]), s.value) for s in lag.samples if s.name.endswith("_bucket")]
        total = buckets[-1][1]
        for q in (0.5, 0.99):
            bound = next(le for le, c in buckets if c >= q * total)
            print(f"apply lag p{int(q * 100)} <= {bound * 1e3:g} ms (histogram bucket bound)")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.http_port}") as http:
            lats = []
            for _ in range(2000):
                body = {"model": "bench", "token_ids": gen.query()}
                t1 = time.perf_counter()
                r = await http.post("/v1/index/query", json=body)
                lats.append(time.perf_counter() - t1)
                assert r.status_code == 200
            print(f"HTTP query (128-512 blocks, tokens): p50 {pct(lats, 50) * 1e3:.2f} ms p99 {pct(lats, 99) * 1e3:.2f} ms")
        held = sum(sum(p.blocks.values()) for p in svc.index.pods().values())
        t1 = time.perf_counter()
        await svc.stop()  # writes the final snapshot
        t2 = time.perf_counter()
        svc2 = IndexerService(cfg, ncfg, registry=CollectorRegistry())
        await svc2.start()
        t3 = time.perf_counter()
        ok = svc2.index == svc.index
        await svc2.stop()
        print(f"snapshot of {held} pod blocks written in {t2 - t1:.2f}s; restart (load snapshot, resume) "
              f"{t3 - t2:.2f}s ({svc2.restore_timings}); restored index equal: {ok}")
        await nc.close()
    finally:
        server.stop()
        server.cleanup()


def to_dynamo(idx: KvIndex, batch: KvEventBatch) -> dict:
    """The batch as Dynamo KvCacheEvents: block hashes = engine hashes, tokens_hash = our keys."""
    out = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            # our keys of these blocks, looked up from the index (already applied)
            pod = idx._pods[batch.pod]
            emap = pod.emaps["GPU"]
            blocks = [{"block_hash": h, "tokens_hash": emap.get(h, h)} for h in ev.block_hashes]
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
"""


if __name__ == "__main__":
    main()
