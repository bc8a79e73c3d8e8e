"""The toy tokenizer's ASCII path, compiled with numba (optional: imported only when numba is).

:class:`simulator.tokenizer.SimpleTokenizer` maps each word (``\\w+``) and each other
non-space character to an id: a canonical syllable word (``"ba"``..``"zu"`` pairs, no leading
``"ba"``) is its number in base 70, anything else ``xxh64(word) % span``, both offset by the
reserved ids. Those are pure functions of the word's bytes, so for ASCII text one pass over the
bytes gives every id with no Python object per word. The ids are the ones the Python path gives,
checked by a property test (tests/test_router_tokenize.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from streams.kv_core import NO_NRT

U64 = np.uint64
_P1 = U64(11400714785074694791)
_P2 = U64(14029467366897019727)
_P3 = U64(1609587929392839161)
_P4 = U64(9650029242287828579)
_P5 = U64(2870177450012600261)

# byte classes: 0 other (a one-character token), 1 word (\w), 2 space (str.isspace)
_CLASS = np.zeros(128, dtype=np.uint8)
for _b in range(128):
    _c = chr(_b)
    if _c.isalnum() or _c == "_":
        _CLASS[_b] = 1
    elif _c.isspace():
        _CLASS[_b] = 2


def syllable_table(syllables: list[str]) -> np.ndarray:
    """``table[(a - 97) * 26 + (b - 97)]``: the index of syllable ``ab``, or -1."""
    t = np.full(26 * 26, -1, dtype=np.int64)
    for i, s in enumerate(syllables):
        t[(ord(s[0]) - 97) * 26 + ord(s[1]) - 97] = i
    return t


@njit(inline="always", cache=True)
def _rotl(x, r):
    return (x << U64(r)) | (x >> U64(64 - r))


@njit(inline="always", cache=True)
def _round(acc, lane):
    acc = acc + lane * _P2
    return _rotl(acc, 31) * _P1


@njit(inline="always", cache=True)
def _read_le(b, i, n):
    """``n`` bytes of ``b`` from ``i``, little-endian."""
    v = U64(0)
    for k in range(n):
        v |= U64(b[i + k]) << U64(8 * k)
    return v


@njit(inline="always", cache=True)
def xxh64(b, start, end):
    """XXH64 with seed 0 of ``b[start:end]`` (what ``xxhash.xxh64_intdigest`` gives)."""
    n = end - start
    i = start
    if n >= 32:
        v1 = _P1 + _P2
        v2 = _P2
        v3 = U64(0)
        v4 = U64(0) - _P1
        while i + 32 <= end:
            v1 = _round(v1, _read_le(b, i, 8))
            v2 = _round(v2, _read_le(b, i + 8, 8))
            v3 = _round(v3, _read_le(b, i + 16, 8))
            v4 = _round(v4, _read_le(b, i + 24, 8))
            i += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        for v in (v1, v2, v3, v4):
            h ^= _round(U64(0), v)
            h = h * _P1 + _P4
    else:
        h = _P5
    h += U64(n)
    while i + 8 <= end:
        h ^= _round(U64(0), _read_le(b, i, 8))
        h = _rotl(h, 27) * _P1 + _P4
        i += 8
    if i + 4 <= end:
        h ^= _read_le(b, i, 4) * _P1
        h = _rotl(h, 23) * _P2 + _P3
        i += 4
    while i < end:
        h ^= U64(b[i]) * _P5
        h = _rotl(h, 11) * _P1
        i += 1
    h ^= h >> U64(33)
    h *= _P2
    h ^= h >> U64(29)
    h *= _P3
    h ^= h >> U64(32)
    return h


@njit(inline="always", cache=True)
def _word_id(b, start, end, syl, nsyl, reserved, vocab_size, span):
    n = end - start
    canonical = n % 2 == 0 and not (n > 2 and b[start] == 98 and b[start + 1] == 97)  # no leading "ba"
    if canonical:
        v = 0
        for i in range(start, end, 2):
            c0 = b[i] - 97
            c1 = b[i + 1] - 97
            if c0 < 0 or c0 >= 26 or c1 < 0 or c1 >= 26:
                canonical = False
                break
            s = syl[c0 * 26 + c1]
            if s < 0:
                canonical = False
                break
            v = v * nsyl + s
            if v + reserved >= vocab_size:  # past the vocabulary (and it only grows)
                canonical = False
                break
        if canonical:
            return v + reserved
    return np.int64(xxh64(b, start, end) % U64(span)) + reserved


@njit(cache=True)
def encode_ascii(b, syl, nsyl, reserved, vocab_size, out):
    """Ids of the ASCII bytes ``b`` into ``out`` (at least ``len(b)`` long); returns how many."""
    none = np.empty(0, dtype=np.int64)
    return encode_ascii_marks(b, 0, syl, nsyl, reserved, vocab_size, out, none, none)


@njit(cache=True, **NO_NRT)
def encode_ascii_marks(b, start, syl, nsyl, reserved, vocab_size, out, cuts, marks):
    """:func:`encode_ascii` of ``b[start:]``, also counting, for each offset in ``cuts`` (ascending,
    each at a whitespace byte, so no token spans it), the ids produced before it into ``marks``."""
    cls = _CLASS
    span = vocab_size - reserved
    n = len(b)
    k = 0
    i = start
    j = 0
    nc = len(cuts)
    while i < n:
        while j < nc and cuts[j] <= i:
            marks[j] = k
            j += 1
        c = cls[b[i]]
        if c == 2:
            i += 1
        elif c == 1:
            e = i + 1
            while e < n and cls[b[e]] == 1:
                e += 1
            out[k] = _word_id(b, i, e, syl, nsyl, reserved, vocab_size, span)
            k += 1
            i = e
        else:
            out[k] = _word_id(b, i, i + 1, syl, nsyl, reserved, vocab_size, span)
            k += 1
            i += 1
    while j < nc:
        marks[j] = k
        j += 1
    return k
