"""The binary KV encoding on the bus (schemas.kv_binary): round trips, vLLM-made frames through
the bridge's encoder, and every consumer (indexer, router feed, replay, tail) reading JSON and
binary messages mixed in one stream; a bad binary message is dead-lettered and the consumer
moves on."""

from __future__ import annotations

import asyncio
import json
import random
import time

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from consumers import bus
from consumers.index_codec import decode_batch, to_json, wire_batch
from consumers.kv_bridge import BridgeConfig, KvBridge, encode_batch
from consumers.kv_wire import FrameDecoder, OutBatch
from fixtures import vllm as fx
from schemas import ValidationFailure, kv_binary
from schemas import subjects as S
from schemas.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodGone, PodReset
from streams.clock import ManualClock
from streams.kv_index import KvIndex

BS = 4
MODEL = "Qwen/Qwen3-8B"
U64 = (1 << 64) - 1


def _plain(b: KvEventBatch) -> dict:
    """A batch as plain data (arrays as lists), for comparing decodes of either encoding."""
    d = dict(b.__dict__)
    d["events"] = events = []
    for ev in b.events:
        e = dict(ev.__dict__)
        for k, v in list(e.items()):
            if isinstance(v, (np.ndarray, list, tuple)):
                e[k] = [int(x) for x in v]
        events.append(e)
    return d


def _rich_batch(seq: int = 7) -> KvEventBatch:
    return KvEventBatch(pod="pod-a", model=MODEL, dp_rank=2, epoch=3, seq=seq, ts=1_700_000_000.25, events=[
        BlockStored(block_hashes=[1, U64, 1 << 63], parent_block_hash=U64 - 5, token_ids=list(range(12)),
                    block_size=4, lora_id=9, lora_name="ad", medium="CPU", block_salts=[0, 5, U64]),
        BlockStored(block_hashes=[42], token_ids=[(1 << 32) - 1] * 4, block_size=4),
        BlockStored(block_hashes=[7, 8], token_ids=[], block_size=16, parent_key=3, block_keys=[11, U64]),
        BlockRemoved(block_hashes=[1, 2, U64], medium="GPU"),
        AllBlocksCleared(medium="DISK"), AllBlocksCleared(), PodReset(reason="engine restart"), PodGone(),
    ])


def test_round_trip_is_exact_and_decodes_to_arrays():
    b = _rich_batch()
    data = kv_binary.encode(b)
    assert kv_binary.is_binary(data) and not kv_binary.is_binary(b.to_json())
    assert len(data) < len(b.to_json()) / 2
    fast = decode_batch(data)
    assert _plain(fast) == _plain(b) == _plain(decode_batch(b.to_json()))
    assert KvEventBatch.from_bytes(data) == b  # the full (pydantic) validation agrees
    stored = fast.events[0]
    assert isinstance(stored.block_hashes, np.ndarray) and stored.block_hashes.dtype == np.uint64
    assert isinstance(stored.token_ids, np.ndarray) and stored.token_ids.dtype == np.uint32
    # to_json renders binary as the schema's JSON (what `infernex tail` and exports show)
    assert KvEventBatch.from_json(to_json(data)) == b


def test_random_batches_round_trip():
    rng = random.Random(5)
    for seq in range(200):
        events = []
        for _ in range(rng.randint(0, 4)):
            n = rng.randint(1, 5)
            hashes = [rng.randint(0, U64) for _ in range(n)]
            if rng.random() < 0.6:
                bs = rng.choice([1, 4, 16])
                events.append(BlockStored(block_hashes=hashes, token_ids=[rng.randint(0, (1 << 32) - 1)
                                                                         for _ in range(n * bs)],
                                          block_size=bs, parent_block_hash=rng.choice([None, rng.randint(0, U64)]),
                                          medium=rng.choice([None, "GPU", "CPU"])))
            else:
                events.append(BlockRemoved(block_hashes=hashes))
        b = KvEventBatch(pod=f"p{seq % 3}", model="m", seq=seq, ts=rng.random() * 1e9, events=events)
        data = kv_binary.encode(b)
        assert _plain(decode_batch(data)) == _plain(b)
        assert KvEventBatch.from_bytes(data) == b


