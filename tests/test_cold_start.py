"""A router, an indexer or a KV bridge that has started compiles nothing more on its first events or requests.

The KV index, the KV feed's readers and the tokenizer run numba kernels. On a fresh install (a new
container, no numba cache on disk) compiling one takes seconds; a kernel first compiled by a KV
message or a request does it on the event loop while the router serves. The conversation-trace bench
showed what that costs: a router started on a fresh install spent its first round compiling the KV
feed's group reader (11 s on a 2-core machine), its event loop 66 ms late on average, TTFT p50 4.5 s
against 0.09 s once warm (bench/RESULTS.md, session 28).

Ground truth here: a router in its own process (numba's dispatchers new, as in a fresh pod; kernels
may load from the on-disk cache, which counts as compiling: both add a signature), started on a real
JetStream with a kv-aware strategy and a ``tokenizer.json``. After ``start()`` returns, long
prompts are routed over HTTP to an engine (their routes are predictions in the index), the
bridge's group messages are folded by its KV feed (through the columns reader, checked), and more
prompts are routed; every numba dispatcher of the project's modules must have the
signatures it had when ``start()`` returned. The indexer the same way: started, it reads the
bridge's group messages, answers token-id queries over HTTP, records routes (predictions) that the
next messages confirm, and writes a snapshot in process; nothing compiles after ``start()``. A KV
bridge, once ready, takes every frame shape vLLM 0.11, 0.22 and 0.33 encoded (tests/fixtures/vllm),
grouped and one at a time: the frames its transcoder leaves go through the Python decoder and the
digest kernel, which compiled on the first such frame before it was warmed at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from consumers import index_columns

pytestmark = pytest.mark.skipif(not index_columns.AVAILABLE, reason="needs numba")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

_CHILD = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[4])
import aiohttp
from numba.core.dispatcher import Dispatcher
from router import feeds
from router.app import RouterApp
from router.config import RouterConfig
from router.testing import FakeEngine, wait_for
from schemas import EngineAnnouncement, kv_binary
from schemas import subjects as S
from schemas.config import NatsConfig
from consumers import bus
from consumers.index_codec import fold_group
from test_index_columns import _bridge_groups

PROJECT = ("streams", "consumers", "router", "schemas", "simulator", "infernex")


def signatures():
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] not in PROJECT or mod is None:
            continue
        for attr, v in list(vars(mod).items()):
            if isinstance(v, Dispatcher):
                out[f"{name}.{attr}"] = len(v.signatures)
    return out


async def ask(url, which):
    words = ("the cache of every engine holds blocks the router reads before it picks one "
             "and a long document shared by many questions comes first").split()
    async with aiohttp.ClientSession() as s:
        for i in which:
            prompt = " ".join(words[(i + j) % len(words)] for j in range(900)) + f" question {i}?"
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()


async def main():
    url, prefix, tok = sys.argv[1:4]
    groups = _bridge_groups(5, frames=64, per_group=16)  # (made before the router's start: the
    # transcoder compiles its own kernels, which a router never runs)
    sizes = [len(fold_group(g)) for g in groups]
    eng = await FakeEngine("pod-a").start()
    nats = NatsConfig(servers=[url], subject_prefix=prefix, connect_timeout_s=3)
    app = RouterApp(RouterConfig(strategy="kv-aware", tokenizer=tok, seed=1), nats)
    rurl = await app.start("127.0.0.1", 0)
    before = signatures()
    taken = []
    fold_group_, fold_batch_, wire_run = feeds._folds()  # (the feed's readers)

    def counting(data, decode):
        run = wire_run(data, decode)
        taken.append(run is not None)
        return run

    feeds._FOLDS = (fold_group_, fold_batch_, counting)
    nc = await bus.connect(nats)
    js = nc.jetstream()
    await bus.publish(js, S.with_prefix(prefix, S.engine_announce("pod-a")),
                      EngineAnnouncement(pod="pod-a", url=eng.url, model="m", ts=time.time()).to_json())
    assert await wait_for(lambda: len(app.state.snapshot()) == 1, timeout=15)
    await ask(rurl, range(4))  # routed first: their predictions are in the index when the events come
    seq = 0
    for g, n in zip(groups, sizes):
        await js.publish(S.with_prefix(prefix, S.kv_events("m", "pod-a")), g,
                         headers=kv_binary.group_headers("pod-a", "m", 0, seq, seq + n - 1, n))
        seq += n
    assert await wait_for(lambda: len(taken) == len(groups), timeout=30), taken
    assert await wait_for(lambda: sum(app.index.pods()["pod-a"].blocks.values()) > 0, timeout=10)
    await ask(rurl, range(4, 8))
    after = signatures()
    await nc.close()
    await app.stop(drain=True)
    await eng.stop()
    new = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    print(json.dumps({"new": new, "columns": sum(taken), "groups": len(groups),
                      "blocks": sum(app.index.pods()["pod-a"].blocks.values()), "served": len(eng.requests)}))


asyncio.run(main())
"""


