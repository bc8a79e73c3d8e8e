"""vLLM's KV-event frames straight into the bus's binary batches, compiled (numba; optional).

The bridge's common case is a run of in-order frames from one engine in vLLM's current shape (an
array ``KVEventBatch`` of map events). For those, one kernel call reads every frame of the run and
writes each one's :mod:`schemas.kv_binary` batch (the bytes ``kv_binary.encode`` would give for the
batch :class:`consumers.kv_wire.FrameDecoder` makes of it), with no Python object per event.

The kernel takes only frames it can transcode without judgement: every event indexed as it is. It
stops at the first frame that is anything else (another shape, an event the index would skip: a
partial KV-cache group, an offload placeholder, extra keys, a LoRA name, a malformed value...), and
:class:`consumers.kv_wire.FrameDecoder` decides that one (it counts skips, dead-letters, learns
groups) before the kernel goes on with the next. ``tests/test_kv_transcode.py`` checks the bytes
against the Python path on vLLM's own fixtures and on generated frames.
"""

from __future__ import annotations

import msgspec
import numpy as np

from consumers.kv_wire_compiled import _TOKEN_SIZE, AVAILABLE, PAD, _array, _be, _digest, _int, njit
from schemas import kv_binary

OK, STOP = 0, 1

# constant strings the kernel compares with, end to end in one array: (offset, length) each
_WORDS = [b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id", b"medium",
          b"lora_name", b"extra_keys", b"group_idx", b"kv_cache_spec_kind", b"BlockStored", b"BlockRemoved",
          b"AllBlocksCleared", b"full_attention", b"mla_attention", b"sink_full_attention"]
_CONST = np.frombuffer(b"".join(_WORDS), dtype=np.uint8)
_OFF = np.cumsum([0] + [len(w) for w in _WORDS]).astype(np.int64)
(K_TYPE, K_HASHES, K_PARENT, K_TOKENS, K_BS, K_LORA_ID, K_MEDIUM, K_LORA_NAME, K_EXTRA, K_GROUP, K_KIND,
 V_STORED, V_REMOVED, V_CLEARED, V_FULL, V_MLA, V_SINK) = range(len(_WORDS))


def _word(buf, s, ln, w, lower):  # pragma: no cover - compiled
    """buf[s:s+ln] equals word ``w`` (ASCII-lower-cased first when ``lower``)."""
    o = _OFF[w]
    if _OFF[w + 1] - o != ln:
        return False
    for j in range(ln):
        c = np.int64(buf[s + j])
        if lower and 65 <= c <= 90:
            c += 32
        if c != _CONST[o + j]:
            return False
    return True


def _skip(buf, pos, n):  # pragma: no cover - compiled
    """The position after the msgpack value at ``pos`` (-1 when malformed or cut short)."""
    left = 1
    while left > 0:
        if pos >= n:
            return -1
        c = np.int64(buf[pos])
        left -= 1
        if c <= 0x7F or c >= 0xE0 or c == 0xC0 or c == 0xC2 or c == 0xC3:
            pos += 1
        elif c <= 0x8F:
            left += 2 * (c - 0x80)
            pos += 1
        elif c <= 0x9F:
            left += c - 0x90
            pos += 1
        elif c <= 0xBF:
            pos += 1 + (c - 0xA0)
        elif c == 0xC4 or c == 0xD9:
            pos += 2 + np.int64(buf[pos + 1])
        elif c == 0xC5 or c == 0xDA:
            pos += 3 + np.int64(_be(buf, pos + 1, 2))
        elif c == 0xC6 or c == 0xDB:
            pos += 5 + np.int64(_be(buf, pos + 1, 4))
        elif c == 0xC7:
            pos += 3 + np.int64(buf[pos + 1])
        elif c == 0xC8:
            pos += 4 + np.int64(_be(buf, pos + 1, 2))
        elif c == 0xC9:
            pos += 6 + np.int64(_be(buf, pos + 1, 4))
        elif c == 0xCA or c == 0xCE or c == 0xD2:
            pos += 5
        elif c == 0xCB or c == 0xCF or c == 0xD3:
            pos += 9
        elif c == 0xCC or c == 0xD0:
            pos += 2
        elif c == 0xCD or c == 0xD1:
            pos += 3
        elif 0xD4 <= c <= 0xD8:  # fixext 1, 2, 4, 8, 16
            pos += 2 + (1 << (c - 0xD4))
        elif c == 0xDC:
            left += np.int64(_be(buf, pos + 1, 2))
            pos += 3
        elif c == 0xDD:
            left += np.int64(_be(buf, pos + 1, 4))
            pos += 5
        elif c == 0xDE:
            left += 2 * np.int64(_be(buf, pos + 1, 2))
            pos += 3
        elif c == 0xDF:
            left += 2 * np.int64(_be(buf, pos + 1, 4))
            pos += 5
        else:
            return -1
    return pos if pos <= n else -1


