"""The global KV-cache index: a pure fold of :class:`schemas.KvEventBatch` messages.

Keys
    Blocks are keyed by our own chained hash over the token ids that ``BlockStored``
    carries (:func:`block_keys`: xxh3-64 of the block's little-endian uint32 token bytes,
    seeded with the parent block's key), never by the engine's hash, so the index does not
    depend on how an engine hashes (sha256 over pickle or CBOR, seeded or not). Per pod and
    tier the index keeps ``engine hash -> key`` to resolve parents and removals.

Data structure (per-block work in C-level dict passes; the cost left is cache misses)
    per model and tier ``key -> pod bitmask`` (one bit per pod slot), plus ``key -> bitmask``
    over all tiers when a model uses more than one tier. A query maps the dicts over the
    query keys and folds them with ``itertools.accumulate(and)`` in C, stopping at the first
    block no pod holds; because a prefix-AND only loses bits, the running masks decrease
    numerically, so each pod's matched length is found by bisection, not by a Python loop.
    Per pod and tier the index also keeps the stored events themselves (parent key, engine
    hashes, keys, token bytes: references, no per-block copies) for :meth:`KvIndex.dump`; a
    block is still held when the pod's ``engine hash -> key`` map points at that very key
    object, and the list is compacted when dead blocks outnumber held ones. Ingest thus does
    a handful of C-level dict passes per event and no per-block Python work besides hashing.

Deliberate handling of bad input (counted in :class:`ApplyStats`, never corrupting)
    * a batch whose ``(epoch, seq)`` is not newer than the pod's last one is dropped
      (redelivery, replay); a skipped sequence is counted as a gap but applied;
    * a newer ``epoch`` means the engine restarted: the pod's blocks are dropped first;
    * ``BlockStored`` whose parent the pod does not hold is skipped (its keys cannot be
      computed); removals of unknown blocks are counted and ignored; a block stored twice is
      counted as a duplicate; two engine hashes for the same key are reference-counted;
    * a block size different from the model's first one is rejected (keys would differ).

Approximate mode
    :meth:`KvIndex.record_route` records the router's own decision as predicted blocks with a
    TTL (``predicted_ttl_s`` for pods that never sent events, ``predict_on_route_ttl_s`` for
    pods that do, to cover sibling requests arriving before the engine's event). Queries merge
    exact and predicted blocks per pod; :attr:`PodMatch.predicted_blocks` counts the
    predicted-only part of the matched prefix.

Dump
    :meth:`KvIndex.dump` writes the exact state back out as events; restoring is
    ``KvIndex(...).apply_many(dump)``. The events are rebuilt from the kept stored events: each
    run of blocks a pod still holds becomes one ``BlockStored`` carrying ``parent_key`` (our key
    of the parent), so replaying needs no parent lookups and blocks whose parent the pod no
    longer holds survive a restore: they become usable again when the parent is stored again.
    Predictions are transient and not dumped; :meth:`KvIndex.state` (used by ``==``) is the
    exact state.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from collections import deque
from dataclasses import dataclass, fields
from functools import partial
from itertools import accumulate, compress, islice, repeat, takewhile
from operator import and_, attrgetter, is_, not_, or_
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from schemas.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodGone, PodReset
from streams.clock import Clock

PRIMARY_TIER = "GPU"
DEFAULT_TIER_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "LOCAL_FILE": 0.5, "REMOTE": 0.3}
_LITTLE = sys.byteorder == "little"


# --------------------------------------------------------------------------------------- keys


def root_seed(lora: int | str | None = None) -> int:
    """The chain seed of a first block: 0, or derived from a LoRA adapter's id or name."""
    if lora is None:
        return 0
    return xxh3_64_intdigest(f"lora:{lora}".encode())


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        if hasattr(token_ids, "astype"):  # numpy array
            if len(token_ids) and (token_ids.min() < 0 or token_ids.max() >= 1 << 32):
                raise ValueError("token ids must be integers in [0, 2**32)")
            return token_ids.astype("<u4", copy=False).tobytes()
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def _chunks(data: bytes, width: int, n: int) -> list[bytes]:
    return list(map(data.__getitem__, map(slice, range(0, n * width, width), range(width, n * width + 1, width))))


