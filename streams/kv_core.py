"""The KV index's compiled core: open-addressing tables in numpy arrays, worked by numba.

Pure functions over arrays (no I/O, no clock): :mod:`streams.kv_index` owns the arrays and
the semantics around them (epochs, predictions, dump); this module holds the per-block work,
which in Python dicts cost ~2.6 us per stored-then-removed block, mostly cache misses on
boxed ints. Here a block is a few probes into flat rows of ``uint64``.

Our block key
    ``key[i] = combine(key[i-1], digest(tokens of block i))``. The digest folds each pair of
    uint32 token ids in as one 64-bit word by multiply-xor-rotate and finishes with murmur3's
    64-bit mixer; it depends on the block's tokens only, so a KV bridge can send a block's
    digest (8 bytes) in place of its token ids (4 per token) and the index chains it here.
    ``combine`` is a bijection in each argument. Keys are never 0 (0 marks an empty row). The
    same function serves ingest and queries, so the router and the indexer always agree; it
    does not depend on how an engine hashes.

Tables (rows of ``uint64``; capacity a power of two, linear probing, backward-shift deletes)
    ``kt``  key table, one row per distinct key of the model: ``[key, mask words...]`` with
            ``T * W`` mask words (tier-major: ``1 + tier * W + slot // 64``), bit ``slot % 64``.
    ``em``  engine map, one row per (pod slot, tier, engine hash): ``[hash, holder + 1, key]``
            with ``holder = slot * 8 + tier``; resolves parents and removals.
    ``ex``  extra references, ``[key, holder + 1, count]``: the same key held by one pod and
            tier under more than one engine hash (aliases), so a removal keeps the bit; and
            ``[hash ^ DUP_MARK, holder + 1, count]``: further physical blocks of one engine
            hash (vLLM can compute the same block twice and then sends one ``BlockRemoved``
            per physical block), so only the last removal drops it.
    ``sz``  row counts ``[kt, em, ex]``; ``cnt[slot, tier]`` engine hashes held.

Operations arrive as flat arrays (one row per stored/removed event, hashes and tokens
concatenated) so one call applies a whole chunk of batches in order. A call stops before an
operation that could overflow a table and says which; the caller grows it and calls again.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir as _ir
from numba import njit, types
from numba.core import cgutils
from numba.core.cpu import CPUTargetOptions
from numba.extending import intrinsic

U64 = np.uint64
#: numba options for a kernel that allocates no array (its callers pass every buffer in): no reference
#: counting. With it, numba wraps each inlined helper in atomic increments and decrements of every
#: array's count, which took 31% of the fold's samples (py-spy; bench/RESULTS.md, session 32). Empty
#: on a numba without the option (the kernels then count references as before).
NO_NRT = {"_nrt": False} if hasattr(CPUTargetOptions, "_nrt") else {}
LOAD = 0.6  # grow a table before it would pass this load factor
TIER_BITS = 3  # holder = slot << 3 | tier (a model has at most 5 tiers)

# operation kinds and parent kinds
OP_STORE, OP_REMOVE = 0, 1
PARENT_ROOT, PARENT_HASH, PARENT_KEY, KEYS_GIVEN = 0, 1, 2, 3
DIGESTS = 8  # or-ed into a parent kind: the operation's "tokens" are one digest per block (2 words)

# stats slots
S_STORED, S_REMOVED, S_UNKNOWN_PARENT, S_UNKNOWN_PARENT_BLOCKS, S_UNKNOWN_REMOVED, S_DUPLICATES, \
    S_ALIASES = range(7)
N_STATS = 7

DUP_MARK = U64(0xD1B54A32D192ED03)  # ex rows of extra physical copies are keyed hash ^ DUP_MARK

# need flags (what to grow before the operation that did not fit)
NEED_KT, NEED_EM, NEED_EX = 1, 2, 4

_M1 = U64(0x9E3779B97F4A7C15)
_M2 = U64(0xC2B2AE3D27D4EB4F)
_M3 = U64(0x165667B19E3779F9)
_F1 = U64(0xFF51AFD7ED558CCD)
_F2 = U64(0xC4CEB9FE1A85EC53)


@njit(inline="always", cache=True)
def _fmix(h):
    h ^= h >> U64(33)
    h *= _F1
    h ^= h >> U64(33)
    h *= _F2
    h ^= h >> U64(33)
    return h


@njit(inline="always", cache=True)
def _digest(tokens, start, bs):
    """A block's digest: its ``bs`` token ids from ``tokens[start]`` (no chaining)."""
    h = U64(bs) * _M1
    j = 0
    while j + 1 < bs:
        w = U64(tokens[start + j]) | (U64(tokens[start + j + 1]) << U64(32))
        h ^= w * _M2
        h = ((h << U64(29)) | (h >> U64(35))) * _M1
        j += 2
    if j < bs:
        h ^= U64(tokens[start + j]) * _M2
        h = ((h << U64(29)) | (h >> U64(35))) * _M1
    return _fmix(h ^ U64(bs))


