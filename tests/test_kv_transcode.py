"""The compiled transcoder (vLLM frame -> bus batch) writes exactly the bytes the Python path
writes, or leaves the frame to it.

Checked on the frames vLLM 0.11 / 0.22 / 0.33 encoded with their own classes (tests/fixtures/vllm),
on generated frames in vLLM 0.33's shape with every field varied (msgspec-encoded, as vLLM's own
encoder writes them), and on runs of frames where a frame it leaves to the Python path sits in
the middle."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import kv_transcode as kt
from consumers.kv_bridge import encode_batch
from consumers.kv_wire import FrameDecoder, OutBatch
from fixtures import vllm as fx
from schemas import kv_binary

pytestmark = pytest.mark.skipif(not kt.AVAILABLE, reason="numba is not installed")

POD, MODEL, DP = "pod-7", "Qwen/Qwen3-8B", 3


def python_path(payload: bytes, seq: int, epoch: int, groups: dict[int, bool] | None = None, digests: bool = True):
    """What the bridge publishes for the frame without the transcoder: (bytes, stored, removed, skipped)."""
    dec = FrameDecoder()
    if groups is not None:
        dec.groups = groups
    norm = dec.decode(payload)
    data, hdrs = encode_batch(OutBatch(POD, MODEL, DP if norm.dp_rank is None else norm.dp_rank, epoch, seq,
                                       norm.ts, norm.events), digests=digests)
    if hdrs[kv_binary.HDR_CONTENT_TYPE] != kv_binary.CONTENT_TYPE:  # token ids past 32 bits: sent as JSON
        data = None
    return data, norm.blocks_stored, norm.blocks_removed, norm.skipped


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "token-ids"])
def test_every_vllm_fixture_is_transcoded_exactly_or_left_to_the_python_path(digests):
    taken = 0
    for f in fx.all_frames():
        got = kt.Transcoder(POD, MODEL, DP, {}, digests=digests).transcode([f.payload], 41, 2)
        try:
            want = python_path(f.payload, 41, 2, {}, digests)
        except ValueError:  # a frame the Python path refuses: the transcoder must not take it
            assert got == [], f.name
            continue
        if want[0] is None:
            assert got == [], f.name
            continue
        if got:
            taken += 1
            assert got[0] == want[:3], f"{f.version} {f.name}"
            assert want[3] == {}, f"{f.version} {f.name}: the transcoder took a frame with skipped events"
        else:  # left to the Python path: older shapes, skipped events, salts (extra keys, LoRA names), groups
            assert f.version != "0.33.0" or want[3] or any(
                e.get("extra_keys") or e.get("lora_name") or e.get("group_idx") or e.get("kv_cache_spec_kind")
                for e in f.expected["events"]), f"{f.version} {f.name} not taken"
    assert taken >= 5  # vLLM 0.33's plain stores, removals and clears


def _frame(rng: random.Random, events: list[dict], dp=0) -> bytes:
    return msgspec.msgpack.encode((rng.random() * 2e9, events, dp))


U64 = (1 << 64) - 1
hashes_st = st.lists(st.one_of(st.integers(-(1 << 63), U64), st.binary(min_size=0, max_size=33)), max_size=6)


@st.composite
def map_event(draw):
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus"]))
    e: dict = {"type": kind}
    bs = draw(st.sampled_from([1, 2, 16]))
    hashes = draw(hashes_st)
    if kind == "BlockStored":
        e["block_hashes"] = hashes
        n_tok = len(hashes) * bs + draw(st.sampled_from([0, 0, 0, 1, bs]))
        e["parent_block_hash"] = draw(st.one_of(st.none(), st.integers(-(1 << 63), U64), st.binary(max_size=9)))
        e["token_ids"] = draw(st.lists(st.integers(0, (1 << 32) - 1) | st.integers(-3, (1 << 33)),
                                       min_size=n_tok, max_size=n_tok))
        e["block_size"] = draw(st.sampled_from([bs, bs, 0, -1]))
        e["lora_id"] = draw(st.one_of(st.none(), st.integers(-(1 << 40), 1 << 40)))
        e["lora_name"] = draw(st.sampled_from([None, None, "adapter-a"]))
        if draw(st.booleans()):
            e["extra_keys"] = draw(st.sampled_from([None, [], [["mm-1"]] * len(hashes)]))
        if draw(st.booleans()):
            e["group_idx"] = draw(st.sampled_from([0, 1, 2, 70]))
            e["kv_cache_spec_kind"] = draw(st.sampled_from([None, "full_attention", "Full_Attention",
                                                             "sliding_window", "mamba", "mla_attention"]))
    elif kind == "BlockRemoved":
        e["block_hashes"] = hashes
        if draw(st.booleans()):
            e["group_idx"] = draw(st.sampled_from([None, 0, 1, 2]))
    e["medium"] = draw(st.sampled_from([None, "GPU", "gpu", "CPU", "cpu_tier_2", "bad medium", "", "Ä", "X" * 33]))
    if draw(st.booleans()):  # fields the index does not read (vLLM adds some per release)
        e["locality"] = draw(st.sampled_from([None, {"node": [1, 2.5, b"x"]}, "rack-1"]))
    return e


@settings(max_examples=400, deadline=None)
@given(st.lists(map_event(), max_size=4), st.sampled_from([0, 2, None, -1]), st.integers(0, 1000),
       st.dictionaries(st.sampled_from([0, 1, 2]), st.booleans(), max_size=2), st.booleans())
def test_generated_frames_are_transcoded_exactly_or_left_to_the_python_path(events, dp, seed, groups, digests):
    rng = random.Random(seed)
    payload = _frame(rng, events, dp)
    t = kt.Transcoder(POD, MODEL, DP, dict(groups), digests=digests)
    got = t.transcode([payload], 5, 1)
    try:
        want = python_path(payload, 5, 1, dict(groups), digests)
    except ValueError:
        assert got == []
        return
    if want[0] is None:
        assert got == []
    elif got:
        assert got[0] == want[:3]
        assert want[3] == {}  # never a frame whose events the Python path would skip


def test_a_run_stops_at_the_frame_it_leaves_and_learns_groups():
    """A run of consecutive frames: the transcoder takes the leading ones, stops at the first frame
    it leaves to the Python path, and a group's kind learnt from a store lets later removals in."""
    rng = random.Random(3)
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
              "kv_cache_spec_kind": "full_attention"}
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 1}
    lora = dict(stored, lora_name="adapter-a")
    frames = [_frame(rng, [stored]), _frame(rng, [removed]), _frame(rng, [lora]), _frame(rng, [removed])]
    groups: dict[int, bool] = {}
    t = kt.Transcoder(POD, MODEL, DP, groups)
    got = t.transcode(frames, 100, 4)
    assert len(got) == 2 and groups == {1: True}
    ref_groups: dict[int, bool] = {}
    for i, g in enumerate(got):
        assert g == python_path(frames[i], 100 + i, 4, ref_groups)[:3]
    # a removal of a group nobody described is left to the Python path (it skips it as other_kv_group)
    assert kt.Transcoder(POD, MODEL, DP, {}).transcode([frames[1]], 0, 0) == []


