"""A pure, synchronous model of one vLLM engine, run in virtual time.

No sockets, no asyncio, no clock: the caller passes ``now`` to :meth:`EngineCore.step`, which
schedules one continuous-batching step like vLLM's v1 scheduler, returns how long it took
(from a roofline timing model of the hardware and model profiles), the tokens it emitted,
the requests it finished and the KV events it caused. The HTTP server drives it in scaled
real time; a trace replayer can drive thousands of requests per second through it.

KV cache: ``num_gpu_blocks`` paged blocks of ``block_size`` tokens with reference counts; full
blocks are prefix-cached under vLLM's chained block hashes; unreferenced blocks sit in an
LRU free queue (freed tail-first, like vLLM) and a cached one is evicted only when its block
is reallocated (``BlockRemoved``). A prefix hit is the longest run of cached full blocks
(at most ``num_tokens - 1`` tokens, so one token is always computed) and removes those
tokens from the prefill cost: cached tokens really shorten TTFT.

PD: a request with ``do_remote_decode`` (producer) finishes after its first token but keeps
its blocks pinned until :meth:`EngineCore.take_transfer` or ``kv_transfer_timeout_s``; a
request with a :class:`RemotePrefill` (consumer) allocates its blocks, waits the simulated
transfer time, then needs one step to produce its first token.

Token-less requests (``prompt_token_ids=None`` with ``num_prompt_tokens``): only the caller's
``block_hashes`` key the cache (one per full block of the prompt); no token ids are kept, blocks
of generated tokens are not cached, their ``BlockStored`` events carry no token ids, and every
token they generate is the placeholder ``TOKENLESS_OUTPUT_ID`` (only counts and times matter). The
what-if simulation uses them with a ``block_size`` of one trace block (512 tokens), so a prompt
is a few dozen cache units instead of a thousand 16-token blocks (see :mod:`simulator.whatif`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, takewhile
from dataclasses import dataclass, field
from typing import Any, Hashable

import xxhash

from simulator.config import EngineConfig
from simulator.hashing import BlockHasher, event_extra_keys, to_external
from simulator.kv_events import AllBlocksCleared, KvCacheEventT, block_removed, block_stored

_U64 = (1 << 64) - 1
RESERVED_TOKEN_IDS = 16  # generated ids avoid the lowest ids (special tokens)
TOKENLESS_OUTPUT_ID = RESERVED_TOKEN_IDS  # every generated id of a token-less request (only counts matter)


def _tuple_hash(token_ids: list[int]) -> bytes:
    """A fast fingerprint of a token list; ints hash without randomisation, so it is the
    same in every 64-bit CPython process (engines of a PD pair agree)."""
    return hash(tuple(token_ids)).to_bytes(8, "little", signed=True)


class TransferError(LookupError):
    """Unknown, expired or mismatched ``kv_transfer_params``."""


@dataclass(slots=True)
class RemotePrefill:
    """What a consumer needs to pull a prompt's KV from a producer."""

    remote_engine_id: str
    num_tokens: int


