"""The compiled walk of vLLM's msgpack integer arrays gives what the Python path gives, or refuses.

Arrays are encoded by msgspec (as vLLM's own encoder writes them): every integer width, negative
hashes (vLLM's signed ints), bytes digests, and values the index cannot take."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import kv_wire_compiled as kc

pytestmark = pytest.mark.skipif(not kc.AVAILABLE, reason="numba is not installed")

U64 = (1 << 64) - 1
hash_values = st.one_of(st.integers(-(1 << 63), U64), st.binary(min_size=1, max_size=40))
token_values = st.integers(0, (1 << 32) - 1)


def _hash(v) -> int:  # the Python path's rule (consumers.kv_wire._hash)
    return int.from_bytes(v[-8:], "big") if isinstance(v, bytes) else v & U64


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(hash_values, max_size=40), st.lists(token_values, max_size=300)), max_size=4))
def test_arrays_decode_to_the_python_values(events):
    raw, kinds, want64, want32, want_counts = b"", b"", [], [], []
    for hashes, tokens in events:
        raw += msgspec.msgpack.encode(hashes) + msgspec.msgpack.encode(tokens)
        kinds += bytes((kc.KIND_HASHES, kc.KIND_TOKENS))
        want64 += [_hash(v) for v in hashes]
        want32 += tokens
        want_counts += [len(hashes), len(tokens)]
    got = kc.Arrays(16).parse([raw], kinds)  # small buffers: they must grow
    assert got is not None
    h64, t32, counts = got
    assert h64.tolist() == want64 and t32.tolist() == want32 and counts == want_counts


@pytest.mark.parametrize("tokens", [[1, -2], [1 << 32], [1.5], ["a"], [[1]], [None], [b"\x01"]])
def test_token_ids_the_index_cannot_take_are_refused(tokens):
    assert kc.Arrays().parse([msgspec.msgpack.encode(tokens)], bytes((kc.KIND_TOKENS,))) is None


@pytest.mark.parametrize("raw, kinds", [
    (msgspec.msgpack.encode([b""]), b"\x00"),  # an empty digest
    (msgspec.msgpack.encode([1.0]), b"\x00"),
    (msgspec.msgpack.encode({"a": 1}), b"\x00"),  # not an array
    (msgspec.msgpack.encode([1, 2])[:-1], b"\x00"),  # cut short
    (msgspec.msgpack.encode([1]) + b"\x01", b"\x00"),  # bytes left over
    (msgspec.msgpack.encode([1]), b"\x00\x00"),  # fewer arrays than kinds
    (msgspec.msgpack.encode([b"x" * 300]), b"\x00"),  # bin 16: left to the Python path
])
def test_malformed_arrays_are_refused(raw, kinds):
    assert kc.Arrays().parse([raw], kinds) is None


def test_long_arrays_use_the_wide_headers():
    tokens = list(range(70_000))  # array 32 header, every token width
    h64, t32, counts = kc.Arrays().parse([msgspec.msgpack.encode(tokens)], bytes((kc.KIND_TOKENS,)))
    assert t32.tolist() == tokens and counts == [70_000] and len(h64) == 0
