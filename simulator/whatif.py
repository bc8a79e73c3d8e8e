"""What-if simulation: the router's real strategy code over simulated engines, in virtual time.

No HTTP, no sockets, no asyncio: a discrete-event loop advances virtual time from one
arrival or engine step to the next. Each arrival is routed by :meth:`router.core.Router.decide`
(the very code the HTTP router runs) over :class:`router.types.BackendState` snapshots built
from the engines' live state; the engines are :class:`simulator.engine_core.EngineCore`
(the model behind ``infernex sim``: paged prefix cache, continuous batching, timing profiles).

The KV view the router sees is exact and without lag: each engine's prefix cache is
consulted directly (what a fully caught-up indexer would answer). Event-stream lag is not
modelled here; the HTTP demo has it. The router's own bookkeeping (requests in flight, their
prompt tokens, uncached prompt tokens until the first token) is kept as ``router.state`` keeps
it for the HTTP router, so filters such as ``not-busy`` see the same inputs.

Fidelity of the KV cache model (``Fleet.kv_model``):

- ``coarse`` (the default): the engines' prefix cache works in units of one trace block (one
  ``hash_id``, 512 tokens = 32 engine blocks of 16). A prompt's cache keys are its chain of
  hash ids (only full trace blocks; the cut tail block is computed, never matched), no token
  ids are synthesized (the engines get token-less requests), memory is the same number of
  tokens as in the fine model (``num_gpu_blocks * block_size / 512`` units), so a request's
  KV rounds up to whole units (at most 511 tokens, ~3 % of a 15k-token prompt). Scheduling,
  chunked prefill, batching and the timing model are unchanged (they work in tokens).
  Differences from ``fine``: a prefix shared only within a cut tail block, and blocks of
  generated tokens, are not reused (in the Mooncake trace no later prompt contains them).
  ``tests/test_whatif.py`` checks that both models give the same strategy ordering and
  close hit rates on a slice of the shared trace.
- ``fine``: vLLM's 16-token blocks over synthesized prompts
  (:class:`simulator.workloads.synth.PromptSynthesizer`, so requests that share ``hash_ids``
  share real token prefixes); block keys are the index's own
  :func:`streams.kv_index.block_keys`, memoised per trace block chain. About 20x slower on
  ~15k-token prompts (per-block Python work).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from router.core import Router
from router.types import BackendState, RoutingRequest
from simulator.config import EngineConfig
from simulator.engine_core import EngineCore, RemotePrefill
from simulator.workloads.metrics import RequestResult, summarize
from simulator.workloads.synth import PromptSynthesizer
from simulator.workloads.trace import TraceRow
from streams.kv_index import block_keys

MODEL = "sim-model"


@dataclass(frozen=True)
class Fleet:
    """Engines of the simulated cluster: aggregated ones and PD groups (x prefill, y decode)."""

    aggregated: int = 8
    pd_groups: int = 0
    prefill_per_group: int = 2
    decode_per_group: int = 2
    hardware: str = "h100"
    model_profile: str = "llama-3.1-8b"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144  # the Mooncake trace has prompts beyond 128k tokens
    kv_model: Literal["coarse", "fine"] = "coarse"  # see the module docstring

    def specs(self) -> list[tuple[str, str, str | None]]:
        out = [(f"agg-{i}", "aggregated", None) for i in range(self.aggregated)]
        for g in range(self.pd_groups):
            out += [(f"pd{g}-prefill-{i}", "prefill", f"g{g}") for i in range(self.prefill_per_group)]
            out += [(f"pd{g}-decode-{i}", "decode", f"g{g}") for i in range(self.decode_per_group)]
        return out


@dataclass
class _Engine:
    pod: str
    role: str
    group: str | None
    core: EngineCore
    free_at: float = math.inf  # when its next step may start; inf = idle
    busy: float = 0.0
    # the router's own bookkeeping, as router.state keeps it for the HTTP router
    inflight: int = 0
    active_tokens: int = 0  # prompt tokens of requests in flight
    pending_prefill: int = 0  # their uncached prompt tokens until the first token


@dataclass(slots=True)
class _Req:
    index: int
    rid: str
    row: TraceRow
    arrival: float
    tokens: list[int] | None  # None: token-less (coarse KV model)
    keys: list[int]
    out_tokens: int = 1
    pending: int = 0
    decode_pod: str | None = None
    backend: str | None = None
    first: float | None = None
    last: float | None = None
    end: float | None = None
    itl: list[float] = field(default_factory=list)
    cached: int | None = None
    produced: int = 0
    error: str | None = None
    http_status: int | None = None

    def result(self) -> RequestResult:
        return RequestResult(
            index=self.index, request_id=self.rid, scheduled_s=self.arrival, start_s=self.arrival,
            end_s=self.end, ttft_s=None if self.first is None else self.first - self.arrival, itl_s=self.itl,
            e2e_s=None if self.end is None else self.end - self.arrival, prompt_tokens=self.row.input_length,
            output_tokens=self.produced, expected_output_tokens=self.row.output_length, cached_tokens=self.cached,
            status="error" if self.error else "ok", http_status=self.http_status, error=self.error,
            backend=self.backend)


@dataclass
class WhatIfResult:
    profile: str
    rows: list[RequestResult]
    wall_s: float
    virtual_s: float
    busy: dict[str, float]
    best_overlap_blocks: int
    chosen_overlap_blocks: int
    rejected: int = 0
    extra: dict = field(default_factory=dict)
    #: prefix-cache hits / lookups as the engines count them, decode engines of a PD group left out
    #: (the KV a decode engine pulled from its prefill engine counts as cached there, as in vLLM)
    engine_hit_rate: float | None = None

    @property
    def overlap_share(self) -> float | None:
        return self.chosen_overlap_blocks / self.best_overlap_blocks if self.best_overlap_blocks else None

    @property
    def busy_spread(self) -> float | None:
        vals = [v for v in self.busy.values()]
        mean = sum(vals) / len(vals) if vals else 0
        return max(vals) / mean if mean > 0 else None

    def summary(self):
        return summarize(self.rows, duration_s=self.virtual_s)


class _UnitKeys:
    """Coarse cache keys: one per full trace block, chained (equal keys = equal prefixes)."""

    def __init__(self, unit_tokens: int):
        self.unit = unit_tokens
        self._chain: dict[tuple[int, int], int] = {}

    def keys(self, row: TraceRow) -> list[int]:
        chain = self._chain
        out: list[int] = []
        parent = 0
        for h in row.hash_ids[:min(len(row.hash_ids), row.input_length // self.unit)]:
            k = chain.get((parent, h))
            if k is None:
                k = chain[(parent, h)] = len(chain) + 1
            out.append(k)
            parent = k
        return out


class _Keys:
    """Block keys of synthesized prompts, memoised along trace hash-id chains."""

    def __init__(self, synth: PromptSynthesizer, block_size: int):
        self.synth = synth
        self.bs = block_size
        self.per_trace_block = synth.block_tokens // block_size if synth.block_tokens % block_size == 0 else 0
        self._chain: dict[tuple[int, int], list[int]] = {}

    def keys(self, row: TraceRow, tokens: np.ndarray) -> list[int]:
        if not self.per_trace_block:
            return block_keys(tokens, self.bs)
        b = self.synth.block_tokens
        full_trace_blocks = min(len(row.hash_ids), row.input_length // b)
        out: list[int] = []
        parent = None
        for j in range(full_trace_blocks):
            memo = self._chain.get((parent or 0, row.hash_ids[j]))
            if memo is None:
                memo = block_keys(tokens[j * b:(j + 1) * b], self.bs, parent)
                self._chain[(parent or 0, row.hash_ids[j])] = memo
            out.extend(memo)
            parent = memo[-1]
        rest = tokens[full_trace_blocks * b:]
        if len(rest) >= self.bs:
            out.extend(block_keys(rest, self.bs, parent))
        return out


def _overlap(core: EngineCore, keys: list[int]) -> int:
    cached = core._cached  # noqa: SLF001 - the simulator's ground truth, read-only
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return n


def simulate(rows: list[TraceRow], profile: str, fleet: Fleet | None = None, *, time_scale: float = 1.0,
             seed: int = 0, synth: PromptSynthesizer | None = None, max_output_tokens: int | None = None,
             metrics_interval_s: float = 0.0) -> WhatIfResult:
    """Run ``rows`` (arrivals at ``timestamp / time_scale``) through ``profile`` on ``fleet``.

    ``metrics_interval_s``: the engines' reported load (waiting, running, KV usage) as a metrics
    collector scraping that often would give it (0: exact at every decision): read at the first
    decision after each scrape tick and kept until the next. The router's own counters (in flight,
    pending prefill) are always exact, as they are for the HTTP router."""
    fleet = fleet or Fleet()
    synth = synth or PromptSynthesizer()
    coarse = fleet.kv_model == "coarse"
    block_size, num_gpu_blocks = fleet.block_size, fleet.num_gpu_blocks
    if coarse:
        unit = synth.block_tokens
        if unit % fleet.block_size:
            raise ValueError(f"the coarse KV model needs trace blocks ({unit} tokens) to be whole engine blocks "
                             f"({fleet.block_size} tokens); use kv_model='fine'")
        per_unit = unit // fleet.block_size
        if num_gpu_blocks is None:
            probe = EngineConfig(model_profile=fleet.model_profile, hardware=fleet.hardware,
                                 block_size=fleet.block_size)
            num_gpu_blocks = probe.resolved_num_gpu_blocks()
        block_size, num_gpu_blocks = unit, max(1, num_gpu_blocks // per_unit)
        unit_keys = _UnitKeys(unit)
    else:
        keyer = _Keys(synth, fleet.block_size)
    router = Router(profile, seed=seed, default_block_size=block_size)
    engines: dict[str, _Engine] = {}
    for pod, role, group in fleet.specs():
        cfg = EngineConfig(engine_id=pod, served_model_name=MODEL, model_profile=fleet.model_profile,
                           hardware=fleet.hardware, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                           max_num_seqs=fleet.max_num_seqs, max_num_batched_tokens=fleet.max_num_batched_tokens,
                           max_model_len=fleet.max_model_len, role=role if role != "aggregated" else "aggregated",
                           emit_kv_events=False)
        engines[pod] = _Engine(pod, role, group, EngineCore(cfg, stream_outputs=True))
    if router.strategy.pd and not any(e.role == "prefill" for e in engines.values()):
        raise ValueError(f"profile {profile} needs PD groups (--pd-groups)")
    prefill_engines = [e for e in engines.values() if e.role == "prefill"]
    states = {e.pod: BackendState(pod=e.pod, url=f"sim://{e.pod}", model=MODEL, role=e.role, group=e.group)
              for e in engines.values()}
    reqs: dict[str, _Req] = {}
    order: list[_Req] = []
    best_total = chosen_total = 0
    rejected = 0
    arrivals = sorted(((r.timestamp / 1000.0 / time_scale, i, r) for i, r in enumerate(rows)), key=lambda x: (x[0], x[1]))
    ai = 0
    wall0 = time.perf_counter()
    heap: list[tuple[float, str]] = []  # (free_at, pod) for engines with work

    def wake(e: _Engine, t: float) -> None:
        if e.free_at == math.inf:
            e.free_at = t
            heapq.heappush(heap, (t, e.pod))

    scraped = [-math.inf]

    def route(req: _Req, now: float) -> None:
        nonlocal best_total, chosen_total, rejected
        scrape = now - scraped[0] >= metrics_interval_s
        if scrape and metrics_interval_s > 0:
            scraped[0] = now - (now % metrics_interval_s)
        for e in engines.values():
            s = states[e.pod]
            if scrape:
                s.waiting = e.core.num_waiting
                s.running = e.core.num_running
                s.kv_usage = e.core.kv_usage
            s.inflight = e.inflight
            s.active_tokens = e.active_tokens
            s.pending_prefill_tokens = e.pending_prefill
        overlap = {pod: _overlap(e.core, req.keys) for pod, e in engines.items()}
        rr = RoutingRequest(model=MODEL, request_id=req.rid, keys=req.keys,
                            prompt_tokens=req.row.input_length, max_tokens=req.row.output_length)
        dec = router.decide(rr, list(states.values()), None, now, overlap=overlap)
        if not dec.ok or dec.target is None:
            rejected += 1
            req.error, req.http_status = f"router: {dec.status}: {dec.reason}", 503
            return
        best_total += dec.best_overlap_blocks
        chosen_total += dec.chosen_overlap_blocks
        out_tokens = max(1, req.row.output_length if max_output_tokens is None
                         else min(req.row.output_length, max_output_tokens))
        rid = req.rid
        req.out_tokens = out_tokens
        if dec.prefill is not None:
            p = engines[dec.prefill.pod]
            try:
                p.core.add_request(rid, req.tokens, 1, now, block_hashes=req.keys, do_remote_decode=True,
                                   num_prompt_tokens=req.row.input_length)
            except ValueError as exc:
                rejected += 1
                req.error, req.http_status = str(exc), 400
                return
            p.inflight += 1
            p.active_tokens += req.row.input_length
            req.pending = req.row.input_length
            p.pending_prefill += req.pending
            req.decode_pod = dec.target.pod
            req.backend = dec.target.pod
            wake(p, now)
            return
        e = engines[dec.target.pod]
        try:
            e.core.add_request(rid, req.tokens, out_tokens, now, block_hashes=req.keys,
                               num_prompt_tokens=req.row.input_length)
        except ValueError as exc:  # what vLLM answers with a 400
            rejected += 1
            req.error, req.http_status = str(exc), 400
            return
        e.inflight += 1
        e.active_tokens += req.row.input_length
        req.pending = max(req.row.input_length - dec.chosen_overlap_blocks * dec.block_size, 0)
        e.pending_prefill += req.pending
        req.backend = e.pod
        wake(e, now)

    while ai < len(arrivals) or heap:
        next_arrival = arrivals[ai][0] if ai < len(arrivals) else math.inf
        next_step = heap[0][0] if heap else math.inf
        if next_arrival <= next_step:
            t, i, row = arrivals[ai]
            ai += 1
            if coarse:
                tokens, keys = None, unit_keys.keys(row)
            else:
                tokens_arr = synth.token_array(row)
                tokens, keys = tokens_arr.tolist(), keyer.keys(row, tokens_arr)
            rid = f"req-{i}"
            req = _Req(i, rid, row, t, tokens, keys)
            reqs[rid] = req
            order.append(req)
            route(req, t)
            continue
        now, pod = heapq.heappop(heap)
        e = engines[pod]
        # decode-only stretches run in one call up to the next moment new work can reach this
        # engine: an arrival, or (decode engines) the end of a prefill engine's next step
        horizon = next_arrival
        if e.role == "decode" and prefill_engines:
            horizon = min(horizon, min(p.free_at for p in prefill_engines))
        step = e.core.step(now, None if horizon == math.inf else horizon)
        if step.idle:
            e.free_at = math.inf
            if step.next_wakeup is not None and e.core.has_work:
                e.free_at = step.next_wakeup
                heapq.heappush(heap, (step.next_wakeup, pod))
            continue
        end = step.end
        e.busy += step.duration
        for out in step.outputs:
            req = reqs.get(out.request_id)
            if req is None:
                continue
            if out.kv_transfer is not None and req.decode_pod is not None and e.role == "prefill":
                # prefill done: hand the KV to the decode engine (same request id, as the PD proxy does)
                d = engines[req.decode_pod]
                t = e.core.take_transfer(out.kv_transfer.transfer_id, end)
                d.core.add_request(out.request_id, req.tokens, req.out_tokens, end,
                                   block_hashes=req.keys, num_prompt_tokens=req.row.input_length,
                                   remote_prefill=RemotePrefill(remote_engine_id=pod, num_tokens=t.num_tokens))
                e.inflight -= 1
                e.active_tokens -= req.row.input_length
                e.pending_prefill -= req.pending
                req.pending = 0
                d.inflight += 1
                d.active_tokens += req.row.input_length
                wake(d, end)
                continue
            t_out = out.time or end
            if out.new_token_ids:
                n_new = len(out.new_token_ids)
                if req.first is None:  # a first token always comes from a prefill step, alone
                    req.first = t_out
                    n_new -= 1
                    e.pending_prefill -= req.pending
                    req.pending = 0
                if n_new > 0:
                    req.itl.extend([(t_out - (req.last or req.first)) / n_new] * n_new)
                req.last = t_out
                req.produced = out.num_output_tokens
            if out.finished:
                req.end = t_out
                req.cached = out.num_cached_tokens
                e.inflight -= 1
                e.active_tokens -= req.row.input_length
                e.pending_prefill -= req.pending
                req.pending = 0
                del reqs[out.request_id]
        e.free_at = end
        heapq.heappush(heap, (end, pod))

    wall = time.perf_counter() - wall0
    rows_out = [r.result() for r in order]
    virtual = max((r.end_s for r in rows_out if r.end_s is not None), default=0.0) - min(
        (r.start_s for r in rows_out if r.start_s is not None), default=0.0)
    prefilling = [e for e in engines.values() if e.role != "decode"]
    queries = sum(e.core.stats.prefix_cache_queries for e in prefilling)
    return WhatIfResult(profile=profile, rows=rows_out, wall_s=wall, virtual_s=virtual,
                        busy={p: e.busy for p, e in engines.items()},
                        engine_hit_rate=sum(e.core.stats.prefix_cache_hits for e in prefilling) / queries if queries else None,
                        best_overlap_blocks=best_total, chosen_overlap_blocks=chosen_total, rejected=rejected,
                        extra={"kv_model": fleet.kv_model,
                               "kv_capacity_tokens": {p: e.core.num_blocks * e.core.block_size
                                                      for p, e in engines.items()}})
