"""Filters: ``apply(request, candidates, ctx) -> kept candidates``. Order is kept."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router.plugins.base import Ctx, Plugin, register
from router.types import BackendState, RoutingRequest

log = logging.getLogger(__name__)


class _P(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Filter(Plugin):
    kind = "filter"

    def apply(self, req: RoutingRequest, cands: list[BackendState], ctx: Ctx) -> list[BackendState]:
        raise NotImplementedError


@register
class ModelFilter(Filter):
    """Backends serving the requested model (or holding the requested LoRA adapter as the model)."""

    type_name = "model-filter"

    def apply(self, req, cands, ctx):
        m = req.model
        return [b for b in cands if b.model == m or m in b.loras]


class RoleParams(_P):
    roles: list[Literal["aggregated", "prefill", "decode"]] = Field(default_factory=lambda: ["aggregated"],
                                                                    min_length=1)


@register
class RoleFilter(Filter):
    type_name = "role-filter"
    Params = RoleParams

    def __init__(self, name, params):
        super().__init__(name, params)
        self._roles = frozenset(params.roles)

    def apply(self, req, cands, ctx):
        roles = self._roles
        return [b for b in cands if b.role in roles]


@register
class PdGroupFilter(Filter):
    """In the decode stage, keep the prefill pod's group (xPyD: transfers stay inside a group)."""

    type_name = "pd-group-filter"

    def apply(self, req, cands, ctx):
        if ctx.group is None:
            return cands
        g = ctx.group
        return [b for b in cands if b.group == g]


class HealthyParams(_P):
    fail_open: bool = Field(default=True, description="when every otherwise usable backend has an open circuit "
                                                      "breaker, keep them rather than refuse everything (counted)")