@njit(inline="always", cache=True)
def _combine(seed, d):
    """The key of a block of digest ``d`` after a block keyed ``seed`` (never 0)."""
    h = seed ^ _M3
    h ^= d * _M2
    h = _fmix(((h << U64(31)) | (h >> U64(33))) * _M1)
    if h == U64(0):
        h = U64(1)
    return h


@njit(inline="always", cache=True)
def _hash_block(tokens, start, bs, seed):
    return _combine(seed, _digest(tokens, start, bs))


@njit(cache=True)
def chain_keys(tokens, bs, n, seed):
    """Keys of the first ``n`` full blocks of ``tokens`` (uint32), chained from ``seed``."""
    out = np.empty(n, dtype=np.uint64)
    s = U64(seed)
    for i in range(n):
        s = _hash_block(tokens, i * bs, bs, s)
        out[i] = s
    return out


@njit(cache=True)
def block_digests(tokens, bs, n):
    """The digest of each of the first ``n`` full blocks of ``tokens`` (uint32)."""
    out = np.empty(n, dtype=np.uint64)
    for i in range(n):
        out[i] = _digest(tokens, i * bs, bs)
    return out


@njit(cache=True)
def chain_digests(digests, seed):
    """Keys of blocks given by their digests, chained from ``seed`` (= :func:`chain_keys`)."""
    n = digests.shape[0]
    out = np.empty(n, dtype=np.uint64)
    s = U64(seed)
    for i in range(n):
        s = _combine(s, digests[i])
        out[i] = s
    return out


# ------------------------------------------------------------------------------ prefetch

# LLVM 17+ has only opaque pointers (llvm.prefetch.p0); before, numba's typed i8* overload is p0i8
_PREFETCH = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"
PREFETCH_AHEAD = 12  # query walk: rows requested this many blocks ahead


