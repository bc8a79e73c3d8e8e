"""What the router publishes: a routing decision and a record per request."""

from __future__ import annotations

import binascii
import sys
from array import array
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from schemas.base import Event

RequestRole = Literal["aggregated", "pd"]
#: which engines served the request: ``pd`` prefill pod then decode pod; ``decode`` a PD pool's
#: decode pod alone (remote prefill skipped: it held the prefix); ``aggregated`` one engine did both
ServedStage = Literal["aggregated", "pd", "decode"]
RequestStatus = Literal["ok", "error", "cancelled", "rejected", "timeout"]


def pack_keys(keys: Any) -> str:
    """Block keys (unsigned 64-bit) in the compact wire form of ``DecisionInputs.prefix_keys``:
    base64 of their little-endian bytes, about half the size of the JSON integers and written
    without a Python int per key. ``keys``: a sequence of ints or a numpy integer array."""
    if hasattr(keys, "dtype") and hasattr(keys, "astype"):  # numpy, without importing it here
        raw = keys.astype("<u8", copy=False).tobytes()
    else:
        a = array("Q", keys)
        if sys.byteorder == "big":
            a.byteswap()
        raw = a.tobytes()
    return binascii.b2a_base64(raw, newline=False).decode("ascii")


def packed_bytes(text: str, field: str = "prefix_keys") -> bytes:
    """The little-endian key bytes of a :func:`pack_keys` string; ValueError (naming ``field``)
    when ``text`` is not that form."""
    try:
        raw = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{field}: not base64 ({exc})") from None
    if len(raw) % 8:
        raise ValueError(f"{field}: {len(raw)} bytes of base64 is not a whole number of 8-byte keys")
    return raw


def unpack_keys(text: str) -> list[int]:
    """The keys of :func:`pack_keys`; ValueError when ``text`` is not that form."""
    raw = packed_bytes(text)
    a = array("Q")
    a.frombytes(raw)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


