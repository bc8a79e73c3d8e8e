"""Pickers: ``pick(candidates, totals, ctx) -> index``; ``totals`` are weighted scores in [0,1]."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from router.plugins.base import Ctx, Plugin, register
from router.types import BackendState


class _P(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Picker(Plugin):
    kind = "picker"

    def pick(self, cands: list[BackendState], totals: list[float], ctx: Ctx) -> int:
        raise NotImplementedError


@register
class MaxScorePicker(Picker):
    """Highest total; ties broken at random (so equal backends share the load)."""

    type_name = "max-score-picker"

    def pick(self, cands, totals, ctx):
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t >= best - 1e-12]
        return ties[0] if len(ties) == 1 else ctx.rng.choice(ties)


@register
class RandomPicker(Picker):
    type_name = "random-picker"

    def pick(self, cands, totals, ctx):
        return ctx.rng.randrange(len(cands))


@register
class RoundRobinPicker(Picker):
    """Cycles over the candidates by pod name (stable when the set does not change)."""

    type_name = "round-robin-picker"

    def __init__(self, name, params):
        super().__init__(name, params)
        self._n = 0
        self._pods: list[str] = []  # the candidate pods of the last call, and their order by name
        self._order: list[int] = []

    def pick(self, cands, totals, ctx):
        pods = [b.pod for b in cands]
        if pods != self._pods:  # the candidate set changed: sort again (usually it has not)
            self._pods = pods
            self._order = sorted(range(len(pods)), key=pods.__getitem__)
        order = self._order
        i = order[self._n % len(order)]
        self._n += 1
        return i


class SoftmaxParams(_P):
    temperature: float = Field(default=0.1, ge=0, description="0 means always the best")


@register
class SoftmaxPicker(Picker):
    """Weighted random as Dynamo's softmax sampling: ``p_i ~ exp(total_i / T)``; T=0 is argmax."""

    type_name = "softmax-picker"
    Params = SoftmaxParams

    def pick(self, cands, totals, ctx):
        t = self.params.temperature
        if t <= 0:
            best = max(totals)
            return totals.index(best)
        top = max(totals)
        weights = [math.exp((x - top) / t) for x in totals]
        r = ctx.rng.random() * sum(weights)
        acc = 0.0
        for i, w in enumerate(weights):
            acc += w
            if r < acc:
                return i
        return len(weights) - 1


@register
class PowerOfTwoPicker(Picker):
    """Two candidates at random, the better of them."""

    type_name = "power-of-two-picker"

    def pick(self, cands, totals, ctx):
        n = len(cands)
        if n == 1:
            return 0
        a, b = ctx.rng.sample(range(n), 2)
        return a if totals[a] >= totals[b] else b