@intrinsic
def _prefetch_row(typingctx, arr, row):
    """Ask the CPU to start loading row ``row`` of a 2-D array (no load, no fault, no wait)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2 or not isinstance(row, types.Integer):
        return None
    sig = types.void(arr, row)

    def codegen(context, builder, signature, args):
        aryty, rowty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        r = context.cast(builder, args[1], rowty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [r, context.get_constant(types.intp, 0)],
                                       wraparound=False)
        i8p = _ir.IntType(8).as_pointer()
        i32 = _ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                                            _PREFETCH)
        # read, keep in all cache levels, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), _ir.Constant(i32, 0), _ir.Constant(i32, 3), _ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# ------------------------------------------------------------------------------ key table


@njit(inline="always", cache=True)
def _kt_find(kt, key):
    mask = kt.shape[0] - 1
    i = np.int64(key & U64(mask))
    while True:
        k = kt[i, 0]
        if k == key:
            return i
        if k == U64(0):
            return -1
        i = (i + 1) & mask


@njit(inline="always", cache=True)
def _kt_find_or_insert(kt, sz, key):
    mask = kt.shape[0] - 1
    i = np.int64(key & U64(mask))
    while True:
        k = kt[i, 0]
        if k == key:
            return i
        if k == U64(0):
            kt[i, 0] = key
            sz[0] += 1
            return i
        i = (i + 1) & mask


@njit(cache=True, **NO_NRT)
def _kt_delete(kt, sz, i):
    mask = kt.shape[0] - 1
    cols = kt.shape[1]
    j = i
    while True:
        j = (j + 1) & mask
        k = kt[j, 0]
        if k == U64(0):
            break
        home = np.int64(k & U64(mask))
        # the row at j may move to the hole at i unless its home lies cyclically in (i, j]
        if i <= j:
            if i < home <= j:
                continue
        elif home > i or home <= j:
            continue
        for c in range(cols):
            kt[i, c] = kt[j, c]
        i = j
    for c in range(cols):
        kt[i, c] = U64(0)
    sz[0] -= 1


# ----------------------------------------------------------------- pair tables (em, ex)


@njit(inline="always", cache=True)
def _p_home(a, b, mask):
    return np.int64(_fmix(a ^ (b * _M3)) & U64(mask))


@njit(inline="always", cache=True)
def _p_find(t, a, b):
    mask = t.shape[0] - 1
    i = _p_home(a, b, mask)
    while True:
        tb = t[i, 1]
        if tb == U64(0):
            return -1
        if tb == b and t[i, 0] == a:
            return i
        i = (i + 1) & mask


@njit(inline="always", cache=True)
def _p_put(t, a, b, v):
    """Put a row into a pair table being rebuilt (the pair is known to be absent)."""
    mask = t.shape[0] - 1
    i = _p_home(a, b, mask)
    while t[i, 1] != U64(0):
        i = (i + 1) & mask
    t[i, 0] = a
    t[i, 1] = b
    t[i, 2] = v


@njit(inline="always", cache=True)
def _p_insert(t, sz, which, a, b, v):
    """Insert (a, b) -> v and count it in ``sz[which]``; the pair must not be present."""
    _p_put(t, a, b, v)
    sz[which] += 1


@njit(cache=True, **NO_NRT)
def _p_delete(t, sz, which, i):
    mask = t.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if t[j, 1] == U64(0):
            break
        home = _p_home(t[j, 0], t[j, 1], mask)
        if i <= j:
            if i < home <= j:
                continue
        elif home > i or home <= j:
            continue
        t[i, 0] = t[j, 0]
        t[i, 1] = t[j, 1]
        t[i, 2] = t[j, 2]
        i = j
    t[i, 0] = U64(0)
    t[i, 1] = U64(0)
    t[i, 2] = U64(0)
    sz[which] -= 1


@njit(inline="always", cache=True)
def _kt_put(out, src, r):
    """Copy key-table row ``r`` of ``src`` into ``out`` being rebuilt (the key is known to be absent)."""
    mask = out.shape[0] - 1
    i = np.int64(src[r, 0] & U64(mask))
    while out[i, 0] != U64(0):
        i = (i + 1) & mask
    for c in range(src.shape[1]):
        out[i, c] = src[r, c]


# ------------------------------------------------------------------------------ growing


# Tables are allocated by numpy, never inside a kernel: numpy advises the kernel to back large
# arrays with transparent huge pages (numba's allocator does not), so a table of millions of
# rows costs a query a cache miss per block but rarely a TLB miss as well.


def table(rows: int, cols: int) -> np.ndarray:
    """A zeroed table (numpy's allocator: huge pages for large tables where the kernel allows)."""
    return np.zeros((rows, cols), dtype=np.uint64)


@njit(cache=True, **NO_NRT)
def _rehash_kt(kt, out):
    for r in range(kt.shape[0]):
        if kt[r, 0] != U64(0):
            _kt_put(out, kt, r)


def grow_kt(kt, new_cap, out=None):
    """``kt`` rehashed into a table of ``new_cap`` rows: ``out`` (zeroed, of that shape: made ahead,
    :mod:`streams.kv_spares`) or a new one."""
    if out is None:
        out = table(new_cap, kt.shape[1])
    _rehash_kt(kt, out)
    return out


@njit(cache=True, **NO_NRT)
def _rehash_pairs(t, out):
    for r in range(t.shape[0]):
        if t[r, 1] != U64(0):
            _p_put(out, t[r, 0], t[r, 1], t[r, 2])


def grow_pairs(t, new_cap, out=None):
    """A pair table rehashed into ``new_cap`` rows (``out``: as :func:`grow_kt`'s)."""
    if out is None:
        out = table(new_cap, 3)
    _rehash_pairs(t, out)
    return out


# ------------------------------------------------------------------------- apply a chunk


@njit(inline="always", cache=True)
def _add_one(kt, em, ex, sz, cnt, W, holder, h, k, stats):
    b = U64(holder + 1)
    _p_insert(em, sz, 1, h, b, k)
    slot = holder >> TIER_BITS
    tier = holder & 7
    cnt[slot, tier] += 1
    ki = _kt_find_or_insert(kt, sz, k)
    col = 1 + tier * W + (slot >> 6)
    bit = U64(1) << U64(slot & 63)
    if kt[ki, col] & bit:
        x = _p_find(ex, k, b)
        if x >= 0:
            ex[x, 2] += U64(1)
        else:
            _p_insert(ex, sz, 2, k, b, U64(1))
        stats[S_ALIASES] += 1
    else:
        kt[ki, col] |= bit


@njit(inline="always", cache=True)
def _remove_at(kt, em, ex, sz, cnt, W, holder, e, stats):
    k = em[e, 2]
    b = em[e, 1]
    _p_delete(em, sz, 1, e)
    slot = holder >> TIER_BITS
    tier = holder & 7
    cnt[slot, tier] -= 1
    stats[S_REMOVED] += 1
    if sz[2] > 0:
        x = _p_find(ex, k, b)
        if x >= 0:
            if ex[x, 2] > U64(1):
                ex[x, 2] -= U64(1)
            else:
                _p_delete(ex, sz, 2, x)
            return
    ki = _kt_find(kt, k)
    if ki < 0:
        return  # cannot happen while the tables agree
    col = 1 + tier * W + (slot >> 6)
    kt[ki, col] &= ~(U64(1) << U64(slot & 63))
    for c in range(1, kt.shape[1]):
        if kt[ki, c] != U64(0):
            return
    _kt_delete(kt, sz, ki)


@njit(inline="always", cache=True)
def _drop_copy(ex, sz, a, b):
    """Forget one extra physical copy ``(hash ^ DUP_MARK, holder + 1)``; False if there is none."""
    x = _p_find(ex, a, b)
    if x < 0:
        return False
    if ex[x, 2] > U64(1):
        ex[x, 2] -= U64(1)
    else:
        _p_delete(ex, sz, 2, x)
    return True


@njit(cache=True, **NO_NRT)
def apply_ops(kt, em, ex, sz, cnt, W, meta, parents, salts, hashes, tokens, start, stats, stored_keys, stored_slots,
              n_stored, keys):
    """Apply operations ``start..`` in order. Returns ``(next op, need flags)``; need is 0 when
    every operation was applied, else the tables to grow before calling again from ``next``.

    When ``stored_keys`` has room (one row per hash of the operations), the key and pod slot of
    every block stored are written there (``stored_slots``; ``n_stored[0]`` counts them): the
    caller drops the router's predictions those events confirm (:func:`pred_confirm`).

    ``meta`` has a row per operation: kind, holder, parent kind, block size, and the end of
    its hashes and of its tokens in ``hashes`` / ``tokens`` (each starts where the previous
    operation's ends); ``parents`` the parent hash, parent key or root seed; ``salts`` a salt
    mixed into the chain seed of the operation's first block (0: none).

    Each operation first touches the table rows its blocks will probe, in a loop of
    independent loads, so their cache misses overlap instead of being paid one by one."""
    kt_lim = np.int64(kt.shape[0] * LOAD)
    em_lim = np.int64(em.shape[0] * LOAD)
    ex_lim = np.int64(ex.shape[0] * LOAD)
    em_mask = em.shape[0] - 1
    kt_mask = kt.shape[0] - 1
    m = meta.shape[0]
    sink = U64(0)
    note = stored_keys.shape[0] > 0
    for o in range(start, m):
        holder = meta[o, 1]
        b = U64(holder + 1)
        h0 = meta[o - 1, 4] if o > 0 else 0
        n = meta[o, 4] - h0
        if meta[o, 0] == OP_REMOVE:
            # deleting shifts the rows after the hole back: touch the next line as well
            for i in range(n):
                r = _p_home(hashes[h0 + i], b, em_mask)
                sink ^= em[r, 1] ^ em[(r + 3) & em_mask, 1]
            for i in range(n):
                e = _p_find(em, hashes[h0 + i], b)
                keys[i] = em[e, 2] if e >= 0 else U64(0)
            for i in range(n):
                r = np.int64(keys[i] & U64(kt_mask))
                sink ^= kt[r, 0] ^ kt[((r | 3) + 1) & kt_mask, 0]
            for i in range(n):
                e = _p_find(em, hashes[h0 + i], b)
                if e < 0:
                    stats[S_UNKNOWN_REMOVED] += 1
                elif sz[2] > 0 and _drop_copy(ex, sz, hashes[h0 + i] ^ DUP_MARK, b):
                    stats[S_REMOVED] += 1  # one of several physical copies: the block stays
                else:
                    _remove_at(kt, em, ex, sz, cnt, W, holder, e, stats)
            continue
        need = 0
        if sz[0] + n > kt_lim:
            need |= NEED_KT
        if sz[1] + n > em_lim:
            need |= NEED_EM
        if sz[2] + n > ex_lim:
            need |= NEED_EX
        if need:
            return o, need
        pk = meta[o, 2]
        dg = pk & DIGESTS
        pk &= ~DIGESTS
        seed = parents[o]
        if pk == PARENT_HASH:
            # the parent is almost always in the same tier; else any tier of the pod
            e = _p_find(em, seed, b)
            if e < 0:
                base = (holder >> TIER_BITS) << TIER_BITS
                for t in range(8):
                    if base + t != holder:
                        e = _p_find(em, seed, U64(base + t + 1))
                        if e >= 0:
                            break
            if e < 0:
                stats[S_UNKNOWN_PARENT] += 1
                stats[S_UNKNOWN_PARENT_BLOCKS] += n
                continue
            seed = em[e, 2]
        seed ^= salts[o]
        stats[S_STORED] += n
        bs = meta[o, 3]
        t0 = meta[o - 1, 5] if o > 0 else 0
        for i in range(n):
            if pk == KEYS_GIVEN:
                k = tokens_key(tokens, t0, i)
            elif dg:
                k = _combine(seed, tokens_key(tokens, t0, i))
                seed = k
            else:
                k = _hash_block(tokens, t0 + i * bs, bs, seed)
                seed = k
            keys[i] = k
        # a tight loop of independent loads (the hashing above would keep too few in flight)
        for i in range(n):
            sink ^= kt[np.int64(keys[i] & U64(kt_mask)), 0] ^ em[_p_home(hashes[h0 + i], b, em_mask), 1]
        if note:
            slot = holder >> TIER_BITS
            for i in range(n):
                stored_keys[n_stored[0]] = keys[i]
                stored_slots[n_stored[0]] = slot
                n_stored[0] += 1
        for i in range(n):
            k = keys[i]
            h = hashes[h0 + i]
            e = _p_find(em, h, b)
            if e >= 0:
                if em[e, 2] == k:
                    # another physical block with the same content: count the copy
                    stats[S_DUPLICATES] += 1
                    x = _p_find(ex, h ^ DUP_MARK, b)
                    if x >= 0:
                        ex[x, 2] += U64(1)
                    else:
                        _p_insert(ex, sz, 2, h ^ DUP_MARK, b, U64(1))
                    continue
                # the engine reused a hash for other content: the new content wins
                if sz[2] > 0:
                    x = _p_find(ex, h ^ DUP_MARK, b)
                    if x >= 0:
                        _p_delete(ex, sz, 2, x)
                _remove_at(kt, em, ex, sz, cnt, W, holder, e, stats)
            _add_one(kt, em, ex, sz, cnt, W, holder, h, k, stats)
    if sink == U64(0x5EED):  # keeps the touching loads from being optimised away
        stats[S_STORED] += 0
    return m, 0


@njit(inline="always", cache=True)
def tokens_key(tokens, t0, i):
    """A key or digest handed over in the token array (two uint32 words, little end first)."""
    return U64(tokens[t0 + 2 * i]) | (U64(tokens[t0 + 2 * i + 1]) << U64(32))


# ----------------------------------------------------------------------------- clearing


@njit(cache=True, **NO_NRT)
def _pairs_without(t, out, slot, tier):
    """The pair table rebuilt into ``out`` (zeroed, same shape) without the rows of ``slot`` in
    ``tier`` (every tier if < 0); returns how many rows it keeps."""
    kept = 0
    for r in range(t.shape[0]):
        b = t[r, 1]
        if b == U64(0):
            continue
        holder = np.int64(b) - 1
        if (holder >> TIER_BITS) == slot and (tier < 0 or (holder & 7) == tier):
            continue
        _p_put(out, t[r, 0], b, t[r, 2])
        kept += 1
    return kept


def clear_holder(kt, em, ex, sz, cnt, W, slot, tier):
    """Drop everything ``slot`` holds in ``tier`` (or every tier when ``tier < 0``).
    Returns the new ``(kt, em, ex)`` (rebuilt at the same capacity) and the hashes dropped."""
    kt2, em2, ex2 = table(*kt.shape), table(*em.shape), table(*ex.shape)
    dropped = _clear_holder_into(kt, em, ex, kt2, em2, ex2, sz, cnt, W, slot, tier)
    return kt2, em2, ex2, dropped


@njit(cache=True, **NO_NRT)
def _clear_holder_into(kt, em, ex, kt2, em2, ex2, sz, cnt, W, slot, tier):
    T = (kt.shape[1] - 1) // W
    n_em = _pairs_without(em, em2, slot, tier)
    dropped = sz[1] - n_em
    n_ex = _pairs_without(ex, ex2, slot, tier)
    # key table: clear the slot's bit in the tier(s), drop rows nobody holds
    cols = kt.shape[1]
    w = slot >> 6
    nbit = ~(U64(1) << U64(slot & 63))
    n_kt = 0
    for r in range(kt.shape[0]):
        if kt[r, 0] == U64(0):
            continue
        for t in range(T):
            if tier < 0 or t == tier:
                kt[r, 1 + t * W + w] &= nbit
        anyb = False
        for c in range(1, cols):
            if kt[r, c] != U64(0):
                anyb = True
                break
        if anyb:
            _kt_put(kt2, kt, r)
            n_kt += 1
    for t in range(8):
        if tier < 0 or t == tier:
            cnt[slot, t] = 0
    sz[0] = n_kt
    sz[1] = n_em
    sz[2] = n_ex
    return dropped


# --------------------------------------------------------------------------- predictions
# A model's predicted blocks (the router's own routing, until the engines' events say so):
#   ``pk``  key table ``[key, mask words (W)...]``: the pods predicted to hold each key;
#   ``pe``  pair table ``[key, slot + 1, expiry]``, the expiry a float64 stored in the row's third
#           word (``pef`` is a float64 view of the same array, through which it is read and written);
#   ``psz`` row counts ``[pk, pe]``.
# A (key, pod) prediction lasts until its expiry; routing the same key to the same pod again
# moves the expiry later. The caller grows the tables before a record could pass LOAD.


@njit(cache=True, **NO_NRT)
def pred_record(pk, pe, pef, psz, slot, keys, exp):
    """Predict that pod ``slot`` holds ``keys`` until ``exp`` (a zero key, the tables' empty
    mark, is skipped)."""
    word = 1 + slot // 64
    if word >= pk.shape[1]:
        return  # (the caller widens the masks first)
    bit = U64(1) << U64(slot % 64)
    b = U64(slot + 1)
    for j in range(len(keys)):
        k = keys[j]
        if k == U64(0):
            continue
        r = _kt_find_or_insert(pk, psz, k)
        pk[r, word] |= bit
        i = _p_find(pe, k, b)
        if i < 0:
            _p_put(pe, k, b, U64(0))
            psz[1] += 1
            i = _p_find(pe, k, b)
            pef[i, 2] = exp
        elif pef[i, 2] < exp:
            pef[i, 2] = exp


@njit(cache=True, **NO_NRT)
def pred_expire(pk, pe, pef, psz, W, slot, keys, now, force):
    """Drop pod ``slot``'s predictions of ``keys`` that expired by ``now`` (all of them with
    ``force``); returns how many were dropped."""
    word = 1 + slot // 64
    n = 0
    if word >= pk.shape[1]:
        return n
    nb = ~(U64(1) << U64(slot % 64))
    b = U64(slot + 1)
    for j in range(len(keys)):
        k = keys[j]
        if k == U64(0):
            continue  # (never recorded)
        i = _p_find(pe, k, b)
        if i < 0:
            continue
        if not force and pef[i, 2] > now:
            continue
        _pred_drop(pk, pe, psz, W, word, nb, k, i)
        n += 1
    return n


@njit(inline="always", cache=True)
def _pred_drop(pk, pe, psz, W, word, nb, k, i):
    """Drop prediction pair row ``i`` (key ``k``) and the pod's bit (``word``, mask ``nb``) in the key table."""
    _p_delete(pe, psz, 1, i)
    r = _kt_find(pk, k)
    if r < 0:
        return
    pk[r, word] &= nb
    for c in range(1, 1 + W):
        if pk[r, c] != U64(0):
            return
    _kt_delete(pk, psz, r)


@njit(cache=True, **NO_NRT)
def pred_confirm(pk, pe, psz, W, keys, slots, n):
    """The pods' events say they store these blocks (``keys[j]`` on ``slots[j]``, the first
    ``n``): their predictions, now redundant, are dropped, so the tables hold only what the
    events have not confirmed yet, and a block the engine later evicts is not still counted as
    predicted. Returns how many were dropped."""
    dropped = 0
    for j in range(n):
        k = keys[j]
        slot = slots[j]
        word = 1 + slot // 64
        if k == U64(0) or word >= pk.shape[1]:
            continue
        i = _p_find(pe, k, U64(slot + 1))
        if i < 0:
            continue
        _pred_drop(pk, pe, psz, W, word, ~(U64(1) << U64(slot % 64)), k, i)
        dropped += 1
    return dropped


# ------------------------------------------------------------------------------- queries


@njit(inline="always", cache=True)
def _ctz(low):
    """Index of the one set bit of ``low``."""
    b = 0
    if low >= U64(1 << 32):
        low >>= U64(32)
        b += 32
    if low >= U64(1 << 16):
        low >>= U64(16)
        b += 16
    if low >= U64(1 << 8):
        low >>= U64(8)
        b += 8
    if low >= U64(1 << 4):
        low >>= U64(4)
        b += 4
    if low >= U64(1 << 2):
        low >>= U64(2)
        b += 2
    if low >= U64(2):
        b += 1
    return b


@njit(cache=True, **NO_NRT)
def query(kt, W, keys, allowed, pk, torder, matched, tiers, scratch):
    """Walk ``keys`` while some allowed pod holds every block so far (exact in any tier, or
    predicted in the prediction key table ``pk``, which may have no rows). ``matched[slot]`` gets the pod's matched
    prefix length. With ``tiers`` of shape (slots, T + 1) (multi-tier or predictions), each
    matched block is also counted under the best category that holds it for that pod:
    tiers in ``torder``, then predicted (column T). ``scratch``: room for ``2 * W`` words. Returns
    the length walked."""
    T = (kt.shape[1] - 1) // W
    n = keys.shape[0]
    run = scratch[:W]
    new = scratch[W:2 * W]
    for w in range(W):
        run[w] = allowed[w]
    use_pred = pk.shape[0] > 0
    detail = tiers.shape[0] > 0
    # the home rows of the next PREFETCH_AHEAD keys are requested ahead of the walk, so their
    # cache misses overlap each other and the work, and a walk that stops early loads no more
    kt_mask = kt.shape[0] - 1
    ahead = min(n, PREFETCH_AHEAD)
    for j in range(ahead):
        _prefetch_row(kt, np.int64(keys[j] & U64(kt_mask)))
    i = 0
    while i < n:
        if ahead < n:
            _prefetch_row(kt, np.int64(keys[ahead] & U64(kt_mask)))
            ahead += 1
        ki = _kt_find(kt, keys[i])
        pi = _kt_find(pk, keys[i]) if use_pred else -1
        anyb = False
        for w in range(W):
            v = U64(0)
            if ki >= 0:
                for t in range(T):
                    v |= kt[ki, 1 + t * W + w]
            if pi >= 0:
                v |= pk[pi, 1 + w]
            v &= run[w]
            new[w] = v
            if v != U64(0):
                anyb = True
        if not anyb:
            break
        for w in range(W):
            lost = run[w] & ~new[w]
            while lost != U64(0):
                low = lost & (~lost + U64(1))
                b = _ctz(low)
                matched[w * 64 + b] = i
                lost ^= low
            run[w] = new[w]
        if detail:
            for w in range(W):
                v = run[w]
                while v != U64(0):
                    low = v & (~v + U64(1))
                    b = _ctz(low)
                    s = w * 64 + b
                    cat = T
                    if ki >= 0:
                        for j in range(T):
                            t = torder[j]
                            if kt[ki, 1 + t * W + w] & low:
                                cat = t
                                break
                    tiers[s, cat] += 1
                    v ^= low
        i += 1
    for w in range(W):
        v = run[w]
        while v != U64(0):
            low = v & (~v + U64(1))
            b = _ctz(low)
            matched[w * 64 + b] = i
            v ^= low
    return i


@njit(cache=True)
def query_tokens(kt, W, tokens, bs, n, seed, allowed, torder, matched, tiers):
    """:func:`query` over the chained keys of ``tokens``, hashed as the walk goes (no pred)."""
    keys = chain_keys(tokens, bs, n, seed)
    pk = np.zeros((0, 1 + W), dtype=np.uint64)
    return query(kt, W, keys, allowed, pk, torder, matched, tiers, np.empty(2 * W, dtype=np.uint64))


@njit(cache=True)
def em_lookup(em, hashes, holder):
    """Our key for each engine hash ``holder`` holds (0 where it holds none)."""
    out = np.zeros(hashes.shape[0], dtype=np.uint64)
    b = U64(holder + 1)
    for i in range(hashes.shape[0]):
        e = _p_find(em, hashes[i], b)
        if e >= 0:
            out[i] = em[e, 2]
    return out


# ------------------------------------------------------------------------ wire decoding

_U64_MAX = U64(0xFFFFFFFFFFFFFFFF)
_U32_MAX = U64(0xFFFFFFFF)


@njit(inline="always", cache=True)
def _skip_ws(buf, pos, n):
    while pos < n:
        c = buf[pos]
        if c != 32 and c != 10 and c != 13 and c != 9:
            break
        pos += 1
    return pos


@njit(cache=True)
def parse_uint_arrays(buf, to32):
    """Parse JSON arrays of non-negative integers laid end to end in ``buf`` (uint8): array
    ``i`` goes to the uint32 output when ``to32[i]`` (each value must be < 2**32), else to the
    uint64 output (< 2**64). Returns ``(bad, out64, out32, counts)``: ``bad`` is -1, or the
    index of the first array that is not an array of such integers (floats, negatives,
    strings, nesting, overflow); ``counts[i]`` is array ``i``'s length.

    The decoders hand the raw JSON of token ids and block hashes here instead of building a
    Python int per value (about 20 ns each); ``buf`` is JSON already checked as well-formed.
    """
    n = buf.shape[0]
    k = to32.shape[0]
    out64 = np.empty(n // 2 + 1, dtype=np.uint64)
    out32 = np.empty(n // 2 + 1, dtype=np.uint32)
    counts = np.zeros(k, dtype=np.int64)
    p64 = 0
    p32 = 0
    pos = 0
    for a in range(k):
        pos = _skip_ws(buf, pos, n)
        if pos >= n or buf[pos] != 91:  # [
            return a, out64[:p64], out32[:p32], counts
        pos = _skip_ws(buf, pos + 1, n)
        if pos < n and buf[pos] == 93:  # ] (empty)
            pos += 1
            continue
        c0 = p32 if to32[a] else p64
        while True:
            # one integer: up to 19 digits always fit in 64 bits, the 20th is checked
            v = U64(0)
            start = pos
            while pos < n:
                d = np.int64(buf[pos]) - 48
                if d < 0 or d > 9:
                    break
                v = v * U64(10) + U64(d)
                pos += 1
            nd = pos - start
            if nd == 0 or nd > 20:
                return a, out64[:p64], out32[:p32], counts
            if nd == 20:
                head = U64(0)
                for j in range(start, start + 19):
                    head = head * U64(10) + U64(np.int64(buf[j]) - 48)
                last = U64(np.int64(buf[start + 19]) - 48)
                if head > (_U64_MAX - last) // U64(10):
                    return a, out64[:p64], out32[:p32], counts
            if to32[a]:
                if v > _U32_MAX:
                    return a, out64[:p64], out32[:p32], counts
                out32[p32] = np.uint32(v)
                p32 += 1
            else:
                out64[p64] = v
                p64 += 1
            if pos >= n:
                return a, out64[:p64], out32[:p32], counts
            c = buf[pos]
            if c == 44:  # ,
                pos = _skip_ws(buf, pos + 1, n)
                continue
            if c == 93:  # ]
                pos += 1
                break
            pos = _skip_ws(buf, pos, n)
            if pos < n and buf[pos] == 44:
                pos = _skip_ws(buf, pos + 1, n)
                continue
            if pos < n and buf[pos] == 93:
                pos += 1
                break
            return a, out64[:p64], out32[:p32], counts  # '.', 'e', '-', a string, nesting...
        counts[a] = (p32 if to32[a] else p64) - c0
    return -1, out64[:p64], out32[:p32], counts
