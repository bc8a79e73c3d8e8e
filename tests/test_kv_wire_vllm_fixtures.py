"""Table test: every KV-event frame vLLM 0.11.2 / 0.22.1 / 0.33.0 encoded with its own classes
(tests/fixtures/vllm, made by make_fixtures.py) decodes to exactly the events vLLM put in it.

The expected side is read from the fixture's ``expected`` JSON (vLLM's struct fields by name),
never from our encoder: hashes, parents, tokens, medium, LoRA, extra keys and DP rank."""

from __future__ import annotations

import pytest

import msgspec

from consumers.kv_wire import FrameDecoder, OutCleared, OutRemoved, OutStored, decode_frame
from schemas.kv_binary import WRemoved, WStored
from streams.kv_keys import extra_salt
from fixtures import vllm as fx

U64 = (1 << 64) - 1


def _h(v):
    return int.from_bytes(v, "big") & U64 if isinstance(v, bytes) else v & U64


def _expected(batch: dict):
    """(normalized events, skipped reasons) an index consumer must get from vLLM's batch."""
    events, skipped = [], {}

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    full = {}  # group -> full attention, as learned from this batch's stores
    for e in batch["events"]:
        t = e["type"]
        if t == "BlockStored":
            g, kind = e.get("group_idx"), e.get("kv_cache_spec_kind")
            if kind is not None and g is not None:
                full[g] = kind in ("full_attention", "mla_attention", "sink_full_attention")
                if not full[g]:
                    skip("partial_kv_group")
                    continue
            elif (g or 0) > 0:
                skip("other_kv_group")
                continue
            if not e["token_ids"] or e["block_size"] == 0:
                skip("no_tokens")
                continue
            if len(e["token_ids"]) != len(e["block_hashes"]) * e["block_size"]:
                skip("null_blocks")  # hybrid model: hashes of null blocks left out
                continue
            salts = None
            if e.get("extra_keys"):
                salts = [extra_salt(x, e.get("lora_name")) for x in e["extra_keys"]]
                salts = salts if any(salts) else None
            parent = e["parent_block_hash"]
            events.append(("stored", [_h(x) for x in e["block_hashes"]], None if parent is None else _h(parent),
                           e["token_ids"], e["block_size"], e["lora_id"], e.get("lora_name"),
                           e["medium"].upper() if e["medium"] else None, salts))
        elif t == "BlockRemoved":
            g = e.get("group_idx") or 0
            if not full.get(g, g == 0):
                skip("other_kv_group" if g not in full else "partial_kv_group")
                continue
            events.append(("removed", [_h(x) for x in e["block_hashes"]], e["medium"]))
        else:
            assert t == "AllBlocksCleared"
            events.append(("cleared", None))
    return events, skipped


def _ints(values) -> list[int] | None:
    """Python ints from a list or (the compiled decoder's) typed memoryview."""
    return None if values is None else values.tolist() if hasattr(values, "tolist") else list(values)


def _got(norm):
    """The events, whether the Python path's (``Out*``) or the compiled one's (the bus's wire structs)."""
    out = []
    for e in norm.events:
        if e.type == "stored":
            assert type(e) in (OutStored, WStored)
            out.append(("stored", _ints(e.block_hashes), e.parent_block_hash, _ints(e.token_ids), e.block_size,
                        e.lora_id, e.lora_name, e.medium, _ints(e.block_salts)))
        elif e.type == "removed":
            assert type(e) in (OutRemoved, WRemoved)
            out.append(("removed", _ints(e.block_hashes), e.medium))
        else:
            assert isinstance(e, OutCleared)
            out.append(("cleared", e.medium))
    return out


FRAMES = fx.all_frames()


@pytest.mark.parametrize("frame", FRAMES, ids=[f"{f.version}-{f.name}" for f in FRAMES])
def test_every_vllm_frame_decodes_to_what_vllm_encoded(frame):
    want, want_skipped = _expected(frame.expected)
    decoders = []
    for compiled in (False, True):  # the Python path, and the compiled walk of the integer arrays
        other = FrameDecoder(compiled=compiled)
        other.map_events = not other.map_events  # as if the last batch had the other event shape
        decoders += [FrameDecoder(compiled=compiled), other]
    assert decoders[2].compiled  # numba is part of the test install
    for dec in decoders:
        norm = dec.decode(frame.payload)
        assert _got(norm) == want
        assert norm.skipped == want_skipped
        assert norm.ts == frame.expected["ts"]
        assert norm.dp_rank == frame.expected["data_parallel_rank"]
        assert norm.blocks_stored == sum(len(e[1]) for e in want if e[0] == "stored")
        assert norm.blocks_removed == sum(len(e[1]) for e in want if e[0] == "removed")


def test_fixtures_cover_the_cases_the_issue_names():
    names = {f.name for f in FRAMES}
    for n in ("stored_root_int", "stored_with_parent_int", "stored_bytes_hashes_dp3", "stored_cpu_storage",
              "stored_lora_mm_salt", "offload_placeholder_and_good", "hybrid_null_block", "removed", "all_cleared"):
        assert n in names
    dps = {f.expected["data_parallel_rank"] for f in FRAMES}
    assert dps == {None, 0, 3}
    # the shapes differ per release exactly as the README says
    assert fx.meta("0.11.2")["event_array_like"] and fx.meta("0.22.1")["event_array_like"]
    assert not fx.meta("0.33.0")["event_array_like"]
    assert all(fx.meta(v)["batch_array_like"] for v in fx.VERSIONS)


def test_storage_is_its_own_tier_and_the_good_event_survives_a_placeholder():
    for v in fx.VERSIONS:
        by = {f.name: f for f in fx.frames(v)}
        media = [e.medium for e in decode_frame(by["stored_cpu_storage"].payload).events]
        assert media == ["CPU", "STORAGE"]
        norm = decode_frame(by["offload_placeholder_and_good"].payload)
        assert norm.skipped == {"no_tokens": 1} and len(norm.events) == 1 and norm.blocks_stored == 1


def test_one_corrupt_event_costs_only_itself_in_every_release():
    """Replace one event of a real frame with garbage of the release's own shape."""
    import msgspec
    for f in FRAMES:
        raw = msgspec.msgpack.decode(f.payload)
        if len(raw[1]) < 2:
            continue
        bad = list(raw)
        first = raw[1][0]
        bad[1] = [["BlockStored", "not-a-hash-list"] if isinstance(first, list) else {"type": "BlockStored",
                                                                                       "block_hashes": "x"}]
        bad[1] += raw[1][1:]
        norm = FrameDecoder().decode(msgspec.msgpack.encode(bad))
        good = FrameDecoder().decode(f.payload)
        assert norm.skipped.get("undecodable_event") == 1
        assert _got(norm) == [e for e in _got(good)][len(_got(good)) - len(_got(norm)):]


def test_removals_follow_what_their_group_taught():
    """vLLM tags only stores with the group's kind; a later removal is judged by its group."""
    def frame(*events):
        return msgspec.msgpack.encode([1.0, list(events), 0])

    toks = list(range(16))
    dec = FrameDecoder()
    n = dec.decode(frame({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": toks,
                          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
                          "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64},
                         {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": toks,
                          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
                          "kv_cache_spec_kind": "full_attention"}))
    assert n.skipped == {"partial_kv_group": 1} and [e.block_hashes for e in n.events] == [[1]]
    n = dec.decode(frame({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
                         {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
                         {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 5}))
    assert n.skipped == {"partial_kv_group": 1, "other_kv_group": 1}
    assert [(type(e), e.block_hashes) for e in n.events] == [(OutRemoved, [1])]
