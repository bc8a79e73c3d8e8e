"""The chaos suite's rig: simulated engines with a known cache, bridges, an indexer and a router's
embedded KV index on real nats-server processes, and the ground-truth comparison.

An engine is a :class:`simulator.engine_core.EngineCore` (a real prefix cache that evicts) whose
KV events go out in vLLM's wire format on a ZMQ socket (:class:`simulator.kv_publisher.KvEventPublisher`);
``cached_block_hashes()`` is what it really holds. A :class:`consumers.kv_bridge.KvBridge` per
engine publishes to JetStream; the indexer and the router's feed fold the stream. The run ends
by comparing every index with every engine's cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.kv_bridge import BridgeConfig, KvBridge
from schemas import subjects as S
from schemas.config import NatsConfig
from schemas.kv import BlockStored
from simulator.config import EngineConfig
from simulator.engine_core import EngineCore
from simulator.kv_publisher import KvEventPublisher
from streams.kv_index import KvIndex
from streams.topology import stream_for_subject

MODEL = "chaos-model"
BS = 4


class SimEngine:
    """One engine: requests sharing prefixes run through a small cache (so blocks are evicted),
    every scheduler step's KV events published on its ZMQ socket."""

    def __init__(self, pod: str, seed: int, num_blocks: int = 40):
        self.pod = pod
        self.core = EngineCore(EngineConfig(engine_id=pod, served_model_name=MODEL, block_size=BS,
                                            num_gpu_blocks=num_blocks, max_model_len=128, max_num_seqs=4))
        self.pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=200_000)
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(100, 20_000) for _ in range(BS * self.rng.randint(2, 5))]
                         for _ in range(10)]
        self.now = 0.0
        self.n = 0
        self.batches = 0

    def serve(self, requests: int = 2) -> None:
        """Run a few requests to completion, publishing each step's events."""
        rng = self.rng
        for _ in range(requests):
            prompt = rng.choice(self.prefixes) + [rng.randrange(100, 20_000) for _ in range(rng.randint(1, 2 * BS))]
            self.core.add_request(f"{self.pod}-{self.n}", prompt, max_tokens=2, arrival_time=self.now)
            self.n += 1
        for _ in range(1000):
            if not self.core.has_work:
                break
            res = self.core.step(self.now)
            self.now = max(self.now + 1e-3, res.end)
            if res.events:
                self.pub.publish(res.events)
                self.batches += 1
        left = self.core.take_pending_events()
        if left:
            self.pub.publish(left)
            self.batches += 1

    def truth(self) -> set[int]:
        return self.core.cached_block_hashes()

    def close(self) -> None:
        self.pub.close()


def index_blocks(index: KvIndex) -> dict[str, set[int]]:
    """The engine hashes an index holds, per pod (from its dump)."""
    out: dict[str, set[int]] = {}
    for b in index.dump():
        s = out.setdefault(b.pod, set())
        for e in b.events:
            if isinstance(e, BlockStored):
                s.update(int(h) for h in e.block_hashes)
    return out


def _warm_bridge_kernels() -> None:
    from consumers import kv_transcode, kv_wire_compiled

    kv_wire_compiled.warm_up()
    kv_transcode.warm_up()


def compare(index: KvIndex, engines: list[SimEngine]) -> list[str]:
    """What differs between the index and the engines' caches (empty when equal)."""
    have = index_blocks(index)
    diffs = []
    for e in engines:
        want, got = e.truth(), have.get(e.pod, set())
        if want != got:
            diffs.append(f"{e.pod}: {len(want - got)} blocks missing, {len(got - want)} extra "
                         f"(engine {len(want)}, index {len(got)})")
    return diffs


