"""A fleet of :class:`~simulator.engine_core.EngineCore` engines in virtual time, with a router
policy in front: aggregated (every engine prefills and decodes) or PD (prefill engines hand the
KV to decode engines, which pull it over the connector link). No sockets and no clock: the same
engine model the HTTP simulator runs, stepped in event order, so a minute of traffic on a dozen
engines takes seconds and the same seed gives the same figures.

What it shows is what PD is for: in an aggregated engine a step mixes prefill chunks and decodes
under one token budget, so every long prompt stretches the inter-token latency of every request
decoding there; PD keeps prefills off the decode engines at the price of a KV transfer
(``transfer_time``: blocks moved / link bandwidth + latency) and of a fixed prefill:decode split,
which the planner (:mod:`streams.planner`) sizes from a profile measured here
(:func:`measure_profile`).

Per request it records TTFT (arrival -> first token the client sees: the decode engine's for PD),
TPOT (mean time per output token after the first) and whether both met the SLA (goodput).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Literal

from simulator.config import EngineConfig
from simulator.engine_core import EngineCore, RemotePrefill


@dataclass(frozen=True)
class Arrival:
    t: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class Outcome:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    prefill_done: float | None = None  # PD: when the prefill engine produced its token

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    @property
    def done(self) -> bool:
        return self.tokens >= self.output_tokens


def poisson_workload(rate: float, seconds: float, isl: tuple[int, int], osl: tuple[int, int],
                     seed: int = 0) -> list[Arrival]:
    """Poisson arrivals; prompt and output lengths uniform in the given ranges."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(Arrival(t, rng.randint(*isl), rng.randint(*osl)))


class _Engine:
    __slots__ = ("core", "role", "name", "t", "queued_prefill", "active")

    def __init__(self, name: str, cfg: EngineConfig, role: str):
        self.core = EngineCore(cfg.model_copy(update={"engine_id": name, "emit_kv_events": False,
                                                      "enable_prefix_caching": False}))
        self.role, self.name = role, name
        self.t = 0.0  # the engine is busy until t
        self.queued_prefill = 0  # prompt tokens admitted here and not yet through their first token
        self.active = 0  # requests on this engine


