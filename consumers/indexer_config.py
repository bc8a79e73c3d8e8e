"""The ``indexer`` settings section, apart from the service so that loading the settings does
not import the service's libraries (numba, nats, numpy)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IndexerConfig(BaseModel):
    """The ``indexer`` settings section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durable: str = Field(default="kv-indexer", pattern=r"^[A-Za-z0-9_-]+$",
                         description="durable consumer name; one per indexer instance")
    http_host: str = "127.0.0.1"
    http_port: int | None = Field(default=8090, ge=0, le=65535, description="0 = a free port; null = no HTTP")
    nats_query: bool = Field(default=True, description="answer kv.index.query requests")
    snapshot_bucket: str = Field(default="kv-index-snapshots", pattern=r"^[A-Za-z0-9_-]+$")
    snapshot_every_events: int = Field(default=20_000, ge=1)
    snapshot_every_s: float = Field(default=30.0, gt=0)
    snapshot_on_stop: bool = True
    snapshot_fork: bool = Field(default=True, description="encode snapshots in a forked child (copy-on-write), "
                                "so consumption pauses only for the fork; off or without os.fork: a thread")
    pod_timeout_s: float | None = Field(default=None, gt=0)
    predicted_ttl_s: float = Field(default=120.0, gt=0)
    predict_on_route_ttl_s: float = Field(default=2.0, gt=0)
    tier_weights: dict[str, float] = Field(default_factory=dict)
    default_block_size: int | None = Field(default=None, gt=0,
                                           description="block size for models without KV events (approximate mode)")
    tokenizer: str | None = Field(default=None, description="tokenizer spec for prompt/messages queries")
    fetch_batch: int = Field(default=512, ge=1, description="most batches folded in one apply_many call")
    max_ack_pending: int = Field(default=8192, ge=16, description="messages the server may have unacked in flight")
    ack_wait_s: float = Field(default=30.0, gt=0)
