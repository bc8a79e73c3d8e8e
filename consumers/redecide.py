"""Re-run a recorded routing decision from the inputs recorded with it, and explain it.

Pure: no bus, no I/O. A :class:`schemas.records.RoutingDecision`'s first stage carries
:class:`schemas.records.DecisionInputs`: the strategy's settings, the request's routing fields,
the prefix overlap the KV index gave per pod and every backend of the router's snapshot as it
was read. :func:`redecide` rebuilds the strategy and the backends from them and runs the
router's own :class:`router.core.Router` again, so the scores come out float-equal.

Random draws (tie-breaks of ``max-score-picker``, ``random-picker``, ``power-of-two-picker``)
and the position of a ``round-robin-picker`` are the router's internal state, not data: replay
takes their outcome from the record (the pick), and computes everything else. Under another
profile (``--profile``) nothing is forced: ties go to the first candidate.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from router.core import Router
from router.plugins.base import Ctx
from router.profiles import Strategy, build_strategy, load_strategy
from router.types import BackendState, Decision, RoutingRequest
from schemas.records import DecisionInputs, RoutingDecision


class NotReplayable(ValueError):
    """The decision was recorded without its inputs (an older router)."""


def backends_from_inputs(inputs: DecisionInputs) -> list[BackendState]:
    return [BackendState(pod=b.pod, url="", model=b.model, role=b.role, group=b.group, pool=b.pool,
                         loras=frozenset(b.loras), node=b.node, waiting=b.waiting, running=b.running,
                         kv_usage=b.kv_usage, num_gpu_blocks=b.num_gpu_blocks, cpu_util=b.cpu_util,
                         mem_util=b.mem_util, inflight=b.inflight, active_tokens=b.active_tokens,
                         pending_prefill_tokens=b.pending_prefill_tokens, health=b.health,
                         circuit_open=b.circuit_open, draining=b.draining, source="replay")
            for b in inputs.backends]


def request_from_inputs(model: str, request_id: str, inputs: DecisionInputs) -> RoutingRequest:
    # no token ids: the overlap is given (recorded), and the block count is prompt_tokens // block_size
    return RoutingRequest(model=model, request_id=request_id, token_ids=None, prompt_tokens=inputs.prompt_tokens,
                          max_tokens=inputs.max_tokens, lora=inputs.lora, index_model=inputs.index_model,
                          exclude=frozenset(inputs.exclude))


class _Forced(random.Random):
    """An rng whose draw lands on candidate ``target`` (an index), when the picker's choice allows it."""

    def __init__(self, target: int):
        super().__init__(0)
        self.target = target

    def choice(self, seq):
        return self.target if self.target in seq else seq[0]

    def randrange(self, start, stop=None, step=1):
        n = start if stop is None else stop
        return self.target if 0 <= self.target < n else 0

    def sample(self, population, k, **kw):
        pop = list(population)
        if self.target in pop and k >= 1:
            return [self.target] + [x for x in pop if x != self.target][: k - 1]
        return pop[:k]


class _RecordedPicker:
    """Wraps a profile's picker: its random draw (or round-robin position) becomes the recorded pick."""

    def __init__(self, inner, pick: str | None):
        self.inner, self.pick_pod = inner, pick
        self.name, self.type_name, self.kind, self.params = inner.name, inner.type_name, "picker", inner.params
        self.forced = False  # the recorded draw decided among equals (or a stateful picker)

    def pick(self, cands, totals, ctx: Ctx) -> int:
        pods = [b.pod for b in cands]
        if self.pick_pod not in pods:
            return self.inner.pick(cands, totals, dataclasses.replace(ctx, rng=random.Random(0)))
        target = pods.index(self.pick_pod)
        if self.inner.type_name == "round-robin-picker":
            self.forced = True
            return target
        probe = _Forced(target)
        i = self.inner.pick(cands, totals, dataclasses.replace(ctx, rng=probe))
        best = max(totals)
        self.forced = sum(1 for t in totals if t >= best - 1e-12) > 1 or self.inner.type_name != "max-score-picker"
        return i


def redecide(stages: list[RoutingDecision], *, strategy: Strategy | str | None = None) -> tuple[Decision, bool]:
    """Re-run the decision recorded as ``stages`` (one request's records of one attempt, first
    stage first). ``strategy``: another strategy (a name, a file, or a built one) instead of the
    recorded one; then no draw is forced. Returns the decision and whether a recorded random draw
    (or round-robin position) decided a pick."""
    first = stages[0]
    inputs = first.inputs
    if inputs is None:
        raise NotReplayable(f"decision {first.request_id} was recorded without its inputs (router older than "
                            "replay support); use 'replay decide' with the request body instead")
    recorded = strategy is None
    if strategy is None:
        strat = build_strategy(first.profile, inputs.strategy)
    elif isinstance(strategy, str):
        strat = load_strategy(strategy)
    else:
        strat = strategy
    wrappers = []
    if recorded:
        picks = {s.stage: s.picked for s in stages}
        for name, prof in strat.profiles.items():
            stage = name if strat.pd else "aggregated"
            w = _RecordedPicker(prof.picker, picks.get(stage))
            prof.picker = w
            wrappers.append(w)
    router = Router(strat, seed=0, default_block_size=inputs.block_size)
    req = request_from_inputs(first.model, first.request_id, inputs)
    dec = router.decide(req, backends_from_inputs(inputs), None, inputs.now, overlap=dict(inputs.overlap),
                          predicted=dict(inputs.predicted))
    return dec, any(w.forced for w in wrappers)