def _str(buf, pos, n):  # pragma: no cover - compiled
    """``(start, length, next)`` of a str at ``pos``; length -1 when it is nil, -2 when not a str."""
    c = np.int64(buf[pos])
    if 0xA0 <= c <= 0xBF:
        ln = c - 0xA0
        s = pos + 1
    elif c == 0xD9:
        ln = np.int64(buf[pos + 1])
        s = pos + 2
    elif c == 0xC0:
        return 0, -1, pos + 1
    else:
        return 0, -2, pos
    if s + ln > n:
        return 0, -2, pos
    return s, ln, s + ln


def _w_be(out, p, v, size):  # pragma: no cover - compiled
    """``v``'s low ``size`` bytes, big-endian, after the marker at ``out[p]``; the next position."""
    for j in range(size):
        out[p + size - j] = np.uint8(v & np.uint64(0xFF))
        v >>= np.uint64(8)
    return p + 1 + size


def _w_uint(out, p, v):  # pragma: no cover - compiled
    """msgpack's shortest form of the unsigned ``v`` (as msgspec writes it)."""
    if v <= np.uint64(0x7F):
        out[p] = np.uint8(v)
        return p + 1
    if v <= np.uint64(0xFF):
        out[p] = 0xCC
        return _w_be(out, p, v, 1)
    if v <= np.uint64(0xFFFF):
        out[p] = 0xCD
        return _w_be(out, p, v, 2)
    if v <= np.uint64(0xFFFFFFFF):
        out[p] = 0xCE
        return _w_be(out, p, v, 4)
    out[p] = 0xCF
    return _w_be(out, p, v, 8)


def _w_int(out, p, v, neg):  # pragma: no cover - compiled
    """msgpack's shortest form of a signed int given as two's complement (msgspec's choice)."""
    if not neg:
        return _w_uint(out, p, v)
    s = np.int64(v)
    if s >= -32:
        out[p] = np.uint8(v & np.uint64(0xFF))
        return p + 1
    if s >= -128:
        out[p] = 0xD0
        return _w_be(out, p, v, 1)
    if s >= -32768:
        out[p] = 0xD1
        return _w_be(out, p, v, 2)
    if s >= -2147483648:
        out[p] = 0xD2
        return _w_be(out, p, v, 4)
    out[p] = 0xD3
    return _w_be(out, p, v, 8)


def _w_bin(out, p, nbytes):  # pragma: no cover - compiled
    if nbytes <= 0xFF:
        out[p] = 0xC4
        out[p + 1] = nbytes
        return p + 2
    if nbytes <= 0xFFFF:
        out[p] = 0xC5
        out[p + 1] = nbytes >> 8
        out[p + 2] = nbytes & 0xFF
        return p + 3
    out[p] = 0xC6
    for j in range(4):
        out[p + 4 - j] = (nbytes >> (8 * j)) & 0xFF
    return p + 5