@dataclass
class FleetResult:
    mode: str
    engines: dict[str, int]
    outcomes: list[Outcome] = field(default_factory=list)
    duration: float = 0.0

    def goodput(self, ttft_s: float, tpot_s: float) -> float:
        """Requests per second that finished within both targets."""
        good = sum(1 for o in self.outcomes if o.done and o.ttft is not None and o.ttft <= ttft_s
                   and (o.tpot is None or o.tpot <= tpot_s))
        return good / self.duration

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        n = len(self.outcomes)
        return self.goodput(ttft_s, tpot_s) * self.duration / n if n else 0.0

    def quantile(self, what: Literal["ttft", "tpot"], q: float) -> float | None:
        xs = sorted(v for v in (getattr(o, what) for o in self.outcomes) if v is not None)
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class Fleet:
    """Engines per role in virtual time, resizable while running (``scale``): the event loop of
    :func:`run_fleet`, step by step (``run_until``) so a planner can act between intervals."""

    def __init__(self, cfg: EngineConfig, mode: Literal["aggregated", "pd"], **counts: int):
        self.cfg, self.mode = cfg, mode
        self.engines: list[_Engine] = []
        self.by_name: dict[str, _Engine] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.now = 0.0
        self._n = 0
        self._seq = 0
        self._ev: list[tuple[float, int, str, object]] = []
        self._scheduled: set[str] = set()
        self._draining: set[str] = set()
        roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
        for role in roles:
            self.scale(role, counts.get(role, 0))
        if any(not self._live(r) for r in roles):
            raise ValueError("a fleet needs at least one engine per role")

    _KV = {"aggregated": "aggregated", "prefill": "kv_producer", "decode": "kv_consumer"}

    def _live(self, role: str) -> list[_Engine]:
        return [e for e in self.engines if e.role == role and e.name not in self._draining]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.engines:
            if e.name not in self._draining:
                out[e.role] = out.get(e.role, 0) + 1
        return out

    def scale(self, role: str, n: int) -> None:
        """``n`` engines in ``role`` from now on; removed ones take no new requests, finish theirs."""
        live = self._live(role)
        for _ in range(n - len(live)):
            e = _Engine(f"{role}-{self._n}", self.cfg.model_copy(update={"role": self._KV[role]}), role)
            self._n += 1
            e.t = self.now
            self.engines.append(e)
            self.by_name[e.name] = e
        for e in live[max(n, 0):][::-1] if n < len(live) else []:
            self._draining.add(e.name)
            self._retire(e)

    def _retire(self, e: _Engine) -> None:
        if e.name in self._draining and not e.core.has_work and not e.core.transfers:
            self.engines.remove(e)
            self._draining.discard(e.name)

    def submit(self, arrivals: list[Arrival], first_id: int = 0) -> None:
        for i, a in enumerate(arrivals):
            self._push(a.t, "arrive", (f"r{first_id + i}", a))

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._ev, (t, self._seq, kind, payload))
        self._seq += 1

    def _wake(self, e: _Engine, t: float) -> None:
        if e.name not in self._scheduled:
            self._scheduled.add(e.name)
            self._push(max(t, e.t), "step", e.name)

    @staticmethod
    def _pick(cands: list[_Engine], prefill_tokens: bool) -> _Engine:
        if prefill_tokens:
            return min(cands, key=lambda e: (e.queued_prefill, e.active, e.name))
        return min(cands, key=lambda e: (e.active, e.name))

    def run_until(self, until: float) -> None:
        ev = self._ev
        while ev and ev[0][0] <= until:
            t, _, kind, payload = heapq.heappop(ev)
            self.now = t
            if kind == "arrive":
                rid, a = payload
                self.outcomes[rid] = Outcome(a.t, a.prompt_tokens, a.output_tokens)
                e = self._pick(self._live("aggregated" if self.mode == "aggregated" else "prefill"), True)
                prompt = _prompt(rid, a.prompt_tokens)
                if e.role == "prefill":
                    e.core.add_request(rid, prompt, 1, t, do_remote_decode=True)
                else:
                    e.core.add_request(rid, prompt, a.output_tokens, t)
                e.queued_prefill += a.prompt_tokens
                e.active += 1
                self._wake(e, t)
            elif kind == "handoff":
                rid, src = payload
                o = self.outcomes[rid]
                d = self._pick(self._live("decode"), False)
                prod = self.by_name[src]
                prod.core.take_transfer(rid, t)  # the consumer pulls: the producer frees its blocks
                self._retire(prod)
                d.core.add_request(rid, _prompt(rid, o.prompt_tokens), o.output_tokens, t,
                                   remote_prefill=RemotePrefill(src, o.prompt_tokens))
                d.active += 1
                self._wake(d, t)
            else:
                e = self.by_name[payload]
                self._scheduled.discard(e.name)
                # decode-only batches run up to the next event in one call (same tokens and times)
                r = e.core.step(t, ev[0][0] if ev else t + 1.0)
                if r.idle:
                    if r.next_wakeup is not None:
                        self._wake(e, r.next_wakeup)
                    continue
                e.t = r.end
                for out in r.outputs:
                    rid = out.request_id
                    o = self.outcomes[rid]
                    if e.role == "prefill":
                        if out.finished:
                            o.prefill_done = out.time
                            e.queued_prefill -= o.prompt_tokens
                            e.active -= 1
                            self._push(out.time, "handoff", (rid, e.name))
                        continue
                    n = len(out.new_token_ids)
                    if n:
                        if o.first_token is None:
                            o.first_token = out.time
                            if e.role == "aggregated":
                                e.queued_prefill -= o.prompt_tokens
                        o.last_token = out.time
                        o.tokens += n
                    if out.finished:
                        e.active -= 1
                if e.core.has_work:
                    self._wake(e, r.end)
                else:
                    self._retire(e)
        self.now = max(self.now, until)