class CandidateScore(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pod: str
    scores: dict[str, float] = Field(default_factory=dict, description="scorer name -> score in [0,1]")
    total: float = 0.0
    filtered_by: str | None = Field(default=None, description="the filter that removed it, if any")
    overlap_blocks: int = 0


class BackendInput(BaseModel):
    """One backend as the router's snapshot held it when it decided: every field a filter or
    scorer reads (identity, load, device utilisation, the router's own in-flight counters, health)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pod: str
    model: str
    role: str = "aggregated"
    group: str | None = None
    pool: str = "default"
    loras: list[str] = Field(default_factory=list)
    node: str | None = None
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None
    cpu_util: float | None = Field(default=None, description="device utilisation in [0,1] (health cpu term)")
    mem_util: float | None = Field(default=None, description="device memory use in [0,1] (health mem term)")
    inflight: int = 0
    active_tokens: int = 0
    pending_prefill_tokens: int = 0
    health: str = "ok"
    circuit_open: bool = False
    draining: bool = False


class DecisionInputs(BaseModel):
    """Everything ``Router.decide`` read for one request, so replay re-runs it exactly: the
    strategy's settings (plugins, parameters, weights), the request's routing fields, the prefix
    overlap per pod read from the KV index, and every backend of the snapshot in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    now: float
    strategy: dict[str, Any] = Field(description="the strategy as an EndpointPickerConfig mapping")
    prompt_tokens: int = 0
    max_tokens: int | None = None
    lora: str | None = None
    cache_salt_set: bool = Field(default=False, description="the request carried a cache_salt (not recorded)")
    index_model: str | None = None
    exclude: list[str] = Field(default_factory=list)
    block_size: int = 16
    overlap: dict[str, int] = Field(default_factory=dict, description="pod -> reusable prefix blocks (KV index)")
    predicted: dict[str, int] = Field(default_factory=dict, description="pod -> of its overlap, the blocks "
                                      "only predicted from the router's own routing (approximate prefix mode)")
    prefix_keys: list[int] | None = Field(default=None, description="the prompt's block keys (to read the index), "
                                          "as far as the router tokenized it (router.tokenize_lazily: past every "
                                          "engine's match, new text is left untokenized); on the wire also as a string: base64 of the keys' little-endian "
                                          "uint64 bytes (schemas.records.pack_keys), the form the router writes",
                                          json_schema_extra={"anyOf": [
                                              {"type": "array", "items": {"type": "integer"}},
                                              {"type": "string", "contentEncoding": "base64"},
                                              {"type": "null"}]})
    key_scheme: int | None = Field(default=None, description="the block-key function prefix_keys were made with "
                                   "(streams.kv_keys.KEY_SCHEME); absent: a router from before the field, whose keys "
                                   "an index folded today does not share")
    backends: list[BackendInput] = Field(default_factory=list, description="on the wire also the compact form "
                                         "{columns: [field, ...], rows: [[value, ...], ...]}")

    @field_validator("prefix_keys", mode="before")
    @classmethod
    def _packed(cls, v: Any) -> Any:
        return unpack_keys(v) if isinstance(v, str) else v

    @field_validator("backends", mode="before")
    @classmethod
    def _columnar(cls, v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"columns", "rows"}:
            cols = v["columns"]
            if not isinstance(cols, list) or not isinstance(v["rows"], list):
                raise ValueError("backends: columns and rows must be lists")
            return [dict(zip(cols, r)) for r in v["rows"]]
        return v


class RoutingDecision(Event):
    request_id: str = Field(min_length=1)
    ts: float = Field(ge=0)
    pool: str = Field(min_length=1)
    model: str
    profile: str
    stage: Literal["aggregated", "prefill", "decode"] = "aggregated"
    picked: str | None
    reason: str = ""
    candidates: list[CandidateScore] = Field(default_factory=list)
    inputs: DecisionInputs | None = Field(default=None, description="what the decision read (first stage only)")


class RequestRecord(Event):
    request_id: str = Field(min_length=1)
    ts: float = Field(ge=0, description="arrival time at the router, seconds since the epoch")
    pool: str = Field(min_length=1)
    role: RequestRole = "aggregated"
    model: str
    profile: str = ""
    pods: list[str] = Field(default_factory=list, description="chosen pods, prefill first for PD")
    prefill_pod: str | None = None
    decode_pod: str | None = None
    prompt_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    ttft_s: float | None = Field(default=None, ge=0)
    itl_s: float | None = Field(default=None, ge=0, description="mean inter-token latency")
    e2e_s: float | None = Field(default=None, ge=0)
    status: RequestStatus = "ok"
    http_status: int = 200
    error: str | None = None
    best_overlap_blocks: int = Field(default=0, ge=0)
    chosen_overlap_blocks: int = Field(default=0, ge=0)
    retries: int = Field(default=0, ge=0)
    migrations: int = Field(default=0, ge=0)
    stream: bool = False
    served_stage: ServedStage = "aggregated"
    prefill_ttft_s: float | None = Field(default=None, ge=0, description="PD: the prefill stage's time to its "
                                                                          "token (prefill pod TTFT)")
    kv_transfer_s: float | None = Field(default=None, ge=0, description="PD: from the prefill's answer to the "
                                        "decode's first token (KV pull plus one decode step; an upper bound)")
    tpot_s: float | None = Field(default=None, ge=0, description="time per output token after the first: "
                                 "(e2e - TTFT) / (output tokens - 1)")
    queue_s: float | None = Field(default=None, ge=0, description="time the request waited in the router's "
                                  "admission queue for a backend slot")
    router_s: float | None = Field(default=None, ge=0, description="the router's own time before the request "
                                   "reached an engine: from its body read to its first send (parsing, tokenizing, "
                                   "the routing decision), the admission queue's wait left out; None when no "
                                   "engine was sent it")


class _PackedKeys(BaseModel):
    """Fields ``keys`` and ``pieces`` (where a subclass has them) hold packed keys
    (:func:`pack_keys`): checked to decode when the message is read."""

    @field_validator("keys", "pieces", check_fields=False)
    @classmethod
    def _packed_keys(cls, v: str | None, info) -> str | None:
        if v is not None:
            packed_bytes(v, info.field_name)
        return v


class RoutedPrompt(_PackedKeys):
    """A prompt a replica just sent to an engine: its block keys (packed, as
    :func:`pack_keys`), which the other replicas count as that engine's predicted blocks until
    its KV events can say so."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="the index model (a LoRA adapter's base)")
    pod: str = Field(min_length=1)
    keys: str = Field(description="base64 of the blocks' keys, little-endian uint64 (schemas.records.pack_keys)")
    pieces: str | None = Field(default=None, description="the prompt's text past those blocks, left untokenized "
                               "(router.lazy_prompt): base64 of a key per piece of it, little-endian uint64; "
                               "left out when there is none")


class ReplicaLoad(Event):
    """One router replica's own accounting per engine, for the other replicas of its pool: the
    requests it has in flight there, their prompt tokens, and their prompt tokens not yet
    prefilled. Sent on core NATS (``router.sync.<pool>``, not stored) when it changes and at
    least every second. The values are absolute, so a lost message is made good by the next; a
    replica that stops sends ``final`` and one that goes silent is dropped after a timeout."""

    replica: str = Field(min_length=1, max_length=256, description="the sending replica's id")
    pool: str = Field(min_length=1)
    seq: int = Field(ge=0, description="the sender's message counter (an older message is ignored)")
    ts: float = Field(ge=0)
    pods: dict[str, tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt]] = Field(
        default_factory=dict, description="pod -> [requests in flight, their prompt tokens, prompt tokens not yet "
                                          "prefilled]; a pod left out has none")
    routes: list[RoutedPrompt] = Field(default_factory=list, max_length=1024,
                                       description="prompts sent since the last message, for the others' "
                                                   "predicted blocks (kv-aware's approximate prefix mode)")
    final: bool = Field(default=False, description="the replica is stopping: forget its load now")

    def to_json(self) -> bytes:
        # a route without untokenized text leaves ``pieces`` out: readable by a replica from before the field
        return self.model_dump_json(exclude_none=True).encode()


class RouteEnd(_PackedKeys):
    """A routed prompt (:class:`RoutedPrompt`) that stops counting as predicted on its engine:
    ``settle``, its request is over there, so the routes of its untokenized text (``pieces``) end
    shortly (router.lazy_prompt.SETTLE_S after this arrives); ``forget``, it left the engine before
    its prefill ran there, so the blocks predicted for it (``keys``) end now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="the index model (a LoRA adapter's base)")
    pod: str = Field(min_length=1)
    kind: Literal["settle", "forget"]
    keys: str | None = Field(default=None, description="forget: base64 of the prompt's block keys, little-endian "
                             "uint64 (schemas.records.pack_keys)")
    pieces: str | None = Field(default=None, description="settle: base64 of the keys of the pieces of text the "
                               "prompt left untokenized (RoutedPrompt.pieces), little-endian uint64")

    @model_validator(mode="after")
    def _what_it_ends(self) -> RouteEnd:
        need = "pieces" if self.kind == "settle" else "keys"
        if getattr(self, need) is None:
            raise ValueError(f"a {self.kind} end needs {need}")
        return self


class RouteEnds(Event):
    """The ends of routes a router replica shared in its :class:`ReplicaLoad` messages, for the
    other replicas of its pool, which recorded those routes. Sent on core NATS
    (``router.sync.<pool>.ends``, not stored) at most once per sync interval, and only while the
    replica hears others. A subject of its own: a replica from before it neither receives nor has
    to decode it, and gets no ends, as before."""

    replica: str = Field(min_length=1, max_length=256, description="the sending replica's id")
    pool: str = Field(min_length=1)
    seq: int = Field(ge=0, description="the sender's message counter, shared with its ReplicaLoad messages")
    load_seq: int = Field(ge=0, description="the seq of the sender's last ReplicaLoad before this message: the "
                          "routes these ends refer to went out in it or earlier, and a receiver that has not seen "
                          "it yet holds the ends until it has (the two subjects are read apart)")
    ts: float = Field(ge=0)
    ends: list[RouteEnd] = Field(min_length=1, max_length=1024)

    def to_json(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()
