"""A binary group message read straight into columns by a compiled kernel (the indexer's hot path).

A bridge publishes one pod's consecutive batches as one group message (:mod:`schemas.kv_binary`).
Decoding it into wire structs costs a Python object per batch and per event, and the fold then
walks them in Python again: in process about half of the decode and fold's 0.37-0.49 us per stored
block (0.20-0.25 this way; bench/RESULTS.md, session 27). Here one numba call walks the whole message once, applies the
schema's checks to it, and fills per-event arrays (:class:`schemas.kv_binary.WRun`) that the fold
appends in a few array operations.

Only the shape a bridge sends all day is read this way: every batch of one pod, model and epoch,
consecutive sequences, events that are stores with block digests (no keys, salts, LoRA; one block
size) and removals. Anything else (and any message the schema refuses) gives None, and the caller
takes the message the usual way (:func:`consumers.index_codec.fold_group`, which names what is
wrong). The kernel is strict: it accepts a subset of what that path accepts, never more
(tests/test_index_columns.py compares the two on the bridges' output and on mutated messages).
"""

from __future__ import annotations

import numpy as np

from consumers import kv_wire_compiled as kwc
from consumers.kv_transcode import _str  # (fixstr / str 8 / nil; a longer name is left to the decoder)
from schemas import kv_binary
from schemas.base import SCHEMA_VERSION
from schemas.kv import MAX_EPOCH, MAX_SEQ

AVAILABLE = kwc.AVAILABLE
PAD = 16  # zero bytes after the message: a header read at its end sees a byte that is no header
MAX_MEDIUMS = 8  # distinct tier names in one message (an engine names one or two)

# info[] slots the kernel fills
_I_EVENTS, _I_HASHES, _I_DIGESTS, _I_EPOCH, _I_SEQ, _I_POD, _I_POD_LEN, _I_MODEL, _I_MODEL_LEN = range(9)
_I_BLOCK_SIZE, _I_STORED, _I_REMOVED, _I_MEDIUMS = range(9, 13)
_N_INFO = 13


def _bin(buf, pos, n):  # pragma: no cover - compiled
    """``(start, length, next)`` of a msgpack bin at ``pos``; length -1 for nil, -2 anything else."""
    c = np.int64(buf[pos])
    if c == 0xC4:
        ln, s = np.int64(buf[pos + 1]), pos + 2
    elif c == 0xC5:
        ln, s = np.int64(kwc._be(buf, pos + 1, 2)), pos + 3
    elif c == 0xC6:
        ln, s = np.int64(kwc._be(buf, pos + 1, 4)), pos + 5
    elif c == 0xC0:
        return 0, -1, pos + 1
    else:
        return 0, -2, pos
    if s + ln > n:
        return 0, -2, pos
    return s, ln, s + ln


def _same(buf, a, b, ln):  # pragma: no cover - compiled
    for j in range(ln):
        if buf[a + j] != buf[b + j]:
            return False
    return True


def _le64(buf, s, count, out, at):  # pragma: no cover - compiled
    """``count`` little-endian uint64s from ``buf[s:]`` into ``out[at:]``."""
    for j in range(count):
        p = s + 8 * j
        v = np.uint64(0)
        for k in range(7, -1, -1):
            v = (v << np.uint64(8)) | np.uint64(buf[p + k])
        out[at + j] = v


def _uint(buf, pos, n, most):  # pragma: no cover - compiled
    """``(ok, value, next)`` of a non-negative msgpack int no larger than ``most`` (-1: any uint64)."""
    kind, v, neg, nxt = kwc._int(buf, pos, n)
    if kind != 0 or neg or (most >= 0 and v > np.uint64(most)):
        return False, np.uint64(0), pos
    return True, v, nxt


def _medium(buf, pos, n, med, info):  # pragma: no cover - compiled
    """``(index, next)`` of an event's medium: -1 nil, its index in ``med`` (added when new), -2 refused."""
    s, ln, nxt = _str(buf, pos, n)
    if ln == -1:
        return -1, nxt
    if ln < 1 or ln > 32:
        return -2, pos
    k = info[_I_MEDIUMS]
    for j in range(k):
        if med[j, 1] == ln and _same(buf, med[j, 0], s, ln):
            return j, nxt
    if k == med.shape[0]:
        return -2, pos
    med[k, 0], med[k, 1] = s, ln
    info[_I_MEDIUMS] = k + 1
    return k, nxt


