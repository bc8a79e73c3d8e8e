"""Per-request rows and the summary of a run: TTFT, inter-token latency, end-to-end,
throughput, prefix cache hit rate, errors and (when rows name a backend) load spread.

Shared by the HTTP replay client and the what-if simulator, so both report the same figures
computed the same way. Times are seconds, relative to the start of the run.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "error", "timeout", "cancelled"]


class RequestResult(BaseModel):
    """What happened to one request."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, description="position in the replayed trace")
    request_id: str | None = None
    scheduled_s: float = Field(description="when the trace said it arrives (scaled), from run start")
    start_s: float | None = Field(default=None, description="when it was sent, from run start")
    end_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = Field(default_factory=list, description="gaps between streamed chunks after the first")
    e2e_s: float | None = None
    prompt_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    expected_output_tokens: int | None = None
    cached_tokens: int | None = Field(default=None, ge=0, description="usage.prompt_tokens_details.cached_tokens")
    status: Status = "ok"
    http_status: int | None = None
    error: str | None = None
    backend: str | None = Field(default=None, description="the engine that served it, when known")


def _pct(values: list[float] | np.ndarray, q: float) -> float | None:
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


class Summary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: int
    ok: int
    errors: int
    timeouts: int
    cancelled: int = 0
    duration_s: float
    throughput_rps: float | None
    output_tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    hit_rate: float | None = Field(description="cached / prompt tokens over ok requests that reported usage")
    usage_reported: int
    max_start_lag_s: float | None = Field(description="worst delay between scheduled and actual send")
    backends: dict[str, int] = Field(default_factory=dict)
    load_spread: float | None = Field(default=None, description="max/mean requests per backend")
    error_kinds: dict[str, int] = Field(default_factory=dict)


def summarize(rows: Iterable[RequestResult], duration_s: float | None = None) -> Summary:
    """Summary over rows. ``duration_s`` defaults to first send to last completion."""
    rows = list(rows)
    ok = [r for r in rows if r.status == "ok"]
    if duration_s is None:
        starts = [r.start_s for r in rows if r.start_s is not None]
        ends = [r.end_s for r in rows if r.end_s is not None]
        duration_s = (max(ends) - min(starts)) if starts and ends else 0.0
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt_rep = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    out_tokens = sum(r.output_tokens for r in ok)
    lags = [r.start_s - r.scheduled_s for r in rows if r.start_s is not None]
    backends = Counter(r.backend for r in ok if r.backend)
    spread = None
    if backends:
        counts = list(backends.values())
        spread = max(counts) / (sum(counts) / len(counts))
    kinds = Counter(_error_kind(r) for r in rows if r.status != "ok")
    return Summary(
        requests=len(rows),
        ok=len(ok),
        errors=sum(1 for r in rows if r.status == "error"),
        timeouts=sum(1 for r in rows if r.status == "timeout"),
        cancelled=sum(1 for r in rows if r.status == "cancelled"),
        duration_s=duration_s,
        throughput_rps=len(ok) / duration_s if duration_s > 0 else None,
        output_tokens_per_s=out_tokens / duration_s if duration_s > 0 else None,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90), ttft_p99_s=_pct(ttft, 99),
        ttft_mean_s=float(np.mean(ttft)) if ttft else None,
        itl_p50_s=_pct(itl, 50), itl_p99_s=_pct(itl, 99),
        e2e_p50_s=_pct(e2e, 50), e2e_p90_s=_pct(e2e, 90),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=out_tokens,
        cached_tokens=cached,
        hit_rate=cached / prompt_rep if prompt_rep else None,
        usage_reported=len(reported),
        max_start_lag_s=max(lags) if lags else None,
        backends=dict(sorted(backends.items())),
        load_spread=spread,
        error_kinds=dict(kinds),
    )


def _error_kind(r: RequestResult) -> str:
    if r.status in ("timeout", "cancelled"):
        return r.status
    if r.http_status and r.http_status >= 400:
        return f"http {r.http_status}"
    return (r.error or "error").split(":", 1)[0][:60]