@pytest.mark.parametrize("version", fx.VERSIONS)
def test_vllm_frames_through_the_bridge_encoder_fold_like_json(version):
    """Frames made by vLLM's own classes, normalized as the bridge does, encoded both ways:
    the decoded batches and the index they build are the same."""
    dec, compiled = FrameDecoder(), FrameDecoder(compiled=True)
    assert compiled.compiled  # numba is part of the test install
    via_json, via_bin, via_wire, via_digests = (KvIndex(ManualClock()) for _ in range(4))
    n = 0
    for seq, f in enumerate(fx.frames(version)):
        norm = dec.decode(f.payload)
        out = OutBatch("pod-v", "m", norm.dp_rank or 0, 0, seq, norm.ts, norm.events)
        j, b = msgspec.json.encode(out), kv_binary.encode(out)
        # the bridge's compiled decode gives the same bytes on the bus
        cnorm = compiled.decode(f.payload)
        assert kv_binary.encode(OutBatch("pod-v", "m", norm.dp_rank or 0, 0, seq, cnorm.ts, cnorm.events)) == b
        bj, bb = decode_batch(j), decode_batch(b)
        assert _plain(bj) == _plain(bb)
        via_json.apply(bj)
        via_bin.apply(bb)
        via_wire.apply(wire_batch(b))  # what the indexer folds: the checked wire struct
        via_digests.apply(wire_batch(encode_batch(out)[0]))  # what the bridge sends: block digests
        n += len(norm.events)
    assert n > 0 and via_json == via_bin == via_wire == via_digests


def test_the_fold_takes_wire_structs_as_it_takes_the_schemas_batches():
    """Random batches of every event kind (parents, salts, keys, tiers, resets, clears, a pod gone),
    folded as decoded schema batches and as the indexer's checked wire structs, each with token
    ids and with the bridge's block digests in their place: the same index and the same counts."""
    rng = random.Random(11)
    a, b, c, d = (KvIndex(ManualClock()) for _ in range(4))
    held: dict[str, list[int]] = {}
    for seq in range(400):
        pod = f"p{rng.randrange(3)}"
        events: list = []
        for _ in range(rng.randint(0, 3)):
            r = rng.random()
            if r < 0.55:
                n = rng.randint(1, 4)
                hashes = [rng.randint(1, U64) for _ in range(n)]
                parent = rng.choice(held.get(pod) or [None]) if rng.random() < 0.5 else None
                kw: dict = {}
                if rng.random() < 0.15:
                    kw["block_salts"] = [rng.choice([0, rng.randint(1, U64)]) for _ in range(n)]
                if rng.random() < 0.1:
                    kw["block_keys"], toks = [rng.randint(1, U64) for _ in range(n)], []
                else:
                    toks = _toks(*(rng.randint(0, 5) for _ in range(n)))
                events.append(BlockStored(block_hashes=hashes, token_ids=toks, block_size=BS, parent_block_hash=parent,
                                          medium=rng.choice([None, "GPU", "CPU"]), **kw))
                held.setdefault(pod, []).extend(hashes)
            elif r < 0.85 and held.get(pod):
                events.append(BlockRemoved(block_hashes=rng.sample(held[pod], min(2, len(held[pod]))),
                                           medium=rng.choice([None, "GPU", "CPU"])))
            elif r < 0.92:
                events.append(AllBlocksCleared(medium=rng.choice([None, "CPU"])))
            elif r < 0.97:
                events.append(PodReset())
            else:
                events.append(PodGone())
        batch = KvEventBatch(pod=pod, model="m", seq=seq, ts=float(seq), events=events)
        data = kv_binary.encode(batch)
        digested, _ = encode_batch(batch)  # the bridge's form: block digests in place of token ids
        assert (len(digested) < len(data)) == any(type(e) is BlockStored and e.token_ids for e in events)
        sa, sb = a.apply(decode_batch(data)), b.apply(wire_batch(data))
        sc, sd = c.apply(wire_batch(digested)), d.apply(decode_batch(digested))
        assert sa == sb == sc == sd, (seq, sa, sb, sc, sd)
    assert a == b == c == d and len(a) > 0