def _columns(buf, n, ts_bits, kind, medium, parent, has_parent, hash_end, digest_end, hashes, digests, med,
             info):  # pragma: no cover - compiled (numba), exercised through wire_run
    """Walk a group message; the number of batches, or 0 when it is not the simple shape (or not valid)."""
    if n < 6 or buf[0] != 0x92 or buf[1] != 0xA3 or buf[2] != 0x6B or buf[3] != 0x76 or buf[4] != 0x67:
        return 0
    nb, pos = kwc._array(buf, 5, n)
    if nb < 1 or nb > ts_bits.shape[0]:
        return 0
    ne = nh = nd = 0
    info[_I_MEDIUMS] = 0
    size = np.int64(-1)
    stored = removed = np.int64(0)
    for bi in range(nb):
        ln, pos = kwc._array(buf, pos, n)
        if ln != 9:
            return 0
        s, ln, pos = _str(buf, pos, n)
        if ln != 3 or buf[s] != 0x6B or buf[s + 1] != 0x76 or buf[s + 2] != 0x31:  # "kv1"
            return 0
        ok, v, pos = _uint(buf, pos, n, SCHEMA_VERSION)
        if not ok or v < 1:
            return 0
        s, ln, pos = _str(buf, pos, n)  # pod
        if ln < 1:
            return 0
        if bi == 0:
            info[_I_POD], info[_I_POD_LEN] = s, ln
        elif ln != info[_I_POD_LEN] or not _same(buf, info[_I_POD], s, ln):
            return 0
        s, ln, pos = _str(buf, pos, n)  # model
        if ln < 1:
            return 0
        if bi == 0:
            info[_I_MODEL], info[_I_MODEL_LEN] = s, ln
        elif ln != info[_I_MODEL_LEN] or not _same(buf, info[_I_MODEL], s, ln):
            return 0
        ok, v, pos = _uint(buf, pos, n, -1)  # dp_rank
        if not ok:
            return 0
        ok, v, pos = _uint(buf, pos, n, MAX_EPOCH)
        if not ok:
            return 0
        if bi == 0:
            info[_I_EPOCH] = np.int64(v)
        elif np.int64(v) != info[_I_EPOCH]:
            return 0
        ok, v, pos = _uint(buf, pos, n, MAX_SEQ)
        if not ok:
            return 0
        if bi == 0:
            info[_I_SEQ] = np.int64(v)
        elif np.int64(v) != info[_I_SEQ] + bi:
            return 0
        if buf[pos] != 0xCB or pos + 9 > n:  # ts: a float64
            return 0
        ts_bits[bi] = kwc._be(buf, pos + 1, 8)
        pos += 9
        count, pos = kwc._array(buf, pos, n)
        if count < 1:
            return 0
        for _ in range(count):
            if ne == kind.shape[0]:
                return 0
            ln, pos = kwc._array(buf, pos, n)
            s, tl, pos = _str(buf, pos, n)
            if tl != 1:
                return 0
            tag = buf[s]
            hs, hl, pos = _bin(buf, pos, n)
            if hl < 8 or hl % 8:
                return 0
            blocks = hl // 8
            if nh + blocks > hashes.shape[0]:
                return 0
            if tag == 0x73 and ln == 12:  # "s"
                s, tl, pos = _bin(buf, pos, n)  # token ids: none (digests instead)
                if tl != 0:
                    return 0
                ok, v, pos = _uint(buf, pos, n, -1)  # block_size
                if not ok or v == 0:
                    return 0
                if size == -1:
                    if v > np.uint64(1 << 31):
                        return 0
                    size = np.int64(v)
                elif np.int64(v) != size:
                    return 0
                if buf[pos] == 0xC0:
                    has_parent[ne] = 0
                    parent[ne] = 0
                    pos += 1
                else:
                    ok, v, pos = _uint(buf, pos, n, -1)
                    if not ok:
                        return 0
                    has_parent[ne] = 1
                    parent[ne] = v
                if buf[pos] != 0xC0 or buf[pos + 1] != 0xC0:  # lora_id, lora_name
                    return 0
                m, pos = _medium(buf, pos + 2, n, med, info)
                if m == -2:
                    return 0
                if buf[pos] != 0xC0 or buf[pos + 1] != 0xC0 or buf[pos + 2] != 0xC0:  # salts, parent_key, keys
                    return 0
                ds, dl, pos = _bin(buf, pos + 3, n)
                if dl != hl:  # one digest per block
                    return 0
                _le64(buf, ds, blocks, digests, nd)
                nd += blocks
                kind[ne] = 0
                stored += blocks
            elif tag == 0x72 and (ln == 2 or ln == 3):  # "r"
                m = np.int64(-1)
                if ln == 3:
                    m, pos = _medium(buf, pos, n, med, info)
                    if m == -2:
                        return 0
                kind[ne] = 1
                has_parent[ne] = 0
                parent[ne] = 0
                removed += blocks
            else:
                return 0
            _le64(buf, hs, blocks, hashes, nh)
            nh += blocks
            medium[ne] = m
            hash_end[ne] = nh
            digest_end[ne] = 2 * nd
            ne += 1
    if pos != n:  # trailing bytes: not one message
        return 0
    info[_I_EVENTS], info[_I_HASHES], info[_I_DIGESTS] = ne, nh, nd
    info[_I_BLOCK_SIZE], info[_I_STORED], info[_I_REMOVED] = size, stored, removed
    return nb