def _w_medium(out, p, buf, s, ln):  # pragma: no cover - compiled
    """The medium name upper-cased (the schema's tier name), or -1 when it is not one
    (``[A-Z][A-Z0-9_]{0,31}`` after upper-casing): the Python path then skips the event."""
    if ln < 0:
        out[p] = 0xC0
        return p + 1
    if ln == 0 or ln > 32:
        return -1
    if ln < 32:
        out[p] = 0xA0 + ln
        q = p + 1
    else:
        out[p] = 0xD9
        out[p + 1] = ln
        q = p + 2
    for j in range(ln):
        c = np.int64(buf[s + j])
        if 97 <= c <= 122:
            c -= 32
        if not (65 <= c <= 90 or (j > 0 and (48 <= c <= 57 or c == 95))):
            return -1
        out[q + j] = c
    return q + ln


def _hashes(buf, pos, n, out, p):  # pragma: no cover - compiled
    """Write the msgpack array of block hashes at ``pos`` as a bin of uint64 LE at ``out[p]``
    (ints, negative ones as two's complement; bytes: their last 8 big-endian). ``(count, next
    input, next output)``; count -1 when refused."""
    m, pos = _array(buf, pos, n)
    if m < 0:
        return -1, pos, p
    p = _w_bin(out, p, 8 * m)
    for _ in range(m):
        if pos >= n:
            return -1, pos, p
        c = np.int64(buf[pos])
        if c == 0xCF and pos + 9 <= n:  # the common case: a 64-bit hash, reversed into little-endian
            for j in range(8):
                out[p + j] = buf[pos + 8 - j]
            pos += 9
            p += 8
            continue
        if c == 0xC4:
            ok, v, pos = _digest(buf, pos, n)
            if not ok:
                return -1, pos, p
        else:
            kind, v, neg, pos = _int(buf, pos, n)
            if kind != 0:
                return -1, pos, p
        for j in range(8):
            out[p + j] = np.uint8(v & np.uint64(0xFF))
            v >>= np.uint64(8)
        p += 8
    return m, pos, p


def _tokens(buf, pos, n, out, p):  # pragma: no cover - compiled
    """Write the msgpack array of token ids at ``pos`` as a bin of uint32 LE (each in [0, 2**32)).
    ``(count, next input, next output)``; count -1 when refused."""
    m, pos = _array(buf, pos, n)
    if m < 0:
        return -1, pos, p
    p = _w_bin(out, p, 4 * m)
    for _ in range(m):  # no branch on each value's width (it varies from value to value)
        c = buf[pos]
        size = _TOKEN_SIZE[c]
        if size == 255 or pos + 1 + size > n:
            return -1, pos, p
        w = _be(buf, pos + 1, 4) >> np.uint64(32 - 8 * size)
        if size == 0:
            w = np.uint64(c)
        out[p] = np.uint8(w & np.uint64(0xFF))
        out[p + 1] = np.uint8((w >> np.uint64(8)) & np.uint64(0xFF))
        out[p + 2] = np.uint8((w >> np.uint64(16)) & np.uint64(0xFF))
        out[p + 3] = np.uint8((w >> np.uint64(24)) & np.uint64(0xFF))
        pos += 1 + size
        p += 4
    return m, pos, p