def test_token_ids_past_32_bits_cannot_be_binary():
    b = KvEventBatch(pod="p", model="m", seq=0, ts=1.0,
                     events=[BlockStored(block_hashes=[1], token_ids=[1 << 40], block_size=1)])
    with pytest.raises(OverflowError):
        kv_binary.encode(b)


@pytest.mark.parametrize("data, why", [
    (b"\x93\xa3kv1\x01\x02", "length"),
    (b"\x99\xa3kv9\x01\xa1p\xa1m\x00\x00\x00\x00\x90", "kv9"),
    (b"\x9f", "truncated"),
])
def test_bad_binary_is_a_validation_failure_naming_why(data, why):
    with pytest.raises(ValidationFailure) as exc:
        decode_batch(data)
    assert "binary" in str(exc.value)
    with pytest.raises(ValidationFailure):
        KvEventBatch.from_bytes(data)


@pytest.mark.parametrize("medium", ["gpu", "G-PU", "9GPU", "É"])
def test_a_medium_that_is_not_a_tier_name_is_refused(medium):
    """Tier names are checked by the consumers' decode (the wire struct only bounds the length): a
    binary batch naming another medium is refused, by the fast path and by the careful one."""
    w = kv_binary.WBatch(1, "p", "m", 0, 0, 1, 1.0, [kv_binary.WRemoved(kv_binary.pack([5], "Q"), medium)])
    data = msgspec.msgpack.encode(w)
    with pytest.raises(ValidationFailure, match="tier name"):
        decode_batch(data)
    with pytest.raises(ValueError, match="tier name"):
        wire_batch(data)
    ok = msgspec.msgpack.encode(kv_binary.WBatch(1, "p", "m", 0, 0, 1, 1.0, [kv_binary.WRemoved(kv_binary.pack([5], "Q"), "CPU_2")]))
    assert wire_batch(ok).events[0].medium == "CPU_2"


def test_ragged_arrays_are_refused():
    good = kv_binary.to_wire(KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2)]))
    for field, value, msg in (("block_hashes", b"\x01" * 12, "whole number of uint64s"),
                              ("token_ids", b"\x01" * 10, "whole number of uint32s"),
                              ("token_ids", b"\x01" * 12, "need 4"),
                              ("block_hashes", b"", "empty")):
        ev = good.events[0]
        bad = msgspec.structs.replace(good, events=[msgspec.structs.replace(ev, **{field: value})])
        with pytest.raises(ValidationFailure, match=msg):
            decode_batch(msgspec.msgpack.encode(bad))
    # the optional arrays and a removal's hashes are named too when they do not divide
    ev = good.events[0]
    for field, value in (("block_salts", b"\x01" * 12), ("block_digests", b"\x01" * 12), ("block_keys", b"\x01" * 4)):
        extra = {"token_ids": b""} if field != "block_salts" else {}
        bad = msgspec.structs.replace(good, events=[msgspec.structs.replace(ev, **{field: value}, **extra)])
        with pytest.raises(ValidationFailure, match=f"events.0.{field} is .* not a whole number of uint64s"):
            decode_batch(msgspec.msgpack.encode(bad))
    removal = kv_binary.WBatch(1, "p", "m", 0, 0, 1, 1.0, [ev, kv_binary.WRemoved(b"\x01" * 9, "GPU")])
    with pytest.raises(ValidationFailure, match="events.1.block_hashes is 9 bytes"):
        decode_batch(msgspec.msgpack.encode(removal))


