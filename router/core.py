"""The routing decision: pure, synchronous, no I/O. Callable from HTTP and from simulations.

``Router.decide(request, backends, index_view, now)`` runs the strategy's profiles over the
backend snapshots and returns a :class:`router.types.Decision` with every candidate's scores.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from router.plugins.base import Ctx
from router.profiles import Profile, Strategy, load_strategy
from router.types import BackendState, Decision, RoutingRequest, StageResult
from streams.kv_keys import request_salt

_EMPTY_STATUS = {"model-filter": "no_model", "not-busy-filter": "busy"}


_PREFIX_KEYS = None


def _prefix_keys():
    """streams.kv_index.prefix_keys, imported at its first use (the index module loads numba, which
    a strategy run without one never needs)."""
    global _PREFIX_KEYS
    if _PREFIX_KEYS is None:
        from streams.kv_index import prefix_keys

        _PREFIX_KEYS = prefix_keys
    return _PREFIX_KEYS


def overlaps_from_index(index_view: Any, req: RoutingRequest, approximate: bool,
                        predicted: dict[str, int] | None = None) -> dict[str, int]:
    """Prefix blocks each pod could reuse for ``req``, from a KvIndex-like view (PodMatch objects
    or plain ints). ``approximate`` counts the blocks predicted from this router's own routing
    too; ``predicted`` (a dict) then receives, per pod, how many of its blocks are only predicted.

    As vLLM's scheduler: at most ``len(prompt) - 1`` tokens are reused (the last prompt token is
    always computed, so a prompt of whole blocks reuses one block less), under the request's LoRA
    adapter and cache salt (blocks cached for another adapter or salt are not reusable)."""
    if index_view is None:
        return {}
    if req.token_ids is not None and len(req.token_ids) > 0:
        n = len(req.token_ids) - 1
        model = req.index_model or req.model
        pk = req.prompt_keys
        if approximate and pk is not None and pk[0] == index_view.block_size(model) and hasattr(index_view, "match_keys"):
            # the router hashed the prompt already (its predictions take the same keys)
            keys = _prefix_keys()(pk[1], n // pk[0])
            counts = getattr(index_view, "match_counts", None)
            if counts is not None:  # the embedded KvIndex: the counts alone, no PodMatch per pod
                out, pred = counts(model, keys)
                if predicted is not None:
                    predicted.update(pred)
                return out
            matches = index_view.match_keys(model, keys)
        elif req.lora is None and req.cache_salt is None:
            matches = index_view.match_tokens(model, req.token_ids[:n])
        else:
            matches = index_view.match_tokens(model, req.token_ids[:n], lora=req.lora, salt=request_salt(req.cache_salt))
    elif req.keys and hasattr(index_view, "match_keys"):
        matches = index_view.match_keys(req.model, req.keys)
    else:
        return {}
    out: dict[str, int] = {}
    for pod, m in matches.items():
        if isinstance(m, int):
            out[pod] = m
            continue
        n = int(getattr(m, "matched_blocks", 0) or 0)  # exact and predicted blocks
        p = int(getattr(m, "predicted_blocks", 0) or 0)
        if not approximate:
            n -= p
        elif p and predicted is not None:
            predicted[pod] = p
        if n:
            out[pod] = n
    return out


class Router:
    """A strategy plus the little state its pickers keep (round-robin position, random seed)."""

    def __init__(self, strategy: Strategy | str, *, seed: int | None = None, default_block_size: int = 16):
        self.strategy = load_strategy(strategy) if isinstance(strategy, str) else strategy
        self.rng = random.Random(seed)
        self.default_block_size = default_block_size
        self.admission = False  # set by the server when admission control queues (see Ctx.admission)
        # columns of load-only scorers: (id(profile), id(scorer)) -> (load_epoch, ids of the candidates, column)
        self._columns: dict[tuple[int, int], tuple[int, list[int], list[float]]] = {}

    @property
    def name(self) -> str:
        return self.strategy.name

    def block_size(self, index_view: Any, model: str) -> int:
        if index_view is not None and hasattr(index_view, "block_size"):
            try:
                bs = index_view.block_size(model)
            except (KeyError, ValueError):
                bs = None
            if bs:
                return int(bs)
        return self.default_block_size

    def decide(self, request: RoutingRequest, backends: Sequence[BackendState], index_view: Any = None,
               now: float = 0.0, *, overlap: dict[str, int] | None = None, load_epoch: int | None = None,
               queued: bool | None = None, predicted: dict[str, int] | None = None) -> Decision:
        """Run the strategy. ``queued``: whether a refused request would wait in admission's queue
        (default: :attr:`admission`); the endpoint picker has no queue and passes False. ``load_epoch``: a number the caller changes whenever any backend's load or
        health fields (waiting, running, kv_usage, cpu/mem utilisation, health, GPU blocks) change
        (``ClusterState.epoch``); while it stays the same, the columns of load-only scorers are reused
        for the same candidates. Without it (simulations, tests) every column is computed."""
        st = self.strategy
        bs = self.block_size(index_view, request.model)
        predicted = dict(predicted) if predicted else {}  # (given with a recorded overlap: replay)
        if overlap is None:
            overlap = overlaps_from_index(index_view, request, st.approximate, predicted) if st.needs_overlap else {}
        nblocks = len(request.keys) if (request.token_ids is None and request.keys) else request.prompt_tokens // bs
        ctx = Ctx(request_blocks=nblocks, block_size=bs, overlap=overlap, predicted=predicted, rng=self.rng, now=now,
                  prompt_tokens=request.prompt_tokens, load_epoch=load_epoch, backends=backends,
                  admission=self.admission if queued is None else queued)
        cands = list(backends)
        model = request.model
        best = 0
        if overlap:
            pods = {b.pod for b in cands if b.model == model}
            best = max((v for p, v in overlap.items() if p in pods), default=0)
        dec = Decision(profile=st.name, status="ok", request_blocks=nblocks, block_size=bs,
                       best_overlap_blocks=best)
        if not st.pd:
            prof = next(iter(st.profiles.values()))
            res, status = self._stage(prof, "aggregated", request, cands, ctx)
            dec.stages.append(res)
            dec.status, dec.target = status, res.picked
            if res.picked is not None:
                dec.chosen_overlap_blocks = overlap.get(res.picked.pod, 0)
            return dec
        params = st.handler.params
        ctx.stage = "prefill"
        pre, status = self._stage(st.profiles["prefill"], "prefill", request, cands, ctx)
        dec.stages.append(pre)
        if pre.picked is None:
            dec.status = status
            return dec
        ctx.stage = "decode"
        ctx.group = pre.picked.group if params.same_group else None
        dcd, status = self._stage(st.profiles["decode"], "decode", request, cands, ctx)
        dec.stages.append(dcd)
        if dcd.picked is None:
            dec.status = status
            return dec
        dec.target = dcd.picked
        d_ov = overlap.get(dcd.picked.pod, 0)
        uncached = max(request.prompt_tokens - d_ov * bs, 0)
        if uncached <= params.threshold_tokens and request.prompt_tokens > 0 and params.threshold_tokens > 0:
            dec.prefill = None
            dec.chosen_overlap_blocks = d_ov
            dec.note = (f"decode {dcd.picked.pod} already holds all but {uncached} prompt tokens "
                        f"(threshold {params.threshold_tokens}): remote prefill skipped; ")
        else:
            dec.prefill = pre.picked
            dec.chosen_overlap_blocks = overlap.get(pre.picked.pod, 0)
        return dec

    def _stage(self, prof: Profile, stage: str, req: RoutingRequest, cands: list[BackendState],
               ctx: Ctx) -> tuple[StageResult, str]:
        filtered: dict[str, str] = {}
        for f in prof.filters:
            kept = f.apply(req, cands, ctx)
            if len(kept) != len(cands):
                keep = {id(b) for b in kept}
                for b in cands:
                    if id(b) not in keep:
                        filtered[b.pod] = f.name
                cands = kept
            if not cands:
                status = _EMPTY_STATUS.get(f.type_name, "no_backend")
                why = {"no_model": f"no backend serves model {req.model!r}",
                       "busy": "all backends are busy"}.get(status, f"no backend left after filter {f.name!r}")
                return StageResult(stage, [], filtered, {}, [], ctx.overlap, None, why, predicted=ctx.predicted), status
        if not cands:
            return StageResult(stage, [], filtered, {}, [], ctx.overlap, None, "no backends known",
                               predicted=ctx.predicted), "no_backend"
        columns: dict[str, list[float]] = {}
        cols = []
        epoch = ctx.load_epoch
        ids = None
        for s, _ in prof.scorers:
            if epoch is not None and s.load_only:
                if ids is None:
                    ids = list(map(id, cands))
                key = (id(prof), id(s))
                hit = self._columns.get(key)
                if hit is not None and hit[0] == epoch and hit[1] == ids:
                    col = hit[2]
                else:
                    col = s.score(req, cands, ctx)
                    self._columns[key] = (epoch, ids, col)
            else:
                col = s.score(req, cands, ctx)
            columns[s.name] = col
            cols.append(col)
        totals = prof.combine(cols) if cols else [0.0] * len(cands)
        i = prof.picker.pick(cands, totals, ctx)
        picked = cands[i]
        return StageResult(stage, cands, filtered, columns, totals, ctx.overlap, picked, "", i, prof.picker.name,
                           ctx.request_blocks, ctx.predicted), "ok"
