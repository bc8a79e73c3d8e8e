"""What-if simulation: the router's real strategy code over simulated engines, in virtual time.

No HTTP, no sockets, no asyncio: a discrete-event loop advances virtual time from one
arrival or engine step to the next. Each arrival is routed by :meth:`router.core.Router.decide`
(the very code the HTTP router runs) over :class:`router.types.BackendState` snapshots built
from the engines' live state; the engines are :class:`simulator.engine_core.EngineCore`
(the model behind ``infernex sim``: paged prefix cache, continuous batching, timing profiles).

The KV view the router sees is exact and without lag: each engine's prefix cache is
consulted directly (what a fully caught-up indexer would answer). Event-stream lag is not
modelled here; the HTTP demo has it.

Prompts come from :class:`simulator.workloads.synth.PromptSynthesizer`, so requests that
share trace ``hash_ids`` share real token prefixes; block keys are the index's own
:func:`streams.kv_index.block_keys`, memoised per 512-token trace block chain.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

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
    inflight: int = 0
    active_tokens: int = 0


@dataclass(slots=True)
class _Req:
    index: int
    rid: str
    row: TraceRow
    arrival: float
    tokens: list[int]
    keys: list[int]
    out_tokens: int = 1
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
             seed: int = 0, synth: PromptSynthesizer | None = None, max_output_tokens: int | None = None) -> WhatIfResult:
    """Run ``rows`` (arrivals at ``timestamp / time_scale``) through ``profile`` on ``fleet``."""
    fleet = fleet or Fleet()
    router = Router(profile, seed=seed, default_block_size=fleet.block_size)
    synth = synth or PromptSynthesizer()
    keyer = _Keys(synth, fleet.block_size)
    engines: dict[str, _Engine] = {}
    for pod, role, group in fleet.specs():
        cfg = EngineConfig(engine_id=pod, served_model_name=MODEL, model_profile=fleet.model_profile,
                           hardware=fleet.hardware, block_size=fleet.block_size, num_gpu_blocks=fleet.num_gpu_blocks,
                           max_num_seqs=fleet.max_num_seqs, max_num_batched_tokens=fleet.max_num_batched_tokens,
                           max_model_len=fleet.max_model_len, role=role if role != "aggregated" else "aggregated",
                           emit_kv_events=False)
        engines[pod] = _Engine(pod, role, group, EngineCore(cfg, stream_outputs=True))
    if router.strategy.pd and not any(e.role == "prefill" for e in engines.values()):
        raise ValueError(f"profile {profile} needs PD groups (--pd-groups)")
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

    def route(req: _Req, now: float) -> None:
        nonlocal best_total, chosen_total, rejected
        for e in engines.values():
            s = states[e.pod]
            s.waiting = e.core.num_waiting
            s.running = e.core.num_running
            s.kv_usage = e.core.kv_usage
            s.inflight = e.inflight
            s.active_tokens = e.active_tokens
        overlap = {pod: _overlap(e.core, req.keys) for pod, e in engines.items()}
        rr = RoutingRequest(model=MODEL, request_id=req.rid, keys=req.keys,
                            prompt_tokens=len(req.tokens), max_tokens=req.row.output_length)
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
                p.core.add_request(rid, req.tokens, 1, now, block_hashes=req.keys, do_remote_decode=True)
            except ValueError as exc:
                rejected += 1
                req.error, req.http_status = str(exc), 400
                return
            p.inflight += 1
            p.active_tokens += len(req.tokens)
            req.decode_pod = dec.target.pod
            req.backend = dec.target.pod
            wake(p, now)
            return
        e = engines[dec.target.pod]
        try:
            e.core.add_request(rid, req.tokens, out_tokens, now, block_hashes=req.keys)
        except ValueError as exc:  # what vLLM answers with a 400
            rejected += 1
            req.error, req.http_status = str(exc), 400
            return
        e.inflight += 1
        e.active_tokens += len(req.tokens) + out_tokens
        req.backend = e.pod
        wake(e, now)

    while ai < len(arrivals) or heap:
        next_arrival = arrivals[ai][0] if ai < len(arrivals) else math.inf
        next_step = heap[0][0] if heap else math.inf
        if next_arrival <= next_step:
            t, i, row = arrivals[ai]
            ai += 1
            tokens_arr = synth.token_array(row)
            keys = keyer.keys(row, tokens_arr)
            rid = f"req-{i}"
            req = _Req(i, rid, row, t, tokens_arr.tolist(), keys)
            reqs[rid] = req
            order.append(req)
            route(req, t)
            continue
        now, pod = heapq.heappop(heap)
        e = engines[pod]
        # decode-only stretches run in one call up to the next moment anything else can happen
        horizon = min(next_arrival, heap[0][0] if heap else math.inf)
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
                                   block_hashes=req.keys,
                                   remote_prefill=RemotePrefill(remote_engine_id=pod, num_tokens=t.num_tokens))
                e.inflight -= 1
                e.active_tokens -= len(req.tokens)
                d.inflight += 1
                d.active_tokens += len(req.tokens) + req.out_tokens
                wake(d, end)
                continue
            t_out = out.time or end
            if out.new_token_ids:
                n_new = len(out.new_token_ids)
                if req.first is None:  # a first token always comes from a prefill step, alone
                    req.first = t_out
                    n_new -= 1
                if n_new > 0:
                    req.itl.extend([(t_out - (req.last or req.first)) / n_new] * n_new)
                req.last = t_out
                req.produced = out.num_output_tokens
            if out.finished:
                req.end = t_out
                req.cached = out.num_cached_tokens
                e.inflight -= 1
                e.active_tokens -= len(req.tokens) + req.out_tokens
                del reqs[out.request_id]
        e.free_at = end
        heapq.heappush(heap, (end, pod))

    wall = time.perf_counter() - wall0
    rows_out = [r.result() for r in order]
    virtual = max((r.end_s for r in rows_out if r.end_s is not None), default=0.0) - min(
        (r.start_s for r in rows_out if r.start_s is not None), default=0.0)
    return WhatIfResult(profile=profile, rows=rows_out, wall_s=wall, virtual_s=virtual,
                        busy={p: e.busy for p, e in engines.items()},
                        best_overlap_blocks=best_total, chosen_overlap_blocks=chosen_total, rejected=rejected)