# ------------------------------------------------------------------ consumers on a real nats-server

def _toks(*blocks: int) -> list[int]:
    return [t for b in blocks for t in range(b * 10, b * 10 + BS)]


def _workload(n: int, seed: int = 3) -> list[KvEventBatch]:
    rng = random.Random(seed)
    seqs = {"p0": -1, "p1": -1}
    out = []
    held: dict[str, list[int]] = {"p0": [], "p1": []}
    for i in range(n):
        pod = rng.choice(sorted(seqs))
        seqs[pod] += 1
        if held[pod] and rng.random() < 0.3:
            h = held[pod].pop(rng.randrange(len(held[pod])))
            ev = BlockRemoved(block_hashes=[h])
        else:
            blocks = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
            hashes = [rng.randint(1, U64) for _ in blocks]
            held[pod].extend(hashes)
            ev = BlockStored(block_hashes=hashes, token_ids=_toks(*blocks), block_size=BS)
        out.append(KvEventBatch(pod=pod, model=MODEL, seq=seqs[pod], ts=time.time(), events=[ev]))
    return out


async def _publish_mixed(js, prefix, batches, bad_every: int = 0):
    """Odd batches as binary (with the headers the bridge sets), even ones as JSON; every
    ``bad_every``-th, a corrupt binary message first. Returns the last ack."""
    ack = None
    for i, b in enumerate(batches):
        subject = S.with_prefix(prefix, S.kv_events(b.model, b.pod))
        if bad_every and i % bad_every == 0:
            await js.publish(subject, b"\x99\xa3kv1\x01\xa2p0" + b"\xff" * 300,
                             headers=kv_binary.headers(b.pod, b.model, b.epoch, b.seq))
        if i % 2:
            hdrs = kv_binary.headers(b.pod, b.model, b.epoch, b.seq)
            hdrs["Nats-Msg-Id"] = b.msg_id
            ack = await js.publish(subject, kv_binary.encode(b), headers=hdrs)
        else:
            ack = await bus.publish(js, subject, b.to_json(), msg_id=b.msg_id)
    return ack


async def _stop_indexer(js, svc) -> None:
    """Stop an indexer a test started and drop its snapshot bucket."""
    await svc.stop()
    try:
        await js.delete_object_store(svc.bucket)
    except Exception:  # noqa: BLE001 - the bucket may not exist
        pass


async def _wait(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _feed_caught_up(registry, n: int) -> None:
    def kv_applied() -> float:
        return registry.get_sample_value("infernex_router_feed_messages_total", {"kind": "KvEventBatch"}) or 0

    await _wait(lambda: kv_applied() >= n, what="router feed caught up")


async def test_indexer_reads_a_mixed_stream_and_dead_letters_bad_binary(nats_config, topology, nc, prefix):
    from consumers.indexer import IndexerConfig, IndexerService

    js = nc.jetstream()
    dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.KV_EVENTS)), ordered_consumer=True)
    batches = _workload(60)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches)
    svc = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="ix-bin",
                                       snapshot_every_events=10_000), nats_config, registry=CollectorRegistry())
    await svc.start()
    try:
        ack = await _publish_mixed(js, prefix, batches, bad_every=20)
        await _wait(lambda: svc.applied_seq >= ack.seq, what="indexer caught up")
        assert svc.index == truth
        letters = [json.loads((await dlq.next_msg(timeout=10)).data) for _ in range(3)]
        assert all("binary" in x["reason"] for x in letters)
        assert all(len(x["payload"]) <= 4 * 1024 for x in letters)
        assert svc._dlq.count == 3
    finally:
        await _stop_indexer(js, svc)