def _event(buf, pos, n, out, p, groups, digests, dg):  # pragma: no cover - compiled
    """One map event at ``pos`` written as its wire struct at ``out[p]``. ``(status, next input,
    next output, stored blocks, removed blocks)``; ``groups[0]`` / ``groups[1]``: bit masks of the
    KV-cache groups known to be full / partial (a store naming its group's kind updates them);
    ``digests``: a store carries its blocks' digests in place of its token ids, computed into the
    scratch ``dg`` (room for one per byte of the frame)."""
    c = np.int64(buf[pos])
    if 0x80 <= c <= 0x8F:
        nk = c - 0x80
        pos += 1
    elif c == 0xDE:
        nk = np.int64(_be(buf, pos + 1, 2))
        pos += 3
    else:
        return STOP, pos, p, 0, 0
    etype = -1
    nh = nt = -1  # hashes / token ids read (written at out[p + 3:q_h] / out[q_h:q_t])
    q_h = q_t = 0
    tk_at = -1
    parent_kind = 1
    parent = np.uint64(0)
    bs_kind = 1
    bs = np.uint64(0)
    lora_kind = 1
    lora = np.uint64(0)
    lora_neg = False
    med_s = 0
    med_ln = -1
    group_kind = 1
    group = np.uint64(0)
    kind_ln = -1
    full = False
    for _ in range(nk):
        if pos >= n:
            return STOP, pos, p, 0, 0
        ks, kl, pos = _str(buf, pos, n)
        if kl < 0 or pos >= n:
            return STOP, pos, p, 0, 0
        if _word(buf, ks, kl, K_TYPE, False):
            vs, vl, pos = _str(buf, pos, n)
            if vl < 0:
                return STOP, pos, p, 0, 0
            if _word(buf, vs, vl, V_STORED, False):
                etype = 0
            elif _word(buf, vs, vl, V_REMOVED, False):
                etype = 1
            elif _word(buf, vs, vl, V_CLEARED, False):
                etype = 2
            else:
                return STOP, pos, p, 0, 0
            continue
        if _word(buf, ks, kl, K_HASHES, False):
            if nh >= 0:
                return STOP, pos, p, 0, 0
            # written where both stores and removals hold them (after the array header and tag)
            nh, pos, q_h = _hashes(buf, pos, n, out, p + 3)
            if nh < 0:
                return STOP, pos, p, 0, 0
            continue
        elif _word(buf, ks, kl, K_TOKENS, False):
            if nt >= 0 or tk_at >= 0:
                return STOP, pos, p, 0, 0
            if nh >= 0:  # vLLM's order: the hashes came first, the ids follow them
                nt, pos, q_t = _tokens(buf, pos, n, out, q_h)
                if nt < 0:
                    return STOP, pos, p, 0, 0
                continue
            tk_at = pos  # written after the map is read
        elif _word(buf, ks, kl, K_PARENT, False):
            if buf[pos] == 0xC4:  # a digest (an empty one: the Python path)
                ok, parent, pos = _digest(buf, pos, n)
                if not ok:
                    return STOP, pos, p, 0, 0
                parent_kind = 0
                continue
            parent_kind, parent, neg, q = _int(buf, pos, n)
            if parent_kind < 0:
                return STOP, pos, p, 0, 0
            pos = q
            continue
        elif _word(buf, ks, kl, K_BS, False):
            bs_kind, bs, neg, q = _int(buf, pos, n)
            if bs_kind != 0 or neg:
                return STOP, pos, p, 0, 0
            pos = q
            continue
        elif _word(buf, ks, kl, K_LORA_ID, False):
            lora_kind, lora, lora_neg, q = _int(buf, pos, n)
            if lora_kind < 0:
                return STOP, pos, p, 0, 0
            pos = q
            continue
        elif _word(buf, ks, kl, K_MEDIUM, False):
            med_s, med_ln, q = _str(buf, pos, n)
            if med_ln == -2:
                return STOP, pos, p, 0, 0
            pos = q
            continue
        elif _word(buf, ks, kl, K_LORA_NAME, False):
            if buf[pos] != 0xC0:  # a LoRA name: its blocks are salted, the Python path does that
                return STOP, pos, p, 0, 0
        elif _word(buf, ks, kl, K_EXTRA, False):
            if buf[pos] != 0xC0 and buf[pos] != 0x90:  # extra keys: salts, the Python path
                return STOP, pos, p, 0, 0
        elif _word(buf, ks, kl, K_GROUP, False):
            group_kind, group, neg, q = _int(buf, pos, n)
            if group_kind < 0 or neg or group >= np.uint64(64):
                return STOP, pos, p, 0, 0
            pos = q
            continue
        elif _word(buf, ks, kl, K_KIND, False):
            vs, kind_ln, q = _str(buf, pos, n)
            if kind_ln == -2:
                return STOP, pos, p, 0, 0
            full = kind_ln >= 0 and (_word(buf, vs, kind_ln, V_FULL, True) or _word(buf, vs, kind_ln, V_MLA, True)
                                     or _word(buf, vs, kind_ln, V_SINK, True))
            pos = q
            continue
        pos = _skip(buf, pos, n)  # a field the index does not use (or an array read below)
        if pos < 0:
            return STOP, 0, p, 0, 0
    # KV-cache groups (consumers.kv_wire._group_skip): only events the index takes as they are
    if etype != 2:
        if kind_ln >= 0 and group_kind == 0 and etype == 0:  # (removals carry no kind)
            if not full:
                return STOP, pos, p, 0, 0
            bit = np.uint64(1) << group
            groups[0] |= bit
            groups[1] &= ~bit
        elif group_kind == 1 or group == np.uint64(0):
            if groups[1] & np.uint64(1):
                return STOP, pos, p, 0, 0
        elif not groups[0] & (np.uint64(1) << group):
            return STOP, pos, p, 0, 0
    if etype == 0:
        if nh <= 0 or bs_kind != 0 or bs == np.uint64(0):
            return STOP, pos, p, 0, 0
        if nt < 0 and tk_at >= 0:
            nt, _, q_t = _tokens(buf, tk_at, n, out, q_h)
        if nt <= 0 or np.uint64(nt) != np.uint64(nh) * bs:
            return STOP, pos, p, 0, 0
        out[p] = 0x9C
        out[p + 1] = 0xA1
        out[p + 2] = 115  # "s"
        q = q_t
        if digests:  # the ids (written at q_h) give way to an empty bin; their digests go last
            b = np.int64(bs)
            toks = out[q_t - 4 * nt:q_t].view(np.uint32)
            for i in range(nh):
                dg[i] = _block_digest(toks, i * b, b)
            out[q_h] = 0xC4
            out[q_h + 1] = 0
            q = q_h + 2
        q = _w_uint(out, q, bs)
        if parent_kind == 1:
            out[q] = 0xC0
            q += 1
        else:
            q = _w_uint(out, q, parent)
        if lora_kind == 1:
            out[q] = 0xC0
            q += 1
        else:
            q = _w_int(out, q, lora, lora_neg)
        out[q] = 0xC0  # lora_name
        q = _w_medium(out, q + 1, buf, med_s, med_ln)
        if q < 0:
            return STOP, pos, p, 0, 0
        out[q] = 0xC0  # block_salts, parent_key, block_keys
        out[q + 1] = 0xC0
        out[q + 2] = 0xC0
        q += 3
        if not digests:
            out[q] = 0xC0
            return OK, pos, q + 1, nh, 0
        q = _w_bin(out, q, 8 * nh)
        for i in range(nh):
            v = dg[i]
            for j in range(8):
                out[q + j] = np.uint8(v & np.uint64(0xFF))
                v >>= np.uint64(8)
            q += 8
        return OK, pos, q, nh, 0
    if etype == 1:
        if nh <= 0:
            return STOP, pos, p, 0, 0
        out[p] = 0x93
        out[p + 1] = 0xA1
        out[p + 2] = 114  # "r"
        q = _w_medium(out, q_h, buf, med_s, med_ln)
        if q < 0:
            return STOP, pos, p, 0, 0
        return OK, pos, q, 0, nh
    if etype == 2:
        out[p] = 0x92
        out[p + 1] = 0xA1
        out[p + 2] = 99  # "c"
        q = _w_medium(out, p + 3, buf, med_s, med_ln)
        if q < 0:
            return STOP, pos, p, 0, 0
        return OK, pos, q, 0, 0
    return STOP, pos, p, 0, 0