def _chain(chunks: list[bytes], seed: int) -> list[int]:
    out = []
    ap = out.append
    h = xxh3_64_intdigest
    for c in chunks:
        seed = h(c, seed)
        ap(seed)
    return out


def block_keys(token_ids: Sequence[int], block_size: int, parent: int | None = None,
               *, lora: int | str | None = None) -> list[int]:
    """Our chained 64-bit key of every full block of ``token_ids``.

    ``key[i] = xxh3_64(uint32-LE tokens of block i, seed=key[i-1])``; the first block is seeded
    with ``parent`` (a key) or, without one, with :func:`root_seed` of ``lora``. A trailing
    partial block is ignored. Equal prefixes give equal keys in every process.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    data = _token_bytes(token_ids[: n * block_size] if len(token_ids) != n * block_size else token_ids)
    return _chain(_chunks(data, block_size * 4, n), root_seed(lora) if parent is None else parent)


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


class _Model:
    __slots__ = ("name", "block_size", "tiers", "present", "pred")

    def __init__(self, name: str):
        self.name = name
        self.block_size: int | None = None
        # tier -> key -> pod mask; ``present`` is the union over tiers (the GPU dict itself
        # while the model only uses one tier)
        self.tiers: dict[str, dict[int, int]] = {}
        self.present: dict[int, int] = {}
        self.pred: dict[int, int] = {}  # key -> mask of pods predicted to hold it

    def tier(self, name: str) -> dict[int, int]:
        d = self.tiers.get(name)
        if d is None:
            d = self.tiers[name] = {}
            if len(self.tiers) == 1:
                self.present = d
            else:
                if len(self.tiers) == 2:  # split the union from the first tier's dict
                    self.present = dict(self.present)
        return d

    @property
    def multi(self) -> bool:
        return len(self.tiers) > 1


# A kept ``BlockStored`` (for dump), a plain tuple because one is built per event:
# (parent key or None, engine hashes, our keys, uint32-LE token bytes, lora_id, lora_name).
# ``keys`` holds the very int objects the pod's ``engine hash -> key`` map points at, so a
# block is still held by the pod exactly when ``emap.get(hash) is key``.
_Rec = tuple


def _live_parts(rec: _Rec, emap_get, w: int) -> Sequence[_Rec]:
    """The runs of ``rec``'s blocks the pod still holds, each as a kept event of its own."""
    parent, hashes, keys, data, lora_id, lora_name = rec
    live = list(map(is_, map(emap_get, hashes), keys))
    if all(live):
        return (rec,)
    if True not in live:
        return ()
    n = len(live)
    out = []
    i = live.index(True)
    while True:
        try:
            j = live.index(False, i)
        except ValueError:
            j = n
        if i == 0:
            out.append((parent, hashes[:j], keys[:j], data[:j * w], lora_id, lora_name))
        else:
            out.append((keys[i - 1], hashes[i:j], keys[i:j], data[i * w:j * w], None, None))
        if j == n:
            break
        try:
            i = live.index(True, j)
        except ValueError:
            break
    return out


