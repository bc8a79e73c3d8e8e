"""Chaos (c): SIGKILL the indexer process twice under load. Simulated engines -> bridges ->
JetStream -> an indexer subprocess (killed, restarted from its snapshot); at the end its index
equals the engines' caches (through a router's embedded index that is checked against them)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client import CollectorRegistry

from chaos_tools import Rig, compare, record, until
from infernex.embedded_nats import free_port
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from streams.clock import SystemClock
from streams.kv_index import KvIndex


def _start(env, port):
    return subprocess.Popen(
        [sys.executable, "-m", "infernex.cli", "indexer", "--http-port", str(port), "--durable", "chaos-c",
         "--snapshot-every-events", "150"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_sigkill_the_indexer_twice_under_load(nats_config, nc, prefix, topology):
    port = free_port()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_config.servers[0], INFERNEX_NATS__SUBJECT_PREFIX=prefix,
               INFERNEX_LOG_LEVEL="WARNING")
    rig = Rig(nats_config)
    router_index = KvIndex(SystemClock())
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=router_index,
                     registry=CollectorRegistry())
    procs = []
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5)

    async def health():
        try:
            return (await http.get("/health")).json()
        except (httpx.HTTPError, ValueError):
            return None

    try:
        await rig.start_bridges(topology)
        await feeds.start()
        procs.append(_start(env, port))
        await until(health, 60, "the indexer up")
        rig.start_load(every_s=0.005)
        restored = []
        for _ in range(2):
            await until(lambda: _progress(health), 30, "the indexer applying batches")
            await asyncio.sleep(1.5)
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(10)
            await asyncio.sleep(0.5)  # load goes on while it is down
            procs.append(_start(env, port))
            await until(health, 60, "the indexer back")
            restored.append((await health())["restored_seq"])
        restarted = time.monotonic()
        await asyncio.sleep(1.0)
        await rig.stop_load()
        await until(lambda: rig.published_all() and not compare(router_index, rig.engines), 60,
                    "the router's index to equal the engines")

        async def equal():
            h = await health()
            if h is None:
                return False
            st = (await http.get("/v1/index/state")).json()
            return st["fingerprint"] == router_index.fingerprint()

        await until(equal, 60, "the restarted indexer to equal the engines' caches")
        recovered = time.monotonic() - restarted
        assert all(s > 0 for s in restored), f"restarts did not resume from a snapshot: {restored}"
        h = await health()
        info = await nc.jetstream().stream_info(f"{prefix.upper()}_KV_EVENTS")
        assert h["applied_seq"] == info.state.last_seq  # not stuck
        pods = (await http.get("/v1/index/pods")).json()["pods"]
        for e in rig.engines:  # nothing applied twice or lost: block counts are the engines' own
            assert pods[e.pod]["total_blocks"] == len(e.truth())
        record("SIGKILL the indexer x2 under load", True, 0, recovered,
               batches=sum(e.batches for e in rig.engines), restored_from_seq=restored)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        await http.aclose()
        await rig.close()
        await feeds.stop()


_last_seen: dict[str, int] = {}


async def _progress(health) -> bool:
    h = await health()
    if h is None:
        return False
    prev = _last_seen.get("seq", -1)
    _last_seen["seq"] = h["applied_seq"]
    return prev >= 0 and h["applied_seq"] > prev + 50
