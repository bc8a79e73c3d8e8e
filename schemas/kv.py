"""Normalized KV-cache events: one message per vLLM ``KVEventBatch``.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``; the bridge
adds ``PodReset`` (engine restarted, its sequence went back to 0) and discovery adds
``PodGone`` (pod deleted). Block hashes are the engine's, reduced to unsigned 64 bits
(vLLM sends the low 64 bits of its sha256 digests, or the digest bytes in newer
versions); token ids are exactly what the engine sent, so consumers can compute
their own hash-independent keys.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import re

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from schemas.base import Event

U64 = (1 << 64) - 1
MAX_EPOCH = (1 << 32) - 1  # engine incarnations a bridge can count; more is corrupt input
MAX_SEQ = (1 << 63) - 1  # vLLM's batch sequence is a signed 64-bit int
KNOWN_MEDIA = ("GPU", "CPU", "DISK", "LOCAL_FILE", "REMOTE", "STORAGE")
_MEDIUM_PATTERN = r"^[A-Z][A-Z0-9_]{0,31}$"
_MEDIUM_RE = re.compile(_MEDIUM_PATTERN)
Medium = Annotated[str, StringConstraints(pattern=_MEDIUM_PATTERN)]
"""The storage tier a block lives in, as the engine names it (vLLM: ``GPU``, ``CPU`` for
offloaded blocks, connectors' own names such as ``STORAGE``). Every name is a tier of its own;
an unknown one is never taken for ``GPU``."""


def normalize_medium(value: str | None) -> str | None:
    """An engine's medium name as a tier name (upper case); ValueError if it is not a name."""
    if value is None:
        return None
    up = value.upper()
    if not _MEDIUM_RE.match(up):
        raise ValueError(f"medium {value[:40]!r} is not a tier name")
    return up


def normalize_block_hash(value: int | bytes | str) -> int:
    """Reduce an engine block hash to an unsigned 64-bit int.

    ints (signed or unsigned) are masked; bytes take their low 8 bytes big-endian,
    as vLLM does when it converts a digest for external consumers; a hex string is
    read as bytes.
    """
    if isinstance(value, bool):
        raise ValueError("block hash must be an int or bytes, not bool")
    if isinstance(value, int):
        if value < -(1 << 63) or value > U64:
            raise ValueError(f"block hash {value} does not fit in 64 bits")
        return value & U64
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value)
        except ValueError:
            raise ValueError("block hash string must be hex") from None
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise ValueError("block hash bytes are empty")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise ValueError(f"block hash of type {type(value).__name__} is not supported")


