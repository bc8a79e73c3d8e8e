"""The global KV-cache index: a pure fold of :class:`schemas.KvEventBatch` messages.

Keys
    Blocks are keyed by our own chained 64-bit hash over the token ids that ``BlockStored``
    carries (:func:`block_keys`, computed by :func:`streams.kv_core.chain_keys`: each block's
    key is seeded with its parent's key), never by the engine's hash, so the index does not
    depend on how an engine hashes (sha256 over pickle or CBOR, seeded or not). Per pod and
    tier the index keeps ``engine hash -> key`` to resolve parents and removals.

Data structure
    Per model, three open-addressing tables of ``uint64`` rows worked by compiled kernels
    (:mod:`streams.kv_core`): ``key -> pod bitmask per tier``, ``(pod, tier, engine hash) ->
    key`` and the alias counts. Applying a chunk of batches buffers its stored/removed events
    as flat arrays and hands them to one kernel call, which hashes the tokens and updates the
    tables block by block; a query walks the key table along the prompt's keys, AND-ing pod
    masks until no pod is left. The Python side keeps what is per batch or per pod: sequence
    and epoch checks, pod slots, predictions, stats.

Deliberate handling of bad input (counted in :class:`ApplyStats`, never corrupting)
    * a batch whose ``(epoch, seq)`` is not newer than the pod's last one is dropped
      (redelivery, replay); a skipped sequence is counted as a gap but applied;
    * with ``reorder_window_s`` set, a batch that skips a sequence (or starts a new epoch past
      seq 0) is held back, per pod, until the missing ones arrive -- then all are applied in
      order -- or until it has waited ``reorder_window_s`` (then the gap is accepted). A
      message stream stored out of order (a publisher's retry after a broker restart) thus
      folds in the engine's order. :meth:`release_expired` applies what has waited long enough
      (a service calls it periodically);
    * an empty batch at the pod's current ``(epoch, seq)`` is a heartbeat: it refreshes the
      pod's ``last_seen`` (see ``pod_timeout_s``) and changes nothing else;
    * an epoch above ``MAX_EPOCH`` (2**32-1), a seq above ``MAX_SEQ`` (2**63-1), or an epoch
      more than ``MAX_EPOCH_JUMP`` above the pod's is dropped (``out_of_bounds``): one corrupt
      batch cannot make every later real batch look stale;
    * a newer ``epoch`` means the engine restarted: the pod's blocks are dropped first;
    * ``BlockStored`` whose parent the pod does not hold is skipped (its keys cannot be
      computed); removals of unknown blocks are counted and ignored; a block stored twice is
      counted as a duplicate; two engine hashes for the same key are reference-counted;
    * a block size different from the model's first one, or token ids that do not fill the
      blocks, are rejected (keys would differ).

Approximate mode
    :meth:`KvIndex.record_route` records the router's own decision as predicted blocks with a
    TTL (``predicted_ttl_s`` for pods that never sent events, ``predict_on_route_ttl_s`` for
    pods that do, to cover sibling requests arriving before the engine's event). A pod's
    ``BlockStored`` event ends its prediction of that block at once (the event confirms it; a
    later eviction then leaves nothing behind). Queries merge exact and predicted blocks per
    pod; :attr:`PodMatch.predicted_blocks` counts the predicted-only part of the matched prefix.

Dump
    :meth:`KvIndex.dump` writes the exact state back out as events; restoring is
    ``KvIndex(...).apply_many(dump)``. Each held ``engine hash -> key`` pair is written once, in
    ``BlockStored`` events that carry our keys (``block_keys``) instead of token ids, so
    replaying a dump needs neither parents nor hashing. Predictions are transient and not
    dumped; :meth:`KvIndex.state` (used by ``==``) is the exact state.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from itertools import compress
from operator import attrgetter, mul
from typing import NamedTuple

import numpy as np
from xxhash import xxh3_64_intdigest

from schemas.kv import MAX_EPOCH, MAX_SEQ, BlockRemoved, BlockStored, KvEventBatch, PodGone, PodReset
from schemas.kv_binary import WRemoved, WRun, WStored
from streams import kv_core as core
from streams.clock import Clock, ManualClock
from streams.kv_keys import lora_seed
from streams.kv_spares import EARLY, Spares

PRIMARY_TIER = "GPU"
DEFAULT_TIER_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "LOCAL_FILE": 0.5, "REMOTE": 0.3}
_U64 = (1 << 64) - 1
_DUMP_CHUNK = 4096  # blocks per BlockStored event of a dump
MAX_EPOCH_JUMP = 1 << 16  # a bridge adds one per engine restart; a larger jump is corrupt input


# --------------------------------------------------------------------------------------- keys


root_seed = lora_seed  # the chain seed of a prompt's first block (see streams.kv_keys)


def _token_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as a uint32 array (ValueError unless every id is in [0, 2**32))."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype == np.uint32:  # (a tokenizer's array: nothing to check)
            return np.ascontiguousarray(token_ids)
        if len(token_ids) and (token_ids.min() < 0 or token_ids.max() >= 1 << 32):
            raise ValueError("token ids must be integers in [0, 2**32)")
        return np.ascontiguousarray(token_ids, dtype=np.uint32)
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        arr = token_ids
    else:
        try:
            arr = array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return np.frombuffer(arr, dtype=np.uint32) if len(arr) else np.zeros(0, dtype=np.uint32)


class BlockKeys(list):
    """A list of block keys that also carries them as a uint64 array (``.array``), so a query
    with keys from :func:`block_keys` skips converting 64-bit Python ints (~25 ns each)."""

    __slots__ = ("array",)


def prefix_keys(keys: Sequence[int], n: int) -> Sequence[int]:
    """The first ``n`` of ``keys``, still carrying their array when :func:`block_keys` made them
    (``keys`` itself when that is all of them)."""
    if n >= len(keys):
        return keys
    if type(keys) is BlockKeys:
        out = BlockKeys(keys[:n])
        out.array = keys.array[:n]
        return out
    return keys[:n]


def block_keys(token_ids: Sequence[int], block_size: int, parent: int | None = None,
               *, lora: int | str | None = None, salt: int = 0) -> list[int]:
    """Our chained 64-bit key of every full block of ``token_ids``.

    ``key[i] = chain(tokens of block i, seed=key[i-1])`` (:func:`streams.kv_core.chain_keys`);
    the first block is seeded with ``parent`` (a key) or, without one, with :func:`root_seed`
    of ``lora``. A trailing partial block is ignored. Equal prefixes give equal keys in every
    process; keys are never 0.
    """
    arr = block_key_array(token_ids, block_size, parent, lora=lora, salt=salt)
    out = BlockKeys(arr.tolist())
    out.array = arr
    return out


def block_key_array(token_ids: Sequence[int], block_size: int, parent: int | None = None,
                    *, lora: int | str | None = None, salt: int = 0) -> np.ndarray:
    """:func:`block_keys` as a ``uint64`` array only (no Python int per key): what the router's
    hot path hashes a prompt into, queries and predicts with."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    toks = _token_array(token_ids[: n * block_size] if len(token_ids) != n * block_size else token_ids)
    seed = (root_seed(lora) if parent is None else parent) ^ salt  # salt: the first block's (cache_salt)
    return core.chain_keys(toks, block_size, n, np.uint64(seed))


class _NoPredictions(dict):
    """W -> an empty prediction key table of that width (for queries of a model without predictions)."""

    def __missing__(self, W: int) -> np.ndarray:
        t = self[W] = np.zeros((0, 1 + W), dtype=np.uint64)
        return t


_NO_PRED = _NoPredictions()
_NO_TIERS = np.zeros((0, 1), dtype=np.int64)  # a query without per-category counts


def _as_key_array(keys: Sequence[int]) -> np.ndarray:
    """Block keys as a uint64 array (the array itself when they are one); ValueError when they
    are not integers in [0, 2**64)."""
    karr = getattr(keys, "array", None) if type(keys) is BlockKeys else None
    if karr is not None:
        return karr
    if type(keys) is np.ndarray and keys.dtype == np.uint64:
        return keys
    try:
        return np.frombuffer(array("Q", keys), dtype=np.uint64)
    except (OverflowError, TypeError):
        raise ValueError("block keys must be integers in [0, 2**64)") from None