async def test_indexer_waits_for_a_dead_lettered_batch_only_the_grace(nats_config, topology, nc, prefix):
    """A batch replaced by a corrupt message with the bridge's headers: the indexer dead-letters it,
    and the pod's later batches are folded after the short grace, well within the reorder window
    (ground truth: the batches less the lost one)."""
    from consumers.indexer import IndexerConfig, IndexerService
    from streams.kv_index import LOST_GRACE_S

    js = nc.jetstream()
    batches = [b for b in _workload(40, seed=21) if b.pod == "p0"]
    lost = 3
    truth = KvIndex(ManualClock())
    truth.apply_many(batches[:lost] + batches[lost + 1:])
    cfg = IndexerConfig(http_port=None, nats_query=False, durable="ix-lost", snapshot_every_events=10_000)
    assert cfg.reorder_window_s >= 4 * LOST_GRACE_S
    svc = IndexerService(cfg, nats_config, registry=CollectorRegistry())
    await svc.start()
    try:
        for i, b in enumerate(batches):
            subject = S.with_prefix(prefix, S.kv_events(b.model, b.pod))
            hdrs = kv_binary.headers(b.pod, b.model, b.epoch, b.seq)
            data = b"\x99\xa3kv1\x01\xa2p0" + b"\xff" * 300 if i == lost else kv_binary.encode(b)
            await js.publish(subject, data, headers=hdrs)
        # (within half the window: the batches behind the lost one did not wait it out)
        await _wait(lambda: svc.index == truth, timeout=cfg.reorder_window_s / 2, what="the batches after the lost one")
        assert svc._dlq.count == 1
    finally:
        await _stop_indexer(js, svc)


async def test_router_feed_and_replay_read_both_encodings(nc, prefix, topology):
    from consumers.replay import read_window
    from infernex.incident import ReplayState
    from router.config import RouterConfig
    from router.feeds import BusFeeds
    from router.state import ClusterState

    js = nc.jetstream()
    batches = _workload(40, seed=9)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches)
    await _publish_mixed(js, prefix, batches, bad_every=15)
    registry = CollectorRegistry()
    embedded = KvIndex(ManualClock())
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=embedded, registry=registry)
    await feeds.start()
    try:
        await _feed_caught_up(registry, len(batches))
        assert embedded == truth
    finally:
        await feeds.stop()
    st = ReplayState()
    msgs = [m async for m in read_window(nc, topology, ["kv.events.>"], prefix=prefix)]
    assert len(msgs) == len(batches) + 3
    st.apply_many(msgs)
    assert st.index == truth
    assert len(st.undecodable) == 3


async def test_bridge_publishes_binary_with_headers_and_falls_back_to_json(nats_config, topology, nc, prefix):
    js = nc.jetstream()
    bridge = KvBridge(BridgeConfig(endpoint="tcp://127.0.0.1:1", pod="pod-b", model="m", recover=False),
                      nc, subject_prefix=prefix, registry=CollectorRegistry())
    await bridge.publisher.start()
    sender = asyncio.create_task(bridge.publisher.run())
    frames = fx.frames("0.33.0")
    for seq, f in enumerate(frames):
        await bridge.handle_frame([b"kv", seq.to_bytes(8, "big"), f.payload])
    # a batch whose token ids do not fit 32 bits goes out as JSON
    big = OutBatch("pod-b", "m", 0, 0, len(frames), 1.0, [])
    data, hdrs = bridge._encode(big)
    assert hdrs[kv_binary.HDR_CONTENT_TYPE] == kv_binary.CONTENT_TYPE
    from consumers.kv_wire import OutStored
    big.events = [OutStored([1], None, [1 << 40], 1, None, None, None)]
    data, hdrs = bridge._encode(big)
    assert hdrs[kv_binary.HDR_CONTENT_TYPE] == kv_binary.JSON_CONTENT_TYPE and data.startswith(b"{")
    await bridge.publisher.put(None)
    await asyncio.wait_for(sender, 10)
    sub = await js.subscribe(S.with_prefix(prefix, S.kv_events("m", "pod-b")), ordered_consumer=True)
    got = [await sub.next_msg(timeout=5) for _ in range(len(frames))]
    await sub.unsubscribe()
    for seq, m in enumerate(got):
        assert m.headers[kv_binary.HDR_CONTENT_TYPE] == kv_binary.CONTENT_TYPE
        assert (m.headers[kv_binary.HDR_POD], m.headers[kv_binary.HDR_MODEL]) == ("pod-b", "m")
        assert (m.headers[kv_binary.HDR_EPOCH], m.headers[kv_binary.HDR_SEQ]) == ("0", str(seq))
        assert m.headers["Nats-Msg-Id"] == f"pod-b:0:{seq}"
        assert kv_binary.is_binary(m.data) and KvEventBatch.from_bytes(m.data).seq == seq


