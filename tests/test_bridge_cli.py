"""``infernex bridge vllm-kv`` runs as a real process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import httpx

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
    assert "bridge stopped" in out
    last = KvEventBatch.all_from_bytes((await js.get_last_msg(stream, subject)).data)[-1]
    assert last.pod == "cli-pod" and last.model == "m1" and last.epoch == 0