if AVAILABLE:
    from numba import njit
    from streams.kv_core import NO_NRT


    _bin = njit(inline="always", cache=True)(_bin)
    _same = njit(inline="always", cache=True)(_same)
    _le64 = njit(inline="always", cache=True)(_le64)
    _uint = njit(inline="always", cache=True)(_uint)
    _medium = njit(cache=True, **NO_NRT)(_medium)
    _kernel = njit(cache=True, **NO_NRT)(_columns)
else:
    _kernel = None


def wire_run(data: bytes, decode) -> kv_binary.WRun | None:  # noqa: ANN001 - decode: bytes -> list[WBatch]
    """The group message ``data`` as a :class:`~schemas.kv_binary.WRun`, or None when it is not a
    group in the simple shape (or the kernel is not available): then the caller decodes it as
    usual. ``decode`` is kept for :meth:`~schemas.kv_binary.WRun.batches` (the caller's checked
    group decoder)."""
    if _kernel is None or data[:5] != b"\x92\xa3kvg":
        return None
    n = len(data)
    buf = np.frombuffer(data + bytes(PAD), dtype=np.uint8)
    cap_events = n // 8 + 1  # an event takes more than 8 bytes
    cap_blocks = n // 8 + 1
    ts_bits = np.empty(min(n // 16 + 1, 1 << 20), dtype=np.uint64)
    kind = np.empty(cap_events, dtype=np.uint8)
    medium = np.empty(cap_events, dtype=np.int64)
    parent = np.empty(cap_events, dtype=np.uint64)
    has_parent = np.empty(cap_events, dtype=np.uint8)
    hash_end = np.empty(cap_events, dtype=np.int64)
    digest_end = np.empty(cap_events, dtype=np.int64)
    hashes = np.empty(cap_blocks, dtype=np.uint64)
    digests = np.empty(cap_blocks, dtype=np.uint64)
    med = np.zeros((MAX_MEDIUMS, 2), dtype=np.int64)
    info = np.zeros(_N_INFO, dtype=np.int64)
    nb = _kernel(buf, n, ts_bits, kind, medium, parent, has_parent, hash_end, digest_end, hashes, digests, med, info)
    if not nb:
        return None
    i = info.tolist()
    try:
        pod = data[i[_I_POD]:i[_I_POD] + i[_I_POD_LEN]].decode()
        model = data[i[_I_MODEL]:i[_I_MODEL] + i[_I_MODEL_LEN]].decode()
        mediums = [data[s:s + ln].decode() for s, ln in med[:i[_I_MEDIUMS]].tolist()]
    except UnicodeDecodeError:
        return None
    if not all(kv_binary.MEDIUM_RE.match(m) for m in mediums):
        return None
    ts = ts_bits[:nb].view(np.float64)
    if not (ts >= 0).all():  # (NaN too)
        return None
    ne = i[_I_EVENTS]
    return kv_binary.WRun(pod, model, i[_I_EPOCH], i[_I_SEQ], ts, i[_I_BLOCK_SIZE], kind[:ne], medium[:ne], mediums,
                          parent[:ne], has_parent[:ne], hash_end[:ne], digest_end[:ne], hashes[:i[_I_HASHES]],
                          digests[:i[_I_DIGESTS]], i[_I_STORED], i[_I_REMOVED], data, decode)


def warm_up() -> bool:
    """Compile the kernel (or load it from numba's cache) now. False without numba."""
    if _kernel is None:
        return False
    one = kv_binary.encode_wire(kv_binary.WBatch(1, "p", "m", 0, 0, 0, 0.0, [
        kv_binary.WStored(memoryview(bytes(8)), memoryview(b""), 16, None, None, None, None, None, None, None,
                          memoryview(bytes(8))),
        kv_binary.WRemoved(memoryview(bytes(8)), "GPU")]))
    wire_run(kv_binary.group([one, one]), lambda d: [])  # (compiles; the same seq twice: refused)
    return True