@dataclass
class Rig:
    """Engines + bridges on one NATS deployment; the consumers are added by each test."""

    nats: NatsConfig
    pods: tuple[str, ...] = ("e0", "e1", "e2")
    engines: list[SimEngine] = field(default_factory=list)
    bridges: list[KvBridge] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _clients: list = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _load_stop: asyncio.Event = field(default_factory=asyncio.Event)
    load_task: asyncio.Task | None = None

    async def start_bridges(self, topology, *, ack_timeout_s: float = 2.0) -> None:
        # a bridge is ready once its numba kernels are compiled: on a fresh install that took the
        # transcoder 36 s on a busy 2-core machine (one CI run timed out here), so compile them first,
        # off the loop, and bound the bridges' own start below
        await asyncio.to_thread(_warm_bridge_kernels)
        for i, pod in enumerate(self.pods):
            eng = SimEngine(pod, seed=100 + i)
            self.engines.append(eng)
            nc = await bus.connect(self.nats, name=f"bridge-{pod}")
            self._clients.append(nc)
            subject = S.with_prefix(self.nats.subject_prefix, S.kv_events(MODEL, pod))
            cfg = BridgeConfig(endpoint=eng.pub.endpoint, replay_endpoint=eng.pub.replay_endpoint, pod=pod,
                               model=MODEL, ack_timeout_s=ack_timeout_s, max_inflight=64, heartbeat_s=0)
            br = KvBridge(cfg, nc, subject_prefix=self.nats.subject_prefix, registry=CollectorRegistry(),
                          stream=stream_for_subject(topology, subject).name)
            self.bridges.append(br)
            task = asyncio.create_task(br.run(self._stop), name=f"bridge-{pod}")
            self._tasks.append(task)
            ready = asyncio.create_task(br.ready.wait())
            done, _ = await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            if task in done:  # the bridge stopped before it was ready: its own error, not a timeout
                ready.cancel()
                task.result()
                raise AssertionError(f"bridge {pod} stopped before it was ready")
            assert ready in done, f"bridge {pod} not ready within 30 s"
        # PUB/SUB joins asynchronously: serve until every bridge has seen a frame
        deadline = time.monotonic() + 20
        while any(b.stats.frames == 0 for b in self.bridges):
            assert time.monotonic() < deadline, "a bridge never received a frame"
            for e in self.engines:
                e.serve(1)
            await asyncio.sleep(0.05)

    def start_load(self, every_s: float = 0.01, requests: int = 1) -> None:
        async def load() -> None:
            while not self._load_stop.is_set():
                for e in self.engines:
                    e.serve(requests)
                await asyncio.sleep(every_s)

        self._load_stop.clear()
        self.load_task = asyncio.create_task(load(), name="chaos-load")

    async def stop_load(self) -> None:
        self._load_stop.set()
        if self.load_task is not None:
            await self.load_task
            self.load_task = None

    def published_all(self) -> bool:
        return all(b.stats.published >= e.batches for b, e in zip(self.bridges, self.engines))

    async def close(self) -> None:
        await self.stop_load()
        self._stop.set()
        for t in self._tasks:
            await bus.cancel_task(t, timeout=10)
        for nc in self._clients:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:  # noqa: BLE001 - the server may be gone
                pass
        for e in self.engines:
            e.close()


def record(fault: str, survived: bool, lost: int, recovery_s: float, **extra) -> None:
    """Append one chaos figure to ``$INFERNEX_CHAOS_RESULTS`` (JSON lines) when set (bench/chaos.py)."""
    import json
    import os

    path = os.environ.get("INFERNEX_CHAOS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, "survived": survived, "lost": lost,
                                "recovery_s": round(recovery_s, 2), **extra}) + "\n")


async def until(cond, timeout: float, what: str, every: float = 0.1) -> float:
    """Wait until ``cond()`` (sync or async) is true; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(every)


class NatsCluster:
    """``n`` nats-server processes forming one JetStream cluster on loopback, each with its own
    store directory; a node can be SIGKILLed and restarted on the same ports and store."""

    def __init__(self, root, n: int = 3):
        from pathlib import Path

        from infernex.embedded_nats import find_nats_server, free_port

        self.binary = str(find_nats_server())
        self.root = Path(root)
        self.n = n
        self.ports = [free_port() for _ in range(n)]
        self.cports = [free_port() for _ in range(n)]
        self.procs: list = [None] * n

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    def name(self, i: int) -> str:
        return f"n{i}"

    def start(self, i: int) -> None:
        import subprocess

        d = self.root / self.name(i)
        d.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.cports) if j != i)
        (d / "nats.conf").write_text(
            f"server_name: {self.name(i)}\nlisten: 127.0.0.1:{self.ports[i]}\n"
            f"jetstream {{ store_dir: {d / 'js'} }}\n"
            f"cluster {{ name: chaos, listen: 127.0.0.1:{self.cports[i]}, routes: [{routes}] }}\n")
        log = open(d / "server.log", "ab")
        self.procs[i] = subprocess.Popen([self.binary, "-c", str(d / "nats.conf")], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)

    def start_all(self) -> None:
        for i in range(self.n):
            self.start(i)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[i] = None

    def index_of(self, server_name: str) -> int:
        return int(server_name.lstrip("n"))

    def stop_all(self) -> None:
        for i in range(self.n):
            self.kill(i)
