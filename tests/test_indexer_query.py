"""Query bodies of the indexer API (no server needed): inputs, tokenization, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from consumers.index_codec import SNAPSHOT_FORMAT
from consumers.indexer import (QueryError, decode_snapshot, encode_snapshot, record_route, run_query,
                               run_query_json)
from schemas.kv import BlockStored, KvEventBatch
from simulator.tokenizer import SimpleTokenizer
from streams.clock import ManualClock
from streams.kv_index import KvIndex, block_keys

BS = 4


@pytest.fixture
def setup():
    tok = SimpleTokenizer()
    messages = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hi there friend"}]
    ids = tok.encode(tok.apply_chat_template(messages))
    n = len(ids) // BS
    assert n >= 2
    idx = KvIndex(ManualClock())
    idx.apply(KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=list(range(1, n + 1)), token_ids=ids[: n * BS], block_size=BS)]))
    return idx, tok, messages, ids, n


def test_every_input_form_gives_the_same_answer(setup):
    idx, tok, messages, ids, n = setup
    expect = {"block_size": BS, "pods": {"p": {"matched_blocks": n, "tiers": {"GPU": n}, "score": float(n),
                                               "predicted_blocks": 0}}}
    assert run_query(idx, {"model": "m", "token_ids": ids}) == expect
    assert run_query(idx, {"model": "m", "messages": messages}, tok) == expect
    text = tok.apply_chat_template(messages)
    assert run_query(idx, {"model": "m", "prompt": text}, tok) == expect
    assert run_query(idx, {"model": "m", "block_hashes": block_keys(ids, BS)}) == expect
    assert run_query(idx, {"model": "other", "token_ids": ids}) == {"block_size": None, "pods": {}}
    # the JSON-bytes entry point (HTTP, NATS) answers the same for every form, fast path or not
    for body in ({"model": "m", "token_ids": ids}, {"model": "m", "block_hashes": block_keys(ids, BS)},
                 {"model": "m", "token_ids": ids, "pods": ["p", "q"]}, {"model": "m", "messages": messages},
                 {"model": "m", "prompt": text}, {"model": "other", "token_ids": ids}):
        assert run_query_json(idx, json.dumps(body).encode(), tok) == run_query(idx, body, tok)
    assert run_query_json(idx, json.dumps({"model": "m", "token_ids": ids, "pods": ["q"]}).encode()) == {
        "block_size": BS, "pods": {"q": {"matched_blocks": 0, "tiers": {}, "score": 0.0, "predicted_blocks": 0}}}


@pytest.mark.parametrize("body,needle", [
    ([1, 2], "JSON object"),
    ({"model": "m"}, "exactly one"),
    ({"model": "m", "token_ids": [1], "prompt": "x"}, "exactly one"),
    ({"model": "m", "token_ids": ["a"]}, "token_ids"),
    ({"model": "m", "token_ids": [1 << 40] * BS}, "2**32"),
    ({"model": "m", "block_hashes": [-1]}, "64-bit"),
    ({"model": "m", "prompt": "hello"}, "no tokenizer"),
    ({"model": "m", "token_ids": [1], "extra": 1}, "extra"),
])
def test_bad_queries_are_400_with_a_message(setup, body, needle):
    idx = setup[0]
    with pytest.raises(QueryError) as exc:
        run_query(idx, body, None)
    assert exc.value.status == 400 and needle in str(exc.value)
    with pytest.raises(QueryError) as exc:
        run_query_json(idx, json.dumps(body).encode(), None)
    assert exc.value.status == 400 and needle in str(exc.value)


@pytest.mark.parametrize("data", [b"{nope", b"", b"\xff\xfe", b'{"model": "m", "token_ids": [1,]}'])
def test_undecodable_query_bytes_are_400_invalid_json(setup, data):
    with pytest.raises(QueryError) as exc:
        run_query_json(setup[0], data)
    assert exc.value.status == 400 and "invalid JSON" in str(exc.value)


def test_record_route_and_snapshot_codec(setup):
    idx, _, _, ids, n = setup
    assert record_route(idx, {"model": "m", "pod": "q", "token_ids": ids})["recorded"]
    with pytest.raises(QueryError):
        record_route(idx, {"model": "m", "pod": "q"})
    seq, created, batches = decode_snapshot(encode_snapshot(idx, 42, 5.0))
    assert (seq, created) == (42, 5.0)
    restored = KvIndex(ManualClock())
    restored.apply_many(batches)
    assert restored == idx and restored.fingerprint() == idx.fingerprint()
    with pytest.raises(ValueError):
        decode_snapshot(b"\x80")


def test_snapshot_of_several_tiers_pods_and_block_sizes_round_trips():
    """Format 4 packs engine hashes and our keys; no token ids are stored."""
    import msgpack

    idx = KvIndex(ManualClock())
    a = [7, 8, 9, 10] * 3
    idx.apply(KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2, 3], token_ids=a, block_size=BS),
        BlockStored(block_hashes=[(1 << 64) - 1], parent_block_hash=1, token_ids=a[:BS], block_size=BS,
                    medium="CPU")]))
    idx.apply(KvEventBatch(pod="q", model="m", seq=5, ts=2.0, events=[
        BlockStored(block_hashes=[11, 12], token_ids=a[:2 * BS], block_size=BS, lora_name="ad")]))
    idx.apply(KvEventBatch(pod="r", model="n", seq=0, ts=3.0, events=[
        BlockStored(block_hashes=[21], token_ids=[(1 << 32) - 1, 0], block_size=2)]))
    data = encode_snapshot(idx, 9, 1.5)
    doc = msgpack.unpackb(data, strict_map_key=False)
    assert doc["format"] == SNAPSHOT_FORMAT == 5 and "tokens" not in doc
    stored = [r for b in doc["batches"] for r in b[5]]
    assert all(r[0] == "k" and len(r[1]) == len(r[2]) and len(r[1]) % 8 == 0 for r in stored)
    assert sum(len(r[1]) // 8 for r in stored) == 3 + 1 + 2 + 1  # every held block once
    seq, created, batches = decode_snapshot(data)
    restored = KvIndex(ManualClock())
    restored.apply_many(batches)
    assert (seq, created) == (9, 1.5) and restored == idx
    assert restored.match_tokens("m", a, lora="ad")["q"].matched_blocks == 2
    assert restored.match_tokens("n", [(1 << 32) - 1, 0])["r"].matched_blocks == 1


def test_snapshots_of_the_old_key_scheme_are_refused(setup):
    """Formats 2 and 3 keyed blocks with xxh3: their parent keys would not chain with today's
    keys, so they are refused and the service replays the stream instead."""
    import msgpack

    for fmt in (2, 3):
        doc = {"format": fmt, "stream_seq": 3, "created": 4.0, "tokens": {}, "batches": []}
        with pytest.raises(ValueError, match=f"format {fmt}"):
            decode_snapshot(msgpack.packb(doc))


@pytest.fixture(params=["lists", "raw"])
def fast_path(request, monkeypatch):
    """Both fast decoders: msgspec-built lists (small messages) and the native array parse (large)."""
    import consumers.index_codec as ix

    monkeypatch.setattr(ix, "RAW_PARSE_MIN_BYTES", 0 if request.param == "raw" else 1 << 30)
    return request.param


def test_fast_decoder_agrees_with_the_schema(fast_path):
    import random

    from consumers.indexer import _fast_batch, decode_batch
    from schemas import ValidationFailure
    from schemas.kv import AllBlocksCleared, BlockRemoved, PodGone, PodReset

    rng = random.Random(1)
    for _ in range(50):
        events = []
        for _ in range(rng.randint(0, 4)):
            kind = rng.randrange(5)
            if kind == 0:
                n = rng.randint(1, 3)
                events.append(BlockStored(block_hashes=[rng.getrandbits(64) for _ in range(n)],
                                          parent_block_hash=rng.choice([None, rng.getrandbits(64)]),
                                          token_ids=[rng.randrange(50000) for _ in range(n * BS)], block_size=BS,
                                          medium=rng.choice([None, "GPU", "CPU"]), lora_name=rng.choice([None, "a"])))
            elif kind == 1:
                events.append(BlockRemoved(block_hashes=[rng.getrandbits(64)], medium=rng.choice([None, "CPU"])))
            elif kind == 2:
                events.append(AllBlocksCleared())
            elif kind == 3:
                events.append(PodReset())
            else:
                events.append(PodGone())
        b = KvEventBatch(pod="p", model="m", epoch=rng.randint(0, 3), seq=rng.randint(0, 99), ts=rng.random(),
                         events=events)
        fast = _fast_batch(b.to_json())
        assert fast is not None
        for e in fast.events:  # on the raw path hashes and token ids come as parsed numpy arrays
            for name in ("block_hashes", "token_ids"):
                if hasattr(e, name):
                    v = getattr(e, name)
                    if fast_path == "raw":
                        assert isinstance(v, np.ndarray)
                        assert v.dtype == (np.uint32 if name == "token_ids" else np.uint64)
                    else:
                        assert type(v) is list
        plain = _plain(fast)
        assert plain == b
        assert plain.model_dump_json() == b.model_dump_json()  # same fields, same order
    # token ids the index cannot key take the careful path (the consumer applies those one by one)
    big = KvEventBatch(pod="p", model="m", seq=0, ts=1.0,
                       events=[BlockStored(block_hashes=[1], token_ids=[1 << 32] * BS, block_size=BS)])
    assert _fast_batch(big.to_json()) is None and decode_batch(big.to_json()) == big
    # what the fast path cannot take goes through pydantic: accepted (hex hashes) or rejected with a reason
    hexed = b'{"pod":"p","model":"m","seq":0,"ts":1,"events":[{"type":"removed","block_hashes":["00ff"]}]}'
    assert _fast_batch(hexed) is None and decode_batch(hexed).events[0].block_hashes == [255]
    for bad in (b'{"pod":"p","model":"m","seq":-1,"ts":1,"events":[]}',
                b'{"pod":"p","model":"m","seq":0,"ts":1,"events":[{"type":"stored","block_hashes":[1],'
                b'"token_ids":[1,2],"block_size":4}]}',
                b'{"pod":"p","model":"m","seq":0,"ts":1,"events":[],"extra":1}'):
        assert _fast_batch(bad) is None
        with pytest.raises(ValidationFailure):
            decode_batch(bad)


def _plain(batch: KvEventBatch) -> KvEventBatch:
    """The batch with numpy arrays turned back into lists (for comparing with the schema's)."""
    events = [e.model_copy(update={k: v.tolist() for k, v in e.__dict__.items() if isinstance(v, np.ndarray)})
              for e in batch.events]
    return batch.model_copy(update={"events": events})


def _stored_json(**over) -> bytes:
    ev = {"type": "stored", "block_hashes": [1], "token_ids": [1, 2, 3, 4], "block_size": BS} | over
    return json.dumps({"pod": "p", "model": "m", "seq": 0, "ts": 1.0, "events": [ev]}).encode()


@pytest.mark.parametrize("data,fast_ok", [
    (_stored_json(block_hashes=[(1 << 64) - 1]), True),
    (_stored_json(token_ids=[0, 1, 2, (1 << 32) - 1]), True),
    (_stored_json(parent_block_hash=(1 << 64) - 1, medium="CPU"), True),
    (_stored_json(block_hashes=[1 << 64]), False),  # too big: rejected by the schema too
    (_stored_json(block_hashes=[-5]), False),  # signed: the schema masks it to 64 bits
    (_stored_json(block_hashes=[]), False),
    (_stored_json(token_ids=[0, 1, 2, 1 << 32]), False),  # valid, but the fold cannot key it
    (_stored_json(token_ids=[0, 1, 2, -1]), False),
    (_stored_json(medium="hbm tier"), False),
    (_stored_json(parent_key=1 << 64), False),
    (_stored_json(block_size=0), False),
    (b'{"pod":"","model":"m","seq":0,"ts":1,"events":[]}', False),
    (b'{"pod":"p","model":"m","seq":0,"ts":1,"events":[],"schema_version":99}', False),
    (b'{"pod":"p","model":"m","seq":0,"ts":-1,"events":[]}', False),
    (b'{"pod":"p","model":"m","seq":0,"ts":1,"events":[{"type":"removed","block_hashes":[18446744073709551616]}]}',
     False),
])
def test_fast_decoder_takes_exactly_what_the_schema_and_fold_accept(data, fast_ok, fast_path):
    from consumers.indexer import _fast_batch, decode_batch
    from schemas import ValidationFailure, decode_event

    fast = _fast_batch(data)
    assert (fast is not None) == fast_ok
    if fast_ok:  # the same object pydantic validation builds
        slow = decode_event(KvEventBatch, data)
        assert _plain(fast) == slow and _plain(fast).model_dump_json() == slow.model_dump_json()
    else:  # the pydantic path decides: accepted as the schema says, or rejected with a reason
        try:
            decode_batch(data)
        except ValidationFailure as exc:
            assert str(exc)