class _Pod:
    __slots__ = ("name", "slot", "bit", "model", "epoch", "seq", "last_event_ts", "last_seen", "emaps",
                 "extra", "pred_exp", "exact", "recs", "rec_n")

    def __init__(self, name: str, slot: int):
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.model: str | None = None
        self.epoch: int | None = None
        self.seq: int | None = None
        self.last_event_ts: float | None = None
        self.last_seen: float | None = None
        self.emaps: dict[str, dict[int, int]] = {}  # tier -> engine hash -> key
        self.extra: dict[str, dict[int, int]] = {}  # tier -> key -> extra references (aliases)
        self.pred_exp: dict[tuple[str, int], float] = {}  # (model, key) -> expiry
        self.exact = False  # has sent KV events
        self.recs: dict[str, list[_Rec]] = {}  # tier -> kept stored events, oldest first (for dump)
        self.rec_n: dict[str, int] = {}  # tier -> blocks in those events, held or not

    def emap(self, tier: str) -> dict[int, int]:
        d = self.emaps.get(tier)
        if d is None:
            d = self.emaps[tier] = {}
        return d

    def find_parent(self, parent: int, tier: str) -> int | None:
        d = self.emaps.get(tier)
        if d is not None:
            k = d.get(parent)
            if k is not None:
                return k
        for t, d in self.emaps.items():
            if t != tier:
                k = d.get(parent)
                if k is not None:
                    return k
        return None


# ------------------------------------------------------------------------------------ the fold