def test_tail_renders_binary_as_json():
    from infernex.commands.backbone import format_event

    b = _rich_batch()
    line = format_event(S.kv_events(MODEL, "pod-a"), kv_binary.encode(b), 5, raw=False)
    assert line.startswith("[5] ") and "KvEventBatch" in line
    body = json.loads(line.split(" KvEventBatch ", 1)[1])
    assert body["events"][0]["block_hashes"] == [1, U64, 1 << 63] and body["seq"] == 7
    raw = format_event(S.kv_events(MODEL, "pod-a"), kv_binary.encode(b), 5, raw=True)
    assert '"block_hashes"' in raw  # --raw shows JSON too, not msgpack bytes


def test_the_contract_documents_both_encodings():
    from infernex.asyncapi import build_document

    doc = build_document()
    ch = doc["channels"]["kv.events.{model}.{pod}:Publish"]
    assert set(ch["messages"]) == {"Message", "BinaryMessage"}
    msgs = doc["components"]["messages"]
    assert msgs["kv.events.{model}.{pod}:Publish:Message"]["contentType"] == "application/json"
    binary = msgs["kv.events.{model}.{pod}:Publish:BinaryMessage"]
    assert binary["contentType"] == kv_binary.CONTENT_TYPE
    assert set(binary["headers"]["properties"]) >= {"Content-Type", "Infernex-Pod", "Infernex-Model",
                                                    "Infernex-Epoch", "Infernex-Seq"}
    layout = doc["components"]["schemas"]["KvEventBatchBinary"]["items"]
    assert layout[0] == {"const": kv_binary.BATCH_TAG} and len(layout) == len(kv_binary.WBatch.__struct_fields__) + 1
    assert len(doc["operations"]["kv.events.{model}.{pod}:Publish"]["messages"]) == 2


def test_bridge_cli_runs_on_uvloop_and_refuses_an_unknown_encoding():
    import uvloop
    from typer.testing import CliRunner

    from infernex.cli import app
    from infernex.commands.common import fast_loop_runner

    assert fast_loop_runner() is uvloop.run
    r = CliRunner().invoke(app, ["bridge", "vllm-kv", "--endpoint", "tcp://127.0.0.1:1", "--pod", "p", "--model",
                                 "m", "--encoding", "xml"])
    assert r.exit_code == 2 and "binary or json" in r.output


# ------------------------------------------------------------------ groups: several batches, one message

def test_group_round_trip_and_tools():
    batches = [_rich_batch(seq) for seq in range(3, 40)]  # > 15: the 16-bit msgpack array header too
    data = kv_binary.group([kv_binary.encode(b) for b in batches])
    assert kv_binary.is_binary(data) and kv_binary.is_group(data)
    assert not kv_binary.is_group(kv_binary.encode(batches[0]))
    assert kv_binary.split(kv_binary.encode(batches[0])) is None
    assert [_plain(decode_batch(p)) for p in kv_binary.split(data)] == [_plain(b) for b in batches]
    assert KvEventBatch.all_from_bytes(data) == batches  # full validation, every batch
    with pytest.raises(ValidationFailure, match="all_from_bytes"):
        KvEventBatch.from_bytes(data)
    assert [d["seq"] for d in kv_binary.to_docs(data)] == list(range(3, 40))
    from infernex.commands.backbone import format_event

    lines = format_event("kv.events.m.p", data, 5, raw=True).splitlines()
    assert len(lines) == len(batches) and all(ln.startswith("[5] kv.events.m.p {") for ln in lines)
    with pytest.raises(ValidationFailure, match="group"):
        from consumers.index_codec import message_parts

        message_parts(b"\x92\xa3kvg\x93\x01")  # a group frame cut short


