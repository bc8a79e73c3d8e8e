"""The compiled part of :mod:`consumers.kv_wire`: vLLM's msgpack integer arrays straight into numpy.

A vLLM ``BlockStored`` of 32 blocks of 16 tokens carries 544 integers; decoding them into Python
ints (about 20-50 ns each, and a list to hold them) was most of the bridge's CPU. Here the raw
msgpack of those arrays (``msgspec.Raw`` slices of the frame, joined) is walked once by a numba
kernel into a ``uint64`` array (block hashes) and a ``uint32`` array (token ids).

Optional: the engine-side sidecar may run without numba (the base install); :data:`AVAILABLE`
says whether the kernel can be used, and :mod:`consumers.kv_wire` falls back to its Python path
when not (or when the kernel refuses an array: the Python path then names the reason).
"""

from __future__ import annotations

import sys

import numpy as np

try:
    from numba import njit
except ImportError:  # the base install: the Python path only
    njit = None

AVAILABLE = njit is not None and sys.byteorder == "little"  # its arrays go on the wire as they are (LE)

PAD = 8  # bytes the kernel may read past the arrays' end (never used)
_TOKEN_SIZE = np.full(256, 255, dtype=np.uint8)  # bytes after a token id's first byte; 255: not a token id
_TOKEN_SIZE[:0x80] = 0  # positive fixint
_TOKEN_SIZE[0xCC], _TOKEN_SIZE[0xCD], _TOKEN_SIZE[0xCE] = 1, 2, 4  # uint 8 / 16 / 32
_PADDING = bytes(PAD)

KIND_HASHES = 0  # u64: ints (negative ones as two's complement, like vLLM's signed hashes) or bytes (last 8, big-endian)
KIND_TOKENS = 1  # u32: non-negative ints below 2**32


def _be(buf, pos, size):  # pragma: no cover - compiled
    """``size`` bytes from ``pos``, big-endian (a constant ``size`` unrolls)."""
    v = np.uint64(0)
    for j in range(size):
        v = (v << np.uint64(8)) | np.uint64(buf[pos + j])
    return v


def _int(buf, pos, n):  # pragma: no cover - compiled
    """``(kind, value, negative, next)`` of the msgpack value at ``pos``: kind 0 an int (two's
    complement in ``value``), 1 nil, -1 anything else (or cut short)."""
    c = np.int64(buf[pos])
    if c <= 0x7F:
        return 0, np.uint64(c), False, pos + 1
    if c == 0xC0:
        return 1, np.uint64(0), False, pos + 1
    if c >= 0xE0:
        return 0, np.uint64(0xFFFFFFFFFFFFFF00) | np.uint64(c), True, pos + 1
    if 0xCC <= c <= 0xCF:
        size = 1 << (c - 0xCC)
        if pos + 1 + size > n:
            return -1, np.uint64(0), False, pos
        return 0, _be(buf, pos + 1, size), False, pos + 1 + size
    if 0xD0 <= c <= 0xD3:
        size = 1 << (c - 0xD0)
        if pos + 1 + size > n:
            return -1, np.uint64(0), False, pos
        v = _be(buf, pos + 1, size)
        neg = buf[pos + 1] >= 0x80
        if neg and size < 8:
            v |= ~((np.uint64(1) << np.uint64(8 * size)) - np.uint64(1))
        return 0, v, neg, pos + 1 + size
    return -1, np.uint64(0), False, pos


def _array(buf, pos, n):  # pragma: no cover - compiled
    """``(count, next)`` of an array header at ``pos`` (count -1 when not an array)."""
    c = np.int64(buf[pos])
    if 0x90 <= c <= 0x9F:
        return c - 0x90, pos + 1
    if c == 0xDC and pos + 3 <= n:
        return np.int64(_be(buf, pos + 1, 2)), pos + 3
    if c == 0xDD and pos + 5 <= n:
        return np.int64(_be(buf, pos + 1, 4)), pos + 5
    return -1, pos


def _digest(buf, pos, n):  # pragma: no cover - compiled
    """``(ok, value, next)`` of a bin 8 digest at ``pos``: its last 8 bytes, big-endian, as vLLM
    turns a digest into an int (an empty one is refused)."""
    size = np.int64(buf[pos + 1]) if pos + 1 < n else np.int64(0)
    if size == 0 or pos + 2 + size > n:
        return False, np.uint64(0), pos
    take = 8 if size > 8 else size
    return True, _be(buf, pos + 2 + size - take, take), pos + 2 + size


