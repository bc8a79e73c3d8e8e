"""Scorers: ``score(request, candidates, ctx) -> list of floats in [0,1]``, higher is better."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router.plugins.base import Ctx, Plugin, register
from router.types import BackendState, RoutingRequest


class _P(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Scorer(Plugin):
    kind = "scorer"

    def score(self, req: RoutingRequest, cands: list[BackendState], ctx: Ctx) -> list[float]:
        raise NotImplementedError


def _relative_low_is_good(values: list[float]) -> list[float]:
    """min -> 1, max -> 0, linear between; all equal -> 1."""
    lo = min(values)
    span = max(values) - lo
    if span <= 0:
        return [1.0] * len(values)
    inv = 1.0 / span
    return [1.0 - (v - lo) * inv for v in values]


PREDICTED_WORTH = 0.9  # a predicted block's share of the prefix score of a block the engine reported
PREDICTED_DISCOUNT = 1.0 - PREDICTED_WORTH


class PrefixParams(_P):
    mode: Literal["exact", "approximate"] = "exact"


@register
class PrefixScorer(Scorer):
    """Share of the prompt's blocks already cached on the backend (from the KV index).

    ``exact`` counts blocks the engines reported (KV events); ``approximate`` also counts
    blocks predicted from the router's own routing history (no events needed), each worth
    :data:`PREDICTED_WORTH` of a reported one: a guess keeps a conversation on the engine it
    was just sent to while that engine's events are late, and a reported copy of the same
    prefix elsewhere wins a tie.
    """

    type_name = "prefix-scorer"
    Params = PrefixParams
    needs_overlap = True

    def score(self, req, cands, ctx):
        n = ctx.request_blocks
        ov = ctx.overlap
        if n <= 0 or not ov:
            return [0.0] * len(cands)
        get = ov.get
        inv = 1.0 / n
        pred = ctx.predicted
        if pred:
            ov = {p: v - PREDICTED_DISCOUNT * pred.get(p, 0) for p, v in ov.items()}
            get = ov.get
        if max(ov.values()) > n:  # more cached than asked (approximate keys): clip to 1
            return [x if x < 1.0 else 1.0 for x in [get(b.pod, 0) * inv for b in cands]]
        return [get(b.pod, 0) * inv for b in cands]


@register
class KvUsageScorer(Scorer):
    """Free KV-cache share: ``1 - kv_cache_usage_perc``."""

    type_name = "kv-usage-scorer"
    load_only = True

    def score(self, req, cands, ctx):
        return [0.0 if k >= 1.0 else (1.0 if k <= 0.0 else 1.0 - k) for k in [b.kv_usage for b in cands]]


@register
class QueueScorer(Scorer):
    """Shorter waiting queue is better (relative to the other candidates)."""

    type_name = "queue-scorer"
    load_only = True

    def score(self, req, cands, ctx):
        return _relative_low_is_good([b.waiting for b in cands])


@register
class ActiveTokensScorer(Scorer):
    """Fewer tokens in flight through this router is better (relative)."""

    type_name = "active-tokens-scorer"

    def score(self, req, cands, ctx):
        return _relative_low_is_good([b.active_tokens + b.running for b in cands])


@register
class InflightScorer(Scorer):
    """Fewer requests in flight through this router is better (relative): the router's own count,
    exact when the request is placed, where the engines' reported queues lag by a scrape."""

    type_name = "inflight-scorer"

    def score(self, req, cands, ctx):
        return _relative_low_is_good([b.inflight for b in cands])


class HealthParams(_P):
    max_queue: float = Field(default=32, gt=0, description="waiting requests that count as a full queue")
    max_running: float = Field(default=256, gt=0, description="running requests that count as full CPU")
    warning_factor: float = Field(default=0.5, ge=0, le=1, description="multiplier under a warning diagnosis")


@register
class HealthScorer(Scorer):
    """The seed-001 health score ``0.4(1-queue)+0.3(1-cpu)+0.3(1-mem)``, lowered under a warning.

    queue = waiting/max_queue, cpu = reported CPU utilisation or running/max_running, mem =
    reported memory utilisation or KV-cache usage; each clipped to [0,1].
    """

    type_name = "health-scorer"
    load_only = True
    Params = HealthParams

    def score(self, req, cands, ctx):
        p = self.params
        iq, ir, wf = 1.0 / p.max_queue, 1.0 / p.max_running, p.warning_factor
        out = []
        for b in cands:
            q = b.waiting * iq
            q = 1.0 if q > 1.0 else q
            cpu = b.cpu_util
            if cpu is None:
                cpu = b.running * ir
            mem = b.mem_util
            if mem is None:
                mem = b.kv_usage
            cpu = 0.0 if cpu < 0.0 else (1.0 if cpu > 1.0 else cpu)
            mem = 0.0 if mem < 0.0 else (1.0 if mem > 1.0 else mem)
            s = 1.0 - 0.4 * q - 0.3 * cpu - 0.3 * mem
            if b.health == "warning":
                s *= wf
            out.append(s)
        return out


