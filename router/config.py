"""The router's settings section (``router:`` in the settings file, ``INFERNEX_ROUTER__...``).

Example::

    router:
      pool: default
      strategy: kv-aware            # or pd-kv-aware, round-robin, ... or a strategy YAML file
      port: 8080
      tokenizer: auto               # or /models/qwen3/tokenizer.json, or simple (must match the engines)
      backends:                     # static; engines announced on NATS and Kubernetes pods join them
        - {pod: p0, url: "http://10.0.0.5:8000", model: Qwen/Qwen3-8B, role: prefill, group: g1}
        - {pod: d0, url: "http://10.0.0.6:8000", model: Qwen/Qwen3-8B, role: decode, group: g1}
      kubernetes: {enabled: true, namespace: ai-inference, label_selector: "openfuyao.com/engine=vllm"}
      api_keys_file: /etc/infernex/keys   # one key per line; admin_key for /v1/router/*
      rate_limit_rps: 20
      engine_api_key_file: /etc/infernex/engine-auth/engine-api-key   # engines run with --api-key
      admission:                    # caps from the router's own counts (see router.admission)
        max_inflight_per_backend: 64  # else a backend's max_inflight, else its announced max_num_seqs
        queue_size: 1024
        queue_timeout_s: 30           # then 503 + Retry-After
        max_inflight_per_key: 16      # then 429 + Retry-After
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from router.admission import AdmissionConfig
from router.pd_protocol import PdConnectorConfig
from schemas.config import key_lines


class _S(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticBackend(_S):
    pod: str = Field(min_length=1)
    url: str = Field(min_length=1, description="base URL of the engine's OpenAI server")
    model: str = Field(min_length=1)
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    group: str | None = None
    loras: list[str] = Field(default_factory=list)
    node: str | None = None
    api_key: SecretStr | None = Field(default=None, description="this engine's --api-key (else engine_api_key)")
    max_inflight: int | None = Field(default=None, gt=0, description="admission cap (else from max_num_seqs)")


class KubernetesDiscovery(_S):
    enabled: bool = False
    namespace: str = "default"
    label_selector: str = "openfuyao.com/engine=vllm"
    port: int = Field(default=8000, gt=0, le=65535)
    model_label: str = "openfuyao.com/model"
    role_labels: list[str] = Field(default_factory=lambda: ["openfuyao.com/pdRole", "llm-d.ai/role"])
    group_label: str = "openfuyao.com/pdGroupID"
    default_model: str | None = None


class RouterConfig(_S):
    pool: str = "default"
    strategy: str = Field(default="kv-aware", description="built-in strategy name or a strategy YAML file")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    epp_port: int | None = Field(default=None, ge=0, le=65535,
                                 description="also serve the GIE endpoint picker (Envoy ext_proc, gRPC) on this port")
    epp_fallbacks: int = Field(default=0, ge=0, le=8,
                               description="next-best endpoints the picker lists after its pick (proxy retries)")
    epp_ask_usage: bool = Field(
        default=True, description="the picker asks the engine for usage on a stream whose client did not (so its "
        "request record has token and cached-token counts) and takes the usage event out of the answer; only when "
        "the gateway relays response bodies in FULL_DUPLEX_STREAMED mode")
    backends: list[StaticBackend] = Field(default_factory=list)
    kubernetes: KubernetesDiscovery = Field(default_factory=KubernetesDiscovery)
    bus: bool = Field(default=True, description="discovery, load, health and KV state from NATS")
    tokenizer: str | None = Field(default="auto", description="'auto' (the model's tokenizer.json if on this "
                                  "machine, else the toy one), 'simple', a tokenizer.json path, or null")
    tokenizer_vocab_size: int = Field(default=32_000, gt=32, description="vocabulary of the 'simple' tokenizer")
    tokenizer_fast: bool = Field(
        default=True, description="encode with tiktoken's BPE a tokenizer.json that converts to it with the same ids "
        "(byte-level BPE, one regex split, merges in id order, checked on a sample at load; 4-6x less CPU: "
        "simulator/fast_bpe.py); false: always the tokenizers library")
    tokenize_threads: int = Field(
        default=2, ge=0, le=64,
        description="threads that tokenize long prompts with a tokenizer.json (whose encoder releases the GIL) "
                    "while the event loop serves other requests; 0: on the event loop. The toy tokenizer always "
                    "runs on the loop")
    tokenize_offload_bytes: int = Field(
        default=4096, ge=0,
        description="request bodies at least this large are tokenized on those threads (below, handing the work "
                    "over costs more than it frees)")
    tokenize_lazily: bool = Field(
        default=True, description="tokenize a long text prompt (with a tokenizer.json whose pieces are memoized) only "
        "as far as an engine may hold it: the engines' matches are the same, new text past them is not tokenized, "
        "and prompt_tokens is estimated for it (router/lazy_prompt.py)")
    block_size: int = Field(default=16, gt=0)
    route_prediction_ttl_s: float = Field(
        default=30.0, gt=0, description="strategies with an 'approximate' prefix scorer: how long a request's "
        "blocks count as cached on the engine it was routed to before that engine's KV events say so (cover "
        "the engine's queueing: its events come only once the prefill ran); a prediction ends sooner, as soon "
        "as the engine's events report that block")
    kv_snapshot: str | None = Field(
        default="kv-index-snapshots/kv-indexer",
        description="BUCKET/NAME of the indexer's snapshot object: the embedded KV index starts from it "
                    "and reads the KV stream from the sequence it covers (null: replay the whole stream)")
    kv_catchup_timeout_s: float = Field(
        default=60.0, ge=0,
        description="at start, readiness waits until the embedded KV index has read the KV stream's backlog (from the "
                    "snapshot, or the whole stream without one), at most this long (0: do not wait); until then its "
                    "prefix matches are those of a past moment")
    seed: int | None = None
    # resilience
    max_retries: int = Field(default=2, ge=0)
    max_migrations: int = Field(default=2, ge=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    read_timeout_s: float = Field(default=300.0, gt=0, description="longest silence from a backend")
    retry_after_s: int = Field(default=1, ge=1)
    breaker_failures: int = Field(default=3, ge=1)
    breaker_cooldown_s: float = Field(default=10.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    metrics_stale_s: float = Field(default=30.0, gt=0)
    # security
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_file: Path | None = Field(default=None, description="one key per line")
    admin_key: SecretStr | None = None
    engine_api_key: SecretStr | None = Field(default=None, description="sent as 'Authorization: Bearer' to engines")
    engine_api_key_file: Path | None = Field(default=None, description="the engine key in a file (a mounted Secret)")
    rate_limit_rps: float | None = Field(default=None, gt=0, description="per API key")
    rate_limit_burst: int = Field(default=20, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    request_timeout_s: float = Field(default=30.0, gt=0,
                                     description="a request must arrive whole within this long of its first byte (else 408)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    # records
    records: bool = True
    pd: PdConnectorConfig = Field(default_factory=PdConnectorConfig,
                                  description="the PD engines' KV connector (nixl, mooncake, mooncake_ascend)")
    records_buffer: int = Field(default=10_000, gt=0)
    replica_sync: bool = Field(default=True, description="share this replica's in-flight load per engine with the "
                               "other router replicas of its pool over NATS (router.sync.<pool>), and count theirs "
                               "(router/replica_sync.py); needs the bus")
    replica_sync_routes: bool = Field(default=True, description="with replica_sync: also share the prompts "
                                      "routed (their block keys), which the others count as predicted blocks")
    replica_sync_interval_s: float = Field(default=0.01, gt=0, le=1.0,
                                           description="at most this often a replica tells the others its load")
    replica_sync_expire_s: float = Field(default=3.0, gt=1.0,
                                         description="a replica not heard from for this long is forgotten")

    def load_engine_keys(self) -> tuple[str | None, dict[str, str]]:
        """(global ``Authorization`` value or None, per static backend pod -> value)."""
        key = self.engine_api_key.get_secret_value() if self.engine_api_key else None
        if self.engine_api_key_file is not None:
            try:
                key = self.engine_api_key_file.read_text().strip() or key
            except OSError as exc:
                raise ValueError(f"engine_api_key_file {self.engine_api_key_file}: {exc.strerror}") from None
        per = {b.pod: "Bearer " + b.api_key.get_secret_value() for b in self.backends if b.api_key is not None}
        return ("Bearer " + key if key else None), per

    def load_api_keys(self) -> list[str]:
        keys = [k.get_secret_value() for k in self.api_keys]
        if self.api_keys_file is not None:
            try:
                text = self.api_keys_file.read_text()
            except OSError as exc:
                raise ValueError(f"api_keys_file {self.api_keys_file}: {exc.strerror}") from None
            keys += key_lines(text)
        return keys
