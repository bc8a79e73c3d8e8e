"""The global KV-cache index: a pure fold of :class:`schemas.KvEventBatch` messages.

Keys
    Blocks are keyed by our own chained hash over the token ids that ``BlockStored``
    carries (:func:`block_keys`: xxh3-64 of the block's little-endian uint32 token bytes,
    seeded with the parent block's key), never by the engine's hash, so the index does not
    depend on how an engine hashes (sha256 over pickle or CBOR, seeded or not). Per pod and
    tier the index keeps ``engine hash -> key`` to resolve parents and removals.

Data structure (built for ingest of millions of blocks/s and ~10 µs queries in Python)
    per model and tier ``key -> pod bitmask`` (one bit per pod slot), plus ``key -> bitmask``
    over all tiers when a model uses more than one tier. A query maps the dicts over the
    query keys and folds them with ``itertools.accumulate(and)`` in C, stopping at the first
    block no pod holds; because a prefix-AND only loses bits, the running masks decrease
    numerically, so each pod's matched length is found by bisection, not by a Python loop.

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
    ``KvIndex(...).apply_many(dump)``. Dumped ``BlockStored`` events carry ``parent_key`` (our
    key of the parent) so blocks whose parent the pod no longer holds survive a restore: they
    become usable again when the parent is stored again. Predictions are transient and not
    dumped; :meth:`KvIndex.state` (used by ``==``) is the exact state.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate, compress, islice, repeat, takewhile
from operator import and_, itemgetter, not_, or_
from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from schemas.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, PodGone, PodReset
from streams.clock import Clock

PRIMARY_TIER = "GPU"
DEFAULT_TIER_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "LOCAL_FILE": 0.5, "REMOTE": 0.3}
_LITTLE = sys.byteorder == "little"
_first = itemgetter(0)
_second = itemgetter(1)


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


@dataclass
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
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    __slots__ = ("name", "block_size", "tiers", "present", "info", "lora_of", "pred")

    def __init__(self, name: str):
        self.name = name
        self.block_size: int | None = None
        # tier -> key -> pod mask; ``present`` is the union over tiers (the GPU dict itself
        # while the model only uses one tier)
        self.tiers: dict[str, dict[int, int]] = {}
        self.present: dict[int, int] = {}
        # key -> (parent key or None, token bytes); only for keys some pod holds (for dump)
        self.info: dict[int, tuple[int | None, bytes]] = {}
        self.lora_of: dict[int, tuple[int | None, str | None]] = {}
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


class _Pod:
    __slots__ = ("name", "slot", "bit", "model", "epoch", "seq", "last_event_ts", "last_seen", "emaps",
                 "extra", "pred_exp", "exact")

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


def _tier_of(medium: str | None) -> str:
    return medium or PRIMARY_TIER


# ------------------------------------------------------------------------------------ the fold


class KvIndex:
    """Which pod holds which KV blocks, per model and tier; see the module docstring."""

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
            if not emap or m is None:
                continue
            n += len(emap)
            tm = m.tiers.get(t, {})
            for key in set(emap.values()):
                v = tm.get(key, 0) & nb
                if v:
                    tm[key] = v
                else:
                    tm.pop(key, None)
                if m.multi:
                    self._recompute_present(m, key)
                elif not v:
                    m.info.pop(key, None)
                    m.lora_of.pop(key, None)
        return n

    def _recompute_present(self, m: _Model, key: int) -> None:
        v = 0
        for tm in m.tiers.values():
            v |= tm.get(key, 0)
        if v:
            m.present[key] = v
        else:
            m.present.pop(key, None)
            m.info.pop(key, None)
            m.lora_of.pop(key, None)

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
        """Fold one batch in; returns what happened (also added to :attr:`totals`)."""
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
        tier = _tier_of(ev.medium)
        hashes = ev.block_hashes
        n = len(hashes)
        if ev.parent_key is not None:  # an index dump names our parent key directly
            parent = seed = ev.parent_key
        elif ev.parent_block_hash is None:
            parent = None
            seed = root_seed(ev.lora_id if ev.lora_id is not None else ev.lora_name) \
                if (ev.lora_id is not None or ev.lora_name is not None) else 0
        else:
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
        chunks = list(map(data.__getitem__, map(slice, range(0, n * w, w), range(w, n * w + 1, w))))
        keys = []
        ap = keys.append
        h64 = xxh3_64_intdigest
        for c in chunks:
            seed = h64(c, seed)
            ap(seed)
        tm = m.tiers.get(tier) or m.tier(tier)
        emap = pod.emaps.get(tier)
        if emap is None:
            emap = pod.emap(tier)
        bit = pod.bit
        old = list(map(tm.get, keys, repeat(0)))
        st.blocks_stored += n
        n0 = len(emap)
        if not any(map(and_, old, repeat(bit))) and emap.keys().isdisjoint(hashes):
            emap.update(zip(hashes, keys))
            fast = len(emap) == n0 + n
            if not fast:  # the same engine hash twice in one event: undo, take the careful path
                for h in hashes:
                    emap.pop(h, None)
        else:
            fast = False
        if fast:
            # every block is new for this pod and tier
            tm.update(zip(keys, map(or_, old, repeat(bit))))
            if m.present is not tm:
                pres = m.present
                pres.update(zip(keys, map(or_, map(pres.get, keys, repeat(0)), repeat(bit))))
            # (parent, tokens) of keys no pod held before (a held key already has them)
            if m.present is not tm or not any(old):
                keys_before = keys[:-1]
                keys_before.insert(0, parent)
                m.info.update(zip(keys, zip(keys_before, chunks)))
            elif 0 in old:
                keys_before = keys[:-1]
                keys_before.insert(0, parent)
                m.info.update(compress(zip(keys, zip(keys_before, chunks)), map(not_, old)))
        else:
            prev = parent
            extra = pod.extra.setdefault(tier, {})
            for h, k, c in zip(hashes, keys, chunks):
                have = emap.get(h)
                if have == k:
                    st.duplicates += 1
                elif have is not None:
                    # the engine reused a hash for other content: the new content wins
                    self._remove_one(m, pod, tier, h, st)
                    self._add_one(m, pod, tier, h, k, extra, st)
                else:
                    self._add_one(m, pod, tier, h, k, extra, st)
                if k not in m.info:
                    m.info[k] = (prev, c)
                prev = k
            if not extra:
                pod.extra.pop(tier, None)
        if parent is None and (ev.lora_id is not None or ev.lora_name is not None):
            m.lora_of[keys[0]] = (ev.lora_id, ev.lora_name)

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
        elif not v:
            m.info.pop(k, None)
            m.lora_of.pop(k, None)
        return True

    def _removed(self, m: _Model, pod: _Pod, ev: BlockRemoved, st: ApplyStats) -> None:
        tier = _tier_of(ev.medium)
        emap = pod.emaps.get(tier)
        hashes = ev.block_hashes
        if not emap:
            st.unknown_removed += len(hashes)
            return
        if pod.extra.get(tier) or m.multi:
            for h in hashes:  # careful path: aliases or several tiers
                self._remove_one(m, pod, tier, h, st)
            return
        # fast path (one tier, no aliases): batch the dict work in C
        keys = list(map(emap.pop, hashes, repeat(None)))
        unknown = keys.count(None)
        if unknown:
            st.unknown_removed += unknown
            keys = [k for k in keys if k is not None]
        st.blocks_removed += len(keys)
        tm = m.tiers[tier]
        new = list(map(and_, map(tm.__getitem__, keys), repeat(~pod.bit)))
        tm.update(zip(keys, new))
        if 0 in new:
            info = m.info
            lora_of = m.lora_of
            for k in compress(keys, map(not_, new)):
                del tm[k]
                del info[k]
                if lora_of:
                    lora_of.pop(k, None)

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
        return {p: PodMatch(0, 0.0, {}, 0) for p in pods}

    def match_keys(self, model: str, keys: Sequence[int], pods: Iterable[str] | None = None) -> dict[str, PodMatch]:
        """Matched prefix per pod for already-computed block keys (see :func:`block_keys`)."""
        if pods is not None:
            pods = list(pods)
        m = self._models.get(model)
        if m is None or not keys:
            return self._empty(pods)
        if self._pred_heap:
            self._expire(self.clock.now())
        allowed = self._allowed(pods)
        present = m.present
        pred = m.pred
        if pred:
            vals = map(or_, map(present.get, keys, repeat(0)), map(pred.get, keys, repeat(0)))
        else:
            vals = map(present.get, keys, repeat(0))
        acc = list(takewhile(bool, accumulate(vals, and_, initial=allowed)))
        # acc[0] = allowed; acc[i] = pods holding blocks 0..i-1; non-increasing as integers
        lengths: dict[int, int] = {}  # slot mask group -> matched
        n = len(acc)
        rev = acc[::-1]
        j = 1
        while j < n:
            v = acc[j]
            nxt = n - bisect_left(rev, v)  # first index after the run of v
            lost = v & ~acc[nxt] if nxt < n else v
            if lost:
                lengths[lost] = nxt - 1
            j = nxt
        out: dict[str, PodMatch] = {}
        if not lengths:
            return self._empty(pods)
        simple = not m.multi and not pred
        tier_name = next(iter(m.tiers), PRIMARY_TIER)
        weight = self.tier_weights.get(tier_name, 1.0)
        detail = None if simple else self._detail(m, keys, n - 1)
        by_slot = self._by_slot
        for mask, matched in lengths.items():
            while mask:
                low = mask & -mask
                mask ^= low
                p = by_slot[low.bit_length() - 1]
                if simple:
                    out[p.name] = PodMatch(matched, matched * weight, {tier_name: matched}, 0)
                else:
                    out[p.name] = self._tiered(detail, low, matched)
        if pods is not None:
            for name in pods:
                if name not in out:
                    out[name] = PodMatch(0, 0.0, {}, 0)
        return out

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

        Per pod and tier, chains of blocks (each block followed by its first child) become one
        ``BlockStored`` carrying ``parent_key``; the dict work is done with C-level maps.
        """
        out: list[KvEventBatch] = []
        for name, p in list(self._pods.items()):
            if not p.exact or p.model is None:
                continue
            m = self._models[p.model]
            info_get = m.info.__getitem__
            events = []
            aliases = []
            for t, e in list(p.emaps.items()):
                if not e:
                    continue
                medium = None if t == PRIMARY_TIER else t
                hashes = sorted(e)
                keys = list(map(e.__getitem__, hashes))
                inv = dict(zip(reversed(keys), reversed(hashes)))  # key -> its smallest engine hash
                if len(inv) != len(hashes):
                    aliases.extend((k, h, medium) for h, k in zip(hashes, keys) if inv[k] != h)
                keys = list(inv)
                parents = list(map(_first, map(info_get, keys)))
                first_child = dict(zip(reversed(parents), reversed(keys)))  # parent -> first child
                starts = [k for k, par in zip(keys, parents) if par not in inv or first_child[par] != k]
                fc_get = first_child.get
                limit = len(keys)
                for start in starts:
                    run = [start]
                    cur = fc_get(start)
                    while cur is not None and len(run) <= limit:
                        run.append(cur)
                        cur = fc_get(cur)
                    events.append(self._dump_stored(m, run, list(map(inv.__getitem__, run)),
                                                    info_get(start)[0], medium))
            for k, h, medium in aliases:
                events.append(self._dump_stored(m, [k], [h], info_get(k)[0], medium))
            out.append(KvEventBatch.model_construct(
                schema_version=1, pod=name, model=p.model, dp_rank=0, epoch=p.epoch or 0, seq=p.seq or 0,
                ts=p.last_event_ts or 0.0, events=events))
        for name, (model, epoch, seq, ts) in list(self._gone.items()):
            out.append(KvEventBatch(pod=name, model=model, epoch=epoch, seq=seq, ts=ts, events=[PodGone()]))
        return out

    @staticmethod
    def _dump_stored(m: _Model, run: list[int], hashes: list[int], parent: int | None,
                     medium: str | None) -> BlockStored:
        lora_id = lora_name = None
        if parent is None and run[0] in m.lora_of:
            lora_id, lora_name = m.lora_of[run[0]]
        toks = array("I")
        toks.frombytes(b"".join(map(_second, map(m.info.__getitem__, run))))
        if not _LITTLE:
            toks.byteswap()
        return BlockStored.model_construct(
            type="stored", block_hashes=hashes, parent_block_hash=None, token_ids=toks.tolist(),
            block_size=m.block_size, lora_id=lora_id, lora_name=lora_name, medium=medium, parent_key=parent)
