"""Engine metric snapshots scraped from vLLM's ``/metrics``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.base import Event

Role = Literal["aggregated", "prefill", "decode"]


class HistogramSnapshot(BaseModel):
    """A Prometheus histogram at one instant: cumulative bucket counts by upper bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sum: float = Field(ge=0)
    count: float = Field(ge=0)
    buckets: dict[str, float] = Field(default_factory=dict, description="le -> cumulative count")


class EngineMetrics(Event):
    """One scrape of one engine (vLLM metric names, without the ``vllm:`` prefix)."""

    pod: str = Field(min_length=1)
    model: str = Field(min_length=1)
    engine: str = "0"
    role: Role = "aggregated"
    ts: float = Field(ge=0)
    num_requests_running: float = Field(ge=0)
    num_requests_waiting: float = Field(ge=0)
    kv_cache_usage_perc: float = Field(ge=0, le=1)
    prefix_cache_queries_total: float = Field(default=0, ge=0)
    prefix_cache_hits_total: float = Field(default=0, ge=0)
    prompt_tokens_total: float = Field(default=0, ge=0)
    generation_tokens_total: float = Field(default=0, ge=0)
    block_size: int | None = Field(default=None, gt=0)
    num_gpu_blocks: int | None = Field(default=None, ge=0)
    time_to_first_token_seconds: HistogramSnapshot | None = None
    inter_token_latency_seconds: HistogramSnapshot | None = None
    e2e_request_latency_seconds: HistogramSnapshot | None = None
    request_queue_time_seconds: HistogramSnapshot | None = None
