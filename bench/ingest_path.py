"""The whole KV ingest path, JSON vs binary on the bus, interleaved in one run.

    python bench/ingest_path.py [--runs 3] [--pods 4] [--frames 2000] [--rate 1000] [--seconds 10]
        [--encodings binary] [--before-ref REF]

``--before-ref REF`` adds each encoding again with the bridges and the indexer of git ``REF``
(extracted with ``git archive``; its kernels compiled before the first round), in the same
interleaved rounds, so a change to the path is measured against its parent side by side.

Per run (encodings alternate: json, binary, json, ...; each run on a fresh file-backed
nats-server): one publisher process sends vLLM-0.33-shaped frames (``simulator.kv_events.
encode_batch``: a map-encoded ``KVEventBatch`` with one ``BlockStored`` chain of ``--stored``
blocks and one ``BlockRemoved`` of ``--removed``) on one ZMQ PUB socket per pod; one
``infernex bridge vllm-kv --encoding E`` process (uvloop; ``--bridges one``, the default: one process
for every pod's socket, as Dynamo's indexer is one process; ``per-pod``: one each) publishes to JetStream; one
indexer process (``IndexerService`` on uvloop, as ``infernex indexer`` runs it) folds.

* flat-out: ``--frames`` frames per pod as fast as the publisher can; stored blocks per second
  from the first send to the indexer having applied the last batch, and CPU per stored block by
  process (bridges, nats-server, indexer; from /proc);
* paced: ``--rate`` frames/s in total for ``--seconds``, each frame stamped with its send time;
  lag = indexer apply time - that stamp, every batch recorded (p50 / p99 / max); meanwhile an HTTP
  query to the indexer every ``--query-every`` s (p50 / p99), and the same queries for 1.5 s with
  nothing ingesting just before, for the client's and the HTTP stack's own share; beside them the
  indexer's own handling time per query while paced (the mean of its query histogram), so a slow
  figure tells the indexer's work from the client, the loopback round trip and the wait for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.client
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "bench-model"
PREFIX = "bench"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU of ``pid`` and its waited-for children, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in parts[11:15]) / TICK


# ---------------------------------------------------------------- publisher (its own process)

class _Engine:
    """One engine's KV events as vLLM sends them, so that the index does the work it is credited
    with: each frame stores a chain of ``stored`` blocks, from the root (a new prompt) or, half the
    time, continuing the engine's latest chain (a conversation's next turn), and removes ``removed``
    blocks the engine holds: the oldest conversation's first, tail first (vLLM frees a request's
    blocks in reverse order, so a block goes before its prefix), never the latest conversation nor
    the system chain (:func:`_system_chain`, stored first and kept, which the queries match).

    (Until session 26 every chain started from a random parent no engine had stored and every
    removal named a random hash: our index and Dynamo's both skipped every store, and the figures
    measured two systems rejecting the events.)"""

    def __init__(self, seed: int, stored: int, removed: int, block_size: int, capacity: int = 0):
        import numpy as np

        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.stored, self.removed, self.bs = stored, removed, block_size
        self.capacity = capacity  # blocks the engine's cache holds (0: no bound): past it, a store evicts as many
        self.convs: deque[list[int]] = deque()  # conversations' block hashes, oldest first
        self.resident = 0  # blocks the engine holds now (what the index should hold for it)

    def reseed(self, seed: int) -> "_Engine":
        """A copy with the same blocks held that goes on with other events (another engine that
        served the same requests so far)."""
        import copy

        import numpy as np

        e = copy.copy(self)
        e.convs = deque(list(c) for c in self.convs)
        e.rng, e.np = random.Random(seed), np.random.default_rng(seed)
        return e

    def filling(self) -> bool:
        """Whether the next frame's blocks still fit the cache without an eviction (False without a capacity)."""
        return bool(self.capacity) and self.resident + self.stored <= self.capacity

    def system(self, hashes: list[int], tokens: list[int]) -> list:
        from simulator.kv_events import block_stored

        self.resident += len(hashes)
        return [block_stored(hashes, None, tokens, self.bs)]

    def next_events(self) -> list:
        from simulator.kv_events import block_removed, block_stored

        go_on = bool(self.convs) and self.rng.random() < 0.5
        parent = self.convs[-1][-1] if go_on else None
        toks = self.np.integers(0, 151_000, self.stored * self.bs).tolist()
        hashes = [self.rng.getrandbits(63) for _ in range(self.stored)]
        if go_on:
            self.convs[-1].extend(hashes)
        else:
            self.convs.append(list(hashes))
        self.resident += len(hashes)
        events = [block_stored(hashes, parent, toks, self.bs)]
        gone: list[int] = []
        want = max(self.removed, self.resident - self.capacity) if self.capacity else self.removed
        while len(gone) < want and len(self.convs) > 1:
            oldest = self.convs[0]
            gone.append(oldest.pop())
            if not oldest:
                self.convs.popleft()
        if gone:
            self.resident -= len(gone)
            events.append(block_removed(gone))
        return events