def test_engine_shaped_frames_transcode_in_one_run():
    """Frames as the simulated engines (vLLM 0.33's shape) send them: every one taken, in one call,
    byte for byte what the Python path gives; valid frames of every kind mostly taken."""
    from simulator.kv_events import block_removed, block_stored, encode_batch

    rng = random.Random(9)
    frames = []
    for _ in range(60):
        toks = [rng.randrange(151_000) for _ in range(8 * 16)]
        events = [block_stored([rng.getrandbits(64) for _ in range(8)], rng.choice([None, rng.getrandbits(63)]),
                               toks, 16, medium=rng.choice(["GPU", "CPU"]))]
        if rng.random() < 0.5:
            events.append(block_removed([rng.getrandbits(63) for _ in range(3)]))
        frames.append(encode_batch(events, ts=rng.random() * 2e9, data_parallel_rank=rng.choice([0, 1, None])))
    got = kt.Transcoder(POD, MODEL, DP, {}).transcode(frames, 7, 0)
    assert len(got) == 60
    for i, (f, g) in enumerate(zip(frames, got)):
        assert g == python_path(f, 7 + i, 0)[:3]


def test_the_bridge_without_numba_publishes_the_same_bytes(tmp_path):
    """The engine-side sidecar's base install has no numba: the bridge then decodes in Python and
    publishes the same batches with token ids (no block digests: those need the index's compiled
    core), checked in a process where numba cannot be imported."""
    import subprocess
    import sys
    from pathlib import Path

    rng = random.Random(4)
    frames = [_frame(rng, [{"type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(3)],
                            "parent_block_hash": None, "token_ids": list(range(i, i + 6)), "block_size": 2,
                            "lora_id": None, "medium": "GPU", "lora_name": None},
                           {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}]) for i in range(5)]
    (tmp_path / "frames.bin").write_bytes(msgspec.msgpack.encode(frames))
    script = """
import asyncio, sys
sys.modules["numba"] = None  # as in the base install
import msgspec
from consumers.kv_bridge import BridgeConfig, KvBridge

class NC:
    def jetstream(self):
        return object()

class Sink:
    items = []
    async def put(self, item):
        self.items.append(item.data)

async def main():
    b = KvBridge(BridgeConfig(endpoint="tcp://127.0.0.1:1", pod="pod-7", model="Qwen/Qwen3-8B", dp_rank=3,
                              group_max=1), NC())
    assert b._transcoder is None and not b._decoder.compiled
    b.publisher = Sink()
    for seq, p in enumerate(msgspec.msgpack.decode(open(sys.argv[1], "rb").read())):
        await b.handle_frame([b"", seq.to_bytes(8, "big"), p])
    sys.stdout.buffer.write(msgspec.msgpack.encode(Sink.items))

asyncio.run(main())
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "frames.bin")], cwd=root, capture_output=True,
                         check=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}).stdout
    got = msgspec.msgpack.decode(out)
    with_numba = kt.Transcoder(POD, MODEL, DP, {}, digests=False).transcode(frames, 0, 0)
    assert len(got) == len(with_numba) == 5
    assert got == [data for data, _, _ in with_numba]


def test_tiny_values_and_short_frames_stay_inside_the_buffers():
    """Hashes that are one-byte ints grow eightfold on the way out, token ids fourfold: a run of
    such frames is transcoded exactly (the output buffer is sized for it), and frames cut short
    anywhere are left to the Python path."""
    rng = random.Random(8)
    frames = [_frame(rng, [{"type": "BlockStored", "block_hashes": [rng.randrange(128) for _ in range(1000)],
                            "parent_block_hash": 1, "token_ids": [rng.randrange(128) for _ in range(1000)],
                            "block_size": 1, "lora_id": None, "medium": None, "lora_name": None}])
              for _ in range(20)]  # 12 bytes out for every 2 in (16 with digests)
    for digests in (True, False):  # (one-token blocks: a digest is twice the bytes of the id)
        got = kt.Transcoder(POD, MODEL, DP, {}, digests=digests).transcode(frames, 0, 0)
        assert [g for g in got] == [python_path(f, i, 0, digests=digests)[:3] for i, f in enumerate(frames)]
    whole = frames[0]
    for cut in range(0, len(whole), 7):
        assert kt.Transcoder(POD, MODEL, DP, {}).transcode([whole[:cut]], 0, 0) == []
