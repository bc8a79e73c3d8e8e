"""Query bodies of the indexer API (no server needed): inputs, tokenization, errors."""

from __future__ import annotations

import pytest

from consumers.indexer import QueryError, decode_snapshot, encode_snapshot, record_route, run_query
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


def test_fast_decoder_agrees_with_the_schema():
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
        assert fast is not None and fast == b
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