def _child(code: str, nats_config, prefix: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    out = subprocess.run([sys.executable, "-c", code, nats_config.servers[0], prefix,
                          str(TESTS / "fixtures" / "tokenize"), str(TESTS)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


async def test_first_kv_events_and_requests_compile_nothing(nats_config, topology, prefix):
    got = _child(_CHILD, nats_config, prefix)
    # the work was done: every group read in columns, blocks held, the requests served
    assert got["columns"] == got["groups"] > 0
    assert got["blocks"] > 0 and got["served"] == 8
    assert got["new"] == {}, f"compiled after the router said it had started: {got['new']}"


_INDEXER_CHILD = _CHILD.split("async def ask(")[0] + r"""
import httpx
from consumers.indexer import IndexerConfig, IndexerService


async def main():
    url, prefix = sys.argv[1:3]
    groups = _bridge_groups(7, frames=96, per_group=16)
    sizes = [len(fold_group(g)) for g in groups]
    nats = NatsConfig(servers=[url], subject_prefix=prefix, connect_timeout_s=3)
    svc = IndexerService(IndexerConfig(http_port=0, durable="ix-cold", snapshot_fork=False,
                                       snapshot_every_events=10**9), nats)
    await svc.start()
    before = signatures()
    nc = await bus.connect(nats)
    js = nc.jetstream()
    subject = S.with_prefix(prefix, S.kv_events("m", "pod-a"))
    seq = 0

    async def publish(which):
        nonlocal seq
        for g, n in which:
            await js.publish(subject, g, headers=kv_binary.group_headers("pod-a", "m", 0, seq, seq + n - 1, n))
            seq += n
        last = (await js.stream_info(svc.stream)).state.last_seq
        assert await wait_for(lambda: svc.applied_seq >= last, timeout=30)

    pairs = list(zip(groups, sizes))
    await publish(pairs[:3])
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{svc.http_port}", timeout=10) as http:
        toks = list(range(1, 16 * 8 + 1))
        r = await http.post("/v1/index/query", json={"model": "m", "token_ids": toks})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/index/route", json={"model": "m", "pod": "pod-a", "token_ids": toks})
        assert r.status_code == 200, r.text
        await publish(pairs[3:])  # (the pod's events while it has predictions: confirmed)
        r = await http.post("/v1/index/query", json={"model": "m", "token_ids": toks})
        assert r.status_code == 200, r.text
    await svc.snapshot()
    after = signatures()
    blocks = len(svc.index)
    await nc.close()
    await svc.stop()
    new = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    print(json.dumps({"new": new, "blocks": blocks, "snapshots": svc.snapshot_seq}))


asyncio.run(main())
"""


async def test_an_indexer_compiles_nothing_after_start(nats_config, topology, prefix):
    got = _child(_INDEXER_CHILD, nats_config, prefix)
    assert got["blocks"] > 0 and got["snapshots"] > 0
    assert got["new"] == {}, f"compiled after the indexer said it had started: {got['new']}"


_BRIDGE_CHILD = _CHILD.split("async def ask(")[0] + r"""
import zmq
from consumers.kv_bridge import BridgeConfig, KvBridge
from fixtures import vllm as fx


async def main():
    url, prefix = sys.argv[1:3]
    frames = [f.payload for f in fx.all_frames()]  # every shape vLLM 0.11, 0.22 and 0.33 encoded
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    nats = NatsConfig(servers=[url], subject_prefix=prefix, connect_timeout_s=3)
    nc = await bus.connect(nats)
    bridge = KvBridge(BridgeConfig(endpoint=f"tcp://127.0.0.1:{port}", pod="pod-a", model="m", backfill=False), nc,
                      subject_prefix=prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 60)
    await asyncio.sleep(0.3)  # (the SUB socket's subscription reaches the PUB)
    before = signatures()
    for rnd in range(3):  # groups of frames, and frames one at a time
        for i, f in enumerate(frames):
            seq = rnd * len(frames) + i
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), f])
            if rnd:
                await asyncio.sleep(0.003)
    s = bridge.stats
    assert await wait_for(lambda: s.frames + s.dead_letters >= 3 * len(frames), timeout=30), vars(s)
    await bridge.flush()
    assert await wait_for(lambda: bridge.publisher.queue.qsize() == 0, timeout=30)
    after = signatures()
    stop.set()
    await task
    await nc.close()
    pub.close(0)
    new = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    print(json.dumps({"new": new, "frames": s.frames, "dead": s.dead_letters, "published": s.published,
                      "sent": 3 * len(frames)}))


asyncio.run(main())
"""


async def test_a_kv_bridge_compiles_nothing_after_it_is_ready(nats_config, topology, prefix):
    got = _child(_BRIDGE_CHILD, nats_config, prefix)
    assert got["frames"] > 0 and got["published"] > 0
    assert got["new"] == {}, f"compiled after the bridge said it was ready: {got['new']}"
