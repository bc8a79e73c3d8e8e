"""``infernex bridge vllm-kv`` runs as a real process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import httpx
import pytest

from infernex.embedded_nats import free_port
from schemas import KvEventBatch
from schemas import subjects as S
from simulator.kv_publisher import KvEventPublisher, block_stored
from streams.topology import stream_for_subject

from proctools import INFERNEX
from proctools import stop_process as _stop


async def test_cli_bridge_publishes_batches(nats_server, prefix, nc, topology):
    pub = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    metrics_port = free_port()
    env = {**os.environ, "INFERNEX_NATS__SERVERS": nats_server.url, "INFERNEX_NATS__SUBJECT_PREFIX": prefix}
    proc = subprocess.Popen([INFERNEX, "bridge", "vllm-kv", "--endpoint", pub.endpoint, "--replay-endpoint",
                             pub.replay_endpoint, "--pod", "cli-pod", "--model", "m1", "--metrics-port",
                             str(metrics_port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    subject = S.with_prefix(prefix, S.kv_events("m1", "cli-pod"))
    stream = stream_for_subject(topology, subject).name
    js = nc.jetstream()
    try:
        deadline = time.monotonic() + 40
        stored = 0
        while stored < 5:
            assert proc.poll() is None, _stop(proc)
            assert time.monotonic() < deadline, "bridge process published nothing"
            pub.publish([block_stored([pub.next_seq + 1], None, [1, 2], 2)])
            await asyncio.sleep(0.2)
            info = await js.stream_info(stream)
            stored = info.state.messages
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)).text
        assert 'infernex_kv_bridge_frames_total{path="live",pod="cli-pod"}' in text
    finally:
        out = _stop(proc)
        pub.close()
    assert "bridge cli-pod stopped" in out
    last = KvEventBatch.all_from_bytes((await js.get_last_msg(stream, subject)).data)[-1]
    assert last.pod == "cli-pod" and last.model == "m1" and last.epoch == 0


async def test_one_bridge_process_serves_several_engines(nats_server, prefix, nc, topology):
    """Two engines (e.g. a pod's data-parallel ranks) bridged by one process: each engine's batches
    reach its own subject whole and in order, with its own sequence; metrics and readiness per pod."""
    pubs = {p: KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for p in ("dp0", "dp1")}
    metrics_port = free_port()
    env = {**os.environ, "INFERNEX_NATS__SERVERS": nats_server.url, "INFERNEX_NATS__SUBJECT_PREFIX": prefix}
    args = [INFERNEX, "bridge", "vllm-kv", "--model", "m1", "--metrics-port", str(metrics_port)]
    for i, (pod, pub) in enumerate(pubs.items()):
        args += ["--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--pod", pod,
                 "--dp-rank", str(i)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    subjects = {p: S.with_prefix(prefix, S.kv_events("m1", p)) for p in pubs}
    stream = stream_for_subject(topology, subjects["dp0"]).name
    js = nc.jetstream()
    sent: dict[str, list[list[int]]] = {p: [] for p in pubs}  # each engine's stored blocks, frame by frame
    try:
        deadline = time.monotonic() + 40
        k = 0
        while True:  # a frame from each engine every 0.1 s until both subjects hold the last one sent
            assert proc.poll() is None, _stop(proc)
            assert time.monotonic() < deadline, "the bridge process did not publish every engine's frames"
            for j, (pod, pub) in enumerate(pubs.items()):
                hashes = [1000 * (j + 1) + 2 * k, 1000 * (j + 1) + 2 * k + 1]
                pub.publish([block_stored(hashes, None, list(range(32)), 16)])
                sent[pod].append(hashes)
            k += 1
            await asyncio.sleep(0.1)
            last = {}
            for pod, subject in subjects.items():
                try:
                    last[pod] = KvEventBatch.all_from_bytes((await js.get_last_msg(stream, subject)).data)[-1].seq
                except Exception:  # noqa: BLE001 - nothing stored for it yet
                    last[pod] = None
            if k >= 5 and all(last[p] == pubs[p].next_seq - 1 for p in pubs):
                break
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)).text
            ready = (await c.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=5)).json()
        for pod in pubs:
            assert f'infernex_kv_bridge_frames_total{{path="live",pod="{pod}"}}' in text
        assert {"nats", "kv_frames:dp0", "kv_frames:dp1"} <= set(ready["checks"])
    finally:
        out = _stop(proc)
        for pub in pubs.values():
            pub.close()
    assert "bridge dp0 stopped" in out and "bridge dp1 stopped" in out
    # ground truth: each subject holds exactly its engine's frames, in order, nothing of the other's
    sub = await js.subscribe(f"{prefix}.>" if prefix else ">", stream=stream, ordered_consumer=True)
    seen: dict[str, list] = {p: [] for p in pubs}
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # noqa: BLE001 - nats' timeout: the stream is read
                break
            for b in KvEventBatch.all_from_bytes(msg.data):
                pod = next(p for p, s in subjects.items() if s == msg.subject)
                assert b.pod == pod
                seen[pod].append(b)
    finally:
        await sub.unsubscribe()
    for pod in pubs:
        batches = seen[pod]
        assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
        stored = [e.block_hashes for b in batches for e in b.events if e.type == "stored"]
        assert stored == sent[pod]


def test_bridge_cli_pairs_each_endpoint_with_its_pod():
    from typer.testing import CliRunner

    from infernex.cli import app

    base = ["bridge", "vllm-kv", "--endpoint", "tcp://127.0.0.1:1", "--endpoint", "tcp://127.0.0.1:2", "--model", "m"]
    r = CliRunner().invoke(app, base + ["--pod", "a"])
    assert r.exit_code == 2 and "one --pod per --endpoint (2 endpoints, 1 --pod)" in r.output
    r = CliRunner().invoke(app, base + ["--pod", "a", "--pod", "a"])
    assert r.exit_code == 2 and "its own --pod name" in r.output
    r = CliRunner().invoke(app, base + ["--pod", "a", "--pod", "b", "--replay-endpoint", "tcp://127.0.0.1:3"])
    assert r.exit_code == 2 and "one --replay-endpoint per --endpoint" in r.output


async def test_a_failing_engine_bridge_stops_the_process_and_hands_over_the_others(nats_config, nc, prefix, topology,
                                                                                   monkeypatch):
    """One engine's bridge failing ends run_bridges with its error (the container restarts, not a
    process bridging half the ranks quietly); the other engine's bridge stops too, after publishing
    what it had read."""
    from consumers import kv_bridge
    from consumers.kv_bridge import BridgeConfig, run_bridges

    good = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    real_run = kv_bridge.KvBridge.run
    started = asyncio.Event()

    async def run(self, stop):
        if self.cfg.pod == "bad":
            await started.wait()  # (the good one is reading by then)
            await asyncio.sleep(0.3)
            raise RuntimeError("engine socket broke")
        started.set()
        return await real_run(self, stop)

    monkeypatch.setattr(kv_bridge.KvBridge, "run", run)
    cfgs = [BridgeConfig(endpoint=good.endpoint, replay_endpoint=good.replay_endpoint, pod="good", model="m1"),
            BridgeConfig(endpoint="tcp://127.0.0.1:1", pod="bad", model="m1", recover=False)]
    task = asyncio.create_task(run_bridges(cfgs, nats_config))
    try:
        await asyncio.wait_for(started.wait(), 20)
        for k in range(5):
            good.publish([block_stored([7000 + k], None, list(range(16)), 16)])
            await asyncio.sleep(0.02)
        with pytest.raises(RuntimeError, match="engine socket broke"):
            await asyncio.wait_for(task, 30)
    finally:
        good.close()
    subject = S.with_prefix(prefix, S.kv_events("m1", "good"))
    stream = stream_for_subject(topology, subject).name
    batches = KvEventBatch.all_from_bytes((await nc.jetstream().get_last_msg(stream, subject)).data)
    assert batches[-1].seq == good.next_seq - 1  # the good engine's frames all published before it stopped