# ------------------------------------------------------------------------------------ results
class PodMatch(NamedTuple):
    """How much of a query's prefix one pod holds (immutable; a NamedTuple because a query
    builds one per pod and tuple construction is several times cheaper than a frozen dataclass)."""

    matched_blocks: int  # leading query blocks held contiguously (exact or predicted)
    score: float  # matched blocks weighted by the best tier each is held in
    tiers: dict[str, int]  # matched blocks by best tier (exact only)
    predicted_blocks: int = 0  # matched blocks held only as predictions


_new_match = partial(tuple.__new__, PodMatch)  # PodMatch from a 4-tuple, without the Python-level __new__


@dataclass(slots=True)
class ApplyStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    unknown_parent: int = 0  # BlockStored events skipped because the pod lacks the parent
    unknown_parent_blocks: int = 0
    unknown_removed: int = 0  # removed engine hashes the pod did not hold
    duplicates: int = 0  # blocks stored again under an engine hash the pod already held
    aliases: int = 0  # a second engine hash for a key the pod holds (reference-counted)
    stale_batches: int = 0  # (epoch, seq) not newer than the pod's last one: dropped
    gaps: int = 0  # batches skipped by the sequence (counted, the batch is applied)
    epoch_resets: int = 0  # a newer epoch: the engine restarted, its blocks were dropped
    resets: int = 0  # PodReset events
    cleared: int = 0  # AllBlocksCleared events
    gone: int = 0  # PodGone events
    rejected: int = 0  # events rejected (block size differs from the model's)
    held: int = 0  # batches held back until an earlier missing one arrives (reordering on)
    heartbeats: int = 0  # empty batches at the pod's position: liveness refreshed, nothing applied
    out_of_bounds: int = 0  # batches with an epoch or seq past the bounds, or an epoch jump: dropped

    def __iadd__(self, other: "ApplyStats") -> "ApplyStats":
        # once per applied batch: read every count in C, touch only the few that moved
        vals = _stat_values(other)
        for name, v in zip(compress(_STAT_NAMES, vals), filter(None, vals)):
            setattr(self, name, getattr(self, name) + v)
        return self

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_STAT_NAMES = tuple(f.name for f in fields(ApplyStats))
_stat_values = attrgetter(*_STAT_NAMES)


@dataclass(frozen=True)
class PodInfo:
    pod: str
    model: str | None
    blocks: dict[str, int]  # engine blocks per tier
    predicted_blocks: int
    epoch: int | None
    seq: int | None
    last_event_ts: float | None  # engine timestamp of the last applied batch
    last_seen: float | None  # our clock when the last batch was applied
    live: bool  # False when silent past the pod timeout (then left out of scoring)


# -------------------------------------------------------------------------------- internals

#: tables smaller than this grow in well under a millisecond: none is made ahead for them
SPARE_MIN_ROWS = 1 << 16
_EARLY_LOAD = EARLY * core.LOAD