def compare(stages: list[RoutingDecision], dec: Decision) -> list[str]:
    """Differences between the recorded stages and a re-run (empty: identical scores and picks)."""
    out = []
    replayed = {s.stage: s for s in dec.stages}
    for rec in stages:
        st = replayed.get(rec.stage)
        if st is None:
            out.append(f"{rec.stage}: not reached on replay")
            continue
        got = st.picked.pod if st.picked else None
        if got != rec.picked:
            out.append(f"{rec.stage}: picked {got}, recorded {rec.picked}")
        mine = st.candidate_dicts()
        theirs = [c.model_dump() for c in rec.candidates]
        if mine != theirs:
            for a, b in zip(mine, theirs):
                if a != b:
                    out.append(f"{rec.stage}: {a['pod']}: replayed {a} recorded {b}")
                    break
            if len(mine) != len(theirs):
                out.append(f"{rec.stage}: {len(mine)} candidates replayed, {len(theirs)} recorded")
    return out


def attempts(decisions: list[RoutingDecision]) -> list[list[RoutingDecision]]:
    """A request's decision records grouped by attempt (a retry decides again): each attempt starts
    with the record that carries inputs, or with a first-stage record."""
    out: list[list[RoutingDecision]] = []
    for d in decisions:
        starts = d.inputs is not None or d.stage in ("aggregated", "prefill")
        if starts or not out:
            out.append([d])
        else:
            out[-1].append(d)
    return out


def explain(stages: list[RoutingDecision], *, other: str | None = None,
            history: dict[str, dict[str, Any]] | None = None, findings: list[dict[str, Any]] | None = None,
            index_blocks: dict[str, int] | None = None) -> dict[str, Any]:
    """Why this request went where it went, as plain data: per stage every candidate's score per
    scorer and total, the pick and the best alternative (with what it lacked); the prefix overlap per
    pod; the backends' inputs as recorded and, where the rebuilt history at that instant disagrees,
    both (``history``: pod -> fields); the health findings in force; and what ``other`` (a strategy
    name) would have picked from the same inputs."""
    first = stages[0]
    inputs = first.inputs
    dec, forced = redecide(stages)
    diffs = compare(stages, dec)
    out: dict[str, Any] = {
        "request_id": first.request_id, "at": first.ts, "pool": first.pool, "model": first.model,
        "profile": first.profile, "reproduced": not diffs, "differences": diffs, "random_draw_used": forced,
        "stages": [],
    }
    for rec in stages:
        scored = [c for c in rec.candidates if c.filtered_by is None]
        ranked = sorted(scored, key=lambda c: -c.total)
        picked = next((c for c in scored if c.pod == rec.picked), None)
        alt = next((c for c in ranked if c.pod != rec.picked), None)
        stage: dict[str, Any] = {
            "stage": rec.stage, "picked": rec.picked, "reason": rec.reason,
            "candidates": [{"pod": c.pod, "total": c.total, "scores": dict(c.scores), "overlap_blocks":
                            c.overlap_blocks, "filtered_by": c.filtered_by} for c in ranked]
                          + [{"pod": c.pod, "total": None, "scores": {}, "overlap_blocks": c.overlap_blocks,
                              "filtered_by": c.filtered_by} for c in rec.candidates if c.filtered_by],
        }
        if alt is not None and picked is not None:
            stage["best_alternative"] = {
                "pod": alt.pod, "total": alt.total, "margin": round(picked.total - alt.total, 6),
                "behind_on": {k: round(picked.scores.get(k, 0.0) - v, 6) for k, v in alt.scores.items()
                              if picked.scores.get(k, 0.0) > v},
                "ahead_on": {k: round(v - picked.scores.get(k, 0.0), 6) for k, v in alt.scores.items()
                             if v > picked.scores.get(k, 0.0)},
            }
        out["stages"].append(stage)
    request_blocks = inputs.prompt_tokens // inputs.block_size if inputs.block_size else 0
    out["prefix"] = {"prompt_tokens": inputs.prompt_tokens, "block_size": inputs.block_size,
                     "request_blocks": request_blocks,
                     "per_pod": {b.pod: {"recorded": inputs.overlap.get(b.pod, 0),
                                         **({"index_at_t": index_blocks.get(b.pod, 0)} if index_blocks is not None
                                            else {})}
                                 for b in inputs.backends}}
    inputs_out = {}
    for b in inputs.backends:
        row = {k: v for k, v in b.model_dump().items() if k not in ("pod", "loras", "pool")}
        h = (history or {}).get(b.pod)
        if h is not None:
            lag = {k: {"recorded": row.get(k), "history": v} for k, v in h.items() if k in row and row.get(k) != v}
            if lag:
                row["history_differs"] = lag
        inputs_out[b.pod] = row
    out["backends"] = inputs_out
    out["findings"] = findings or []
    if other is not None:
        alt_strategy = load_strategy(other)
        alt_dec, _ = redecide(stages, strategy=alt_strategy)
        note = ""
        if alt_strategy.needs_overlap and not inputs.overlap and not inputs.prefix_keys:
            note = ("the live strategy read no prefix overlap, so this one ran without it (prefix scores 0)")
        out["other_profile"] = {"profile": other, "status": alt_dec.status, "note": note,
                                "picked": alt_dec.target.pod if alt_dec.target else None,
                                "prefill": alt_dec.prefill.pod if alt_dec.prefill else None,
                                "reason": alt_dec.reason,
                                "same_pick": (alt_dec.target.pod if alt_dec.target else None) == stages[-1].picked}
    return out