def _frames(buf, starts, ends, seqs, head, dp_default, epoch, groups, out, out_end, counts, digests,  # pragma: no cover
            dg):
    """Transcode frames ``buf[starts[i]:ends[i]]`` in order into ``out`` (frame ``i``'s batch ends at
    ``out_end[i]``; its stored / removed blocks in ``counts[i]``) until one the kernel does not take.
    Returns how many were transcoded."""
    p = 0
    for f in range(starts.shape[0]):
        pos, n = starts[f], ends[f]
        g0, g1 = groups[0], groups[1]
        if n - pos < 12 or buf[pos] < 0x92 or buf[pos] > 0x93 or buf[pos + 1] != 0xCB:
            return f  # (the header, the time and an events array take 12 bytes at least)
        three = buf[pos] == 0x93
        ts_at = pos + 2
        if buf[ts_at] >= 0x80 or (buf[ts_at] == 0x7F and buf[ts_at + 1] >= 0xF0):
            return f  # a negative time or NaN: the Python path refuses the frame
        pos += 10
        m, pos = _array(buf, pos, n)
        if m < 0 or m > 0xFFFF:
            return f
        dp = np.uint64(dp_default)
        # the header: ["kv1", schema_version, pod, model, dp_rank, epoch, seq, ts, [events]]
        q = p
        out[q] = 0x99
        q += 1
        for j in range(head.shape[0]):
            out[q + j] = head[j]
        q += head.shape[0]
        # dp_rank comes after the events in vLLM's batch: the events are written past room for the
        # rest of the header (dp_rank, epoch, seq, ts, the events' array header: at most 39 bytes)
        # and moved down into place once it is known
        dp_at = q
        scratch = q + 40
        e = scratch
        stored = 0
        removed = 0
        ok = True
        for _ in range(m):
            if pos >= n:
                ok = False
                break
            st, pos, e, s_n, r_n = _event(buf, pos, n, out, e, groups, digests, dg)
            if st != OK:
                ok = False
                break
            stored += s_n
            removed += r_n
        if ok and three:
            if pos >= n:
                ok = False
            else:
                kind, v, neg, pos = _int(buf, pos, n)
                if kind < 0 or neg:
                    ok = False
                elif kind == 0:
                    dp = v
        if not ok or pos != n:
            groups[0], groups[1] = g0, g1
            return f
        q = _w_uint(out, dp_at, dp)
        q = _w_uint(out, q, np.uint64(epoch))
        q = _w_uint(out, q, np.uint64(seqs[f]))
        out[q] = 0xCB
        for j in range(8):
            out[q + 1 + j] = buf[ts_at + j]
        q += 9
        if m < 16:
            out[q] = 0x90 + m
            q += 1
        else:
            out[q] = 0xDC
            out[q + 1] = m >> 8
            out[q + 2] = m & 0xFF
            q += 3
        size = e - scratch
        for j in range(size):  # into place (scratch is past q: a forward copy is safe)
            out[q + j] = out[scratch + j]
        p = q + size
        out_end[f] = p
        counts[f, 0] = stored
        counts[f, 1] = removed
    return starts.shape[0]