def run_fleet(arrivals: list[Arrival], cfg: EngineConfig, *, mode: Literal["aggregated", "pd"], engines: int = 0,
              prefill: int = 0, decode: int = 0, drain_s: float = 120.0) -> FleetResult:
    """Serve ``arrivals`` on ``engines`` aggregated engines, or ``prefill`` + ``decode`` PD engines.

    Routing: aggregated and prefill to the engine with the fewest queued prompt tokens (ties: fewest
    requests), decode to the engine with the fewest requests. The run ends when every request is
    done or ``drain_s`` after the last arrival."""
    counts = {"aggregated": engines} if mode == "aggregated" else {"prefill": prefill, "decode": decode}
    fleet = Fleet(cfg, mode, **counts)
    fleet.submit(arrivals)
    fleet.run_until((arrivals[-1].t if arrivals else 0.0) + drain_s)
    res = FleetResult(mode, counts, list(fleet.outcomes.values()))
    res.duration = max(arrivals[-1].t, 1e-9) if arrivals else 1.0
    return res


def _prompt(rid: str, n: int) -> list[int]:
    """Distinct token ids per request (prefix caching is off in the fleet anyway)."""
    base = int("".join(c for c in rid if c.isdigit()) or 0) * 7919 + 1000
    return [(base + i * 31) % 30000 + 20 for i in range(n)]


# ---------------------------------------------------------------------------------------------
# a planner profile measured on the engine model
# ---------------------------------------------------------------------------------------------


def measure_profile(cfg: EngineConfig, isls: list[int], contexts: list[int], batches: list[int]):
    """A :class:`streams.planner.PerformanceProfile` measured on one engine of ``cfg``: prefill
    throughput and TTFT per ISL (a queue of prompts, back to back), decode throughput and ITL per
    context length and batch size (a full batch decoding, its KV pulled from elsewhere)."""
    from streams.planner import DecodePoint, PerformanceProfile, PrefillPoint

    pre = []
    for isl in isls:
        core = EngineCore(cfg.model_copy(update={"emit_kv_events": False, "enable_prefix_caching": False}))
        n = max(4, math.ceil(4 * cfg.max_num_batched_tokens / isl))
        for i in range(n):
            core.add_request(f"p{i}", _prompt(f"p{i}", isl), 1, 0.0)
        t, first = 0.0, None
        while core.has_work:
            r = core.step(t)
            t = r.end
            if first is None and r.ttft:
                first = r.ttft[0]
        pre.append(PrefillPoint(isl=isl, throughput_tokens_per_s=n * isl / t, ttft_s=first))
    dec = []
    for ctx in contexts:
        for b in batches:
            # a decode engine: the prompts' KV arrives from elsewhere, so the steps are pure decode
            core = EngineCore(cfg.model_copy(update={"emit_kv_events": False, "enable_prefix_caching": False,
                                                     "role": "kv_consumer"}))
            if -(-(ctx + 64) // cfg.block_size) * b > core.num_blocks:
                continue
            for i in range(b):
                core.add_request(f"d{i}", _prompt(f"d{i}", ctx), 64, 0.0, remote_prefill=RemotePrefill("m", ctx))
            t, itls = 0.0, []
            while core.has_work:
                r = core.step(t)
                if r.idle:  # waiting for the KV to arrive
                    t = r.next_wakeup if r.next_wakeup is not None else t + 1e-3
                    continue
                t = r.end
                itls.extend(r.itl)
            if itls:
                itl = sum(itls) / len(itls)
                dec.append(DecodePoint(context_length=ctx, throughput_tokens_per_s=b / itl, itl_s=itl))
    return PerformanceProfile(name=f"{cfg.model_profile}-{cfg.hardware}-measured", prefill=pre, decode=dec)


def plan_split(total: int, rate: float, isl: float, osl: float, itl_target: float, profile) -> tuple[int, int]:
    """The planner's formulas (:mod:`streams.planner`) turned into an xPyD split of ``total`` engines:
    prefill and decode replicas for the load, scaled to the engines there are (each role >= 1)."""
    from streams.planner import decode_replicas, prefill_replicas

    pre = prefill_replicas(rate, isl, 1.0, profile)
    dec = decode_replicas(rate, isl, osl, itl_target, 1.0, profile)
    if pre + dec <= 0:
        return max(1, total // 2), max(1, total - total // 2)
    p = min(total - 1, max(1, round(total * pre / (pre + dec))))
    return p, total - p