class _KvBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BlockStored(_KvBase):
    type: Literal["stored"] = "stored"
    block_hashes: list[int] = Field(min_length=1)
    parent_block_hash: int | None = None
    token_ids: list[int]
    block_size: int = Field(gt=0)
    lora_id: int | None = None
    lora_name: str | None = None
    medium: Medium | None = None
    parent_key: int | None = Field(
        default=None, ge=0, le=U64,
        description="the indexer's own chained key of the parent block; only index dumps set it "
                    "(engines leave it unset and give parent_block_hash)")
    block_keys: list[int] | None = Field(
        default=None,
        description="the indexer's own key of every block (one per block hash); only index dumps set "
                    "it, and then token_ids is empty: the keys already say which prefix each block ends")
    block_digests: list[int] | None = Field(
        default=None,
        description="each block's digest of its own token ids (streams.kv_core.block_digests, not "
                    "chained), one per block hash, given by a KV bridge in place of token_ids (then "
                    "empty): 8 bytes per block on the bus instead of 4 per token; the index chains them "
                    "into the same keys the token ids give")
    block_salts: list[int] | None = Field(
        default=None,
        description="one 64-bit salt per block (0 = none), from vLLM's extra_keys (multimodal inputs, "
                    "cache_salt): the index mixes it into the block's key, so blocks vLLM would not share "
                    "never share a key")

    @field_validator("block_hashes", mode="before")
    @classmethod
    def _hashes(cls, v):  # noqa: ANN001
        if not isinstance(v, (list, tuple)):
            raise ValueError("block_hashes must be a list")
        return [normalize_block_hash(h) for h in v]

    @field_validator("parent_block_hash", mode="before")
    @classmethod
    def _parent(cls, v):  # noqa: ANN001
        return None if v is None else normalize_block_hash(v)

    @field_validator("token_ids")
    @classmethod
    def _tokens(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _shape(self) -> "BlockStored":
        if self.block_salts is not None:
            if len(self.block_salts) != len(self.block_hashes):
                raise ValueError(f"block_salts has {len(self.block_salts)} salts for {len(self.block_hashes)} blocks")
            if any(x < 0 or x > U64 for x in self.block_salts):
                raise ValueError("block_salts must be integers in [0, 2**64)")
        if self.block_digests is not None:
            if self.block_keys is not None:
                raise ValueError("give block_digests or block_keys, not both")
            if len(self.block_digests) != len(self.block_hashes):
                raise ValueError(f"block_digests has {len(self.block_digests)} digests for "
                                 f"{len(self.block_hashes)} blocks")
            if any(d < 0 or d > U64 for d in self.block_digests):
                raise ValueError("block_digests must be integers in [0, 2**64)")
            if self.token_ids:
                raise ValueError("token_ids must be empty when block_digests is given")
            return self
        if self.block_keys is not None:
            if len(self.block_keys) != len(self.block_hashes):
                raise ValueError(f"block_keys has {len(self.block_keys)} keys for {len(self.block_hashes)} blocks")
            if any(k <= 0 or k > U64 for k in self.block_keys):
                raise ValueError("block_keys must be integers in [1, 2**64)")
            if self.token_ids:
                raise ValueError("token_ids must be empty when block_keys is given")
            return self
        need = len(self.block_hashes) * self.block_size
        if len(self.token_ids) != need:
            raise ValueError(
                f"token_ids has {len(self.token_ids)} tokens but {len(self.block_hashes)} blocks "
                f"of block_size {self.block_size} need {need}"
            )
        return self


class BlockRemoved(_KvBase):
    type: Literal["removed"] = "removed"
    block_hashes: list[int] = Field(min_length=1)
    medium: Medium | None = None

    @field_validator("block_hashes", mode="before")
    @classmethod
    def _hashes(cls, v):  # noqa: ANN001
        if not isinstance(v, (list, tuple)):
            raise ValueError("block_hashes must be a list")
        return [normalize_block_hash(h) for h in v]


class AllBlocksCleared(_KvBase):
    type: Literal["cleared"] = "cleared"
    medium: Medium | None = None


class PodReset(_KvBase):
    """The engine restarted (sequence back to 0): forget everything it held."""

    type: Literal["reset"] = "reset"
    reason: str = "engine restart"


class PodGone(_KvBase):
    """The pod left the cluster: drop it from the index entirely."""

    type: Literal["gone"] = "gone"
    reason: str = "pod deleted"


KvEvent = Annotated[
    Union[BlockStored, BlockRemoved, AllBlocksCleared, PodReset, PodGone],
    Field(discriminator="type"),
]


class KvEventBatch(Event):
    """One vLLM scheduler step's events for one pod (one NATS message).

    ``epoch`` counts engine incarnations as seen by the bridge (it increments when the
    engine's sequence restarts at 0); ``(pod, epoch, seq)`` is unique and is the
    ``Nats-Msg-Id``.
    """

    pod: str = Field(min_length=1)
    model: str = Field(min_length=1)
    dp_rank: int = Field(default=0, ge=0)
    epoch: int = Field(default=0, ge=0, le=MAX_EPOCH)
    seq: int = Field(ge=0, le=MAX_SEQ)
    ts: float = Field(ge=0, description="engine timestamp, seconds since the epoch")
    events: list[KvEvent]

    @property
    def msg_id(self) -> str:
        return f"{self.pod}:{self.epoch}:{self.seq}"

    @classmethod
    def from_bytes(cls, data: bytes) -> "KvEventBatch":
        """A ``kv.events`` message in either encoding (JSON, or :mod:`schemas.kv_binary`),
        fully validated; :class:`schemas.ValidationFailure` naming what is wrong."""
        from schemas import kv_binary
        from schemas.base import ValidationFailure, decode_event

        if not kv_binary.is_binary(data):
            return decode_event(cls, data)
        if kv_binary.is_group(data):
            raise ValidationFailure(cls.__name__, [{"loc": ("binary",), "msg": "a group of batches, not one: read "
                                                                             "it with KvEventBatch.all_from_bytes"}])
        try:
            doc = kv_binary.to_dict(kv_binary.decode(data))
        except ValueError as exc:  # msgspec's DecodeError / ValidationError, a ragged array
            raise ValidationFailure(cls.__name__, [{"loc": ("binary",), "msg": str(exc)}]) from None
        return decode_event(cls, doc)

    @classmethod
    def all_from_bytes(cls, data: bytes) -> list["KvEventBatch"]:
        """Every batch of a ``kv.events`` message: one, or the batches of a binary group (a bridge
        sends the batches it has ready at once as one message), each fully validated."""
        from schemas import kv_binary
        from schemas.base import ValidationFailure

        if not kv_binary.is_group(data):
            return [cls.from_bytes(data)]
        try:
            parts = kv_binary.split(data) or [data]
        except ValueError as exc:
            raise ValidationFailure(cls.__name__, [{"loc": ("group",), "msg": str(exc)}]) from None
        return [cls.from_bytes(p) for p in parts]