def _system_chain(args) -> tuple[list[int], list[int]]:
    """The chain every engine stores first and keeps (a shared system prompt): its block hashes and
    tokens. The warm-up re-sends it; the HTTP queries ask for it (every pod matches all of it)."""
    rng = random.Random(11)
    return ([rng.getrandbits(63) for _ in range(args.stored)],
            [rng.randrange(151_000) for _ in range(args.stored * args.block_size)])


def _workload(args) -> tuple[bytes, list[bytes], list[bytes], _Engine]:
    """The warm-up frame, the frames that fill the engine's cache to ``--capacity`` (none without
    one), the flat-out frames (the same for every pod) and the engine after them."""
    from simulator.kv_events import encode_batch

    cap = getattr(args, "capacity", 0)
    eng = _Engine(7, args.stored, args.removed, args.block_size, cap)
    warm = encode_batch(eng.system(*_system_chain(args)), ts=1.0)
    fill = []
    while eng.filling():
        fill.append(encode_batch(eng.next_events(), ts=1.0))
    flat = [encode_batch(eng.next_events(), ts=1.0) for _ in range(args.frames)]
    return warm, fill, flat, eng


def _frames(rng: random.Random, n: int, stored: int, removed: int, block_size: int, ts: float | None) -> list[bytes]:
    """``n`` frames of one engine (:class:`_Engine`), encoded as vLLM 0.33 sends them (for the codec benches)."""
    from simulator.kv_events import encode_batch

    eng = _Engine(rng.getrandbits(32), stored, removed, block_size)
    return [encode_batch(eng.next_events(), ts=time.time() if ts is None else ts) for _ in range(n)]


def _query_loop(url: str, stop, out: list, args) -> None:
    """``POST /v1/index/query`` every ``--query-every`` seconds until ``stop``; each latency into ``out``.
    The query is the system chain's tokens (:func:`_system_chain`), which every pod holds: the cost
    measured is the HTTP round trip, the request's block keys and a lookup that matches every block
    on every pod, on the indexer's loop while it ingests."""
    body = json.dumps({"model": MODEL, "token_ids": _system_chain(args)[1]}).encode()
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=5)  # keep-alive, the lightest client at hand
    hdrs = {"Content-Type": "application/json"}
    try:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                c.request("POST", "/v1/index/query", body=body, headers=hdrs)
                r = c.getresponse()
                r.read()
                if r.status == 200:
                    out.append(time.perf_counter() - t)
            except (OSError, http.client.HTTPException):
                c.close()
                c = http.client.HTTPConnection(host, int(port), timeout=5)
            stop.wait(args.query_every)
    finally:
        c.close()


def publisher_proc(ports, cmds, done, args) -> None:
    import zmq

    ctx = zmq.Context()
    socks = []
    for p in ports:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 1_000_000)
        s.bind(f"tcp://127.0.0.1:{p}")
        socks.append(s)
    seqs = [0] * len(socks)
    warm, fill, flat, eng = _workload(args)
    engines = [eng.reseed(100 + k) for k in range(len(socks))]  # the paced phase: each pod its own events
    from simulator.kv_events import encode_batch

    import queue

    while True:
        cmd = cmds.get()
        if cmd == "warm":  # a frame per pod every 50 ms until the next command (bridges joining)
            while True:
                try:
                    cmd = cmds.get(timeout=0.05)
                    break
                except queue.Empty:
                    for k, s in enumerate(socks):
                        s.send_multipart((b"kv@", seqs[k].to_bytes(8, "big"), warm), copy=False)
                        seqs[k] += 1
        if cmd == "hold":  # the warm-up's frames stop: the driver reads its base count in quiet
            continue
        if cmd == "fill":  # the engines' caches filled to --capacity (before the clock starts)
            for payload in fill:
                for k, s in enumerate(socks):
                    s.send_multipart((b"kv@", seqs[k].to_bytes(8, "big"), payload), copy=False)
                    seqs[k] += 1
            done.put(len(fill) * len(socks))
        elif cmd == "flat":
            for i in range(args.frames):
                payload = flat[i]
                for k, s in enumerate(socks):
                    s.send_multipart((b"kv@", seqs[k].to_bytes(8, "big"), payload), copy=False)
                    seqs[k] += 1
            done.put(args.frames * len(socks))
        elif cmd == "paced":
            n = int(args.rate * args.seconds)
            t0 = time.perf_counter()
            for i in range(n):
                due = t0 + i / args.rate
                while (d := due - time.perf_counter()) > 0:
                    time.sleep(min(d, 0.002))
                k = i % len(socks)
                socks[k].send_multipart((b"kv@", seqs[k].to_bytes(8, "big"),
                                         encode_batch(engines[k].next_events(), ts=time.time())))
                seqs[k] += 1
            done.put(n)
        else:
            break
    for s in socks:
        s.close(linger=1000)
    ctx.term()


