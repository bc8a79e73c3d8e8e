"""Plain data the routing decision reads and returns. No I/O, no asyncio.

``BackendState`` is a snapshot of one engine as the router sees it (identity from discovery,
load from the engine-metrics fold, health from diagnoses, in-flight counts from the router
itself). ``RoutingRequest`` is what the strategy needs to know about a request. ``Decision`` is
what :meth:`router.core.Router.decide` returns: per stage, every candidate with each plugin's
score, the pick and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from schemas.records import CandidateScore

ROLES = ("aggregated", "prefill", "decode")


@dataclass(slots=True)
class BackendState:
    pod: str
    url: str
    model: str
    role: str = "aggregated"
    group: str | None = None
    pool: str = "default"
    loras: frozenset[str] = frozenset()
    node: str | None = None
    # load, from the engine.metrics fold
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None
    cpu_util: float | None = None
    mem_util: float | None = None
    # the router's own bookkeeping
    inflight: int = 0
    active_tokens: int = 0
    pending_prefill_tokens: int = 0
    # admission: the configured cap, or the engine's announced max_num_seqs
    max_inflight: int | None = None
    max_num_seqs: int | None = None
    # health
    health: str = "ok"  # ok | warning | critical
    circuit_open: bool = False
    circuit_until: float = 0.0  # while circuit_open: when the breaker's cooldown ends (earlier: failed longer ago)
    draining: bool = False
    source: str = "static"

    def public(self) -> dict[str, Any]:
        return {
            "pod": self.pod, "url": self.url, "model": self.model, "role": self.role, "group": self.group,
            "pool": self.pool, "loras": sorted(self.loras), "node": self.node, "waiting": self.waiting,
            "running": self.running, "kv_usage": self.kv_usage, "inflight": self.inflight,
            "active_tokens": self.active_tokens, "pending_prefill_tokens": self.pending_prefill_tokens,
            "health": self.health, "circuit_open": self.circuit_open, "draining": self.draining,
            "source": self.source,
        }


@dataclass(slots=True)
class RoutingRequest:
    model: str
    request_id: str = ""
    token_ids: Sequence[int] | None = None
    keys: Sequence[int] | None = None  # approximate block keys when there are no token ids
    prompt_tokens: int = 0
    max_tokens: int | None = None
    lora: str | None = None  # the LoRA adapter's name (vLLM keys cached blocks by it)
    cache_salt: str | None = None  # vLLM's per-request cache isolation salt (first block's extra key)
    index_model: str | None = None  # the base model whose KV index to read, when ``model`` is a LoRA adapter
    exclude: frozenset[str] = frozenset()  # pods already tried (retries, migration)
    # (block size, the whole prompt's block keys under its adapter and salt) when already hashed
    prompt_keys: tuple[int, Sequence[int]] | None = None
    # the prompt tokenized only in part (router.lazy_prompt): the keys of the text of each piece left
    # untokenized, remembered with the engine the request goes to
    piece_tail: Sequence[int] | None = None


class IndexView(Protocol):
    """What the decision needs from a KV index (``streams.kv_index.KvIndex`` satisfies it)."""

    def match_tokens(self, model: str, token_ids: Sequence[int], pods=None) -> dict: ...


@dataclass(slots=True)
class StageResult:
    """One scheduling stage: the candidates (columnar, cheap to build) and the pick."""

    stage: str  # aggregated | prefill | decode
    cands: list[BackendState]
    filtered: dict[str, str]  # pod -> filter that removed it
    columns: dict[str, list[float]]  # scorer name -> score per candidate
    totals: list[float]
    overlap: dict[str, int]  # pod -> cached prefix blocks
    picked: BackendState | None
    fail_reason: str = ""  # why nothing was picked
    picked_index: int = -1
    picker: str = ""
    request_blocks: int = 0
    predicted: dict[str, int] = field(default_factory=dict)  # pod -> of its overlap, blocks only predicted

    @property
    def reason(self) -> str:
        """Why this pick (built on demand: the hot path never formats it)."""
        if self.picked is None:
            return self.fail_reason
        i = self.picked_index
        parts = ", ".join(f"{k}={v[i]:.2f}" for k, v in self.columns.items())
        out = f"{self.picker} picked {self.picked.pod} of {len(self.cands)}: total {self.totals[i]:.3f}"
        if parts:
            out += f" ({parts})"
        if self.request_blocks:
            out += f"; overlap {self.overlap.get(self.picked.pod, 0)}/{self.request_blocks} blocks"
        return out

    @property
    def pods(self) -> list[str]:
        return [b.pod for b in self.cands]

    def candidate_dicts(self) -> list[dict[str, Any]]:
        """Every candidate as :class:`schemas.records.CandidateScore` fields (scores rounded to 1e-6),
        the filtered ones last. Plain dicts: validating them in one go is ~4x cheaper than a model each."""
        names = list(self.columns)
        cols = [self.columns[k] for k in names]
        totals = self.totals
        try:  # round(x * 1e6) / 1e6 is ~3x cheaper than round(x, 6); NaN or inf make it raise
            cols = [[round(x * 1e6) / 1e6 for x in c] for c in cols]
            totals = [round(t * 1e6) / 1e6 for t in totals]
        except (ValueError, OverflowError):
            cols = [[round(x, 6) for x in c] for c in cols]
            totals = [round(t, 6) for t in totals]
        rows = zip(*cols) if names else [()] * len(self.cands)
        get = self.overlap.get
        out = [{"pod": b.pod, "scores": dict(zip(names, r)), "total": t, "filtered_by": None,
                "overlap_blocks": get(b.pod, 0)} for b, r, t in zip(self.cands, rows, totals)]
        out.extend({"pod": p, "scores": {}, "total": 0.0, "filtered_by": f, "overlap_blocks": 0}
                   for p, f in self.filtered.items())
        return out

    def candidates(self) -> list[CandidateScore]:
        return [CandidateScore.model_validate(c) for c in self.candidate_dicts()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "picked": self.picked.pod if self.picked else None,
            "reason": self.reason,
            "candidates": self.candidate_dicts(),
        }


@dataclass(slots=True)
class Decision:
    profile: str
    status: str  # ok | busy | no_model | no_backend
    stages: list[StageResult] = field(default_factory=list)
    target: BackendState | None = None  # aggregated pick, or the decode pick for PD
    prefill: BackendState | None = None  # set when the request is disaggregated
    note: str = ""  # extra explanation (e.g. why remote prefill was skipped)
    request_blocks: int = 0
    block_size: int = 16
    best_overlap_blocks: int = 0
    chosen_overlap_blocks: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def reason(self) -> str:
        st = self.stages
        if not st:
            return self.note
        if len(st) == 1:
            r = st[0].reason
            return f"{st[0].stage}: {r}" if st[0].stage != "aggregated" else r
        pre, dcd = st[0], st[1]
        if self.status != "ok":
            bad = pre if pre.picked is None else dcd
            return f"{bad.stage}: {bad.reason}"
        if self.prefill is None:
            return self.note + dcd.reason
        return f"prefill: {pre.reason}; decode: {dcd.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "status": self.status,
            "picked": self.target.pod if self.target else None,
            "prefill": self.prefill.pod if self.prefill else None,
            "reason": self.reason,
            "request_blocks": self.request_blocks,
            "block_size": self.block_size,
            "best_overlap_blocks": self.best_overlap_blocks,
            "chosen_overlap_blocks": self.chosen_overlap_blocks,
            "stages": [s.to_dict() for s in self.stages],
        }
