"""The ``indexer`` settings section, apart from the service so that loading the settings does
not import the service's libraries (numba, nats, numpy)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from schemas.config import key_lines


class IndexerConfig(BaseModel):
    """The ``indexer`` settings section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durable: str = Field(default="kv-indexer", pattern=r"^[A-Za-z0-9_-]+$",
                         description="durable consumer name; one per indexer instance")
    http_host: str = Field(default="127.0.0.1", description="address the HTTP API binds (0.0.0.0 / :: for all)")
    api_keys: list[SecretStr] = Field(default_factory=list, description=(
        "when set, /v1/ requests need 'Authorization: Bearer <key>' (the router's scheme); /health and "
        "/metrics stay open"))
    api_keys_file: Path | None = Field(default=None, description="one key per line (# comments)")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    header_timeout_s: float = Field(default=10.0, gt=0, description="a request head must arrive within this")
    body_timeout_s: float = Field(default=30.0, gt=0, description="a request body must arrive within this (408)")
    max_route_ttl_s: float = Field(default=600.0, gt=0, description="longest ttl_s POST /v1/index/route accepts")
    http_port: int | None = Field(default=8090, ge=0, le=65535, description="0 = a free port; null = no HTTP")
    nats_query: bool = Field(default=True, description="answer kv.index.query requests")
    snapshot_bucket: str = Field(default="kv-index-snapshots", pattern=r"^[A-Za-z0-9_-]+$")
    snapshot_every_events: int = Field(default=20_000, ge=1)
    snapshot_every_s: float = Field(default=30.0, gt=0)
    snapshot_on_stop: bool = True
    snapshot_timeout_s: float = Field(default=10.0, gt=0, description=(
        "longest a snapshot write (or the snapshot read and bucket lookup at start) may take; past it "
        "the snapshot is abandoned (the next one retries) or, at start, the stream is replayed"))
    snapshot_fork: bool = Field(default=True, description="encode snapshots in a forked child (copy-on-write), "
                                "so consumption pauses only for the fork; off or without os.fork: a thread")
    pod_timeout_s: float | None = Field(default=60.0, gt=0, description=(
        "a pod that has sent nothing for this long (no batch, no bridge heartbeat: bridges send one every "
        "10 s while the engine is quiet) is left out of answers until it sends again; null = never"))
    reorder_window_s: float = Field(default=10.0, ge=0, description=(
        "a batch that skips its pod's sequence waits this long for the missing ones (a publisher's retry "
        "after a broker restart can store them later), then the gap is accepted; 0 = apply at once. A missing "
        "batch that was dead-lettered (its position in the message's headers) is waited for 1 s at most"))
    predicted_ttl_s: float = Field(default=120.0, gt=0)
    predict_on_route_ttl_s: float = Field(default=2.0, gt=0)
    tier_weights: dict[str, float] = Field(default_factory=dict)
    default_block_size: int | None = Field(default=None, gt=0,
                                           description="block size for models without KV events (approximate mode)")
    tokenizer: str | None = Field(default=None, description="tokenizer spec for prompt/messages queries")
    reserve_blocks: int = Field(default=0, ge=0, description=(
        "size each model's tables for this many blocks (all engines and tiers together) when the model "
        "first appears, so they do not grow (a rehash of the whole table, stalling ingest and queries: "
        "0.1 s at 0.6M blocks, 0.4 s at 2.5M) while the engines fill their caches; about 70-140 bytes a block (the tables are kept at most 60% full, in powers of two)"))
    fetch_batch: int = Field(default=512, ge=1, description="most batches folded in one apply_many call")
    max_ack_pending: int = Field(default=8192, ge=16, description="messages the server may have unacked in flight")
    ack_wait_s: float = Field(default=30.0, gt=0)

    def load_api_keys(self) -> list[str]:
        """The configured keys, inline and from ``api_keys_file`` (never logged)."""
        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_keys_file is not None:
            try:
                text = self.api_keys_file.read_text()
            except OSError as exc:
                raise ValueError(f"api_keys_file {self.api_keys_file}: {exc.strerror}") from None
            keys += key_lines(text)
        return keys