@register
class HealthyFilter(Filter):
    """Drops backends with a critical diagnosis, an open circuit breaker, draining, or tried already.

    Floor: when the only reason nothing is left is open breakers (every engine of the model tripped),
    the least recently failed half of the tripped ones (at least one) is kept rather than answering
    503 to everything: a request that reaches an engine which recovered closes its breaker at once,
    without waiting for the cooldown. Counted as ``fail_open`` and logged once per episode."""

    type_name = "healthy-filter"
    Params = HealthyParams

    def __init__(self, name, params):
        super().__init__(name, params)
        self.fail_opens = 0
        self._episode = False

    def events(self) -> dict[str, int]:
        return {"fail_open": self.fail_opens}

    def apply(self, req, cands, ctx):
        ex = req.exclude
        kept = [b for b in cands
                if b.health != "critical" and not b.circuit_open and not b.draining and b.pod not in ex]
        if kept or not self.params.fail_open:
            if kept and self._episode:
                self._episode = False
            return kept
        tripped = [b for b in cands
                   if b.circuit_open and b.health != "critical" and not b.draining and b.pod not in ex]
        if len(tripped) > 1:
            tripped = sorted(tripped, key=lambda b: b.circuit_until)[:max(1, len(tripped) // 2)]
        if tripped:
            self.fail_opens += 1
            if not self._episode:
                self._episode = True
                log.warning("every backend of model %r has an open circuit breaker: failing open to %d of them",
                            req.model, len(tripped))
        return tripped


class BusyParams(_P):
    kv_usage_threshold: float = Field(default=0.95, gt=0, le=1)
    max_waiting: float = Field(default=64, gt=0)
    # uncached prompt tokens waiting for their first token; long-context traces (Mooncake: 15-22k
    # tokens a prompt) need room for a few such prompts per engine before it counts as busy
    max_pending_prefill_tokens: int = Field(default=262144, gt=0)


@register
class NotBusyFilter(Filter):
    """Dynamo-like busy detection: KV usage, queue and pending prefill tokens over thresholds.

    When every candidate is busy only by its queue (waiting requests, pending prefill tokens; the
    latter grow by themselves when first tokens are merely slow) and the router's admission control
    is on, those candidates are kept: admission already caps what each engine gets and queues the
    rest with a deadline, so a transient queue does not become 503s here (counted as
    ``deferred_to_admission``). A full KV cache still counts as busy."""

    type_name = "not-busy-filter"
    Params = BusyParams

    def __init__(self, name, params):
        super().__init__(name, params)
        self.deferred = 0

    def events(self) -> dict[str, int]:
        return {"deferred_to_admission": self.deferred}

    def apply(self, req, cands, ctx):
        p = self.params
        kv, w, pp = p.kv_usage_threshold, p.max_waiting, p.max_pending_prefill_tokens
        kept = [b for b in cands if b.kv_usage < kv and b.waiting < w and b.pending_prefill_tokens < pp]
        if not kept and cands and ctx.admission:
            kept = [b for b in cands if b.kv_usage < kv]
            if kept:
                self.deferred += 1
        return kept


@register
class LoraFilter(Filter):
    """When the request names a LoRA adapter, keep backends that have it loaded."""

    type_name = "lora-filter"

    def apply(self, req, cands, ctx):
        if not req.lora:
            return cands
        a = req.lora
        return [b for b in cands if a in b.loras]


class Bucket(_P):
    max_prompt_tokens: int | None = Field(default=None, gt=0, description="None: no upper bound")
    groups: list[str] | None = Field(default=None, description="PD groups of this bucket; None: assigned")


class BucketParams(_P):
    buckets: list[Bucket] = Field(
        default_factory=lambda: [Bucket(max_prompt_tokens=1024), Bucket(max_prompt_tokens=None)], min_length=1)
    fallback: bool = Field(default=True, description="when none of the bucket's groups has a usable prefill and "
                                                     "decode pod, use any group that has (counted)")


def _usable(b: BackendState, req: RoutingRequest) -> bool:
    """What :class:`HealthyFilter` would keep."""
    return b.health != "critical" and not b.circuit_open and not b.draining and b.pod not in req.exclude


def bucket_index(buckets: list[Bucket], prompt_tokens: int) -> int:
    for i, b in enumerate(buckets):
        if b.max_prompt_tokens is None or prompt_tokens <= b.max_prompt_tokens:
            return i
    return len(buckets) - 1


@register
class PdBucketFilter(Filter):
    """PD-Bucket: requests are bucketed by prompt length; each bucket owns some PD groups.

    Buckets without explicit ``groups`` share the remaining groups in sorted order (group i goes to
    bucket i mod n), so short and long prompts do not queue behind each other.
    """

    type_name = "pd-bucket-filter"
    Params = BucketParams

    def groups_for(self, prompt_tokens: int, all_groups: list[str]) -> set[str]:
        buckets = self.params.buckets
        i = bucket_index(buckets, prompt_tokens)
        if buckets[i].groups is not None:
            return set(buckets[i].groups)
        explicit = {g for b in buckets if b.groups for g in b.groups}
        free = [g for g in sorted(all_groups) if g not in explicit]
        auto = [j for j, b in enumerate(buckets) if b.groups is None]
        if not free:
            return set()
        if len(free) < len(auto):  # fewer groups than buckets: share
            return {free[auto.index(i) % len(free)]}
        return {g for k, g in enumerate(free) if auto[k % len(auto)] == i}

    def __init__(self, name, params):
        super().__init__(name, params)
        self.fallbacks = 0

    def events(self) -> dict[str, int]:
        return {"bucket_fallback": self.fallbacks}

    def apply(self, req, cands, ctx):
        if ctx.group is not None:
            return cands
        groups = sorted({b.group for b in cands if b.group is not None})
        keep = self.groups_for(ctx.prompt_tokens, groups)
        kept = [b for b in cands if b.group in keep]
        if not self.params.fallback:
            return kept
        ok = self._healthy_groups(req, cands, ctx)
        if any(b.group in ok for b in kept):
            return kept
        alt = [b for b in cands if b.group in ok]
        if not alt:
            return kept  # nothing healthy anywhere: the later filters say why
        self.fallbacks += 1
        return alt

    @staticmethod
    def _healthy_groups(req, cands, ctx) -> set[str]:
        """Groups with a usable prefill candidate and a usable decode pod of the same model."""
        pre = {b.group for b in cands if b.group is not None and _usable(b, req)}
        model = req.model
        dec = {b.group for b in ctx.backends if b.role == "decode" and b.group in pre and _usable(b, req)
               and (b.model == model or model in b.loras)}
        return dec if ctx.backends else pre
