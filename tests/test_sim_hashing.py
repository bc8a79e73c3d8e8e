"""Block hashing matches an independent computation of vLLM's definition, and the
tokenizers are deterministic."""

from __future__ import annotations

import hashlib
import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.hashing import BlockHasher, to_external
from simulator.tokenizer import HFTokenizer, SimpleTokenizer, prompt_to_ids


def _vllm_sha256(obj) -> bytes:  # written out from vLLM's definition, not imported
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    if n < 256:
        return bytes([major << 5 | 24, n])
    if n < 65536:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    return bytes([major << 5 | 26]) + struct.pack(">I", n)


def _cbor(obj) -> bytes:
    """A hand-written canonical CBOR encoder for the few types hashes use."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(type(obj))


def _independent(tokens, block_size, digest):
    none = digest("vllm-none-hash")
    parent, out = none, []
    for i in range(len(tokens) // block_size):
        parent = digest((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.mark.parametrize("algo,digest", [
    ("sha256", _vllm_sha256),
    ("sha256_cbor", lambda o: hashlib.sha256(_cbor(o)).digest()),
])
def test_block_hashes_match_independent_computation(algo, digest):
    tokens = [(i * 7919) % 50_000 for i in range(16 * 5 + 3)]
    hasher = BlockHasher(16, algo)
    assert hasher.external_hashes(tokens) == _independent(tokens, 16, digest)
    assert len(hasher.external_hashes(tokens)) == 5  # the partial block is not hashed


def test_seed_changes_root_and_chain_continues():
    tokens = list(range(64))
    a, b = BlockHasher(16), BlockHasher(16, seed="0")
    assert a.hash_blocks(tokens) != b.hash_blocks(tokens)
    assert b.none_hash == _vllm_sha256("0")  # PYTHONHASHSEED=0 in vLLM
    full = a.hash_blocks(tokens)
    tail = a.hash_blocks(tokens, parent=full[1], start_block=2)
    assert tail == full[2:]


def test_cache_salt_only_changes_hashes_from_the_first_block():
    tokens = list(range(48))
    h = BlockHasher(16)
    plain, salted = h.hash_blocks(tokens), h.hash_blocks(tokens, cache_salt="tenant-a")
    assert all(x != y for x, y in zip(plain, salted))  # chained: all differ
    assert salted[0] == _vllm_sha256((h.none_hash, tuple(tokens[:16]), (("cache_salt", "tenant-a"),)))  # vLLM 0.33 tags it
    assert salted[1] == _vllm_sha256((salted[0], tuple(tokens[16:32]), None))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 100_000), min_size=0, max_size=200), st.integers(1, 32))
def test_prefix_property(tokens, bs):
    h = BlockHasher(bs)
    full = h.external_hashes(tokens)
    cut = len(tokens) // 2
    assert h.external_hashes(tokens[:cut]) == full[: cut // bs]
    assert all(0 <= x < 2**64 for x in full)


def test_to_external_is_low_64_bits():
    d = bytes(range(32))
    assert to_external(d) == int.from_bytes(d[24:], "big")


def test_simple_tokenizer_is_stable_and_round_trips():
    t = SimpleTokenizer(1000)
    ids = t.encode("Hello, world! Hello")
    assert ids[0] == ids[-1] and len(ids) == 5
    assert all(t.RESERVED <= i < 1000 for i in ids)
    assert SimpleTokenizer(1000).encode("Hello, world! Hello") == ids
    gen = [17, 99, 999, 500]
    assert t.encode(t.decode(gen)) == gen


def test_prompt_forms():
    t = SimpleTokenizer(1000)
    assert prompt_to_ids(t, "a b") == t.encode("a b")
    assert prompt_to_ids(t, [1, 2, 3]) == [1, 2, 3]
    assert prompt_to_ids(t, [[4, 5]]) == [4, 5]
    assert prompt_to_ids(t, None, prompt_token_ids=[7]) == [7]
    with pytest.raises(ValueError):
        prompt_to_ids(t, [1, "x"])
    with pytest.raises(ValueError):
        prompt_to_ids(t, [5000])
    with pytest.raises(ValueError):
        prompt_to_ids(t, None)


def test_hf_tokenizer_from_local_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "the dog"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    ids = hf.encode("the cat sat")
    assert len(ids) == 3 and ids[0] == hf.encode("the")[0]
    assert hf.decode(ids).split() == ["the", "cat", "sat"]
    assert "<|user|>" in hf.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError):
        HFTokenizer(tmp_path / "missing")


def test_memo_does_not_change_hashes():
    tokens = list(range(500))
    plain, memo = BlockHasher(16, memo_size=0), BlockHasher(16, memo_size=8)
    assert memo.hash_blocks(tokens) == plain.hash_blocks(tokens)
    assert memo.hash_blocks(tokens) == plain.hash_blocks(tokens)  # second pass: from the memo / after clears