async def _publish_grouped(js, prefix, batches, rng, poison_at: int | None = None):
    """Runs of one pod's consecutive batches as group messages (as the bridge sends them); with
    ``poison_at``, that group also carries one corrupt batch. Returns (last ack, messages sent)."""
    ack, sent, i = None, 0, 0
    while i < len(batches):
        pod = batches[i].pod
        run = [batches[i]]
        while i + len(run) < len(batches) and len(run) < rng.randint(1, 6) and batches[i + len(run)].pod == pod:
            run.append(batches[i + len(run)])
        parts = [kv_binary.encode(b) for b in run]
        if poison_at is not None and sent == poison_at:
            parts.insert(1, msgspec.msgpack.encode(["kv1", 1, "p0"]))  # well-formed msgpack, not a batch
        first, last = run[0], run[-1]
        subject = S.with_prefix(prefix, S.kv_events(first.model, pod))
        if len(parts) == 1:
            hdrs = kv_binary.headers(pod, first.model, first.epoch, first.seq)
            hdrs["Nats-Msg-Id"] = first.msg_id
        else:
            hdrs = kv_binary.group_headers(pod, first.model, last.epoch, first.seq, last.seq, len(parts))
            hdrs["Nats-Msg-Id"] = f"{pod}:{first.epoch}:{first.seq}-{last.epoch}:{last.seq}"
        ack = await js.publish(subject, kv_binary.group(parts) if len(parts) > 1 else parts[0], headers=hdrs)
        sent += 1
        i += len(run)
    return ack, sent


async def test_every_consumer_reads_groups_and_a_bad_batch_in_one_loses_nothing_else(nats_config, topology, nc,
                                                                                       prefix):
    from consumers.indexer import IndexerConfig, IndexerService
    from consumers.replay import read_window
    from infernex.incident import ReplayState
    from router.config import RouterConfig
    from router.feeds import BusFeeds
    from router.state import ClusterState

    js = nc.jetstream()
    dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.KV_EVENTS)), ordered_consumer=True)
    batches = _workload(120, seed=11)
    truth = KvIndex(ManualClock())
    truth.apply_many(batches)
    svc = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="ix-grp",
                                       snapshot_every_events=10_000), nats_config, registry=CollectorRegistry())
    await svc.start()
    registry = CollectorRegistry()
    embedded = KvIndex(ManualClock())
    feeds = BusFeeds(nc, ClusterState(RouterConfig()), prefix=prefix, index=embedded, registry=registry)
    await feeds.start()
    try:
        ack, sent = await _publish_grouped(js, prefix, batches, random.Random(5), poison_at=3)
        assert sent < len(batches)  # groups were formed
        await _wait(lambda: svc.applied_seq >= ack.seq, what="indexer caught up")
        assert svc.index == truth  # every good batch applied, in order, once
        letter = json.loads((await dlq.next_msg(timeout=10)).data)
        assert "batch 1 of a group" in letter["reason"] and len(letter["payload"]) < 200  # just the bad batch

        await _feed_caught_up(registry, len(batches))
        assert embedded == truth
    finally:
        await feeds.stop()
        await _stop_indexer(js, svc)
    st = ReplayState()
    msgs = [m async for m in read_window(nc, topology, ["kv.events.>"], prefix=prefix)]
    assert len(msgs) == sent
    st.apply_many(msgs)
    assert st.index == truth and len(st.undecodable) == 1


