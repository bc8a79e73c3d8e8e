"""Whole path on vLLM's own frames: ZMQ (XPUB + ROUTER, sending exactly the bytes vLLM 0.11.2 /
0.22.1 / 0.33.0 produced, tests/fixtures/vllm) -> KV bridge -> real JetStream -> indexer.

Two of the frames are lost on the way; the bridge fills the gap from the replay socket, which
answers with the reply vLLM's own ``ZmqEventPublisher`` sent (3 parts per message up to 0.22,
4 parts with the topic in 0.33, end marker included). The index then answers the prefix
matches the engine's blocks imply (block hashes are vLLM's sha256 chain of the tokens)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from consumers.indexer import IndexerConfig, IndexerService
from consumers.kv_bridge import BridgeConfig, KvBridge
from schemas import subjects as S
from streams.topology import stream_for_subject
from fixtures import vllm as fx

MODEL = "vllm-fixture-model"
POD = "pod-a"
BLOCK = 16


async def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _reply_for(version: str, topic: bytes, buffer: list[tuple[int, bytes]], start: int) -> list[list[bytes]]:
    """What the release's publisher answers (as a DEALER sees it) for a replay from ``start``."""
    new = version.startswith("0.33")
    out = [([b"", topic] if new else [b""]) + [s.to_bytes(8, "big"), p] for s, p in buffer if s >= start]
    out.append(([b"", b""] if new else [b""]) + [b"\xff" * 8, b""])
    return out


def test_replay_reply_model_matches_vllm():
    """The fake replay socket below answers byte for byte as vLLM's publisher did."""
    for v in fx.VERSIONS:
        r = fx.replay(v)
        buffer = [(int.from_bytes(m[1], "big"), m[2]) for m in r["pub_frames"]]
        assert _reply_for(v, r["topic"].encode(), buffer, r["request_start_seq"]) == r["replay_reply"]
        assert all(len(m) == (4 if v.startswith("0.33") else 3) for m in r["replay_reply"])


async def _serve_replay(router: zmq.asyncio.Socket, version: str, topic: bytes, buffer, requests: list[int]):
    while True:
        ident, _, start_b = await router.recv_multipart()
        start = int.from_bytes(start_b, "big")
        requests.append(start)
        for msg in _reply_for(version, topic, buffer, start):
            await router.send_multipart([ident, *msg])


@pytest.mark.parametrize("version", fx.VERSIONS)
async def test_vllm_frames_through_bridge_and_jetstream_reach_the_index(version, nats_config, nc, prefix, topology):
    rec = fx.replay(version)
    topic = rec["topic"].encode()
    frames = fx.frames(version)
    by_name = {f.name: f for f in frames}
    # seq 0..2: the publisher's real PUB frames; then the rest of the scripted sequence
    payloads = [m[2] for m in rec["pub_frames"]] + [f.payload for f in frames[3:]]
    buffer = list(enumerate(payloads))
    cleared_seq = len(payloads) - 1
    assert frames[-1].name == "all_cleared"

    ctx = zmq.asyncio.Context()
    xpub = ctx.socket(zmq.XPUB)
    router = ctx.socket(zmq.ROUTER)
    for s in (xpub, router):
        s.setsockopt(zmq.LINGER, 0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    requests: list[int] = []
    server = asyncio.create_task(_serve_replay(router, version, topic, buffer, requests))

    subject = S.with_prefix(prefix, S.kv_events(MODEL, POD))
    stream = stream_for_subject(topology, subject).name
    cfg = BridgeConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", pod=POD,
                       model=MODEL, topic="")
    reg = CollectorRegistry()
    bridge = KvBridge(cfg, nc, subject_prefix=prefix, registry=reg, stream=stream)
    service = IndexerService(IndexerConfig(http_port=None, durable="ix-" + version.replace(".", "_")), nats_config,
                             registry=CollectorRegistry())
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    js = nc.jetstream()

    async def applied(n: int):
        if bridge.stats.published < n:
            return False
        last = (await js.stream_info(stream)).state.last_seq
        return service.applied_seq >= last

    def match(tokens, **kw):
        return service.query({"model": MODEL, "token_ids": tokens, **kw})["pods"].get(POD, {})

    try:
        await asyncio.wait_for(bridge.ready.wait(), 10)
        assert await xpub.poll(10_000), "the bridge never subscribed"
        assert (await xpub.recv())[:1] == b"\x01"
        await service.start()
        for seq, payload in buffer[:cleared_seq]:
            if seq in (1, 2):
                continue  # lost on the way: the replay socket must fill them
            await xpub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        await wait_for(lambda: applied(cleared_seq), what="the batches before the clear indexed")

        assert requests == [1]
        assert bridge.stats.gaps_filled == 1 and bridge.stats.replayed == 2 and bridge.stats.dead_letters == 0
        skipped = {r: reg.get_sample_value("infernex_kv_bridge_skipped_events_total", {"pod": POD, "reason": r}) or 0
                   for r in ("no_tokens", "null_blocks", "partial_kv_group")}
        if version.startswith("0.11"):  # no groups on the wire: the hybrid's null-block store is unkeyable
            assert skipped == {"no_tokens": 1, "null_blocks": 1, "partial_kv_group": 0}
        else:  # the sliding-window group's stores are not indexed, the full-attention group's are
            assert skipped == {"no_tokens": 1, "null_blocks": 0, "partial_kv_group": 2}  # seq 7 and 9

        a_tokens = by_name["stored_root_int"].expected["events"][0]["token_ids"] + \
            by_name["stored_with_parent_int"].expected["events"][0]["token_ids"]
        b_tail = by_name["stored_sibling_dp_none"].expected["events"][0]["token_ids"]
        assert len(a_tokens) == 5 * BLOCK
        # request a: all 5 blocks cached on GPU (root + child arrived live and through replay)
        m = match(a_tokens + [1])
        assert m["matched_blocks"] == 5 and m["tiers"].get("GPU") == 5
        # request b shares a's 3-block system prompt; its own 4th block was removed (seq 10)
        assert match(a_tokens[:3 * BLOCK] + b_tail + [1])["matched_blocks"] == 3
        # blocks vLLM would not share: LoRA + multimodal + cache_salt, cache_salt alone, hybrid nulls
        lora = by_name["stored_lora_mm_salt"].expected["events"][0]["token_ids"]
        salted = by_name["stored_cache_salt"].expected["events"][0]["token_ids"]
        hybrid = by_name["hybrid_null_block"].expected["events"][0]["token_ids"]
        if version.startswith("0.11"):  # no extra keys on the wire: keyed by tokens (and lora_id)
            assert match(salted + [1]).get("matched_blocks", 0) == 1
        else:
            assert match(lora + [1]).get("matched_blocks", 0) == 0
            assert match(lora + [1], lora="sql-lora").get("matched_blocks", 0) == 0  # mm + salt still differ
            assert match(salted + [1]).get("matched_blocks", 0) == 0
        # hybrid model: its full-attention group holds all 3 blocks (0.11: the event without a group)
        assert match(hybrid + [1]).get("matched_blocks", 0) == 3

        # the engine clears its cache: nothing is left
        await xpub.send_multipart([topic, cleared_seq.to_bytes(8, "big"), payloads[cleared_seq]])
        await wait_for(lambda: applied(cleared_seq + 1), what="the clear indexed")
        assert match(a_tokens + [1]).get("matched_blocks", 0) == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        server.cancel()
        await service.stop()
        try:
            await js.delete_object_store(service.bucket)
        except Exception:  # noqa: BLE001
            pass
        ctx.destroy(linger=0)