class _Model:
    """One model's tables (see :mod:`streams.kv_core`) and its predictions."""

    __slots__ = ("name", "block_size", "tiers", "tidx", "W", "kt", "em", "ex", "sz", "cnt", "pk", "pe", "pef", "psz",
                 "torder", "spares")

    def __init__(self, name: str, width: int, spares: Spares | None = None):
        self.name = name
        self.spares = spares if spares is not None else Spares()
        self.block_size: int | None = None
        self.tiers: list[str] = []  # local tier index -> name, in order of appearance
        self.tidx: dict[str, int] = {}
        self.W = width  # mask words per tier: slots < 64 * W
        self.kt = np.zeros((1024, 1), dtype=np.uint64)
        self.em = np.zeros((1024, 3), dtype=np.uint64)
        self.ex = np.zeros((64, 3), dtype=np.uint64)
        self.sz = np.zeros(3, dtype=np.int64)
        self.cnt = np.zeros((64 * width, 8), dtype=np.int64)
        # predictions (kv_core): pk key -> mask of the pods predicted to hold it; pe (key, slot + 1)
        # -> expiry (pef: its float64 view); psz their row counts
        self.pk = np.zeros((256, 1 + width), dtype=np.uint64)
        self.pe = np.zeros((256, 3), dtype=np.uint64)
        self.pef = self.pe.view(np.float64)
        self.psz = np.zeros(2, dtype=np.int64)
        self.torder = np.zeros(0, dtype=np.int64)

    @property
    def T(self) -> int:
        return len(self.tiers)

    @property
    def multi(self) -> bool:
        return len(self.tiers) > 1

    def _relayout(self, T: int, W: int) -> None:
        old, oT, oW = self.kt, self.T, self.W
        new = np.zeros((old.shape[0], 1 + T * W), dtype=np.uint64)
        new[:, 0] = old[:, 0]
        for t in range(oT):
            new[:, 1 + t * W: 1 + t * W + oW] = old[:, 1 + t * oW: 1 + (t + 1) * oW]
        self.kt = new
        if W != oW:
            pk = np.zeros((self.pk.shape[0], 1 + W), dtype=np.uint64)
            pk[:, : 1 + oW] = self.pk
            self.pk = pk
            cnt = np.zeros((64 * W, 8), dtype=np.int64)
            cnt[: self.cnt.shape[0]] = self.cnt
            self.cnt = cnt
            self.W = W

    def tier(self, name: str, weights: dict[str, float]) -> int:
        t = self.tidx.get(name)
        if t is None:
            if len(self.tiers) >= 8:
                raise ValueError("a model can use at most 8 tiers")
            self._relayout(self.T + 1, self.W)
            t = self.tidx[name] = len(self.tiers)
            self.tiers.append(name)
            self.torder = np.array(sorted(range(len(self.tiers)), key=lambda i: -weights.get(self.tiers[i], 0.0)),
                                   dtype=np.int64)
        return t

    def widen(self, slot: int) -> None:
        if slot >= 64 * self.W:
            self._relayout(self.T, slot // 64 + 1)

    @property
    def predicting(self) -> bool:
        return bool(self.psz[0])

    def grown(self, t: np.ndarray, cap: int, pairs: bool) -> np.ndarray:
        """Table ``t`` rehashed into ``cap`` rows (a spare made ahead when there is one)."""
        out = self.spares.take(cap, t.shape[1])
        return core.grow_pairs(t, cap, out) if pairs else core.grow_kt(t, cap, out)

    def want_spares(self) -> None:
        """Ask for the next size of each table past :data:`streams.kv_spares.EARLY` of its load factor.
        (Called after every fold and every route noted: tables below :data:`SPARE_MIN_ROWS` are
        skipped before their sizes are read.)"""
        tables = [t for t in (self.kt, self.em, self.ex, self.pk, self.pe) if t.shape[0] >= SPARE_MIN_ROWS]
        if not tables:
            return
        rows = dict(zip(map(id, (self.kt, self.em, self.ex, self.pk, self.pe)), self.sz.tolist() + self.psz.tolist()))
        for t in tables:
            cap = t.shape[0]
            if rows[id(t)] > _EARLY_LOAD * cap:
                self.spares.want(cap * 2, t.shape[1])

    def reserve_predictions(self, n: int) -> None:
        """Room for ``n`` more keys and (key, pod) pairs within the load factor."""
        keys, pairs = self.psz.tolist()
        cap = self.pk.shape[0]
        if keys + n > core.LOAD * cap:
            while keys + n > core.LOAD * cap:
                cap *= 2
            self.pk = self.grown(self.pk, cap, False)
        cap = self.pe.shape[0]
        if pairs + n > core.LOAD * cap:
            while pairs + n > core.LOAD * cap:
                cap *= 2
            self.pe = self.grown(self.pe, cap, True)
            self.pef = self.pe.view(np.float64)
        self.want_spares()

    def predicted_by(self, slot: int) -> np.ndarray:
        """The keys pod ``slot`` is predicted to hold."""
        pe = self.pe
        return pe[pe[:, 1] == np.uint64(slot + 1), 0].copy()

    def copies(self) -> dict[tuple[int, int], int]:
        """(engine hash, holder + 1) -> extra physical copies, for hashes held more than once."""
        ex = self.ex
        if not self.sz[2]:
            return {}
        rows = ex[ex[:, 1] != 0]
        em = self.em
        held = set(zip(em[:, 0].tolist(), em[:, 1].tolist()))
        mark = int(core.DUP_MARK)
        out = {}
        for a, b, c in rows.tolist():
            if (a ^ mark, b) in held:
                out[(a ^ mark, b)] = c
        return out

    def held(self) -> dict[int, np.ndarray]:
        """holder -> its (engine hash, key) rows, sorted; a hash held by several physical blocks
        appears once per block."""
        em = self.em
        rows = em[em[:, 1] != 0]
        if not len(rows):
            return {}
        copies = self.copies()
        if copies:
            reps = np.array([1 + copies.get((a, b), 0) for a, b in rows[:, :2].tolist()], dtype=np.int64)
            rows = np.repeat(rows, reps, axis=0)
        rows = rows[np.lexsort((rows[:, 2], rows[:, 0], rows[:, 1]))]
        holders = rows[:, 1]
        cuts = np.flatnonzero(np.diff(holders)) + 1
        out = {}
        for part in np.split(rows, cuts):
            out[int(part[0, 1]) - 1] = part[:, [0, 2]]
        return out


class _Ops:
    """Stored/removed events buffered for one kernel call (one model): per event a row of
    ``meta`` (kind, holder, parent kind, block size, end of its hashes, end of its tokens)
    and its parent in ``parents``; hashes and tokens concatenated."""

    __slots__ = ("model", "meta", "parents", "salts", "hashes", "tokens")

    def __init__(self, model: "_Model | None" = None):
        self.model = model
        self.meta = array("q")
        self.parents = array("Q")
        self.salts = array("Q")
        self.hashes = array("Q")
        self.tokens = array("I")


class _Pod:
    __slots__ = ("name", "slot", "bit", "model", "epoch", "seq", "last_event_ts", "last_seen",
                 "pred_models", "exact")

    def __init__(self, name: str, slot: int):
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.model: str | None = None
        self.epoch: int | None = None
        self.seq: int | None = None
        self.last_event_ts: float | None = None
        self.last_seen: float | None = None
        self.pred_models: set[str] = set()  # models it has predictions under
        self.exact = False  # has sent KV events


def _extend_hashes(buf: array, hashes) -> None:
    if type(hashes) is np.ndarray and hashes.dtype == np.uint64:  # a decoder's parsed array
        buf.frombytes(memoryview(np.ascontiguousarray(hashes)).cast("B"))
        return
    if type(hashes) is memoryview and hashes.format == "Q":  # a binary message's checked view
        buf.frombytes(hashes.cast("B"))
        return
    n0 = len(buf)
    try:
        buf.extend(hashes.tolist() if type(hashes) is np.ndarray else hashes)
    except (OverflowError, TypeError) as exc:
        del buf[n0:]
        raise ValueError(f"block hashes must be integers in [0, 2**64): {exc}") from None


def _extend_tokens(buf: array, toks) -> None:
    """Append token ids (a binary message's checked view, a decoder's array, a list) as uint32."""
    if type(toks) is memoryview and toks.format == "I":  # a binary message's checked view
        buf.frombytes(toks.cast("B"))
    elif type(toks) is np.ndarray:
        if toks.dtype == np.uint32:  # a decoder's parsed array
            buf.frombytes(memoryview(np.ascontiguousarray(toks)).cast("B"))
        else:
            buf.frombytes(memoryview(_token_array(toks)).cast("B"))
    else:
        buf.extend(toks)


def _u64_bytes(values) -> bytes | memoryview:
    """uint64 values (a checked view, a numpy array, an ``array("Q")`` or ints) as native bytes;
    OverflowError / TypeError / ValueError when they are not all in [0, 2**64)."""
    if type(values) is memoryview and values.format == "Q":
        return values.cast("B")
    if type(values) is np.ndarray:
        if values.dtype == np.uint64:
            return np.ascontiguousarray(values).tobytes()
        values = values.tolist()  # (other integer arrays: checked value by value, like a list)
    a = values if isinstance(values, array) and values.typecode == "Q" else array("Q", values)
    return memoryview(a).cast("B")


_ROOT_DIGESTS = core.PARENT_ROOT | core.DIGESTS
_HASH_DIGESTS = core.PARENT_HASH | core.DIGESTS
_NO_LORA_SEED = lora_seed(None)
_HAS_KEYS = "block_keys" in BlockStored.model_fields
_HAS_SALTS = "block_salts" in BlockStored.model_fields
_HAS_DIGESTS = "block_digests" in BlockStored.model_fields


_NO_U64 = np.zeros(0, dtype=np.uint64)
_NO_U32 = np.zeros(0, dtype=np.uint32)
_NO_I64 = np.zeros(0, dtype=np.int64)
_STAT_FIELDS = ("blocks_stored", "blocks_removed", "unknown_parent", "unknown_parent_blocks", "unknown_removed",
                "duplicates", "aliases")


# ------------------------------------------------------------------------------------ the fold

_FEW_SLOTS = 128  # up to this many pod slots, a query's result is read off a plain list
REUSE_S = 0.05  # match_counts gives its last answer again for the same keys within this long, unchanged
LOST_GRACE_S = 1.0  # a pod's batches behind one its consumer refused wait this long for it, not the window


class KvIndex:
    """Which pod holds which KV blocks, per model and tier; see the module docstring."""

    def __init__(self, clock: Clock, *, tier_weights: dict[str, float] | None = None,
                 predicted_ttl_s: float = 120.0, predict_on_route_ttl_s: float = 2.0,
                 pod_timeout_s: float | None = None, predicted_weight: float = 1.0,
                 default_block_size: int | None = None, reorder_window_s: float = 0.0,
                 reorder_max: int = 4096, reserve_blocks: int = 0, spares: Spares | None = None):
        if reorder_window_s < 0 or reorder_max < 1:
            raise ValueError("reorder_window_s must be >= 0 and reorder_max >= 1")
        self.reorder_window_s = reorder_window_s
        self.reorder_max = reorder_max
        # pod -> {(epoch, seq): (batch, deadline)}: batches waiting for an earlier one
        self._waiting: dict[str, dict[tuple[int, int], tuple[KvEventBatch, float]]] = {}
        if predicted_ttl_s <= 0 or predict_on_route_ttl_s <= 0:
            raise ValueError("prediction TTLs must be positive")
        if pod_timeout_s is not None and pod_timeout_s <= 0:
            raise ValueError("pod_timeout_s must be positive")
        self.clock = clock
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS)
        if tier_weights:
            self.tier_weights.update(tier_weights)
        self.predicted_ttl_s = predicted_ttl_s
        self.predict_on_route_ttl_s = predict_on_route_ttl_s
        self.pod_timeout_s = pod_timeout_s
        self.predicted_weight = predicted_weight
        if default_block_size is not None and default_block_size <= 0:
            raise ValueError("default_block_size must be positive")
        # block size for models no engine has sent events for yet (approximate-only clusters)
        self.default_block_size = default_block_size
        if reserve_blocks < 0:
            raise ValueError("reserve_blocks must be >= 0")
        self.reserve_blocks = reserve_blocks  # each model's tables sized for this many blocks when it appears
        # the next size of a table that fills up, made ahead (streams.kv_spares; the default makes none)
        self.spares = spares if spares is not None else Spares()
        self._models: dict[str, _Model] = {}
        self._pods: dict[str, _Pod] = {}
        self._by_slot: dict[int, _Pod] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._gone: dict[str, tuple[str, int, int, float]] = {}  # pod -> (model, epoch, seq, ts)
        self._pred_heap: list[tuple[float, int, str, str, list[int]]] = []
        self._pred_n = 0
        self._ops = _Ops()
        self._st: ApplyStats | None = None  # the stats of the apply in progress (for flushes)
        self._allowed_cache: tuple[int, int, np.ndarray] | None = None
        self.totals = ApplyStats()
        # match_counts' last answer, reused for the same keys while nothing changed (see there)
        self._version = 0  # bumped by every change of what a query reads
        self._counted: tuple | None = None
        self._lost: dict[str, dict[tuple[int, int], float]] = {}  # pod -> refused (epoch, seq) -> wait until (lost())

    # ------------------------------------------------------------------------- bookkeeping

    def _model(self, name: str) -> _Model:
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = _Model(name, max(1, (self._next_slot + 63) // 64), self.spares)
            if self.reserve_blocks:
                self.reserve(name, self.reserve_blocks)
        return m

    def _pod(self, name: str) -> _Pod:
        p = self._pods.get(name)
        if p is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot = self._next_slot
                self._next_slot += 1
            p = self._pods[name] = _Pod(name, slot)
            self._by_slot[slot] = p
        return p

    def _flush(self) -> None:
        """Apply the buffered stored/removed events (one kernel call, growing tables as needed)."""
        ops = self._ops
        if not ops.parents:
            return
        m = ops.model
        self._ops = _Ops(m)
        meta = np.frombuffer(ops.meta, dtype=np.int64).reshape(-1, 6)
        parents = np.frombuffer(ops.parents, dtype=np.uint64)
        salts = np.frombuffer(ops.salts, dtype=np.uint64)
        hashes = np.frombuffer(ops.hashes, dtype=np.uint64) if ops.hashes else _NO_U64
        tokens = np.frombuffer(ops.tokens, dtype=np.uint32) if ops.tokens else _NO_U32
        stats = np.zeros(core.N_STATS, dtype=np.int64)
        # with predictions, note the blocks stored: their predictions are then confirmed (dropped)
        predicting = bool(m.psz[0])
        n_hashes = len(hashes)
        stored_keys = np.empty(n_hashes, dtype=np.uint64) if predicting else _NO_U64
        stored_slots = np.empty(n_hashes, dtype=np.int64) if predicting else _NO_I64
        n_stored = np.zeros(1, dtype=np.int64)
        keys = np.empty(max(n_hashes, 1), dtype=np.uint64)  # (the kernel's scratch: an operation's block keys)
        start = 0
        while True:
            start, need = core.apply_ops(m.kt, m.em, m.ex, m.sz, m.cnt, m.W, meta, parents, salts, hashes, tokens, start,
                                         stats, stored_keys, stored_slots, n_stored, keys)
            if not need:
                if n_stored[0]:
                    core.pred_confirm(m.pk, m.pe, m.psz, m.W, stored_keys, stored_slots, int(n_stored[0]))
                break
            n = int(meta[start, 4] - (meta[start - 1, 4] if start else 0))
            if need & core.NEED_KT:
                m.kt = m.grown(m.kt, self._cap(m.kt.shape[0], int(m.sz[0]) + n), False)
            if need & core.NEED_EM:
                m.em = m.grown(m.em, self._cap(m.em.shape[0], int(m.sz[1]) + n), True)
            if need & core.NEED_EX:
                m.ex = m.grown(m.ex, self._cap(m.ex.shape[0], int(m.sz[2]) + n), True)
        m.want_spares()
        st = self._st
        if st is not None:
            for name, v in zip(_STAT_FIELDS, stats.tolist()):
                if v:
                    setattr(st, name, getattr(st, name) + v)

    @staticmethod
    def _cap(cap: int, rows: int) -> int:
        cap *= 2
        while rows > cap * core.LOAD:
            cap *= 2
        return cap

    def _clear_pod(self, pod: _Pod, tier: str | None = None) -> int:
        """Drop the pod's exact blocks (of one tier, or all); returns how many."""
        self._flush()
        if pod.model is None:
            return 0
        m = self._models.get(pod.model)
        if m is None or pod.slot >= 64 * m.W:
            return 0
        if tier is None:
            t = -1
        else:
            t = m.tidx.get(tier)
            if t is None:
                return 0
        if not m.cnt[pod.slot].any():
            return 0
        m.kt, m.em, m.ex, n = core.clear_holder(m.kt, m.em, m.ex, m.sz, m.cnt, m.W, pod.slot, t)
        return int(n)

    def _clear_predictions(self, pod: _Pod) -> None:
        for model in pod.pred_models:
            m = self._models.get(model)
            if m is None or pod.slot >= 64 * m.W:
                continue
            core.pred_expire(m.pk, m.pe, m.pef, m.psz, m.W, pod.slot, m.predicted_by(pod.slot), 0.0, True)
        pod.pred_models.clear()

    def remove_pod(self, pod: str) -> None:
        """Forget a pod entirely (exact blocks, predictions, sequence); frees its slot."""
        p = self._pods.get(pod)
        if p is None:
            return
        self._version += 1
        self._clear_pod(p)
        self._waiting.pop(pod, None)
        self._lost.pop(pod, None)
        del self._pods[pod]
        self._clear_predictions(p)
        del self._by_slot[p.slot]
        heapq.heappush(self._free_slots, p.slot)

    # ------------------------------------------------------------------------------- apply

    def apply_many(self, batches: Iterable[KvEventBatch], *, seen: Iterable[float] | None = None) -> ApplyStats:
        """Fold batches in, in order; returns what happened (also added to :attr:`totals`).

        A pod's ``last_seen`` becomes the clock's time of this call, or with ``seen`` the
        matching entry (a replay hands over each message's store time). Stored and removed
        events are buffered and applied in one kernel call per model run.
        """
        st = ApplyStats()
        self._st = st
        self._version += 1
        try:
            ap, fast = self._apply, self._apply_next
            if seen is None:
                now = self.clock.now()
                for b in batches:
                    if type(b) is WRun:
                        self._apply_wire_run(b, st, now)
                    elif not fast(b, st, now):
                        ap(b, st, now)
            else:
                for b, now in zip(batches, seen, strict=True):
                    if type(b) is WRun:
                        self._apply_wire_run(b, st, now)
                    elif not fast(b, st, now):
                        ap(b, st, now)
            self._flush()
        finally:
            if self._ops.parents:  # an exception left events unapplied: drop them
                self._ops = _Ops(self._ops.model)
            self._st = None
        self.totals += st
        return st

    def apply(self, batch: KvEventBatch) -> ApplyStats:
        """Fold one batch in; returns what happened (also added to :attr:`totals`).

        ``token_ids`` of a ``BlockStored`` may be any sequence of ints or an ``array("I")``;
        ``block_hashes`` (and a dump's ``block_keys``) any sequence of ints or an ``array("Q")``.
        Folding many batches with :meth:`apply_many` is cheaper (one kernel call for all).
        """
        return self.apply_many((batch,))

    def _apply_wire_run(self, run: WRun, st: ApplyStats, now: float) -> None:
        """A group's batches in columns (:class:`schemas.kv_binary.WRun`): appended to the kernel's
        buffers in a few array operations when the pod is at the run's first batch (what
        :meth:`_apply_next` checks per batch, checked once), else batch by batch."""
        pod = self._pods.get(run.pod)
        m = self._ops.model
        if (pod is None or m is None or pod.model != run.model or m.name != pod.model or pod.epoch != run.epoch
                or run.first_seq != pod.seq + 1 or run.seq > MAX_SEQ or (self._waiting and run.pod in self._waiting)
                or (self._lost and run.pod in self._lost) or pod.slot >= 64 * m.W
                or (run.stored and run.block_size != m.block_size)
                or any(name not in m.tidx for name in run.mediums)):
            fast, ap = self._apply_next, self._apply
            for b in run.batches():
                if not fast(b, st, now):
                    ap(b, st, now)
            return
        ops = self._ops
        tiers = np.array([*(m.tidx[name] for name in run.mediums), m.tidx[PRIMARY_TIER]], dtype=np.int64)
        stored = run.kind == 0
        n = len(stored)
        meta = np.empty((n, 6), dtype=np.int64)
        meta[:, 0] = run.kind  # (OP_STORE 0, OP_REMOVE 1: the kinds' own values)
        meta[:, 1] = tiers[run.medium] | (pod.slot << core.TIER_BITS)  # (medium -1: the last, the primary tier)
        meta[:, 2] = np.where(stored, np.where(run.has_parent, _HASH_DIGESTS, _ROOT_DIGESTS), 0)
        meta[:, 3] = np.where(stored, m.block_size, 0)
        meta[:, 4] = run.hash_end + len(ops.hashes)
        meta[:, 5] = run.digest_end + len(ops.tokens)
        ops.meta.frombytes(memoryview(meta).cast("B"))
        parents = np.where(stored, np.where(run.has_parent, run.parent, _NO_LORA_SEED), 0).astype(np.uint64)
        ops.parents.frombytes(memoryview(parents).cast("B"))
        ops.salts.frombytes(bytes(8 * n))
        ops.hashes.frombytes(memoryview(run.hashes).cast("B"))
        ops.tokens.frombytes(memoryview(run.digests).cast("B"))
        st.batches += len(run)
        st.events += n
        pod.seq = run.seq
        pod.last_event_ts = float(run.ts[-1])
        pod.last_seen = now
        pod.exact = True

    def _apply_next(self, b, st: ApplyStats, now: float) -> bool:
        """The common case in few steps, or False (nothing done) for :meth:`_apply`: a binary
        message's batch (wire structs) that is the next of a pod already folding this model, its
        events stored blocks with digests (no keys, salts or LoRA) of the model's block size, and
        removals, of tiers the model has. What it does equals :meth:`_apply`'s for such a batch
        (tests/test_kv_index_wire_path.py folds the same histories both ways)."""
        events = b.events
        if not events or type(b) is KvEventBatch:
            return False
        name = b.pod
        pod = self._pods.get(name)
        m = self._ops.model
        if (pod is None or m is None or pod.model != b.model or m.name != pod.model or pod.epoch != b.epoch
                or b.seq != pod.seq + 1 or b.seq > MAX_SEQ or (self._waiting and name in self._waiting)
                or (self._lost and name in self._lost)):
            return False
        slot = pod.slot
        if slot >= 64 * m.W:
            return False
        tidx, bs = m.tidx, m.block_size
        for ev in events:
            t = type(ev)
            if t is WStored:
                if (ev.block_digests is None or ev.block_keys is not None or ev.block_salts is not None
                        or ev.parent_key is not None or ev.block_size != bs or ev.lora_id is not None
                        or ev.lora_name is not None or (ev.medium or PRIMARY_TIER) not in tidx):
                    return False
            elif t is not WRemoved or (ev.medium or PRIMARY_TIER) not in tidx:
                return False
        ops = self._ops
        hs, tk, meta, parents, salts = ops.hashes, ops.tokens, ops.meta, ops.parents, ops.salts
        holder0 = slot << core.TIER_BITS
        for ev in events:
            hs.frombytes(ev.block_hashes.cast("B"))
            t = tidx[ev.medium or PRIMARY_TIER]
            if type(ev) is WStored:
                tk.frombytes(ev.block_digests.cast("B"))
                parent = ev.parent_block_hash
                if parent is None:
                    meta.extend((core.OP_STORE, holder0 | t, _ROOT_DIGESTS, bs, len(hs), len(tk)))
                    parents.append(_NO_LORA_SEED)
                else:
                    meta.extend((core.OP_STORE, holder0 | t, _HASH_DIGESTS, bs, len(hs), len(tk)))
                    parents.append(parent)
            else:
                meta.extend((core.OP_REMOVE, holder0 | t, 0, 0, len(hs), len(tk)))
                parents.append(0)
            salts.append(0)
        st.batches += 1
        st.events += len(events)
        pod.seq = b.seq
        pod.last_event_ts = b.ts
        pod.last_seen = now
        pod.exact = True
        return True

    def _apply(self, batch: KvEventBatch, st: ApplyStats, now: float) -> None:
        st.batches += 1
        epoch, seq = batch.epoch, batch.seq
        if not (0 <= epoch <= MAX_EPOCH and 0 <= seq <= MAX_SEQ):
            st.out_of_bounds += 1
            return
        name = batch.pod
        pod = self._pods.get(name)
        if pod is not None and pod.epoch is not None:
            if epoch > pod.epoch + MAX_EPOCH_JUMP:
                st.out_of_bounds += 1
                return
            if self.reorder_window_s and (epoch, seq) > (pod.epoch, pod.seq) and not (
                    (epoch == pod.epoch and seq == pod.seq + 1) or (epoch > pod.epoch and seq == 0)):
                w = self._waiting.get(name)
                if w is None:
                    w = self._waiting[name] = {}
                if (epoch, seq) in w:
                    st.stale_batches += 1  # a copy of one already waiting
                    return
                w[(epoch, seq)] = (batch, now + self.reorder_window_s)
                st.held += 1
                if self._lost and name in self._lost:
                    self._shorten(name)
                if len(w) > self.reorder_max:
                    self._release(name, st, now, force=True)
                return
        self._apply_now(batch, st, now)
        if self._waiting and name in self._waiting:
            self._release(name, st, now)
        if self._lost and name in self._lost:
            self._shorten(name)

    def _release(self, name: str, st: ApplyStats, now: float, force: bool = False) -> None:
        """Apply the pod's waiting batches that are next in order (or have waited long enough,
        or all of them with ``force``), lowest ``(epoch, seq)`` first."""
        w = self._waiting.get(name)
        while w:
            k = min(w)
            batch, deadline = w[k]
            pod = self._pods.get(name)
            nxt = (pod is None or pod.epoch is None or (k[0] == pod.epoch and k[1] == pod.seq + 1)
                   or (k[0] > pod.epoch and k[1] == 0) or k <= (pod.epoch, pod.seq))
            if not (nxt or force or deadline <= now):
                break
            del w[k]
            self._apply_now(batch, st, now)
        if not w:
            self._waiting.pop(name, None)

    def lost(self, pod: str, epoch: int, seq: int, grace_s: float = LOST_GRACE_S) -> None:
        """Batch ``(epoch, seq)`` of ``pod`` was refused by the consumer folding it (dead-lettered):
        once it is the pod's next batch, the batches right behind it wait for it ``grace_s`` at most
        instead of the reorder window (:meth:`release_expired` then applies them, the gap
        accepted); a later gap of batches merely late keeps its whole window. A good copy arriving
        within the grace is applied as any batch; one arriving later is dropped as stale, as after
        the window. Changes nothing without a reorder window, or for a pod or position this index
        does not wait on."""
        p = self._pods.get(pod)
        if not self.reorder_window_s or p is None or p.epoch is None or (epoch, seq) <= (p.epoch, p.seq):
            return
        self._lost.setdefault(pod, {})[(epoch, seq)] = self.clock.now() + grace_s
        self._shorten(pod)

    def _shorten(self, name: str) -> None:
        """The grace of :meth:`lost` for the pod's waiting batches in the run that starts at its
        next position, when that one was refused (refused positions in the run extend it);
        refused positions the pod has passed are forgotten."""
        lost = self._lost[name]
        p = self._pods.get(name)
        if p is None or p.epoch is None:
            del self._lost[name]
            return
        here = (p.epoch, p.seq)
        for k in [k for k in lost if k <= here]:
            del lost[k]
        if not lost:
            del self._lost[name]
            return
        w = self._waiting.get(name)
        if not w:
            return
        nxt = (p.epoch, p.seq + 1)
        if nxt not in lost:  # or a new epoch's first batch, refused
            nxt = min((k for k in lost if k[0] > p.epoch and k[1] == 0), default=None)
            if nxt is None:
                return  # an earlier batch is missing, not refused: it gets the whole window
        until = lost[nxt]
        e, s = nxt
        while True:
            s += 1
            k = (e, s)
            if k in lost:
                until = max(until, lost[k])
            elif k in w:
                b, d = w[k]
                if d > until:
                    w[k] = (b, until)
            else:
                break

    def release_expired(self) -> ApplyStats:
        """Apply the batches that have waited ``reorder_window_s`` for an earlier one (the gap
        is then accepted); returns what happened (also added to :attr:`totals`)."""
        st = ApplyStats()
        if not self._waiting:
            return st
        now = self.clock.now()
        self._st = st
        self._version += 1
        try:
            for name in list(self._waiting):
                w = self._waiting.get(name)
                if w and min(d for _, d in w.values()) <= now:
                    self._release(name, st, now)
            self._flush()
        finally:
            if self._ops.parents:
                self._ops = _Ops(self._ops.model)
            self._st = None
        self.totals += st
        return st

    def waiting(self) -> list[tuple[str, int, int]]:
        """``(pod, epoch, seq)`` of every batch held back for an earlier one."""
        return [(name, e, s) for name, w in self._waiting.items() for (e, s) in w]

    @property
    def waiting_count(self) -> int:
        return sum(len(w) for w in self._waiting.values()) if self._waiting else 0

    def _apply_now(self, batch: KvEventBatch, st: ApplyStats, now: float) -> None:
        name = batch.pod
        if not batch.events:
            p = self._pods.get(name)
            if p is not None and p.epoch == batch.epoch and p.seq == batch.seq:
                st.heartbeats += 1  # a bridge's heartbeat: the pod is alive, nothing changed
                p.last_seen = now
                return
        if self._gone:
            tomb = self._gone.get(name)
            if tomb is not None:
                if (batch.epoch, batch.seq) <= (tomb[1], tomb[2]):
                    st.stale_batches += 1
                    return
                del self._gone[name]
        pod = self._pods.get(name)
        if pod is None:
            pod = self._pod(name)
        epoch, seq = batch.epoch, batch.seq
        if pod.epoch is not None:
            if epoch == pod.epoch:
                if seq <= pod.seq:
                    st.stale_batches += 1
                    return
                if seq > pod.seq + 1:
                    st.gaps += 1
            elif epoch < pod.epoch:
                st.stale_batches += 1
                return
            else:
                st.epoch_resets += 1
                self._clear_pod(pod)
                self._clear_predictions(pod)
        model = batch.model
        if pod.model != model:
            if pod.model is not None:
                self._clear_pod(pod)  # a pod serves one model; a new model means a new cache
                self._clear_predictions(pod)
            pod.model = model
        pod.epoch = epoch
        pod.seq = seq
        pod.last_event_ts = batch.ts
        pod.last_seen = now
        pod.exact = True
        m = self._models.get(model)
        if m is None:
            m = self._model(model)
        slot = pod.slot
        if slot >= 64 * m.W:
            self._flush()
            m.widen(slot)
        if self._ops.model is not m:
            self._flush()
            self._ops.model = m
        for ev in batch.events:  # the schema's events, or a binary message's wire structs (same fields)
            st.events += 1
            kind = ev.type
            if kind == "stored":
                self._stored(m, slot, ev, st)
            elif kind == "removed":
                t = m.tidx.get(ev.medium or PRIMARY_TIER)
                if t is None:
                    st.unknown_removed += len(ev.block_hashes)
                    continue
                ops = self._ops
                hs = ops.hashes
                _extend_hashes(hs, ev.block_hashes)
                ops.meta.extend((core.OP_REMOVE, slot << core.TIER_BITS | t, 0, 0, len(hs), len(ops.tokens)))
                ops.parents.append(0)
                ops.salts.append(0)
            elif kind == "cleared":
                st.cleared += 1
                self._clear_pod(pod, None if ev.medium is None else ev.medium)
            elif kind == "reset":
                st.resets += 1
                self._clear_pod(pod)
                self._clear_predictions(pod)
            elif kind == "gone":
                st.gone += 1
                self._gone[name] = (model, epoch, seq, batch.ts)
                self.remove_pod(name)
                break  # nothing after a pod is gone

    def _stored(self, m: _Model, slot: int, ev: BlockStored, st: ApplyStats) -> None:
        bs = ev.block_size
        if bs != m.block_size:
            if m.block_size is not None:
                st.rejected += 1
                return
            m.block_size = bs
        ops = self._ops
        hs, tk = ops.hashes, ops.tokens
        h0, t0 = len(hs), len(tk)
        _extend_hashes(hs, ev.block_hashes)
        n = len(hs) - h0
        keys = ev.block_keys if _HAS_KEYS else getattr(ev, "block_keys", None)
        salts = None
        if keys is not None:
            kind, parent = core.KEYS_GIVEN, 0
            karr = array("Q")
            try:
                karr.frombytes(_u64_bytes(keys))
            except (OverflowError, TypeError, ValueError):
                karr = None
            if karr is None or len(karr) != n or 0 in karr:
                del hs[h0:]
                st.rejected += 1
                return
            tk.frombytes(memoryview(karr).cast("B"))
        else:
            parent = ev.parent_key
            if parent is not None:  # an index dump names our parent key directly
                kind = core.PARENT_KEY
            else:
                parent = ev.parent_block_hash
                if parent is not None:
                    kind = core.PARENT_HASH
                else:
                    kind = core.PARENT_ROOT
                    lora_id, lora_name = ev.lora_id, ev.lora_name
                    # vLLM hashes the adapter's name (ids are per engine); the id only when no name
                    parent = lora_seed(lora_name if lora_name is not None else lora_id)
            salts = ev.block_salts if _HAS_SALTS else getattr(ev, "block_salts", None)
            digests = ev.block_digests if _HAS_DIGESTS else getattr(ev, "block_digests", None)
            try:
                if digests is not None:  # a bridge's: a digest per block (two words) in place of its tokens
                    kind |= core.DIGESTS
                    words = 2
                    tk.frombytes(_u64_bytes(digests))
                else:
                    words = bs
                    _extend_tokens(tk, ev.token_ids)
            except (OverflowError, TypeError, ValueError) as exc:
                del hs[h0:]
                del tk[t0:]
                what = "block digests must be integers in [0, 2**64)" if digests is not None else \
                    "token ids must be integers in [0, 2**32)"
                raise ValueError(f"{what}: {exc}") from None
            if len(tk) - t0 != n * words or (salts is not None and len(salts) != n):
                del hs[h0:]
                del tk[t0:]
                st.rejected += 1
                return
        medium = ev.medium or PRIMARY_TIER
        t = m.tidx.get(medium)
        if t is None:
            t = m.tier(medium, self.tier_weights)
        holder = slot << core.TIER_BITS | t
        if salts is not None and any(salts):
            # a salted block starts an operation of its own (the kernel salts an operation's
            # first block), chained to the block before it by that block's engine hash
            starts = [0] + [i for i in range(1, n) if salts[i]]
            for j, a in enumerate(starts):
                b = starts[j + 1] if j + 1 < len(starts) else n
                if a:
                    kind, parent = core.PARENT_HASH | (kind & core.DIGESTS), hs[h0 + a - 1]
                try:
                    ops.parents.append(parent)
                    ops.salts.append(salts[a])
                except OverflowError:
                    raise ValueError("parent hash, key or salt must be an integer in [0, 2**64)") from None
                ops.meta.extend((core.OP_STORE, holder, kind, bs, h0 + b, t0 + b * words))
            return
        try:
            ops.parents.append(parent)
        except OverflowError:
            del hs[h0:]
            del tk[t0:]
            raise ValueError("parent hash or key must be an integer in [0, 2**64)") from None
        ops.salts.append(0)
        ops.meta.extend((core.OP_STORE, holder, kind, bs, len(hs), len(tk)))

    # ----------------------------------------------------------------------- predictions

    def record_route(self, model: str, pod: str, token_ids: Sequence[int] | None = None,
                     keys: Sequence[int] | None = None, ttl_s: float | None = None, *,
                     lora: int | str | None = None, salt: int = 0) -> None:
        """Predict that ``pod`` will hold the blocks of a request just routed to it."""
        if keys is None:
            if token_ids is None:
                raise ValueError("record_route needs token_ids or keys")
            bs = self.block_size(model)
            if bs is None:
                return  # no block size known (no events, no default): nothing can be keyed
            keys = block_keys(token_ids, bs, lora=lora, salt=salt)
        karr = _as_key_array(keys)  # (a zero key, the tables' empty mark, is skipped by the kernel)
        if not len(karr):
            return
        self._version += 1
        now = self.clock.now()
        self._expire(now)
        p = self._pod(pod)
        if ttl_s is None:
            ttl_s = self.predict_on_route_ttl_s if p.exact else self.predicted_ttl_s
        exp = now + ttl_s
        m = self._model(model)
        m.widen(p.slot)
        m.reserve_predictions(len(karr))
        core.pred_record(m.pk, m.pe, m.pef, m.psz, p.slot, karr, exp)
        p.pred_models.add(model)
        self._pred_n += 1
        heapq.heappush(self._pred_heap, (exp, self._pred_n, pod, model, karr))

    def forget_route(self, model: str, pod: str, keys: Sequence[int]) -> int:
        """A request routed to ``pod`` with these blocks left it before its prefill ran there (it
        failed, timed out or was cancelled): their predictions on ``pod`` end now, where they would
        have counted for their whole time to live; what the engine's events reported stays. Returns
        how many predictions ended."""
        p = self._pods.get(pod)
        m = self._models.get(model)
        if p is None or m is None or model not in p.pred_models:
            return 0
        karr = _as_key_array(keys)
        if not len(karr):
            return 0
        self._version += 1
        return int(core.pred_expire(m.pk, m.pe, m.pef, m.psz, m.W, p.slot, karr, self.clock.now(), True))

    def _expire(self, now: float) -> None:
        heap = self._pred_heap
        if heap and heap[0][0] <= now:
            self._version += 1
        while heap and heap[0][0] <= now:
            exp, _, podname, model, keys = heapq.heappop(heap)
            p = self._pods.get(podname)
            m = self._models.get(model)
            if p is None or m is None or model not in p.pred_models:
                continue
            core.pred_expire(m.pk, m.pe, m.pef, m.psz, m.W, p.slot, keys, now, False)

    def reserve(self, model: str, blocks: int) -> bool:
        """Size ``model``'s key table and engine map for ``blocks`` blocks held (all engines and
        tiers together) now, while they hold little. A table that fills up is doubled by rehashing
        every row, which stalls the caller for a time proportional to its size (0.1 s at 0.6M
        keys, 0.4 s at 2.5M: bench/RESULTS.md, session 17); sized ahead, the engines can fill their
        caches without one. Only grows; returns whether a table grew."""
        if blocks <= 0:
            return False
        self._flush()
        m = self._model(model)
        cap = self._cap(512, blocks)  # (the growth policy's size for them: 1024 rows at least)
        grew = False
        if m.kt.shape[0] < cap:
            m.kt = core.grow_kt(m.kt, cap)
            grew = True
        if m.em.shape[0] < cap:
            m.em = core.grow_pairs(m.em, cap)
            grew = True
        return grew

    # ----------------------------------------------------------------------------- queries

    def block_size(self, model: str) -> int | None:
        """Learnt from the model's ``BlockStored`` events, else ``default_block_size``."""
        m = self._models.get(model)
        if m is not None and m.block_size:
            return m.block_size
        return self.default_block_size

    def _allowed(self, pods: Iterable[str] | None) -> int:
        if pods is None:
            allowed = (1 << self._next_slot) - 1
        else:
            allowed = 0
            for name in pods:
                p = self._pods.get(name)
                if p is not None:
                    allowed |= p.bit
        if self.pod_timeout_s is not None:
            cutoff = self.clock.now() - self.pod_timeout_s
            for p in self._pods.values():
                if p.exact and p.last_seen is not None and p.last_seen < cutoff:
                    allowed &= ~p.bit
        return allowed

    def _allowed_words(self, pods: Iterable[str] | None, W: int) -> np.ndarray:
        if pods is None and self.pod_timeout_s is None:
            c = self._allowed_cache
            if c is not None and c[0] == self._next_slot and c[1] == W:
                return c[2]
            words = self._words((1 << self._next_slot) - 1, W)
            self._allowed_cache = (self._next_slot, W, words)
            return words
        return self._words(self._allowed(pods), W)

    @staticmethod
    def _words(mask: int, W: int) -> np.ndarray:
        mask &= (1 << (64 * W)) - 1
        return np.frombuffer(mask.to_bytes(8 * W, "little"), dtype="<u8").astype(np.uint64)

    def match_tokens(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None = None,
                     *, lora: int | str | None = None, salt: int = 0) -> dict[str, PodMatch]:
        """Matched prefix per pod for a token sequence (hashed like the index keys).

        ``lora`` is the request's LoRA adapter (by name, as vLLM hashes it) and ``salt`` the
        salt of its first block (:func:`streams.kv_keys.request_salt` of its ``cache_salt``).

        Without ``pods``: only pods that hold at least one leading block. With ``pods``:
        one entry for each of them (zeros when nothing matches).
        """
        if pods is not None:
            pods = list(pods)
        bs = self.block_size(model)
        m = self._models.get(model)
        if bs is None or m is None:
            return self._empty(pods)
        if self._pred_heap:
            self._expire(self.clock.now())
        n = len(token_ids) // bs
        if m.predicting or not m.T or n == 0:
            return self.match_keys(model, block_keys(token_ids, bs, lora=lora, salt=salt), pods)
        toks = _token_array(token_ids[: n * bs] if len(token_ids) != n * bs else token_ids)
        W = m.W
        matched = np.zeros(64 * W, dtype=np.int64)
        tiers = np.zeros((64 * W if m.multi else 0, m.T + 1), dtype=np.int64)
        walked = core.query_tokens(m.kt, W, toks, bs, n, np.uint64(root_seed(lora) ^ salt), self._allowed_words(pods, W), m.torder,
                                   matched, tiers)
        return self._results(m, walked, matched, tiers, pods)

    def _empty(self, pods: Iterable[str] | None) -> dict[str, PodMatch]:
        if pods is None:
            return {}
        return {p: _new_match((0, 0.0, {}, 0)) for p in pods}

    def match_keys(self, model: str, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Matched prefix per pod for already-computed block keys (see :func:`block_keys`).

        Pods with the same match share one (immutable) :class:`PodMatch`; treat its ``tiers``
        dict as read-only.
        """
        if pods is not None:
            pods = list(pods)
        w = self._walk(model, keys, pods, by_tier=True)
        return self._empty(pods) if w is None else self._results(*w, pods)

    def match_counts(self, model: str, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """:meth:`match_keys` reduced to what a routing decision reads, per pod holding at least
        the first block: ``(matched blocks, exact or predicted; of those, predicted only)``. No
        tier detail, no :class:`PodMatch` per pod: the router asks this for every request.

        The router asks it twice with the same keys object (its lazy tokenizing, then its
        decision; the keys are not changed in between): the second time, when nothing that a query
        reads has changed since (no batch, route, expiry, release or removed pod; :data:`REUSE_S`
        at most), the first answer is given again without a walk (copies: each caller may change
        what it gets)."""
        c = self._counted
        if c is not None and c[0] is keys and c[1] == model and c[2] == self._version:
            now = self.clock.now()
            heap = self._pred_heap
            if now - c[3] <= REUSE_S and not (heap and heap[0][0] <= now):
                return dict(c[4]), dict(c[5])
        out, pred = self._match_counts(model, keys)
        self._counted = (keys, model, self._version, self.clock.now(), dict(out), dict(pred))
        return out, pred

    def _match_counts(self, model: str, keys: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        w = self._walk(model, keys, None, by_tier=False)
        out: dict[str, int] = {}
        pred: dict[str, int] = {}
        if w is None or not w[1]:
            return out, pred
        m, _, matched, tiers = w
        by_slot = self._by_slot
        ml = matched[:self._next_slot].tolist()
        if len(tiers):  # (with predictions: column T counts the predicted blocks)
            pl = tiers[:self._next_slot, m.T].tolist()
            for s, mb in enumerate(ml):
                if mb and (p := by_slot.get(s)) is not None:
                    out[p.name] = mb
                    if pl[s]:
                        pred[p.name] = pl[s]
        else:
            for s, mb in enumerate(ml):
                if mb and (p := by_slot.get(s)) is not None:
                    out[p.name] = mb
        return out, pred

    def _walk(self, model: str, keys: Sequence[int], pods: list[str] | None,
              by_tier: bool) -> tuple[_Model, int, np.ndarray, np.ndarray] | None:
        """The kernel's walk of ``keys``: ``(model, blocks walked, matched per slot, counts per slot
        and category)``, or None when nothing can match. Counts per category are kept when the
        model has predictions, and with ``by_tier`` when it has several tiers."""
        m = self._models.get(model)
        if m is None or not len(keys):
            return None
        if self._pred_heap:
            self._expire(self.clock.now())
        predicting = m.predicting
        if not m.T and not predicting:
            return None
        try:
            karr = _as_key_array(keys)
        except ValueError:
            return None  # not keys of ours: nothing can match
        W = m.W
        matched = np.zeros(64 * W, dtype=np.int64)
        detail = predicting or (by_tier and m.multi)
        tiers = np.zeros((64 * W, m.T + 1), dtype=np.int64) if detail else _NO_TIERS
        walked = core.query(m.kt, W, karr, self._allowed_words(pods, W), m.pk if predicting else _NO_PRED[W],
                            m.torder, matched, tiers, np.empty(2 * W, dtype=np.uint64))
        return m, walked, matched, tiers

    def _results(self, m: _Model, walked: int, matched: np.ndarray, tiers: np.ndarray,
                 pods: list[str] | None) -> dict[str, PodMatch]:
        out: dict[str, PodMatch] = {}
        if walked:
            by_slot = self._by_slot
            n = self._next_slot
            if n <= _FEW_SLOTS:  # scanning a short list beats numpy's nonzero + gather (~1 us a query)
                hit = [(s, mb) for s, mb in enumerate(matched[:n].tolist()) if mb]
            else:
                nz = np.flatnonzero(matched)
                hit = list(zip(nz.tolist(), matched[nz].tolist()))
            if not len(tiers):
                tier_name = m.tiers[0]
                weight = self.tier_weights.get(tier_name, 1.0)
                shared: dict[int, PodMatch] = {}
                for s, mb in hit:
                    pm = shared.get(mb)
                    if pm is None:
                        pm = shared[mb] = _new_match((mb, mb * weight, {tier_name: mb}, 0))
                    out[by_slot[s].name] = pm
            elif hit:
                names = m.tiers
                w = [self.tier_weights.get(t, 0.0) for t in names] + [self.predicted_weight]
                T = len(names)
                rows = tiers[[s for s, _ in hit]].tolist()
                for (s, mb), row in zip(hit, rows):  # row: blocks per tier, then predicted
                    td = {t: c for t, c in zip(names, row) if c}
                    out[by_slot[s].name] = _new_match((mb, sum(map(mul, row, w)), td, row[T]))
        if pods is not None:
            for name in pods:
                if name not in out:
                    out[name] = _new_match((0, 0.0, {}, 0))
        return out

    def _predicted_count(self, p: _Pod) -> int:
        n = 0
        for model in p.pred_models:
            m = self._models.get(model)
            if m is not None:
                n += int(np.count_nonzero(m.pe[:, 1] == np.uint64(p.slot + 1)))
        return n

    def pods(self) -> dict[str, PodInfo]:
        now = self.clock.now()
        if self._pred_heap:
            self._expire(now)
        out = {}
        for name, p in self._pods.items():
            live = not (self.pod_timeout_s is not None and p.exact and p.last_seen is not None
                        and p.last_seen < now - self.pod_timeout_s)
            blocks = {}
            m = self._models.get(p.model) if p.model is not None else None
            if m is not None and p.slot < 64 * m.W:
                row = m.cnt[p.slot].tolist()
                blocks = {t: row[i] for i, t in enumerate(m.tiers) if row[i]}
            out[name] = PodInfo(
                pod=name, model=p.model, blocks=blocks,
                predicted_blocks=self._predicted_count(p), epoch=p.epoch, seq=p.seq, last_event_ts=p.last_event_ts,
                last_seen=p.last_seen, live=live)
        return out

    def keys_of(self, pod: str, block_hashes: Sequence[int], medium: str | None = None) -> list[int | None]:
        """Our key of each engine block hash ``pod`` holds in a tier (None where it holds none):
        which prefix a block the engine names ends, for explaining a decision or a bench."""
        p = self._pods.get(pod)
        m = self._models.get(p.model) if p is not None and p.model is not None else None
        t = m.tidx.get(medium or PRIMARY_TIER) if m is not None else None
        if t is None or p.slot >= 64 * m.W:
            return [None] * len(block_hashes)
        hs = array("Q")
        _extend_hashes(hs, block_hashes)
        keys = core.em_lookup(m.em, np.frombuffer(hs, dtype=np.uint64) if hs else _NO_U64,
                              p.slot << core.TIER_BITS | t)
        return [k or None for k in keys.tolist()]

    def models(self) -> dict[str, int]:
        """Model -> number of distinct blocks held by any pod."""
        return {name: int(m.sz[0]) for name, m in self._models.items()}

    def __len__(self) -> int:
        return sum(int(m.sz[0]) for m in self._models.values())

    # ------------------------------------------------------------------------ dump / state

    def _held(self) -> dict[str, dict[str, np.ndarray]]:
        """pod -> tier -> its (engine hash, key) rows, sorted."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for m in self._models.values():
            for holder, rows in m.held().items():
                p = self._by_slot.get(holder >> core.TIER_BITS)
                if p is None or p.model != m.name:
                    continue
                out.setdefault(p.name, {})[m.tiers[holder & 7]] = rows
        return out

    def state(self) -> dict:
        """A canonical, comparable picture of the exact state (predictions and clocks left out)."""
        held = self._held()
        pods = {}
        for name, p in self._pods.items():
            if not p.exact:
                continue
            tiers = {t: [tuple(r) for r in rows.tolist()] for t, rows in held.get(name, {}).items()}
            pods[name] = (p.model, p.epoch, p.seq, p.last_event_ts, tiers)
        return {"pods": pods, "gone": dict(self._gone)}

    def fingerprint(self) -> str:
        """A short hash of :meth:`state`, equal for equal states (order-independent)."""
        st = self.state()
        canon = (sorted((name, v[:4], sorted((t, tuple(x)) for t, x in v[4].items()))
                        for name, v in st["pods"].items()),
                 sorted(st["gone"].items()))
        return f"{xxh3_64_intdigest(repr(canon).encode()):016x}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvIndex):
            return NotImplemented
        return self.state() == other.state()

    __hash__ = None  # mutable

    def dump(self) -> list[KvEventBatch]:
        """The exact state as events: ``KvIndex(clock).apply_many(index.dump())`` restores it.

        Per pod and tier, the held ``engine hash -> key`` pairs are written once each, in
        ``BlockStored`` events of up to 4096 blocks that carry our keys (``block_keys``) and no
        token ids: replaying needs no parent lookups and no hashing, and blocks whose parent
        the pod no longer holds survive.
        """
        out: list[KvEventBatch] = []
        held = self._held()
        for name, p in list(self._pods.items()):
            if not p.exact or p.model is None:
                continue
            bs = self._models[p.model].block_size or 1
            events = []
            for t, rows in sorted(held.get(name, {}).items()):  # tiers in a canonical order
                medium = None if t == PRIMARY_TIER else t
                for i in range(0, len(rows), _DUMP_CHUNK):
                    part = rows[i:i + _DUMP_CHUNK]
                    events.append(BlockStored.model_construct(
                        type="stored", block_hashes=part[:, 0].tolist(), parent_block_hash=None, token_ids=[],
                        block_size=bs, lora_id=None, lora_name=None, medium=medium, parent_key=None,
                        block_keys=part[:, 1].tolist()))
            out.append(KvEventBatch.model_construct(
                schema_version=1, pod=name, model=p.model, dp_rank=0, epoch=p.epoch or 0, seq=p.seq or 0,
                ts=p.last_event_ts or 0.0, events=events))
        for name, (model, epoch, seq, ts) in list(self._gone.items()):
            out.append(KvEventBatch(pod=name, model=model, epoch=epoch, seq=seq, ts=ts, events=[PodGone()]))
        return out


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) every kernel the fold and the decoders use,
    by exercising them on a tiny index. A cold compile takes several seconds once per install;
    services call this at start so the first event or request does not pay it."""
    from schemas.kv import BlockStored as _S

    clock = ManualClock()
    idx = KvIndex(clock, default_block_size=2)
    toks = list(range(8))
    idx.apply_many([KvEventBatch.model_construct(
        schema_version=1, pod="w", model="w", dp_rank=0, epoch=0, seq=0, ts=0.0, events=[
            _S(block_hashes=[1, 2], token_ids=toks[:4], block_size=2),
            _S(block_hashes=[3], parent_block_hash=2, token_ids=toks[4:6], block_size=2, medium="CPU"),
            BlockRemoved(block_hashes=[2])])])
    KvIndex(ManualClock()).apply_many(idx.dump())
    idx.match_tokens("w", toks)
    idx.match_keys("w", block_keys(toks, 2))
    idx.record_route("w", "x", token_ids=toks)
    idx.match_keys("w", block_keys(toks, 2))
    # the predicted pod's own events then confirm its predictions (a router's feed, every time it
    # has routed something: compiled here, or the first KV message after a route stalls on it)
    idx.apply_many([KvEventBatch.model_construct(schema_version=1, pod="x", model="w", dp_rank=0, epoch=0, seq=0,
                                                 ts=0.0, events=[_S(block_hashes=[11, 12], token_ids=toks[:4],
                                                                    block_size=2)])])
    clock.advance(idx.predicted_ttl_s + 1)  # the predictions expire
    idx.match_keys("w", block_keys(toks, 2))
    # the tables' growth (a rehash into a table twice the size): compiled here, not on the first
    # doubling of a live index, where it stalled that batch or request 0.7 s on a fresh install
    m = next(iter(idx._models.values()))
    core.grow_kt(m.kt, m.kt.shape[0] * 2)
    core.grow_pairs(m.em, m.em.shape[0] * 2)
    idx.record_route("w", "x", token_ids=toks)
    idx.remove_pod("x")  # (and are cleared with their pod)
    idx.keys_of("w", [1])
    idx.apply_many([KvEventBatch.model_construct(schema_version=1, pod="w", model="w", dp_rank=0, epoch=0, seq=1,
                                                 ts=0.0, events=[PodReset()])])
    core.parse_uint_arrays(np.frombuffer(b"[1][2]", dtype=np.uint8), np.frombuffer(b"\x00\x01", dtype=np.uint8))