# ---------------------------------------------------------------- indexer (its own process)

def indexer_role(url: str, lag_file: str, port: int, reserve: int = 0) -> None:
    """``IndexerService`` on uvloop, as ``infernex indexer`` runs it, recording every lag."""
    import logging

    import uvloop

    logging.basicConfig(level=logging.WARNING, format="indexer %(levelname)s %(name)s: %(message)s")
    from prometheus_client import CollectorRegistry

    from consumers.indexer import IndexerConfig, IndexerService
    from schemas.config import NatsConfig

    lags: list[tuple[float, float]] = []

    class Rec:
        def __init__(self, h):
            self.h = h

        def observe(self, v):
            lags.append((time.time(), v))

    async def run():
        cfg = IndexerConfig(http_port=port, nats_query=False, durable="bench-ix", snapshot_every_events=10_000_000,
                            snapshot_every_s=3600, reserve_blocks=reserve)
        svc = IndexerService(cfg, NatsConfig(servers=[url], subject_prefix=PREFIX), registry=CollectorRegistry())
        svc.metrics.lag = Rec(svc.metrics.lag)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, svc.request_stop)
        await svc.start()
        from infernex.commands.common import settle_gc

        settle_gc()  # as `infernex indexer` does once started
        print("ready", flush=True)
        try:
            await svc.run_forever()
        finally:
            await svc.stop()
            Path(lag_file).write_text(json.dumps(lags))

    uvloop.run(run())


async def bus_and_indexer(server, tmp: str, procs: list[subprocess.Popen],
                          tree: Path = ROOT, reserve: int = 0) -> tuple[dict[str, str], int]:
    """On a started nats-server: the topology, the environment for processes that use it, and the
    indexer process (``--role indexer``, lags to ``tmp/lags.json``) started, added to ``procs``
    and ready. Returns ``(env, indexer HTTP port)``."""
    from consumers import bus
    from infernex.embedded_nats import free_port
    from schemas.config import NatsConfig
    from streams.topology import build_topology

    nc = await bus.connect(NatsConfig(servers=[server.url], subject_prefix=PREFIX))
    await bus.apply_topology(nc.jetstream(), build_topology(prefix=PREFIX))
    await nc.close()
    env = {**os.environ, "PYTHONPATH": str(tree), "INFERNEX_NATS__SERVERS": server.url,
           "INFERNEX_NATS__SUBJECT_PREFIX": PREFIX}
    port = free_port()
    ix = subprocess.Popen([sys.executable, str(Path(tree) / "bench" / "ingest_path.py"), "--role", "indexer", "--url", server.url,
                           "--lag-file", str(Path(tmp) / "lags.json"), "--port", str(port),
                           *(["--reserve-blocks", str(reserve)] if reserve else [])],
                          env=env, stdout=subprocess.PIPE, text=True)
    procs.append(ix)
    if ix.stdout.readline().strip() != "ready":
        raise RuntimeError("the indexer process did not start")
    return env, port


