"""Block digests in place of token ids: the keys they chain into are the keys the token ids give,
the contract refuses digests that do not fit, and messages from before digests still read."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from consumers.index_codec import decode_batch, wire_batch
from consumers.kv_bridge import encode_batch
from schemas import ValidationFailure, kv_binary
from schemas.kv import BlockStored, KvEventBatch
from streams import kv_core
from streams.clock import ManualClock
from streams.kv_index import KvIndex, block_keys

U64 = (1 << 64) - 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.integers(0, 6), st.integers(0, U64), st.integers(0, 2**32 - 1))
def test_chained_digests_are_the_keys_of_the_token_ids(bs, n, seed, top):
    rng = np.random.default_rng(top)
    toks = rng.integers(0, top + 1, size=n * bs, dtype=np.uint64).astype(np.uint32)
    d = kv_core.block_digests(toks, bs, n)
    assert d.shape == (n,)
    assert kv_core.chain_digests(d, np.uint64(seed)).tolist() == kv_core.chain_keys(toks, bs, n, np.uint64(seed)).tolist()


def test_a_digest_depends_on_the_tokens_and_a_key_on_every_block_before_it():
    toks = np.arange(64, dtype=np.uint32)
    other = toks.copy()
    other[20] += 1  # block 1 of 4 (block size 16)
    a, b = kv_core.block_digests(toks, 16, 4), kv_core.block_digests(other, 16, 4)
    assert a[0] == b[0] and a[1] != b[1] and a[2:].tolist() == b[2:].tolist()
    ka, kb = kv_core.chain_digests(a, np.uint64(7)), kv_core.chain_digests(b, np.uint64(7))
    assert ka[0] == kb[0] and all(ka[i] != kb[i] for i in range(1, 4))  # the chain carries the change on
    assert 0 not in ka.tolist()


def _stored(**kw) -> dict:
    base = {"block_hashes": [1, 2], "token_ids": [], "block_size": 2}
    base.update(kw)
    return base


@pytest.mark.parametrize("kw, why", [
    ({"block_digests": [5]}, "1 digests for 2 blocks"),
    ({"block_digests": [5, 6], "token_ids": [1, 2, 3, 4]}, "token_ids must be empty"),
    ({"block_digests": [5, 6], "block_keys": [7, 8]}, "not both"),
    ({"block_digests": [5, -1]}, "integers in"),
])
def test_the_schema_refuses_digests_that_do_not_fit(kw, why):
    with pytest.raises(ValidationError, match=why):
        BlockStored(**_stored(**kw))


def test_a_batch_with_digests_folds_as_json_and_binary_like_one_with_token_ids():
    toks = list(range(100, 112))  # three blocks of 4
    digests = kv_core.block_digests(np.array(toks, dtype=np.uint32), 4, 3).tolist()
    with_ids = KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[11, 12, 13], token_ids=toks, block_size=4)])
    with_digests = KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[11, 12, 13], token_ids=[], block_size=4, block_digests=digests)])
    indexes = []
    for batch in (with_ids, KvEventBatch.from_bytes(with_digests.model_dump_json().encode()),
                  decode_batch(kv_binary.encode(with_digests)), wire_batch(kv_binary.encode(with_digests))):
        idx = KvIndex(ManualClock())
        idx.apply(batch)
        indexes.append(idx)
    assert indexes[0] == indexes[1] == indexes[2] == indexes[3]
    got = indexes[3].match_keys("m", block_keys(toks, 4))
    assert got["p"].matched_blocks == 3
    # a parent given by its engine hash chains the same way
    more = list(range(200, 208))
    for idx, ev in ((indexes[0], BlockStored(block_hashes=[14, 15], token_ids=more, block_size=4, parent_block_hash=13)),
                    (indexes[3], BlockStored(block_hashes=[14, 15], token_ids=[], block_size=4, parent_block_hash=13,
                                             block_digests=kv_core.block_digests(np.array(more, dtype=np.uint32), 4, 2).tolist()))):
        idx.apply(KvEventBatch(pod="p", model="m", seq=1, ts=2.0, events=[ev]))
    assert indexes[0] == indexes[3]
    assert indexes[3].match_keys("m", block_keys(toks + more, 4))["p"].matched_blocks == 5


def test_binary_digests_of_the_wrong_length_are_refused():
    w = kv_binary.to_wire(KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2], token_ids=[], block_size=2, block_digests=[3, 4])]))
    w.events[0].block_digests = kv_binary.pack([3], "Q")
    data = kv_binary.encode_wire(w)
    with pytest.raises(ValueError, match="one digest per block"):
        wire_batch(data)
    with pytest.raises(ValidationFailure):
        decode_batch(data)


def test_a_store_from_before_digests_still_reads():
    """A binary store written before the field existed (11 items, no digests) decodes as before."""
    old = msgspec.msgpack.encode(["kv1", 1, "p", "m", 0, 0, 3, 1.0, [
        ["s", kv_binary.pack([1, 2], "Q"), kv_binary.pack([5, 6, 7, 8], "I"), 2, None, None, None, None, None, None,
         None]]])
    w = wire_batch(old)
    assert w.events[0].block_digests is None and len(w.events[0].token_ids) == 4
    idx, ref = KvIndex(ManualClock()), KvIndex(ManualClock())
    idx.apply(w)
    ref.apply(KvEventBatch(pod="p", model="m", seq=3, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2], token_ids=[5, 6, 7, 8], block_size=2)]))
    assert idx == ref and len(idx) > 0


def test_the_bridge_sends_a_quarter_of_the_bytes_for_16_token_blocks():
    rng = np.random.default_rng(1)
    batch = KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=rng.integers(1, 1 << 62, 32).tolist(),
                    token_ids=rng.integers(0, 151_000, 32 * 16).tolist(), block_size=16)])
    digested, hdrs = encode_batch(batch)
    ids, _ = encode_batch(batch, digests=False)
    assert hdrs[kv_binary.HDR_CONTENT_TYPE] == kv_binary.CONTENT_TYPE
    assert wire_batch(digested).events[0].block_digests is not None
    assert len(digested) * 4 < len(ids) * 1.1  # 16 bytes per block against 72