@dataclass(slots=True)
class Transfer:
    """KV blocks a producer keeps pinned for one consumer."""

    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: int
    expires_at: float


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: list[int] | None  # None: a token-less request (block hashes only)
    max_tokens: int
    arrival: float
    keys: list[Hashable]
    out_seed: int
    cache_salt: str | None = None
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0
    num_cached_tokens: int = -1
    first_scheduled: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    do_remote_decode: bool = False
    remote: RemotePrefill | None = None
    remote_ready: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_tokens: int = 0  # len(prompt) + len(output), kept up to date
    prompt_len: int = 0
    transfer_id: str | None = None  # producer: the key a consumer pulls the KV by (default: request_id)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    kv_transfer: Transfer | None = None
    time: float = 0.0  # virtual time of the last token in new_token_ids


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float
    outputs: list[RequestOutput]
    events: list[KvCacheEventT]
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_reqs: int = 0
    next_wakeup: float | None = None
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def idle(self) -> bool:
        return self.num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    steps: int = 0
    busy_time: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, hasher: BlockHasher | None = None,
                 stream_outputs: bool = True, vocab_size: int | None = None):
        cfg = config or EngineConfig()
        self.config = cfg
        self.block_size = bs = cfg.block_size
        self.num_blocks = cfg.resolved_num_gpu_blocks()
        self.hasher = hasher or BlockHasher(bs, cfg.prefix_caching_hash_algo, cfg.hash_seed)
        if self.hasher.block_size != bs:
            raise ValueError("hasher block size differs from the engine's")
        self.vocab_size = vocab_size or cfg.vocab_size or cfg.model.vocab_size
        if self.vocab_size <= 2 * RESERVED_TOKEN_IDS:
            raise ValueError("vocab_size too small")
        self._span = self.vocab_size - RESERVED_TOKEN_IDS
        self._model_seed = xxhash.xxh64_intdigest(cfg.served_model_name.encode())
        self.slow_factor = cfg.faults.slow_factor
        self.emit_events = cfg.emit_kv_events and cfg.enable_prefix_caching
        # False: a RequestOutput only when a request finishes (all its tokens), for trace replay
        self.stream_outputs = stream_outputs

        # timing constants
        hw, m, tp = cfg.hw, cfg.model, cfg.tensor_parallel_size
        self._flops = hw.peak_tflops * 1e12 * hw.mfu * tp
        self._bw = hw.hbm_tb_s * 1e12 * hw.mbu * tp
        self._overhead = hw.step_overhead_ms / 1e3
        self._flops_per_token = 2 * m.params_b * 1e9
        self._attn_flops = 4 * m.num_layers * m.hidden_size  # per (query token x context token)
        self._weight_bytes = m.weight_bytes
        self.kv_bytes_per_token = m.kv_bytes_per_token
        self._link_bw = (config.kv_link_gbps or hw.kv_link_gb_s) * 1e9
        self._link_latency = hw.kv_link_latency_ms / 1e3

        # KV cache
        n = self.num_blocks
        self._ref = [0] * n
        self._key: list[Hashable | None] = [None] * n
        self._cached: dict[Hashable, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))

        # scheduler
        self._requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: list[Request] = []
        self.transfers: dict[str, Transfer] = {}
        self._pending_events: list[KvCacheEventT] = []
        self.stats = EngineStats()

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        max_tokens: int,
        arrival_time: float,
        *,
        cache_salt: str | None = None,
        block_hashes: list[Hashable] | None = None,
        do_remote_decode: bool = False,
        remote_prefill: RemotePrefill | None = None,
        num_prompt_tokens: int | None = None,
        transfer_id: str | None = None,
    ) -> Request:
        """Queue a request (raises ``ValueError`` for requests vLLM would reject).

        ``prompt_token_ids=None`` with ``num_prompt_tokens``: a token-less request, keyed in the
        prefix cache by ``block_hashes`` alone (see the module docstring).
        """
        cfg = self.config
        if prompt_token_ids is None:
            if num_prompt_tokens is None:
                raise ValueError("a request without prompt token ids needs num_prompt_tokens")
            if block_hashes is None and cfg.enable_prefix_caching:
                raise ValueError("a request without prompt token ids needs block_hashes")
            n = num_prompt_tokens
        else:
            n = len(prompt_token_ids)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if n == 0:
            raise ValueError("the prompt must not be empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if n + max_tokens > cfg.max_model_len:
            raise ValueError(f"this model's maximum context length is {cfg.max_model_len} tokens; the request "
                             f"has {n} prompt tokens and asks for {max_tokens} more")
        if not cfg.enable_chunked_prefill and n + max_tokens > cfg.max_num_batched_tokens:
            # (vLLM refuses such a configuration: without chunked prefill, max_num_batched_tokens must
            # hold max_model_len. A request longer than one step's budget would never run again once
            # preempted, since its prompt and output so far are recomputed in one step)
            raise ValueError(f"prompt of {n} tokens plus max_tokens {max_tokens} exceeds max_num_batched_tokens="
                             f"{cfg.max_num_batched_tokens} and chunked prefill is disabled")
        if -(-(n + max_tokens) // self.block_size) > self.num_blocks:
            raise ValueError(f"request needs more KV blocks than the engine has ({self.num_blocks})")
        if remote_prefill is not None and remote_prefill.num_tokens != n:
            raise TransferError(f"kv_transfer_params cover {remote_prefill.num_tokens} tokens but the prompt has {n}")
        if cfg.enable_prefix_caching:
            if block_hashes is not None:
                if len(block_hashes) > n // self.block_size:
                    raise ValueError("more block hashes than full prompt blocks")
                keys = list(block_hashes)
            else:
                keys = self.hasher.hash_blocks(prompt_token_ids, cache_salt=cache_salt)
        else:
            keys = []
        if prompt_token_ids is None:  # the chained last key stands for the prompt's full blocks
            digest = xxhash.xxh64_intdigest(repr((n, keys[-1] if keys else None)).encode(), seed=self._model_seed)
            prompt = None
        else:
            digest = xxhash.xxh64_intdigest(_tuple_hash(prompt_token_ids), seed=self._model_seed)
            prompt = list(prompt_token_ids)
        req = Request(request_id, prompt, max_tokens, arrival_time, keys, digest,
                      cache_salt=cache_salt, do_remote_decode=do_remote_decode, remote=remote_prefill,
                      num_tokens=n, prompt_len=n, transfer_id=transfer_id)
        self._requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        elif req in self.remote_waiting:
            self.remote_waiting.remove(req)
        self._free_blocks(req.blocks)
        req.blocks = []
        req.finished, req.finish_reason = True, "abort"
        self.stats.requests_aborted += 1
        return True

    def output_token(self, prompt_digest: int, index: int) -> int:
        """The deterministic ``index``-th output token of a prompt (same on every engine)."""
        return RESERVED_TOKEN_IDS + xxhash.xxh64_intdigest(index.to_bytes(4, "little"), seed=prompt_digest) % self._span

    # ----------------------------------------------------------------- state

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote_waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def kv_usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def cached_block_hashes(self) -> set[int]:
        """Ground truth: the 64-bit hashes of every block now in the prefix cache."""
        return {self._external(k) for k in self._cached}

    def take_pending_events(self) -> list[KvCacheEventT]:
        events, self._pending_events = self._pending_events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache (``AllBlocksCleared``); refused while blocks are in use."""
        if any(self._ref):
            return False
        self._cached.clear()
        self._key = [None] * self.num_blocks
        if self.emit_events:
            self._pending_events.append(AllBlocksCleared())
        return True

    # ----------------------------------------------------------------- PD

    @staticmethod
    def prompt_digest(prompt_token_ids: list[int]) -> int:
        """A fingerprint of a prompt, so a consumer can prove it pulls the KV of the same prompt."""
        return xxhash.xxh64_intdigest(_tuple_hash(prompt_token_ids))

    def take_transfer(self, transfer_id: str, now: float, *, num_tokens: int | None = None,
                      prompt_digest: int | None = None) -> Transfer:
        """A consumer pulls pinned blocks: validates and releases them (raises TransferError)."""
        t = self.transfers.get(transfer_id)
        if t is None:
            raise TransferError(f"unknown KV transfer {transfer_id!r} (never prefilled here or already pulled)")
        if now > t.expires_at:
            self._release_transfer(t)
            raise TransferError(f"KV transfer {transfer_id!r} expired")
        if num_tokens is not None and num_tokens != t.num_tokens:
            raise TransferError(f"KV transfer {transfer_id!r} holds {t.num_tokens} tokens, not {num_tokens}")
        if prompt_digest is not None and prompt_digest != t.prompt_digest:
            raise TransferError(f"KV transfer {transfer_id!r} was computed for a different prompt")
        self._release_transfer(t)
        return t

    def transfer_time(self, num_tokens: int) -> float:
        """Pulling ``num_tokens`` of KV: whole paged blocks move (the last one partly filled), at the
        connector link's bandwidth (``kv_link_gbps`` or the hardware profile's), plus its latency."""
        blocks = -(-num_tokens // self.block_size)
        return self._link_latency + blocks * self.block_size * self.kv_bytes_per_token / self._link_bw

    def _release_transfer(self, t: Transfer) -> None:
        if self.transfers.pop(t.transfer_id, None) is not None:
            self._free_blocks(t.block_ids)

    # ----------------------------------------------------------------- blocks

    @staticmethod
    def _external(key: Hashable) -> int:
        if isinstance(key, bytes):
            return to_external(key)
        if isinstance(key, int):
            return key & _U64
        return hash(key) & _U64

    def _allocate(self, n: int, out: list[int], events: list[KvCacheEventT] | None) -> None:
        """Take ``n`` blocks from the LRU end of the free queue, evicting cached ones."""
        free, keys, ref, cached = self._free, self._key, self._ref, self._cached
        removed = []
        for _ in range(n):
            bid, _ = free.popitem(last=False)
            key = keys[bid]
            if key is not None:
                if cached.get(key) == bid:
                    del cached[key]
                    removed.append(key)
                keys[bid] = None
            ref[bid] = 1
            out.append(bid)
        if removed and events is not None:
            events.append(block_removed([self._external(k) for k in removed]))

    def _free_blocks(self, block_ids: list[int]) -> None:
        ref, free = self._ref, self._free
        for bid in reversed(block_ids):
            ref[bid] -= 1
            if ref[bid] == 0:
                free[bid] = None

    def _touch(self, block_ids: list[int]) -> None:
        ref, free = self._ref, self._free
        for bid in block_ids:
            if ref[bid] == 0:
                del free[bid]
            ref[bid] += 1

    def _match_prefix(self, req: Request) -> list[int]:
        """Blocks of the longest cached prefix (stops at the first miss, as vLLM does)."""
        cached = self._cached
        limit = (req.num_tokens - 1) // self.block_size
        return list(map(cached.__getitem__, takewhile(cached.__contains__, islice(req.keys, limit))))

    def _tokens(self, req: Request, a: int, b: int) -> list[int]:
        if req.prompt is None:
            return []
        p = req.prompt_len
        if b <= p:
            return req.prompt[a:b]
        if a >= p:
            return req.output[a - p:b - p]
        return req.prompt[a:] + req.output[:b - p]

    def _cache_full_blocks(self, req: Request, events: list[KvCacheEventT] | None) -> None:
        bs = self.block_size
        full = min(req.num_computed // bs, len(req.blocks))
        start = req.num_cached_blocks
        if full <= start:
            return
        keys = req.keys
        done = full
        if req.prompt is None:  # token-less: only the caller's keys are cacheable
            full = min(full, len(keys))
            if full <= start:
                req.num_cached_blocks = done
                return
        while len(keys) < full:  # blocks of generated tokens (or of a resumed request)
            i = len(keys)
            keys.append(self.hasher.hash_block(keys[-1] if i else None, self._tokens(req, i * bs, (i + 1) * bs),
                                               self.hasher.salt_key(req.cache_salt) if i == 0 and req.cache_salt else None))
        cached, key_of, blocks = self._cached, self._key, req.blocks
        run_start = -1
        for i in range(start, full + 1):
            new = False
            if i < full:
                bid = blocks[i]
                key = keys[i]
                if key_of[bid] is None and key not in cached:
                    cached[key] = bid
                    key_of[bid] = key
                    new = True
            if new:
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                if events is not None:
                    ext = self._external
                    extra = {}
                    if run_start == 0 and req.cache_salt:  # vLLM publishes the salt with the first block
                        extra["extra_keys"] = event_extra_keys(
                            [self.hasher.salt_key(req.cache_salt)] + [None] * (i - 1), self.hasher.style)
                    events.append(block_stored(
                        [ext(k) for k in keys[run_start:i]],
                        ext(keys[run_start - 1]) if run_start else None,
                        self._tokens(req, run_start * bs, i * bs), bs, **extra))
                run_start = -1
        req.num_cached_blocks = done

    # ----------------------------------------------------------------- scheduling

    def _preempt(self, req: Request) -> None:
        self._free_blocks(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.num_preemptions += 1
        req.remote = None  # its pulled KV is gone: a resumed consumer recomputes locally, as vLLM would
        req.remote_ready = None
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _expire_transfers(self, now: float) -> None:
        if self.transfers:
            for t in [t for t in self.transfers.values() if t.expires_at < now]:
                self._release_transfer(t)

    def step_time(self, scheduled: list[tuple[Request, int]]) -> float:
        """Roofline: max(compute, memory) + overhead, times the slow-down factor."""
        new = ctx_reads = 0
        attn = 0.0
        for req, n in scheduled:
            c = req.num_computed
            new += n
            attn += n * (c + n / 2)
            ctx_reads += c + n
        compute = (self._flops_per_token * new + self._attn_flops * attn) / self._flops
        memory = (self._weight_bytes + self.kv_bytes_per_token * ctx_reads) / self._bw
        return (self._overhead + max(compute, memory)) * self.slow_factor

    def _finish(self, req: Request, out: RequestOutput, end: float, result: StepResult) -> None:
        req.finished, req.finish_reason = True, "length"
        out.finished, out.finish_reason = True, "length"
        result.e2e.append(end - req.arrival)
        self.stats.requests_finished += 1
        del self._requests[req.request_id]
        if req.do_remote_decode:
            digest = req.out_seed if req.prompt is None else self.prompt_digest(req.prompt)
            t = Transfer(req.transfer_id or req.request_id, req.blocks, req.prompt_len, digest,
                         end + self.config.kv_transfer_timeout_s)
            old = self.transfers.pop(t.transfer_id, None)
            if old is not None:
                self._free_blocks(old.block_ids)
            self.transfers[t.transfer_id] = t
            out.kv_transfer = t
        else:
            self._free_blocks(req.blocks)
        req.blocks = []

    def step(self, now: float, horizon: float | None = None) -> StepResult:
        """Run one scheduler step starting at virtual time ``now``.

        With ``horizon`` (the next time the caller will add a request), a batch where every
        request is decoding is advanced through all the steps that start before ``horizon`` in
        one call: same tokens and timings as single steps, but the KV events of those steps come
        as one list, ``itl`` holds every token's latency, and with ``stream_outputs`` each
        request gets one output with all its new tokens (``time``: when its last one came).
        The HTTP server never passes it.
        """
        if horizon is not None:
            res = self._decode_run(now, horizon)
            if res is not None:
                return res
        return self._step(now)

    def _decode_run(self, now: float, horizon: float) -> StepResult | None:
        running = self.running
        if not running or self.waiting or self.remote_waiting or self._pending_events:
            return None
        B = len(running)
        if B > self.config.max_num_batched_tokens:
            return None
        for r in running:
            if r.num_computed != r.num_tokens - 1 or r.last_token_time is None:
                return None  # prefilling, or a PD consumer that has not produced its first token
        rem = [r.max_tokens - len(r.output) for r in running]
        order = sorted(range(B), key=rem.__getitem__)
        ctx = [r.num_computed for r in running]
        fpt, attn, F = self._flops_per_token, self._attn_flops, self._flops
        W, kvb, BW = self._weight_bytes, self.kv_bytes_per_token, self._bw
        over, slow = self._overhead, self.slow_factor
        S = float(sum(ctx))
        active = B
        durs: list[float] = []
        t = now
        idx = 0
        j = 0
        while True:
            compute = (fpt * active + attn * (S + 0.5 * active)) / F
            memory = (W + kvb * (S + active)) / BW
            d = (over + (compute if compute > memory else memory)) * slow
            durs.append(d)
            t += d
            j += 1
            while idx < B and rem[order[idx]] == j:
                S -= ctx[order[idx]] + j - 1
                active -= 1
                idx += 1
            if active == 0 or t >= horizon:
                break
            S += active
        k = j
        if k == 1:
            return None  # nothing to gain: a normal step
        bs = self.block_size
        steps = [k if x > k else x for x in rem]
        needs = [-(-(ctx[i] + steps[i]) // bs) - len(running[i].blocks) for i in range(B)]
        if sum(n for n in needs if n > 0) > len(self._free):
            return None
        events: list[KvCacheEventT] | None = [] if self.emit_events else None
        for i in range(B):
            if needs[i] > 0:
                self._allocate(needs[i], running[i].blocks, events)
        ends = []
        acc = now
        for d in durs:
            acc += d
            ends.append(acc)
        result = StepResult(now, acc - now, [], [])
        itl = result.itl
        span = self._span
        caching = self.config.enable_prefix_caching
        xxh = xxhash.xxh64_intdigest
        total = 0
        stream = self.stream_outputs
        streamed: dict[int, RequestOutput] = {}
        for i, r in enumerate(running):
            s_i = steps[i]
            base = len(r.output)
            seed = r.out_seed
            if r.prompt is None:
                new = [TOKENLESS_OUTPUT_ID] * s_i
            else:
                new = [RESERVED_TOKEN_IDS + xxh((base + x).to_bytes(4, "little"), seed=seed) % span for x in range(s_i)]
            r.output.extend(new)
            if stream:
                streamed[i] = RequestOutput(r.request_id, new, False, None, r.prompt_len,
                                            r.num_cached_tokens if r.num_cached_tokens > 0 else 0,
                                            base + s_i, None, ends[s_i - 1])
            r.num_tokens += s_i
            r.num_computed += s_i
            total += s_i
            if caching and r.num_computed // bs > r.num_cached_blocks:
                self._cache_full_blocks(r, events)
            itl.append(ends[0] - r.last_token_time)
            if s_i > 1:
                itl.extend(durs[1:s_i])
            r.last_token_time = ends[s_i - 1]
        # finishes in time order (ties in batch order), as consecutive steps would free them
        finished = [i for i in order if steps[i] == rem[i]]
        finished.sort(key=lambda i: (steps[i], i))
        for i in finished:
            r = running[i]
            out = streamed.pop(i) if stream else RequestOutput(
                r.request_id, list(r.output), False, None, r.prompt_len,
                r.num_cached_tokens if r.num_cached_tokens > 0 else 0, len(r.output), None, ends[steps[i] - 1])
            self._finish(r, out, ends[steps[i] - 1], result)
            result.outputs.append(out)
        if stream:
            result.outputs.extend(streamed.values())
        if finished:
            self.running = [r for r in running if not r.finished]
        st = self.stats
        st.generation_tokens += total
        st.steps += k
        st.busy_time += acc - now
        result.num_scheduled_tokens = total
        result.num_decode_reqs = B
        if events:
            result.events = events
        return result

    def _step(self, now: float) -> StepResult:
        cfg = self.config
        bs = self.block_size
        self._expire_transfers(now)
        events: list[KvCacheEventT] | None = self._pending_events if self.emit_events else None
        self._pending_events = []
        scheduled: list[tuple[Request, int]] = []
        budget = cfg.max_num_batched_tokens
        chunked = cfg.enable_chunked_prefill
        result = StepResult(now, 0.0, [], [])

        # consumers whose KV arrived become decodes (one token to compute: the last prompt token)
        if self.remote_waiting:
            still = []
            for req in self.remote_waiting:
                if req.remote_ready is not None and req.remote_ready <= now:
                    req.num_computed = req.prompt_len - 1
                    req.num_cached_tokens = req.num_computed
                    self._cache_full_blocks(req, events)
                    self.running.append(req)
                else:
                    still.append(req)
            self.remote_waiting = still

        # running requests first, preempting from the tail when blocks run out
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
            upto = req.num_computed + n
            if upto <= len(req.blocks) * bs:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            need = -(-upto // bs) - len(req.blocks)
            self_preempted = False
            while need > len(self._free):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    self_preempted = True
                    break
            if self_preempted:
                break
            if need > 0:
                self._allocate(need, req.blocks, events)
            scheduled.append((req, n))
            budget -= n
            i += 1

        # then admit waiting requests
        if not preempted:
            max_seqs = cfg.max_num_seqs
            waiting = self.waiting
            while waiting and budget > 0 and len(running) + len(self.remote_waiting) < max_seqs:
                req = waiting[0]
                hits = self._match_prefix(req) if cfg.enable_prefix_caching else []
                computed = len(hits) * bs
                if req.remote is not None:
                    n = 0
                    need = -(-req.prompt_len // bs) - len(hits)
                else:
                    n = req.num_tokens - computed
                    if n > budget:
                        if not chunked:
                            break
                        n = budget
                    need = -(-(computed + n) // bs) - len(hits)
                ref = self._ref
                free_hits = sum(1 for b in hits if ref[b] == 0)
                if need > len(self._free) - free_hits:
                    break
                waiting.popleft()
                self._touch(hits)
                req.blocks = hits
                if need > 0:
                    self._allocate(need, req.blocks, events)
                req.num_computed = computed
                req.num_cached_blocks = computed // bs
                if req.first_scheduled is None:
                    req.first_scheduled = now
                    result.queue_time.append(now - req.arrival)
                if req.num_cached_tokens < 0 and req.remote is None:
                    req.num_cached_tokens = computed
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += computed
                if req.remote is not None:
                    remote_tokens = req.prompt_len - computed
                    req.remote_ready = now + self.transfer_time(remote_tokens)
                    self.remote_waiting.append(req)
                    continue
                running.append(req)
                scheduled.append((req, n))
                budget -= n

        if not scheduled:
            wake = [r.remote_ready for r in self.remote_waiting if r.remote_ready is not None]
            if self.transfers and self.waiting:
                wake.append(min(t.expires_at for t in self.transfers.values()))
            result.next_wakeup = min(wake) if wake else None
            if events:
                result.events = events
            return result

        duration = self.step_time(scheduled)
        end = now + duration
        result.duration = duration
        stats = self.stats
        stats.steps += 1
        stats.busy_time += duration
        outputs = result.outputs
        any_finished = False
        caching = cfg.enable_prefix_caching
        span = self._span
        ttft, itl = result.ttft, result.itl
        n_prefill = n_decode = n_sched = n_tokens = 0
        stream = self.stream_outputs
        for req, n in scheduled:
            prompt_len = req.prompt_len
            if req.num_computed < prompt_len:
                n_prefill += n
            else:
                n_decode += 1
            n_sched += n
            computed = req.num_computed = req.num_computed + n
            if caching and computed // bs > req.num_cached_blocks:
                self._cache_full_blocks(req, events)
            if computed < req.num_tokens:
                continue  # a chunk of a longer prefill: no token yet
            output = req.output
            if req.prompt is None:
                tok = TOKENLESS_OUTPUT_ID
            else:
                tok = RESERVED_TOKEN_IDS + xxhash.xxh64_intdigest(len(output).to_bytes(4, "little"),
                                                                  seed=req.out_seed) % span
            output.append(tok)
            req.num_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = end
                ttft.append(end - req.arrival)
                stats.prompt_tokens += prompt_len
            else:
                itl.append(end - req.last_token_time)
            req.last_token_time = end
            n_tokens += 1
            finishing = len(output) >= req.max_tokens or req.do_remote_decode
            if stream:
                out = RequestOutput(req.request_id, [tok], False, None, prompt_len,
                                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0, len(output), None, end)
            elif finishing:
                out = RequestOutput(req.request_id, list(output), False, None, prompt_len,
                                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0, len(output), None, end)
            else:
                continue
            if finishing:
                any_finished = True
                self._finish(req, out, end, result)
            outputs.append(out)
        stats.generation_tokens += n_tokens
        result.num_prefill_tokens = n_prefill
        result.num_decode_reqs = n_decode
        result.num_scheduled_tokens = n_sched
        if any_finished:
            self.running = [r for r in running if not r.finished]
        if events:
            result.events = events
        return result

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "engine_id": cfg.engine_id, "model": cfg.served_model_name, "hardware": cfg.hardware,
            "model_profile": cfg.model_profile, "block_size": self.block_size, "num_gpu_blocks": self.num_blocks,
            "role": cfg.role,
        }