class KvIndex:
    """Which pod holds which KV blocks, per model and tier; see the module docstring."""

    # kept events of a pod and tier are compacted past 2 x held blocks + this many
    _compact_slack = 4096

    def __init__(self, clock: Clock, *, tier_weights: dict[str, float] | None = None,
                 predicted_ttl_s: float = 120.0, predict_on_route_ttl_s: float = 2.0,
                 pod_timeout_s: float | None = None, predicted_weight: float = 1.0,
                 default_block_size: int | None = None):
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
        self._models: dict[str, _Model] = {}
        self._pods: dict[str, _Pod] = {}
        self._by_slot: dict[int, _Pod] = {}
        self._free_slots: list[int] = []
        self._names_of: dict[int, tuple[str, ...]] = {}  # slot mask -> pod names (query output)
        self._next_slot = 0
        self._gone: dict[str, tuple[str, int, int, float]] = {}  # pod -> (model, epoch, seq, ts)
        self._pred_heap: list[tuple[float, int, str, str, list[int]]] = []
        self._pred_n = 0
        self.totals = ApplyStats()

    # ------------------------------------------------------------------------- bookkeeping

    def _model(self, name: str) -> _Model:
        m = self._models.get(name)
        if m is None:
            m = self._models[name] = _Model(name)
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
            self._names_of.clear()
        return p

    def _clear_pod(self, pod: _Pod, tier: str | None = None) -> int:
        """Drop the pod's exact blocks (of one tier, or all); returns how many."""
        if pod.model is None:
            return 0
        m = self._models.get(pod.model)
        n = 0
        tiers = [tier] if tier is not None else list(pod.emaps)
        nb = ~pod.bit
        for t in tiers:
            emap = pod.emaps.pop(t, None)
            pod.extra.pop(t, None)
            pod.recs.pop(t, None)
            pod.rec_n.pop(t, None)
            if not emap or m is None:
                continue
            n += len(emap)
            tm = m.tiers.get(t, {})
            keys = list(set(emap.values()))
            new = list(map(and_, map(tm.get, keys, repeat(0)), repeat(nb)))
            tm.update(zip(keys, new))
            if 0 in new:
                deque(map(tm.pop, compress(keys, map(not_, new)), repeat(None)), 0)
            if m.multi:
                for key in keys:
                    self._recompute_present(m, key)
        return n

    def _recompute_present(self, m: _Model, key: int) -> None:
        v = 0
        for tm in m.tiers.values():
            v |= tm.get(key, 0)
        if v:
            m.present[key] = v
        else:
            m.present.pop(key, None)

    def _clear_predictions(self, pod: _Pod) -> None:
        nb = ~pod.bit
        for (model, key) in pod.pred_exp:
            m = self._models.get(model)
            if m is None:
                continue
            v = m.pred.get(key, 0) & nb
            if v:
                m.pred[key] = v
            else:
                m.pred.pop(key, None)
        pod.pred_exp.clear()

    def remove_pod(self, pod: str) -> None:
        """Forget a pod entirely (exact blocks, predictions, sequence); frees its slot."""
        p = self._pods.pop(pod, None)
        if p is None:
            return
        self._clear_pod(p)
        self._clear_predictions(p)
        del self._by_slot[p.slot]
        self._names_of.clear()
        heapq.heappush(self._free_slots, p.slot)

    # ------------------------------------------------------------------------------- apply

    def apply_many(self, batches: Iterable[KvEventBatch]) -> ApplyStats:
        st = ApplyStats()
        ap = self._apply
        for b in batches:
            ap(b, st)
        self.totals += st
        return st

    def apply(self, batch: KvEventBatch) -> ApplyStats:
        """Fold one batch in; returns what happened (also added to :attr:`totals`).

        ``token_ids`` of a ``BlockStored`` may be any sequence of ints; an ``array("I")`` is
        copied in C, so a snapshot loader can hand token bytes over without building lists.
        """
        st = ApplyStats()
        self._apply(batch, st)
        self.totals += st
        return st

    def _apply(self, batch: KvEventBatch, st: ApplyStats) -> None:
        st.batches += 1
        name = batch.pod
        tomb = self._gone.get(name)
        if tomb is not None:
            if (batch.epoch, batch.seq) <= (tomb[1], tomb[2]):
                st.stale_batches += 1
                return
            del self._gone[name]
        pod = self._pod(name)
        if pod.epoch is not None:
            if batch.epoch < pod.epoch or (batch.epoch == pod.epoch and batch.seq <= pod.seq):
                st.stale_batches += 1
                return
            if batch.epoch > pod.epoch:
                st.epoch_resets += 1
                self._clear_pod(pod)
                self._clear_predictions(pod)
            elif batch.seq > pod.seq + 1:
                st.gaps += 1
        if pod.model is not None and pod.model != batch.model:
            self._clear_pod(pod)  # a pod serves one model; a new model means a new cache
            self._clear_predictions(pod)
        pod.model = batch.model
        pod.epoch, pod.seq = batch.epoch, batch.seq
        pod.last_event_ts = batch.ts
        pod.last_seen = self.clock.now()
        pod.exact = True
        m = self._model(batch.model)
        for ev in batch.events:
            st.events += 1
            if isinstance(ev, BlockStored):
                self._stored(m, pod, ev, st)
            elif isinstance(ev, BlockRemoved):
                self._removed(m, pod, ev, st)
            elif isinstance(ev, AllBlocksCleared):
                st.cleared += 1
                self._clear_pod(pod, None if ev.medium is None else ev.medium)
            elif isinstance(ev, PodReset):
                st.resets += 1
                self._clear_pod(pod)
                self._clear_predictions(pod)
            elif isinstance(ev, PodGone):
                st.gone += 1
                self._gone[name] = (batch.model, batch.epoch, batch.seq, batch.ts)
                self.remove_pod(name)
                break  # nothing after a pod is gone

    def _stored(self, m: _Model, pod: _Pod, ev: BlockStored, st: ApplyStats) -> None:
        bs = ev.block_size
        if m.block_size is None:
            m.block_size = bs
        elif bs != m.block_size:
            st.rejected += 1
            return
        tier = ev.medium or PRIMARY_TIER
        hashes = ev.block_hashes
        n = len(hashes)
        lora_id = lora_name = None
        if ev.parent_key is not None:  # an index dump names our parent key directly
            parent = seed = ev.parent_key
        elif ev.parent_block_hash is None:
            parent = None
            lora_id, lora_name = ev.lora_id, ev.lora_name
            seed = 0 if lora_id is None and lora_name is None else \
                root_seed(lora_id if lora_id is not None else lora_name)
        else:
            em = pod.emaps.get(tier)  # the parent is almost always in the same tier
            parent = em.get(ev.parent_block_hash) if em is not None else None
            if parent is None:
                parent = pod.find_parent(ev.parent_block_hash, tier)
            if parent is None:
                st.unknown_parent += 1
                st.unknown_parent_blocks += n
                return
            seed = parent
        # hash (inlined: this is the hot path of ingest)
        try:
            arr = array("I", ev.token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        if not _LITTLE:
            arr.byteswap()
        data = arr.tobytes()
        w = bs * 4
        keys = []
        ap = keys.append
        h64 = xxh3_64_intdigest
        for i in range(0, n * w, w):
            seed = h64(data[i:i + w], seed)
            ap(seed)
        tm = m.tiers.get(tier)
        if tm is None:
            tm = m.tier(tier)
        emap = pod.emaps.get(tier)
        if emap is None:
            emap = pod.emap(tier)
        bit = pod.bit
        st.blocks_stored += n
        n0 = len(emap)
        # insert hash -> key where the hash is new; ``got`` is what each hash maps to now
        got = list(map(emap.setdefault, hashes, keys))
        old = list(map(tm.get, keys, repeat(0)))
        # fast when every engine hash is new for this pod and tier and no key is held by it yet
        fast = len(emap) == n0 + n and not any(map(and_, old, repeat(bit)))
        if fast:
            tm.update(zip(keys, map(or_, old, repeat(bit))))
            if m.present is not tm:
                pres = m.present
                pres.update(zip(keys, map(or_, map(pres.get, keys, repeat(0)), repeat(bit))))
        if not fast:
            # careful path (known hash, alias, the same hash twice): undo our inserts, go block by block
            if len(emap) != n0:
                for h, g, k in zip(hashes, got, keys):
                    if g is k:
                        del emap[h]
            extra = pod.extra.setdefault(tier, {})
            for h, k in zip(hashes, keys):
                have = emap.get(h)
                if have == k:
                    st.duplicates += 1
                elif have is not None:
                    # the engine reused a hash for other content: the new content wins
                    self._remove_one(m, pod, tier, h, st)
                    self._add_one(m, pod, tier, h, k, extra, st)
                else:
                    self._add_one(m, pod, tier, h, k, extra, st)
            if not extra:
                pod.extra.pop(tier, None)
        # keep the event for dump (references only); compact when dead blocks dominate
        recs = pod.recs.get(tier)
        if recs is None:
            recs = pod.recs[tier] = []
        recs.append((parent, hashes, keys, data, lora_id, lora_name))
        rn = pod.rec_n.get(tier, 0) + n
        if rn > 2 * len(emap) + self._compact_slack:
            self._compact(m, pod, tier)
        else:
            pod.rec_n[tier] = rn

    def _compact(self, m: _Model, pod: _Pod, tier: str) -> None:
        """Rewrite the pod's kept events of ``tier`` as the runs of blocks it still holds."""
        eget = pod.emaps.get(tier, {}).get
        w = (m.block_size or 0) * 4
        out: list[tuple] = []
        total = 0
        for rec in pod.recs.get(tier, ()):
            for part in _live_parts(rec, eget, w):
                out.append(part)
                total += len(part[1])
        pod.recs[tier] = out
        pod.rec_n[tier] = total

    def _add_one(self, m: _Model, pod: _Pod, tier: str, h: int, k: int, extra: dict[int, int],
                 st: ApplyStats) -> None:
        tm = m.tiers[tier]
        emap = pod.emaps[tier]
        emap[h] = k
        v = tm.get(k, 0)
        if v & pod.bit:
            extra[k] = extra.get(k, 0) + 1
            st.aliases += 1
            return
        tm[k] = v | pod.bit
        if m.present is not tm:
            m.present[k] = m.present.get(k, 0) | pod.bit

    def _remove_one(self, m: _Model, pod: _Pod, tier: str, h: int, st: ApplyStats) -> bool:
        emap = pod.emaps.get(tier)
        k = emap.pop(h, None) if emap else None
        if k is None:
            st.unknown_removed += 1
            return False
        st.blocks_removed += 1
        extra = pod.extra.get(tier)
        if extra:
            c = extra.get(k)
            if c:
                if c == 1:
                    del extra[k]
                else:
                    extra[k] = c - 1
                return True
        tm = m.tiers[tier]
        v = tm.get(k, 0) & ~pod.bit
        if v:
            tm[k] = v
        else:
            tm.pop(k, None)
        if m.present is not tm:
            self._recompute_present(m, k)
        return True

    def _removed(self, m: _Model, pod: _Pod, ev: BlockRemoved, st: ApplyStats) -> None:
        tier = ev.medium or PRIMARY_TIER
        emap = pod.emaps.get(tier)
        hashes = ev.block_hashes
        if not emap:
            st.unknown_removed += len(hashes)
            return
        if pod.extra.get(tier) or m.multi:
            for h in hashes:  # careful path: aliases or several tiers
                self._remove_one(m, pod, tier, h, st)
            return
        # fast path (one tier, no aliases: each key is held under one hash): the dict work in C
        keys = list(map(emap.pop, hashes, repeat(None)))
        unknown = keys.count(None)
        if unknown:
            st.unknown_removed += unknown
            keys = [k for k in keys if k is not None]
        st.blocks_removed += len(keys)
        tm = m.tiers[tier]
        new = list(map(and_, map(tm.__getitem__, keys), repeat(~pod.bit)))
        tm.update(zip(keys, new))
        if 0 in new:  # no pod holds these any more
            deque(map(tm.__delitem__, compress(keys, map(not_, new))), 0)

    # ----------------------------------------------------------------------- predictions

    def record_route(self, model: str, pod: str, token_ids: Sequence[int] | None = None,
                     keys: Sequence[int] | None = None, ttl_s: float | None = None, *,
                     lora: int | str | None = None) -> None:
        """Predict that ``pod`` will hold the blocks of a request just routed to it."""
        if keys is None:
            if token_ids is None:
                raise ValueError("record_route needs token_ids or keys")
            bs = self.block_size(model)
            if bs is None:
                return  # no block size known (no events, no default): nothing can be keyed
            keys = block_keys(token_ids, bs, lora=lora)
        keys = list(keys)
        if not keys:
            return
        now = self.clock.now()
        self._expire(now)
        p = self._pod(pod)
        if ttl_s is None:
            ttl_s = self.predict_on_route_ttl_s if p.exact else self.predicted_ttl_s
        exp = now + ttl_s
        m = self._model(model)
        pred = m.pred
        bit = p.bit
        pred.update(zip(keys, map(or_, map(pred.get, keys, repeat(0)), repeat(bit))))
        pe = p.pred_exp
        for k in keys:
            if pe.get((model, k), 0.0) < exp:
                pe[(model, k)] = exp
        self._pred_n += 1
        heapq.heappush(self._pred_heap, (exp, self._pred_n, pod, model, keys))

    def _expire(self, now: float) -> None:
        heap = self._pred_heap
        while heap and heap[0][0] <= now:
            exp, _, podname, model, keys = heapq.heappop(heap)
            p = self._pods.get(podname)
            m = self._models.get(model)
            if p is None or m is None:
                continue
            pe = p.pred_exp
            nb = ~p.bit
            for k in keys:
                e = pe.get((model, k))
                if e is not None and e <= now:
                    del pe[(model, k)]
                    v = m.pred.get(k, 0) & nb
                    if v:
                        m.pred[k] = v
                    else:
                        m.pred.pop(k, None)

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

    def match_tokens(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None = None,
                     *, lora: int | str | None = None) -> dict[str, PodMatch]:
        """Matched prefix per pod for a token sequence (hashed like the index keys).

        Without ``pods``: only pods that hold at least one leading block. With ``pods``:
        one entry for each of them (zeros when nothing matches).
        """
        bs = self.block_size(model)
        if bs is None or model not in self._models:
            return self._empty(pods if pods is None else list(pods))
        return self.match_keys(model, block_keys(token_ids, bs, lora=lora), pods)

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
        m = self._models.get(model)
        if m is None or not keys:
            return self._empty(pods)
        if self._pred_heap:
            self._expire(self.clock.now())
        if pods is None and self.pod_timeout_s is None:
            allowed = (1 << self._next_slot) - 1
        else:
            allowed = self._allowed(pods)
        present = m.present
        pred = m.pred
        if pred:
            vals = map(or_, map(present.get, keys, repeat(0)), map(pred.get, keys, repeat(0)))
        else:
            vals = map(present.get, keys, repeat(0))
        acc = list(takewhile(bool, accumulate(vals, and_, initial=allowed)))
        # acc[0] = allowed; acc[i] = pods holding blocks 0..i-1; non-increasing as integers,
        # so each run of equal masks ends where bisection on the reversed list says
        n = len(acc)
        if n == 1:
            return self._empty(pods)
        rev = acc[::-1]
        groups: list[tuple[int, int]] = []  # (pods that stop matching here, matched blocks)
        j = 1
        while j < n:
            v = acc[j]
            nxt = n - bisect_left(rev, v)  # first index after the run of v
            lost = v & ~acc[nxt] if nxt < n else v
            if lost:
                groups.append((lost, nxt - 1))
            j = nxt
        out: dict[str, PodMatch] = {}
        names_of = self._names_of
        if not m.multi and not pred:
            tier_name = next(iter(m.tiers), PRIMARY_TIER)
            weight = self.tier_weights.get(tier_name, 1.0)
            for mask, matched in groups:
                names = names_of.get(mask)
                if names is None:
                    names = self._names(mask)
                pm = _new_match((matched, matched * weight, {tier_name: matched}, 0))
                if len(names) == 1:
                    out[names[0]] = pm
                else:
                    out.update(zip(names, repeat(pm)))
        else:
            detail = self._detail(m, keys, n - 1)
            by_slot = self._by_slot
            for mask, matched in groups:
                while mask:
                    low = mask & -mask
                    mask ^= low
                    out[by_slot[low.bit_length() - 1].name] = self._tiered(detail, low, matched)
        if pods is not None:
            for name in pods:
                if name not in out:
                    out[name] = _new_match((0, 0.0, {}, 0))
        return out

    def _names(self, mask: int) -> tuple[str, ...]:
        """Pod names of a slot mask (cached per mask until a pod joins or leaves)."""
        names = []
        by_slot = self._by_slot
        v = mask
        while v:
            low = v & -v
            v ^= low
            names.append(by_slot[low.bit_length() - 1].name)
        if len(self._names_of) > 4096:
            self._names_of.clear()
        t = self._names_of[mask] = tuple(names)
        return t

    def _detail(self, m: _Model, keys: Sequence[int], n: int) -> list[tuple[str | None, float, list[int]]]:
        """Per category (tiers by weight, then predicted): mask of pods whose best holding it is."""
        ks = keys[:n]
        claimed = [0] * n
        out = []
        order = sorted(m.tiers, key=lambda t: -self.tier_weights.get(t, 0.0))
        for t in order:
            lt = list(map(m.tiers[t].get, ks, repeat(0)))
            best = list(map(and_, lt, map(lambda c: ~c, claimed)))
            claimed = list(map(or_, claimed, lt))
            out.append((t, self.tier_weights.get(t, 0.0), best))
        if m.pred:
            lt = list(map(m.pred.get, ks, repeat(0)))
            out.append((None, self.predicted_weight, list(map(and_, lt, map(lambda c: ~c, claimed)))))
        return out

    @staticmethod
    def _tiered(detail, bit: int, matched: int) -> PodMatch:
        tiers = {}
        score = 0.0
        predicted = 0
        for t, w, best in detail:
            c = sum(map(and_, islice(best, matched), repeat(bit))) // bit
            if not c:
                continue
            score += c * w
            if t is None:
                predicted = c
            else:
                tiers[t] = c
        return PodMatch(matched, score, tiers, predicted)

    def pods(self) -> dict[str, PodInfo]:
        now = self.clock.now()
        if self._pred_heap:
            self._expire(now)
        out = {}
        for name, p in self._pods.items():
            live = not (self.pod_timeout_s is not None and p.exact and p.last_seen is not None
                        and p.last_seen < now - self.pod_timeout_s)
            out[name] = PodInfo(
                pod=name, model=p.model, blocks={t: len(e) for t, e in p.emaps.items() if e},
                predicted_blocks=len(p.pred_exp), epoch=p.epoch, seq=p.seq, last_event_ts=p.last_event_ts,
                last_seen=p.last_seen, live=live)
        return out

    def models(self) -> dict[str, int]:
        """Model -> number of distinct blocks held by any pod."""
        return {name: len(m.present) for name, m in self._models.items()}

    def __len__(self) -> int:
        return sum(len(m.present) for m in self._models.values())

    # ------------------------------------------------------------------------ dump / state

    @staticmethod
    def _held(pod: _Pod) -> dict[str, dict[int, list[int]]]:
        """tier -> key -> the engine hashes (sorted) under which the pod holds it."""
        out: dict[str, dict[int, list[int]]] = {}
        for t, e in pod.emaps.items():
            d: dict[int, list[int]] = {}
            for h, k in e.items():
                d.setdefault(k, []).append(h)
            if d:
                for v in d.values():
                    v.sort()
                out[t] = d
        return out

    def state(self) -> dict:
        """A canonical, comparable picture of the exact state (predictions and clocks left out)."""
        pods = {}
        for name, p in self._pods.items():
            if not p.exact:
                continue
            held = self._held(p)
            pods[name] = (p.model, p.epoch, p.seq, p.last_event_ts,
                          {t: sorted((h, k) for k, hs in d.items() for h in hs) for t, d in held.items()})
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

        Per pod and tier, every run of blocks still held out of one kept stored event becomes
        one ``BlockStored`` carrying ``parent_key`` (our key of the run's parent), so replaying
        needs no parent lookups and blocks whose parent is gone survive. Each held
        ``engine hash -> key`` pair is written exactly once.
        """
        out: list[KvEventBatch] = []
        for name, p in list(self._pods.items()):
            if not p.exact or p.model is None:
                continue
            m = self._models[p.model]
            bs = m.block_size
            w = (bs or 0) * 4
            events = []
            for t, e in list(p.emaps.items()):
                if not e:
                    continue
                medium = None if t == PRIMARY_TIER else t
                eget = e.get
                for rec in p.recs.get(t, ()):
                    for parent, hashes, _, data, lora_id, lora_name in _live_parts(rec, eget, w):
                        toks = array("I")
                        toks.frombytes(data)
                        if not _LITTLE:
                            toks.byteswap()
                        events.append(BlockStored.model_construct(
                            type="stored", block_hashes=list(hashes), parent_block_hash=None,
                            token_ids=toks.tolist(), block_size=bs, lora_id=lora_id, lora_name=lora_name,
                            medium=medium, parent_key=parent))
            out.append(KvEventBatch.model_construct(
                schema_version=1, pod=name, model=p.model, dp_rank=0, epoch=p.epoch or 0, seq=p.seq or 0,
                ts=p.last_event_ts or 0.0, events=events))
        for name, (model, epoch, seq, ts) in list(self._gone.items()):
            out.append(KvEventBatch(pod=name, model=model, epoch=epoch, seq=seq, ts=ts, events=[PodGone()]))
        return out
