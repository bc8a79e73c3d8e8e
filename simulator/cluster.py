"""Several simulated engines in one process, for ``infernex sim``, tests and the demo.

``SimCluster(specs).start()`` runs the engines on an asyncio loop in a background thread and
returns handles with ``.url``, ``.kv_endpoint``, ``.replay_endpoint``, ``.core`` and ``.stop()``.
Engines of one cluster find each other for PD transfers through the cluster's own peer map.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from simulator.config import EngineConfig, FaultConfig
from simulator.engine_core import EngineCore
from simulator.server import SimEngine

T = TypeVar("T")


@dataclass(frozen=True)
class EngineSpec:
    """Where one engine listens. Port 0 (or ``None`` for the ZMQ ports) picks a free port."""

    config: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int | None = None
    replay_port: int | None = None
    kv_events: bool = True


def specs_for(n: int, base: EngineConfig, *, base_port: int = 0, kv_port_base: int | None = None,
              host: str = "127.0.0.1", roles: list[str] | None = None) -> list[EngineSpec]:
    """``n`` engines ``<prefix>-0..n-1`` on consecutive ports (replay port = KV port + 1)."""
    out = []
    for i in range(n):
        cfg = base.model_copy(update={"engine_id": f"{base.engine_id.rsplit('-', 1)[0]}-{i}"})
        if roles:
            cfg = EngineConfig.model_validate({**cfg.model_dump(), "role": roles[i % len(roles)]})
        out.append(EngineSpec(
            cfg, host=host, port=base_port + i if base_port else 0,
            kv_port=kv_port_base + 2 * i if kv_port_base else None,
            replay_port=kv_port_base + 2 * i + 1 if kv_port_base else None,
        ))
    return out


async def start_engines(specs: Iterable[EngineSpec], *, time_scale: float = 1.0,
                        peers: dict[str, SimEngine] | None = None, kv_array_like: bool = False) -> list[SimEngine]:
    peers = {} if peers is None else peers
    engines: list[SimEngine] = []
    try:
        for s in specs:
            if s.config.engine_id in peers:
                raise ValueError(f"duplicate engine id {s.config.engine_id!r}")
            kv = f"tcp://{s.host}:{s.kv_port if s.kv_port is not None else 0}" if s.kv_events else None
            replay = f"tcp://{s.host}:{s.replay_port if s.replay_port is not None else 0}" if s.kv_events else None
            eng = SimEngine(s.config, host=s.host, port=s.port, kv_endpoint=kv, replay_endpoint=replay,
                            time_scale=time_scale, peers=peers, kv_array_like=kv_array_like)
            engines.append(eng)
            await eng.start()
    except BaseException:
        for e in engines:
            await e.stop()
        raise
    return engines


class EngineHandle:
    """Thread-safe handle on an engine that runs in the cluster's loop."""

    def __init__(self, cluster: "SimCluster", engine: SimEngine):
        self._cluster = cluster
        self.engine = engine

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def kv_endpoint(self) -> str | None:
        return self.engine.kv_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.engine.replay_endpoint

    @property
    def core(self) -> EngineCore:
        """The live core; read it through :meth:`call` while the engine runs."""
        return self.engine.core

    def call(self, fn: Callable[[SimEngine], T]) -> T:
        """Run ``fn(engine)`` on the cluster's loop thread and return its result."""
        async def run() -> T:
            return fn(self.engine)
        return self._cluster.run(run())

    def cached_block_hashes(self) -> set[int]:
        return self.call(lambda e: e.core.cached_block_hashes())

    def set_faults(self, **changes: Any) -> FaultConfig:
        faults = FaultConfig.model_validate({**self.engine.faults.model_dump(), **changes})
        self._cluster.run(self.engine.set_faults(faults))
        return faults

    def restart(self) -> None:
        """Engine restart: cache and requests gone, KV-event sequence back to 0."""
        self.call(lambda e: e.restart())

    def drop_kv_batches(self, n: int) -> None:
        """The next ``n`` KV-event frames are lost on the way (still replayable)."""
        self.call(lambda e: e.drop_kv_batches(n))

    def stop(self) -> None:
        self._cluster.run(self.engine.stop())


class SimCluster:
    """Engines on a private event loop in a daemon thread."""

    def __init__(self, specs: Iterable[EngineSpec], *, time_scale: float = 1.0, kv_array_like: bool = False):
        self.specs = list(specs)
        self.time_scale = time_scale
        self.kv_array_like = kv_array_like
        self.peers: dict[str, SimEngine] = {}
        self.engines: list[EngineHandle] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> "SimCluster":
        loop = asyncio.new_event_loop()
        self._loop = loop
        ready = threading.Event()

        def runner() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._thread = threading.Thread(target=runner, name="sim-cluster", daemon=True)
        self._thread.start()
        ready.wait(timeout)
        try:
            engines = self.run(start_engines(self.specs, time_scale=self.time_scale, peers=self.peers,
                                             kv_array_like=self.kv_array_like), timeout)
        except BaseException:
            self._shutdown_loop()
            raise
        self.engines = [EngineHandle(self, e) for e in engines]
        return self

    def run(self, coro, timeout: float | None = 30.0):  # noqa: ANN001
        if self._loop is None:
            raise RuntimeError("cluster is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def add_engine(self, config: EngineConfig, host: str = "127.0.0.1") -> EngineHandle:
        """Start one more engine at run time (call on the cluster's loop, e.g. from simulator.control)."""
        [eng] = await start_engines([EngineSpec(config, host=host, kv_events=False)], time_scale=self.time_scale,
                                    peers=self.peers, kv_array_like=self.kv_array_like)
        h = EngineHandle(self, eng)
        self.engines.append(h)
        return h

    async def remove_engine(self, engine_id: str, drain_s: float = 30.0) -> bool:
        """Stop an engine at run time: it leaves the peer map and stops taking requests, the ones
        running finish (up to ``drain_s`` real seconds), then it stops."""
        h = next((h for h in self.engines if h.engine_id == engine_id), None)
        if h is None:
            return False
        self.engines.remove(h)
        await h.engine.drain(drain_s)
        await h.engine.stop()
        return True

    def __getitem__(self, i: int) -> EngineHandle:
        return self.engines[i]

    def __len__(self) -> int:
        return len(self.engines)

    def stop(self) -> None:
        if self._loop is None:
            return
        for h in self.engines:
            try:
                self.run(h.engine.stop())
            except Exception:  # noqa: BLE001 - keep stopping the others
                pass
        self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()
        self._loop = None

    def __enter__(self) -> "SimCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