def _spy(folder: str, pids: dict[str, list[int]], encoding: str) -> list[subprocess.Popen]:
    """py-spy on every process of the path for the flat-out window: ``<folder>/<encoding>-<role>-<pid>.raw``
    (collapsed stacks; py-spy is not a dependency: ``pip install py-spy`` first)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = []
    for role, ps in pids.items():
        if role == "nats-server":
            continue
        for pid in ps:
            out.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "-o",
                                         str(Path(folder) / f"{encoding.replace('@', '-')}-{role}-{pid}.raw")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # attached before the first flat-out frame
    return out


def stop_procs(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM every process still running, wait for each, kill what does not stop."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()


async def _metric(http, name: str) -> float:
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ---------------------------------------------------------------- one run

DYNAMO_APPLIED = "dynamo_kvrouter_kv_cache_events_applied"
QUERY_SECONDS = "infernex_indexer_query_seconds"


async def _fill(args, cmds, done, count) -> None:
    """With ``--capacity``: the engines' caches filled before the clock starts, and every fill frame
    applied (``count()``: the batches, or Dynamo's stored events, applied so far; a fill frame is one)."""
    n = _fill_frames(args) * args.pods
    if not n:
        return
    base = await count()
    cmds.put("fill")
    done.get(timeout=args.timeout)
    deadline = time.monotonic() + args.timeout
    while await count() < base + n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fill frames were not all applied ({await count() - base:.0f} of {n})")
        await asyncio.sleep(0.05)


async def _until_applied(count, want, done, timeout, cpu):
    """Poll ``count()`` until it reaches ``want``, or the publisher is done and nothing more was
    applied for 2 s (frames ZMQ dropped under the flat-out load never come: the rate counts up
    to the last batch applied, and the shortfall is reported). ``(count, time, cpu)`` at the last
    progress."""
    import queue

    deadline = time.monotonic() + timeout
    sent = None
    last, t_last, c_last = await count(), time.perf_counter(), cpu()
    while last < want and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if sent is None:
            try:
                sent = done.get_nowait()
            except queue.Empty:
                pass
        got = await count()
        if got != last:
            last, t_last, c_last = got, time.perf_counter(), cpu()
        elif sent is not None and time.perf_counter() - t_last > 2.0:
            break
    if sent is None:
        done.get(timeout=60)
    return last, t_last, c_last


async def _dynamo_stored(http) -> float:
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(DYNAMO_APPLIED + '{event_type="stored"'))


async def _dynamo_outcomes(http) -> dict[str, float]:
    """Dynamo's applied events by ``type:status`` (those not ``ok`` were rejected: e.g. a store whose
    parent it does not hold, ``parent_block_not_found``), the non-zero ones."""
    out = {}
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(DYNAMO_APPLIED + "{"):
            labels, v = line[len(DYNAMO_APPLIED) + 1:].rsplit("} ", 1)
            d = dict(kv.split("=", 1) for kv in labels.split(","))
            if float(v):
                out[f"{d['event_type'].strip(chr(34))}:{d['status'].strip(chr(34))}"] = float(v)
    return out


def _workload_resident(args) -> int:
    """Blocks one engine holds after the warm-up and the flat-out frames."""
    return _counts(args.stored, args.removed, args.block_size, args.frames, getattr(args, "capacity", 0))[1]


def _fill_frames(args) -> int:
    """How many frames fill one engine's cache to ``--capacity`` (0 without one)."""
    return _counts(args.stored, args.removed, args.block_size, args.frames, getattr(args, "capacity", 0))[0]


@functools.cache
def _counts(stored: int, removed: int, block_size: int, frames: int, capacity: int) -> tuple[int, int]:
    """(fill frames, blocks one engine holds after them, the warm-up and the flat-out frames): as
    :func:`_workload`'s engine, without encoding its frames."""
    args = argparse.Namespace(stored=stored, removed=removed, block_size=block_size, frames=frames)
    eng = _Engine(7, args.stored, args.removed, args.block_size, capacity)
    eng.system(*_system_chain(args))
    fill = 0
    while eng.filling():
        eng.next_events()
        fill += 1
    for _ in range(args.frames):
        eng.next_events()
    return fill, eng.resident