def _parse(buf, n, kinds, out64, out32, counts):  # pragma: no cover - compiled (numba), exercised through kv_wire
    """Parse msgpack arrays laid end to end in ``buf[:n]`` (uint8; ``buf`` holds at least :data:`PAD`
    more bytes, read but never used); array ``i`` is of kind ``kinds[i]``, its values go to ``out64``
    (hashes) or ``out32`` (token ids), its length to ``counts[i]`` (the outputs hold at least ``n``
    values: a msgpack value takes a byte or more). Returns ``(bad, n64, n32)``: ``bad`` is -1, or
    the index of the first array that is not an array of such values (``len(kinds)`` when bytes
    are left over)."""
    k = kinds.shape[0]
    p64 = 0
    p32 = 0
    pos = 0
    for a in range(k):
        if pos >= n:
            return a, 0, 0
        m, pos = _array(buf, pos, n)
        if m < 0:
            return a, 0, 0
        if kinds[a] == KIND_TOKENS:
            # token ids: fixint, uint 8 / 16 / 32, decoded without a branch on the width (which
            # varies from value to value): read 4 bytes and shift away what is not the value's
            for _ in range(m):
                c = buf[pos]
                size = _TOKEN_SIZE[c]
                if size == 255 or pos + 1 + size > n:
                    return a, 0, 0
                w = _be(buf, pos + 1, 4)
                out32[p32] = np.uint32(c) if size == 0 else np.uint32(w >> np.uint64(32 - 8 * size))
                pos += 1 + size
                p32 += 1
            counts[a] = m
            continue
        for _ in range(m):
            if pos >= n:
                return a, 0, 0
            c = buf[pos]
            if c == 0xCF and pos + 9 <= n:  # the common case: a 64-bit hash
                out64[p64] = _be(buf, pos + 1, 8)
                p64 += 1
                pos += 9
                continue
            if c == 0xC4:  # bin 8: a bytes digest
                ok, v, pos = _digest(buf, pos, n)
                if not ok:
                    return a, 0, 0
            else:
                kind, v, neg, pos = _int(buf, pos, n)
                if kind != 0:
                    return a, 0, 0
            out64[p64] = v
            p64 += 1
        counts[a] = m
    if pos != n:
        return k, 0, 0
    return -1, p64, p32


if AVAILABLE:
    from streams.kv_core import NO_NRT

    _be = njit(inline="always", cache=True)(_be)
    _int = njit(inline="always", cache=True)(_int)
    _array = njit(inline="always", cache=True)(_array)
    _digest = njit(inline="always", cache=True)(_digest)
    parse_arrays = njit(cache=True, **NO_NRT)(_parse)
else:
    parse_arrays = None


def raw_arrays(events, stored: tuple[type, ...], removed: tuple[type, ...]) -> tuple[list, bytes]:
    """The raw integer arrays of decoded events (each store's hashes then token ids, each removal's
    hashes) and their kinds (:data:`KIND_HASHES` / :data:`KIND_TOKENS`), in order: what a kernel
    walks in one call."""
    raws: list = []
    kinds = bytearray()
    for e in events:
        t = type(e)
        if t in stored:
            raws.append(e.block_hashes)
            raws.append(e.token_ids)
            kinds += b"\x00\x01"
        elif t in removed:
            raws.append(e.block_hashes)
            kinds += b"\x00"
    return raws, bytes(kinds)


def warm_up() -> bool:
    """Compile the kernel (or load it from numba's cache) now rather than on the first frame.
    False when numba is not installed."""
    if not AVAILABLE:
        return False
    Arrays(8).parse([b"\x92\x01\xcc\xff", b"\x91\xc4\x01\x07"], b"\x01\x00")
    return True


class Arrays:
    """Reusable output buffers for :func:`parse_arrays` (one per decoder, grown as needed)."""

    __slots__ = ("out64", "out32", "counts")

    def __init__(self, size: int = 1 << 14) -> None:
        self.out64 = np.empty(size, dtype=np.uint64)
        self.out32 = np.empty(size, dtype=np.uint32)
        self.counts = np.empty(256, dtype=np.int64)

    def parse(self, parts: list, kinds: bytes) -> tuple[memoryview, memoryview, list[int]] | None:
        """The hashes (a ``"Q"`` memoryview), token ids (``"I"``) and per-array lengths of the
        msgpack arrays ``parts`` (bytes-like, one array each; kinds as bytes of :data:`KIND_HASHES`
        / :data:`KIND_TOKENS`), over fresh bytes in native order. None when one array is refused."""
        raw = b"".join((*parts, _PADDING))
        n = len(raw) - PAD
        if n > len(self.out64):
            self.out64 = np.empty(n, dtype=np.uint64)
            self.out32 = np.empty(n, dtype=np.uint32)
        if len(kinds) > len(self.counts):
            self.counts = np.empty(len(kinds), dtype=np.int64)
        bad, n64, n32 = parse_arrays(np.frombuffer(raw, dtype=np.uint8), n, np.frombuffer(kinds, dtype=np.uint8),
                                     self.out64, self.out32, self.counts)
        if bad >= 0:
            return None
        return (memoryview(self.out64[:n64].tobytes()).cast("Q"), memoryview(self.out32[:n32].tobytes()).cast("I"),
                self.counts[:len(kinds)].tolist())