if AVAILABLE:
    from streams.kv_core import NO_NRT

    from streams.kv_core import _digest as _block_digest  # (the index's own block digest; numba)

    _word = njit(inline="always", cache=True)(_word)
    _skip = njit(cache=True, **NO_NRT)(_skip)
    _str = njit(inline="always", cache=True)(_str)
    _w_be = njit(inline="always", cache=True)(_w_be)
    _w_uint = njit(inline="always", cache=True)(_w_uint)
    _w_int = njit(cache=True, **NO_NRT)(_w_int)
    _w_bin = njit(inline="always", cache=True)(_w_bin)
    _w_medium = njit(cache=True, **NO_NRT)(_w_medium)
    _hashes = njit(cache=True, **NO_NRT)(_hashes)
    _tokens = njit(cache=True, **NO_NRT)(_tokens)
    _event = njit(cache=True, **NO_NRT)(_event)
    transcode_frames = njit(cache=True, **NO_NRT)(_frames)
else:
    transcode_frames = None


class Transcoder:
    """One engine's frames -> bus batches (a pod and model fixed; KV-cache groups shared with the
    :class:`consumers.kv_wire.FrameDecoder` that decides the frames this one stops at)."""

    def __init__(self, pod: str, model: str, dp_rank: int, groups: dict[int, bool], *, digests: bool = True) -> None:
        empty = msgspec.msgpack.encode(kv_binary.WBatch(kv_binary.SCHEMA_VERSION, pod, model, 0, 0, 0, 0.0, []))
        self.head = np.frombuffer(empty[1:-13], dtype=np.uint8).copy()  # "kv1", version, pod, model
        self.dp_rank = dp_rank
        self.groups = groups  # the FrameDecoder's (group -> holds full prefixes)
        self.digests = digests  # stores carry block digests (streams.kv_core) in place of token ids
        self._masks = np.zeros(2, dtype=np.uint64)
        self._out = np.empty(1 << 16, dtype=np.uint8)
        self._dg = np.empty(1 << 12, dtype=np.uint64)  # the kernel's scratch: one store's block digests

    def _sync_in(self) -> bool:
        full = partial = 0
        for g, is_full in self.groups.items():
            if not 0 <= g < 64:
                return False  # a group the masks cannot hold: leave these frames to the Python path
            if is_full:
                full |= 1 << g
            else:
                partial |= 1 << g
        self._masks[0], self._masks[1] = full, partial
        return True

    def _sync_out(self) -> None:
        full = int(self._masks[0])
        g = 0
        while full:
            if full & 1:
                self.groups[g] = True
            full >>= 1
            g += 1

    def transcode(self, payloads: list[bytes], first_seq: int, epoch: int) -> list[tuple[bytes, int, int]]:
        """The bus batches of ``payloads`` (consecutive frames from ``first_seq``), as
        ``(batch bytes, stored blocks, removed blocks)``, for as many leading frames as the kernel
        takes (all of them, or up to the first it leaves to the Python path)."""
        if not payloads or not self._sync_in():
            return []
        lens = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads))
        ends = np.cumsum(lens)
        starts = ends - lens
        buf = np.frombuffer(b"".join((*payloads, bytes(PAD))), dtype=np.uint8)
        # the output's bound: a hash can grow from 1 byte (a fixint) to 8, a token id from 1 to 4
        # (to 8 as the digest of a one-token block); each batch adds its header (pod and model
        # included) and its scratch room
        need = 8 * int(ends[-1]) + (len(self.head) + 128) * len(payloads) + 64
        if need > len(self._out):
            self._out = np.empty(need, dtype=np.uint8)
        k = len(payloads)
        seqs = np.arange(first_seq, first_seq + k, dtype=np.int64)
        out_end = np.zeros(k, dtype=np.int64)
        counts = np.zeros((k, 2), dtype=np.int64)
        longest = int(lens.max()) + 1  # (a block's hash takes a byte at least: no frame has more blocks)
        if longest > len(self._dg):
            self._dg = np.empty(max(longest, 2 * len(self._dg)), dtype=np.uint64)
        done = transcode_frames(buf, starts, ends, seqs, self.head, self.dp_rank, epoch, self._masks, self._out,
                                out_end, counts, self.digests, self._dg)
        if self._masks[0]:
            self._sync_out()
        out, ends_out, n = self._out, out_end[:done].tolist(), counts[:done].tolist()
        return [(out[b:e].tobytes(), st, rm) for b, e, (st, rm) in zip([0, *ends_out], ends_out, n)]


def warm_up() -> bool:
    """Compile the kernel (or load it from numba's cache) now. False without numba."""
    if not AVAILABLE:
        return False
    t = Transcoder("p", "m", 0, {})
    frame = msgspec.msgpack.encode((1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                           "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                                           "lora_name": None}], 0))
    t.transcode([frame], 0, 0)
    return True