async def dynamo_run(args) -> dict:
    """Dynamo's standalone indexer (``python -m dynamo.indexer``, from ``--dynamo-python``) on the
    same publisher: it subscribes to the pods' ZMQ sockets itself (no bus, no durability).
    Flat-out blocks/s and CPU per block; its lag cannot be read per batch, so none is given."""
    import httpx

    from infernex.embedded_nats import free_port

    ports = [free_port() for _ in range(args.pods)]
    cmds, done = mp.Queue(), mp.Queue()
    pub = mp.Process(target=publisher_proc, args=(ports, cmds, done, args))
    pub.start()
    hport = free_port()
    workers = ",".join(f"{i}=tcp://127.0.0.1:{p}" for i, p in enumerate(ports))
    dyn = subprocess.Popen([args.dynamo_python, "-m", "dynamo.indexer", "--port", str(hport), "--block-size",
                            str(args.block_size), "--workers", workers], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        cmds.put("warm")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=5) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if await _dynamo_stored(http) >= args.pods * 3:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("dynamo.indexer applied nothing")
                await asyncio.sleep(0.1)
            await _fill(args, cmds, done, lambda: _dynamo_stored(http))
            cmds.put("hold")  # the warm-up's last frames applied before the base is read, the clock started
            await asyncio.sleep(0.5)  # before the first flat-out frame (else both come out short)
            base = await _dynamo_stored(http)
            c0, t0 = cpu_seconds(dyn.pid), time.perf_counter()
            cmds.put("flat")
            want = base + args.frames * args.pods
            got, t1, c1 = await _until_applied(lambda: _dynamo_stored(http), want, done, args.timeout,
                                               lambda: cpu_seconds(dyn.pid))
            outcomes = await _dynamo_outcomes(http)
        n = got - base
        stored = n * args.stored
        per = (c1 - c0) / stored * 1e6
        return {"outcomes": outcomes, "encoding": "dynamo", "batches": n, "lost": args.frames * args.pods - n, "wall_s": t1 - t0, "blocks_per_s": stored / (t1 - t0),
                "cpu_us_per_block": {"bridges": 0.0, "nats-server": 0.0, "indexer": per, "all": per}}
    finally:
        cmds.put("stop")
        dyn.send_signal(signal.SIGTERM)
        try:
            dyn.wait(10)
        except subprocess.TimeoutExpired:
            dyn.kill()
        pub.join(5)
        if pub.is_alive():
            pub.kill()