async def test_bridge_groups_frames_that_arrive_together(nats_config, topology, nc, prefix):
    """Frames already queued when the bridge reads go out as one group message; the indexer folds
    it to the same index as the frames sent one by one; a lone frame is a plain batch."""
    js = nc.jetstream()
    subject = S.with_prefix(prefix, S.kv_events("m", "pod-g"))
    frames = fx.frames("0.33.0")
    reg = CollectorRegistry()
    bridge = KvBridge(BridgeConfig(endpoint="tcp://127.0.0.1:1", pod="pod-g", model="m", recover=False,
                                   group_max=5), nc, subject_prefix=prefix, registry=reg)
    await bridge.publisher.start()
    sender = asyncio.create_task(bridge.publisher.run())
    for seq, f in enumerate(frames):
        await bridge.handle_frame([b"kv", seq.to_bytes(8, "big"), f.payload], flush=False)
    await bridge.flush()
    n = len(frames)
    await bridge.handle_frame([b"kv", n.to_bytes(8, "big"), frames[0].payload])  # alone: no group
    await bridge.publisher.put(None)
    await asyncio.wait_for(sender, 10)
    sub = await js.subscribe(subject, ordered_consumer=True)
    msgs = []
    while True:
        try:
            msgs.append(await sub.next_msg(timeout=1))
        except Exception:  # noqa: BLE001 - no more
            break
    await sub.unsubscribe()
    sizes = [int(m.headers.get(kv_binary.HDR_BATCHES, "1")) for m in msgs]
    assert sum(sizes) == n + 1 and max(sizes) == 5 and sizes[-1] == 1  # groups of at most 5, the lone one alone
    assert len(msgs) == -(-n // 5) + 1
    got = [b for m in msgs for b in KvEventBatch.all_from_bytes(m.data)]
    assert [b.seq for b in got] == list(range(n + 1))
    assert reg.get_sample_value("infernex_kv_bridge_published_total", {"pod": "pod-g"}) == n + 1
    assert reg.get_sample_value("infernex_kv_bridge_messages_total", {"pod": "pod-g"}) == len(msgs)
    # the same frames, one message each, fold to the same index
    alone = KvIndex(ManualClock())
    dec = FrameDecoder()
    for seq, f in enumerate([*frames, frames[0]]):
        norm = dec.decode(f.payload)
        alone.apply(decode_batch(kv_binary.encode(OutBatch("pod-g", "m", 0, 0, seq, norm.ts, norm.events))))
    grouped = KvIndex(ManualClock())
    grouped.apply_many(got)
    assert grouped == alone


def test_kafka_envelope_of_a_group_lists_its_batches():
    """The Kafka mirror's envelope shows a binary batch as its JSON document, and a group as the
    list of its batches' documents, in order."""
    from types import SimpleNamespace

    from consumers.kafka_export import KafkaExportConfig, KafkaExporter
    from schemas.config import NatsConfig

    exp = KafkaExporter(KafkaExportConfig(bootstrap="127.0.0.1:1", subjects=("kv.events.>",), value_format="envelope"),
                        NatsConfig())
    batches = [_rich_batch(seq) for seq in (4, 5, 6)]

    def envelope(data: bytes) -> dict:
        meta = SimpleNamespace(stream="KV_EVENTS", sequence=SimpleNamespace(stream=9), timestamp=None)
        msg = SimpleNamespace(subject="kv.events.m.pod-a", headers={}, data=data, metadata=meta)
        return json.loads(exp._record(msg)[2])

    grouped = envelope(kv_binary.group([kv_binary.encode(b) for b in batches]))["payload"]
    assert [d["seq"] for d in grouped] == [4, 5, 6] and grouped[0]["pod"] == "pod-a"
    single = envelope(kv_binary.encode(batches[0]))["payload"]
    assert single["seq"] == 4 and single["events"][0]["block_hashes"] == [1, U64, 1 << 63]