class CostParams(_P):
    prefill_load_scale: float = Field(default=1.0, ge=0)
    overlap_credit: float = Field(default=1.0, ge=0, le=1)


@register
class DynamoCostScorer(Scorer):
    """Dynamo's KV-router cost, turned into a score (lowest cost -> 1, highest -> 0).

    ``cost = prefill_load_scale * max(prefill_blocks - credit * overlap_blocks, 0) + decode_blocks``
    where prefill_blocks = the prompt's blocks + blocks of prefill already pending on the backend,
    decode_blocks = blocks active on the backend (its KV usage, or the router's in-flight tokens)
    plus the prompt's blocks.
    """

    type_name = "dynamo-cost-scorer"
    Params = CostParams
    needs_overlap = True

    def costs(self, cands: list[BackendState], ctx: Ctx) -> list[float]:
        p = self.params
        bs = ctx.block_size
        n = ctx.request_blocks
        ov = ctx.overlap
        out = []
        for b in cands:
            prefill = n + b.pending_prefill_tokens / bs
            if b.num_gpu_blocks:
                active = b.kv_usage * b.num_gpu_blocks
            else:
                active = b.active_tokens / bs
            decode = active + n
            out.append(p.prefill_load_scale * max(prefill - p.overlap_credit * ov.get(b.pod, 0), 0.0) + decode)
        return out

    def score(self, req, cands, ctx):
        return _relative_low_is_good(self.costs(cands, ctx))


class PrefillLoadParams(_P):
    queue_tokens: float = Field(default=0.0, ge=0,
                                description="prefill tokens counted per waiting request the engine reports "
                                            "(requests other routers sent, which this router's bookkeeping misses)")
    decode_weight: float = Field(default=0.0, ge=0,
                                 description="how much the requests already running on an engine count: its "
                                             "uncached tokens are weighed (1 + decode_weight x running), since every "
                                             "chunk of a new prefill also delays each of them by its step; running is "
                                             "the engines' reported count, a scrape old")
    context_weight: float = Field(default=0.0, ge=0,
                                  description="prefill tokens' worth of one token of context in flight, per output "
                                              "token: each decode step reads the KV of every request on the engine, "
                                              "so the request's decode costs context_weight x output tokens x the "
                                              "prompt tokens this router has in flight there (roofline: KV bytes per "
                                              "token / HBM bandwidth over FLOPs per token / compute, about 0.0015 for "
                                              "an 8B model on an H100)")
    output_tokens: int = Field(default=256, gt=0,
                               description="output tokens assumed for a request that names no max_tokens")
    max_output_tokens: int = Field(default=2048, gt=0,
                                   description="a larger max_tokens counts as this many (most answers stop earlier)")


@register
class PrefillLoadScorer(Scorer):
    """How long the request would take on this backend, in prefill tokens' worth of work.

    ``work = pending prefill tokens already routed there + the request's uncached tokens there
    (prompt - cached prefix blocks x block size) x (1 + decode_weight x running requests) +
    queue_tokens x waiting requests + context_weight x output tokens x context in flight there``.

    The first two terms are how soon it could start decoding. With ``decode_weight``, a long
    uncached prompt leans to an engine decoding less, since each step of a new prefill delays
    the requests running there too. With ``context_weight``, the decode phase counts: each decode
    step reads the KV of every request on the engine, so a request decodes slower where more
    context is in flight. That uses the router's own count of prompt tokens in flight, which is
    exact when the request is placed, where the engines' reported load lags by a scrape interval.

    The score is ``least work / work`` (1 for the least loaded, smoothly lower for the others), so
    a long cached prefix and a short prefill queue pull together, and a hot backend whose queue
    would cost more than its cache saves loses to an idle one.
    """

    type_name = "prefill-load-scorer"
    Params = PrefillLoadParams
    needs_overlap = True

    def score(self, req, cands, ctx):
        bs = ctx.block_size
        prompt = ctx.prompt_tokens or ctx.request_blocks * bs
        get = ctx.overlap.get if ctx.overlap else (lambda _p, _d=0: 0)
        qt = self.params.queue_tokens
        dw = self.params.decode_weight
        work = []
        cw = self.params.context_weight
        if cw:
            out = req.max_tokens if isinstance(req.max_tokens, int) and req.max_tokens > 0 else self.params.output_tokens
            cw *= out if out < self.params.max_output_tokens else self.params.max_output_tokens
        for b in cands:
            uncached = prompt - get(b.pod, 0) * bs
            if uncached < 0:
                uncached = 0
            if dw:
                uncached *= 1.0 + dw * b.running
            work.append((b.pending_prefill_tokens if b.pending_prefill_tokens > 0 else 0)
                        + uncached + qt * b.waiting + bs + cw * b.active_tokens)
        lo = min(work)
        return [lo / w for w in work]
