"""Seeded synthetic workloads in the Mooncake record format.

Each generator returns :class:`~simulator.workloads.trace.TraceRow` rows sorted by arrival;
the same arguments and seed give the same rows. Hash ids follow the trace convention: one
id per ``block_tokens`` block of the prompt, equal ids mean an equal prefix block. A block
that mixes shared and private tokens gets a fresh id, as a real block hash would.

Kinds:

- ``system-prompt``: a few shared system prompts (Zipf popularity) followed by a short
  private user message.
- ``chat``: multi-turn sessions; each turn's prompt is the whole conversation so far (an
  optional shared system prompt, earlier messages and answers), so it extends the previous
  turn's prompt exactly.
- ``doc-qa``: long documents (Zipf popularity) each asked many short questions.
- ``mixed``: the three together, interleaved in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from simulator.workloads.trace import TraceRow

KINDS = ("system-prompt", "chat", "doc-qa", "mixed")


@dataclass(frozen=True)
class WorkloadParams:
    """Knobs shared by the generators; lengths are token means (log-normal spread)."""

    n: int = 1000
    seed: int = 0
    rate_rps: float = 4.0
    block_tokens: int = 512
    # system-prompt
    system_prompts: int = 8
    system_tokens_mean: int = 3000
    user_tokens_mean: int = 400
    output_tokens_mean: int = 150
    zipf_s: float = 1.1
    # chat
    turns_mean: float = 4.0
    max_turns: int = 12
    think_time_s_mean: float = 20.0
    answer_tokens_mean: int = 250
    # doc-qa
    documents: int = 16
    document_tokens_mean: int = 12000
    question_tokens_mean: int = 80
    max_input_tokens: int = 64000

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must be >= 0")
        if self.rate_rps <= 0:
            raise ValueError("rate_rps must be > 0")
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be > 0")


class _Ids:
    """Allocates fresh hash ids."""

    def __init__(self, start: int = 0):
        self.next = start

    def take(self, k: int) -> list[int]:
        out = list(range(self.next, self.next + k))
        self.next += k
        return out


def _lognormal(rng: np.random.Generator, mean: float, sigma: float = 0.6, lo: int = 1,
               hi: int | None = None) -> int:
    mu = np.log(max(mean, 1.0)) - sigma * sigma / 2  # so that the mean is ``mean``
    v = int(round(float(rng.lognormal(mu, sigma))))
    v = max(lo, v)
    return min(v, hi) if hi is not None else v


def _zipf_weights(k: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, k + 1, dtype=float) ** s
    return w / w.sum()


def _arrivals_ms(rng: np.random.Generator, n: int, rate_rps: float) -> np.ndarray:
    gaps = rng.exponential(1000.0 / rate_rps, size=n)
    if n:
        gaps[0] = 0.0
    return np.cumsum(gaps)


def _prompt_ids(shared: list[int], shared_tokens: int, total_tokens: int, b: int, ids: _Ids) -> list[int]:
    """Hash ids of a prompt whose first ``shared_tokens`` tokens are the blocks ``shared``
    (a stream of ``b``-token blocks) and the rest private."""
    full_shared = min(shared_tokens, total_tokens) // b
    need = -(-total_tokens // b)
    return shared[:full_shared] + ids.take(need - full_shared)


def _row(ts_ms: float, input_len: int, output_len: int, hash_ids: list[int]) -> TraceRow:
    return TraceRow(timestamp=int(round(ts_ms)), input_length=input_len, output_length=output_len,
                    hash_ids=hash_ids)


def system_prompt(p: WorkloadParams, rng: np.random.Generator | None = None, ids: _Ids | None = None,
                  n: int | None = None) -> list[TraceRow]:
    rng = rng or np.random.default_rng(p.seed)
    ids = ids or _Ids()
    n = p.n if n is None else n
    b = p.block_tokens
    prompts = []
    for _ in range(p.system_prompts):
        tokens = _lognormal(rng, p.system_tokens_mean, 0.5, lo=b // 4, hi=p.max_input_tokens // 2)
        prompts.append((tokens, ids.take(-(-tokens // b))))
    weights = _zipf_weights(p.system_prompts, p.zipf_s)
    picks = rng.choice(p.system_prompts, size=n, p=weights)
    times = _arrivals_ms(rng, n, p.rate_rps)
    rows = []
    for ts, k in zip(times, picks):
        sys_tokens, sys_ids = prompts[int(k)]
        total = min(sys_tokens + _lognormal(rng, p.user_tokens_mean), p.max_input_tokens)
        rows.append(_row(ts, total, _lognormal(rng, p.output_tokens_mean, hi=4096),
                         _prompt_ids(sys_ids, sys_tokens, total, b, ids)))
    return rows


def chat(p: WorkloadParams, rng: np.random.Generator | None = None, ids: _Ids | None = None,
         n: int | None = None) -> list[TraceRow]:
    """Sessions arrive as a Poisson process sized so requests average ``rate_rps``."""
    rng = rng or np.random.default_rng(p.seed)
    ids = ids or _Ids()
    n = p.n if n is None else n
    b = p.block_tokens
    sys_prompts = []
    for _ in range(max(1, p.system_prompts // 4)):
        tokens = _lognormal(rng, p.system_tokens_mean / 3, 0.4, lo=16, hi=p.max_input_tokens // 4)
        # only full blocks are shared between sessions; the partial one mixes with the
        # session's first message and so belongs to the session
        sys_prompts.append((tokens, ids.take(tokens // b)))
    session_rate = p.rate_rps / max(p.turns_mean, 1.0)
    rows: list[TraceRow] = []
    t = 0.0
    horizon_ms = 1000.0 * n / p.rate_rps  # keep starting sessions until then, then keep the first n
    while n and (len(rows) < n or t < horizon_ms):
        ctx_tokens, sys_ids = sys_prompts[int(rng.integers(len(sys_prompts)))]
        ctx_ids = list(sys_ids)  # the session context as a stream of blocks, grown on demand
        turns = min(p.max_turns, int(rng.geometric(1.0 / max(p.turns_mean, 1.0))))
        ts = t
        for _ in range(turns):
            ctx_tokens = min(ctx_tokens + _lognormal(rng, p.user_tokens_mean), p.max_input_tokens)
            need = -(-ctx_tokens // b)
            ctx_ids += ids.take(need - len(ctx_ids))
            out = _lognormal(rng, p.answer_tokens_mean, hi=4096)
            rows.append(_row(ts, ctx_tokens, out, ctx_ids[:need]))
            if ctx_tokens >= p.max_input_tokens:
                break
            ctx_tokens = min(ctx_tokens + out, p.max_input_tokens)
            ts += float(rng.exponential(p.think_time_s_mean * 1000.0))
        t += float(rng.exponential(1000.0 / session_rate))
    rows.sort(key=lambda r: r.timestamp)
    return rows[:n]


def doc_qa(p: WorkloadParams, rng: np.random.Generator | None = None, ids: _Ids | None = None,
           n: int | None = None) -> list[TraceRow]:
    rng = rng or np.random.default_rng(p.seed)
    ids = ids or _Ids()
    n = p.n if n is None else n
    b = p.block_tokens
    docs = []
    for _ in range(p.documents):
        tokens = _lognormal(rng, p.document_tokens_mean, 0.5, lo=b, hi=p.max_input_tokens - 1024)
        docs.append((tokens, ids.take(-(-tokens // b))))
    weights = _zipf_weights(p.documents, p.zipf_s)
    picks = rng.choice(p.documents, size=n, p=weights)
    times = _arrivals_ms(rng, n, p.rate_rps)
    rows = []
    for ts, k in zip(times, picks):
        doc_tokens, doc_ids = docs[int(k)]
        total = min(doc_tokens + _lognormal(rng, p.question_tokens_mean, 0.5, lo=8), p.max_input_tokens)
        rows.append(_row(ts, total, _lognormal(rng, p.output_tokens_mean * 0.7, hi=2048),
                         _prompt_ids(doc_ids, doc_tokens, total, b, ids)))
    return rows


def mixed(p: WorkloadParams) -> list[TraceRow]:
    """The three kinds at a third of the rate each, one id space, merged by arrival."""
    rng = np.random.default_rng(p.seed)
    ids = _Ids()
    third = WorkloadParams(**{**p.__dict__, "rate_rps": p.rate_rps / 3})
    counts = [p.n // 3, p.n // 3, p.n - 2 * (p.n // 3)]
    rows = (system_prompt(third, rng, ids, counts[0]) + chat(third, rng, ids, counts[1])
            + doc_qa(third, rng, ids, counts[2]))
    rows.sort(key=lambda r: r.timestamp)
    return rows


_GENERATORS: dict[str, Callable[[WorkloadParams], list[TraceRow]]] = {
    "system-prompt": lambda p: system_prompt(p),
    "chat": lambda p: chat(p),
    "doc-qa": lambda p: doc_qa(p),
    "mixed": mixed,
}


def generate(kind: str, params: WorkloadParams | None = None, **overrides) -> list[TraceRow]:
    """Rows of a synthetic workload: ``generate("chat", n=1000, seed=1)``."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown workload kind {kind!r}; choose one of {', '.join(KINDS)}")
    p = params or WorkloadParams()
    if overrides:
        p = WorkloadParams(**{**p.__dict__, **overrides})
    return _GENERATORS[kind](p)