async def one_run(encoding: str, args) -> dict:
    import httpx

    if encoding == "dynamo":
        return await dynamo_run(args)
    encoding, _, ref = encoding.partition("@")  # "binary@REF": that git ref's bridges and indexer
    encoding, _, layout = encoding.partition(":")  # "binary:per-pod": this run's bridge layout
    encoding, _, gmax = encoding.partition("/g")  # "binary/g128": this run's --group-max
    layout = layout or args.bridges
    tree = args.trees[ref] if ref else ROOT

    from infernex.embedded_nats import EmbeddedNats, free_port

    tmp = tempfile.mkdtemp(prefix="bench-ingest-")
    server = EmbeddedNats(Path(tmp) / "store")
    server.start()
    procs: list[subprocess.Popen] = []
    pub = None
    try:
        env, ix_port = await bus_and_indexer(server, tmp, procs, tree, args.reserve_blocks)
        ix = procs[-1]
        lag_file = Path(tmp) / "lags.json"
        ports = [free_port() for _ in range(args.pods)]
        cmds, done = mp.Queue(), mp.Queue()
        pub = mp.Process(target=publisher_proc, args=(ports, cmds, done, args))
        pub.start()
        bridges, logs = [], []
        # one bridge process for every pod (as Dynamo's indexer is one process for them all), or one each
        groups = [list(range(len(ports)))] if layout == "one" else [[i] for i in range(len(ports))]
        mports = [free_port() for _ in groups]
        for g, pods_ in enumerate(groups):
            logs.append(Path(tmp) / f"bridge-{g}.log")
            bridges.append(subprocess.Popen(
                [sys.executable, "-m", "infernex.cli", "bridge", "vllm-kv",
                 *[a for i in pods_ for a in ("--endpoint", f"tcp://127.0.0.1:{ports[i]}", "--pod", f"pod-{i}")],
                 "--model", MODEL, "--encoding", "json" if encoding == "json" else "binary",
                 *(["--group-max", "1"] if encoding in ("json", "binary1") else
                   ["--group-max", gmax or str(args.group_max)] if gmax or args.group_max else []),
                 *(["--group-wait", str(args.group_wait)] if args.group_wait is not None else []),
                 "--metrics-port", str(mports[g])],
                env=env, stdout=subprocess.DEVNULL, stderr=open(logs[-1], "w")))
        procs.extend(bridges)
        cmds.put("warm")
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=2) as http:
            for g, mp_ in enumerate(mports):  # every bridge has received frames: its SUB has joined
                i = groups[g][-1]
                while True:
                    try:
                        text = (await http.get(f"http://127.0.0.1:{mp_}/metrics")).text
                        if all(f'infernex_kv_bridge_frames_total{{path="live",pod="pod-{i}"}} 0.0' not in text
                               and f'pod="pod-{i}"' in text for i in groups[g]):
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"bridge pod-{i} never received a frame")
                    await asyncio.sleep(0.1)
        nats_pid = server.proc.pid
        pids = {"bridges": [b.pid for b in bridges], "nats-server": [nats_pid], "indexer": [ix.pid]}

        def cpu() -> dict[str, float]:
            return {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ix_port}", timeout=5) as http:
            await _fill(args, cmds, done, lambda: _metric(http, "infernex_indexer_batches_total"))
            # flat-out
            cmds.put("hold")  # ends the warm-up; its last frames applied before the base is read and the
            await asyncio.sleep(0.5)  # clock started, both before the first flat-out frame
            base = await _metric(http, "infernex_indexer_batches_total")
            spies = _spy(args.profile, pids, encoding) if args.profile else []
            c0, t0 = cpu(), time.perf_counter()
            cmds.put("flat")
            want = base + args.frames * args.pods
            got, t1, c1 = await _until_applied(lambda: _metric(http, "infernex_indexer_batches_total"), want, done,
                                               args.timeout, cpu)
            for spy in spies:
                spy.send_signal(signal.SIGINT)
            for spy in spies:
                spy.wait(30)
            n = got - base
            stored = n * args.stored
            res = {"encoding": encoding, "batches": n, "lost": args.frames * args.pods - n, "wall_s": t1 - t0, "blocks_per_s": stored / (t1 - t0),
                   "cpu_us_per_block": {k: (c1[k] - c0[k]) / stored * 1e6 for k in c0}}
            res["cpu_us_per_block"]["all"] = sum(res["cpu_us_per_block"].values())
            # the work credited was done: the index holds what the engines hold (every pod the same frames)
            pods = (await http.get("/v1/index/pods")).json()["pods"]
            res["held"] = {"index": sum(p["total_blocks"] for p in pods.values()),
                           "engines": args.pods * _workload_resident(args)}
            # paced, with HTTP queries to the indexer meanwhile (a thread: the wait below blocks)
            await asyncio.sleep(1.0)
            t_paced = time.time()
            base = await _metric(http, "infernex_indexer_batches_total")
            idle_stop, idle_lat = threading.Event(), []  # the same queries with nothing ingesting, first
            it = threading.Thread(target=_query_loop, args=(f"http://127.0.0.1:{ix_port}", idle_stop, idle_lat, args),
                                  daemon=True)
            it.start()
            await asyncio.sleep(1.5)
            idle_stop.set()
            it.join(10)
            q_stop, q_lat = threading.Event(), []
            handled0 = [await _metric(http, f'{QUERY_SECONDS}_{k}{{via="http"}}') for k in ("sum", "count")]
            qt = threading.Thread(target=_query_loop, args=(f"http://127.0.0.1:{ix_port}", q_stop, q_lat, args),
                                  daemon=True)
            qt.start()
            cmds.put("paced")
            sent = done.get(timeout=args.seconds * 3 + 60)
            q_stop.set()
            qt.join(10)
            handled1 = [await _metric(http, f'{QUERY_SECONDS}_{k}{{via="http"}}') for k in ("sum", "count")]
            if handled1[1] > handled0[1]:  # the indexer's own time per query (its histogram): the rest is the
                # client, the loopback round trip and waiting for a core
                res["query_handling_us"] = (handled1[0] - handled0[0]) / (handled1[1] - handled0[1]) * 1e6
            deadline = time.monotonic() + 30
            while await _metric(http, "infernex_indexer_batches_total") < base + sent and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        cmds.put("stop")
        ix.send_signal(signal.SIGTERM)
        ix.wait(30)
        lags = sorted(v for t, v in json.loads(lag_file.read_text()) if t >= t_paced)
        warned = sum(1 for log_ in logs for line in open(log_)
                     if "WARNING" in line or "retrying" in line or "lost" in line)
        res["bridge_warnings"] = warned
        res["bridge_processes"] = len(bridges)
        if warned:
            print(f"  ({warned} bridge warnings, e.g. "
                  f"{next(iter(l for log_ in logs for l in open(log_)), '')[:160]!r})",
                  flush=True)
            res["skipped"] = {k: await _metric(http, f'infernex_indexer_anomalies_total{{kind="{k}"}}')
                              for k in ("unknown_parent", "unknown_removed")}
        for key, lat in (("query_ms", q_lat), ("query_idle_ms", idle_lat)):
            if lat:
                q = sorted(lat)
                res[key] = {"n": len(q), "p50": q[len(q) // 2] * 1e3, "p99": q[min(len(q) - 1, int(len(q) * 0.99))] * 1e3}
        if lags:
            res["lag_ms"] = {"n": len(lags), "p50": lags[len(lags) // 2] * 1e3,
                             "p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3, "max": lags[-1] * 1e3}
        return res
    finally:
        stop_procs(procs)
        if pub is not None:
            pub.join(5)
            if pub.is_alive():
                pub.kill()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="driver", choices=["driver", "indexer"])
    ap.add_argument("--url")
    ap.add_argument("--lag-file")
    ap.add_argument("--port", type=int)
    ap.add_argument("--runs", type=int, default=3, help="runs per encoding (interleaved)")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--frames", type=int, default=2000, help="flat-out frames per pod")
    ap.add_argument("--stored", type=int, default=32, help="blocks stored per frame")
    ap.add_argument("--removed", type=int, default=8, help="blocks removed per frame")
    ap.add_argument("--capacity", type=int, default=0,
                    help="blocks each engine's cache holds: filled before the flat-out phase, which then evicts a "
                         "block for each one stored (steady state: the index at its size, no table growing); 0: the "
                         "engines' caches grow through the run")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1000.0, help="paced phase: frames/s in total")
    ap.add_argument("--query-every", type=float, default=0.01, help="paced phase: an HTTP query this often (s)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--reserve-blocks", type=int, default=0,
                    help="the indexer's reserve_blocks (its tables sized for this many blocks up front; 0: they grow, "
                         "each doubling a rehash that stalls the fold)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--profile", help="a folder: py-spy profiles of the bridges and the indexer in the flat-out window")
    ap.add_argument("--encodings", default="json,binary1,binary",
                    help="json, binary1 (binary, a message per batch), binary (grouped: --group-max)")
    ap.add_argument("--group-max", type=int, default=None, help="the bridges' --group-max for 'binary' (default: theirs)")
    ap.add_argument("--bridges", choices=["one", "per-pod"], default="one",
                    help="one bridge process for every pod (the default since session 30; Dynamo's indexer is "
                         "one process too) or one process per pod (before); an encoding given as ENC:one or "
                         "ENC:per-pod runs with that layout, e.g. --encodings binary:per-pod,binary; binary/gN runs with "
                         "--group-max N, e.g. --encodings binary,binary/g128")
    ap.add_argument("--group-wait", type=float, default=None, help="the bridges' --group-wait (default: theirs)")
    ap.add_argument("--before-ref", default=None,
                    help="also run each encoding with the bridges and the indexer of this git ref (extracted with "
                         "git archive), interleaved in the same rounds")
    ap.add_argument("--dynamo-python", default="auto",
                    help="python of a venv with ai-dynamo-runtime (adds Dynamo's standalone indexer to the rounds); "
                         "auto: bench/peers.py's cached venv, created on first use; none: leave Dynamo out")
    args = ap.parse_args()
    if args.role == "indexer":
        indexer_role(args.url, args.lag_file, args.port, args.reserve_blocks)
        return
    from bench.peers import dynamo_python

    args.dynamo_python = dynamo_python(args.dynamo_python)
    encs = args.encodings.split(",")
    args.trees = {}
    if args.before_ref:
        from bench.peers import extract_ref

        tree = args.trees[args.before_ref] = Path(extract_ref(args.before_ref))
        # its kernels compiled once here (numba caches them in that tree), not by four bridges at once
        subprocess.run([sys.executable, "-c", "from streams.kv_index import warm_up; warm_up(); "
                        "from consumers import kv_transcode, kv_wire_compiled; kv_wire_compiled.warm_up(); "
                        "kv_transcode.warm_up()"], env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, check=True)
        encs += [f"{e}@{args.before_ref}" for e in encs]
    if args.dynamo_python:
        out = subprocess.run([args.dynamo_python, "-c", "import importlib.metadata as m; "
                              "print(m.version('ai-dynamo-runtime'))"], capture_output=True, text=True)
        print(f"peer: ai-dynamo-runtime {out.stdout.strip() or '?'} (python -m dynamo.indexer)")
        encs.append("dynamo")
    results: dict[str, list[dict]] = {e: [] for e in encs}
    for r in range(args.runs):
        for e in (encs if r % 2 == 0 else encs[::-1]):
            res = asyncio.run(one_run(e, args))
            results[e].append(res)
            cpu = res["cpu_us_per_block"]
            lag = res.get("lag_ms", {})
            if "held" in res:
                h, sk = res["held"], res.get("skipped", {})
                ok = res["valid"] = h["index"] == h["engines"] and not any(sk.values())
                print(f"  index end state: {h['index']:,} blocks held, the engines {h['engines']:,}; stores with an "
                      f"unknown parent {sk.get('unknown_parent', 0):.0f}, unknown removals "
                      f"{sk.get('unknown_removed', 0):.0f}: {'valid' if ok else 'NOT VALID (the index skipped work)'}")
            if "outcomes" in res:
                bad = {k: v for k, v in res["outcomes"].items() if not k.endswith(":ok")}
                res["valid"] = not bad
                print(f"  dynamo applied events {res['outcomes']}: {'valid' if not bad else 'NOT VALID (rejected events)'}")
            print(f"run {r + 1} {e:6s}: {res['blocks_per_s']:,.0f} stored blocks/s ({res['batches']:.0f} batches, "
                  f"{res['wall_s']:.2f}s, {res['lost']:.0f} frames lost); CPU us/block all {cpu['all']:.2f} (bridges {cpu['bridges']:.2f}, "
                  f"nats {cpu['nats-server']:.2f}, indexer {cpu['indexer']:.2f}); lag at {args.rate:.0f}/s "
                  f"p50 {lag.get('p50', float('nan')):.1f} p99 {lag.get('p99', float('nan')):.1f} "
                  f"max {lag.get('max', float('nan')):.1f} ms; HTTP query p50 "
                  f"{res.get('query_ms', {}).get('p50', float('nan')):.2f} p99 "
                  f"{res.get('query_ms', {}).get('p99', float('nan')):.2f} ms (idle p50 "
                  f"{res.get('query_idle_ms', {}).get('p50', float('nan')):.2f} ms; the indexer's own handling "
                  f"{res.get('query_handling_us', float('nan')):.0f} us a query)", flush=True)
    print("\nmedians:")
    med = {}
    for e, rs in results.items():
        m = {"blocks_per_s": statistics.median(r["blocks_per_s"] for r in rs)}
        for k in ("all", "bridges", "nats-server", "indexer"):
            m[k] = statistics.median(r["cpu_us_per_block"][k] for r in rs)
        m["lag_p99"] = statistics.median(r.get("lag_ms", {}).get("p99", float("nan")) for r in rs)
        m["lag_p50"] = statistics.median(r.get("lag_ms", {}).get("p50", float("nan")) for r in rs)
        m["q_p50"] = statistics.median(r.get("query_ms", {}).get("p50", float("nan")) for r in rs)
        m["q_p99"] = statistics.median(r.get("query_ms", {}).get("p99", float("nan")) for r in rs)
        m["q_idle"] = statistics.median(r.get("query_idle_ms", {}).get("p50", float("nan")) for r in rs)
        m["q_handling"] = statistics.median(r.get("query_handling_us", float("nan")) for r in rs)
        med[e] = m
        print(f"  {e:6s}: {m['blocks_per_s']:,.0f} blocks/s; CPU us/block all {m['all']:.2f} (bridges "
              f"{m['bridges']:.2f}, nats {m['nats-server']:.2f}, indexer {m['indexer']:.2f}); lag p50 "
              f"{m['lag_p50']:.1f} ms p99 {m['lag_p99']:.1f} ms; HTTP query while paced p50 {m['q_p50']:.2f} ms "
              f"p99 {m['q_p99']:.2f} ms (idle p50 {m['q_idle']:.2f} ms; handling {m['q_handling']:.0f} us)")
    invalid = [f"{e} run {i + 1}" for e, rs in results.items() for i, r in enumerate(rs) if not r.get("valid", True)]
    if invalid:
        print(f"  NOT VALID: in {', '.join(invalid)} an index skipped events or held other blocks than the engines; "
              f"the figures above do not measure the work they name")
    for e in [x for x in med if x != "dynamo"] if "dynamo" in med else []:
        d, b = med["dynamo"], med[e]
        print(f"  {e} / dynamo: blocks/s {b['blocks_per_s'] / d['blocks_per_s']:.2f}x; CPU per block "
              f"{b['all'] / d['all']:.2f}x")
    if "binary1" in med and "binary" in med:
        j, b = med["binary1"], med["binary"]
        print(f"  binary (grouped) / binary1: blocks/s {b['blocks_per_s'] / j['blocks_per_s']:.2f}x; CPU per block "
              f"{b['all'] / j['all']:.2f}x (bridges {b['bridges'] / j['bridges']:.2f}x, nats "
              f"{b['nats-server'] / j['nats-server']:.2f}x, indexer {b['indexer'] / j['indexer']:.2f}x)")
    if "json" in med and "binary" in med:
        j, b = med["json"], med["binary"]
        print(f"  binary / json: blocks/s {b['blocks_per_s'] / j['blocks_per_s']:.2f}x; CPU per block "
              f"{b['all'] / j['all']:.2f}x (bridges {b['bridges'] / j['bridges']:.2f}x, indexer "
              f"{b['indexer'] / j['indexer']:.2f}x)")


if __name__ == "__main__":
    main()
