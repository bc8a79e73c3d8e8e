"""Configuration models handed to services. Pure data; the entry point builds them.

The root settings object (environment, YAML file) lives in :mod:`infernex.settings`
and is composed of these sections.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NatsTls(_Section):
    ca_file: Path | None = None
    ca_pem: str | None = Field(default=None, description="the CA certificate itself (PEM), e.g. from a Secret")
    cert_file: Path | None = None
    key_file: Path | None = None
    verify: bool = True
    server_name: str | None = Field(default=None, description="name to verify the server certificate against "
                                    "(default: the host in the server URL)")


class NatsConfig(_Section):
    """How to reach NATS. Secrets are ``SecretStr`` and never print."""

    servers: list[str] = Field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    token: SecretStr | None = None
    user: str | None = None
    password: SecretStr | None = None
    credentials_file: Path | None = None
    tls: NatsTls | None = None
    name: str = "infernex"
    connect_timeout_s: float = Field(default=5.0, gt=0)
    max_reconnect_attempts: int = -1
    subject_prefix: str | None = Field(default=None, description="root under which all subjects live")

    def __repr_args__(self):  # URLs may hold credentials: printed redacted
        from schemas.redact import redact_url

        for k, v in super().__repr_args__():
            yield k, ([redact_url(u) for u in v] if k == "servers" else v)

    @field_validator("servers", mode="before")
    @classmethod
    def _split(cls, v):  # noqa: ANN001
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not v:
            raise ValueError("at least one NATS server URL is required")
        return v


class StreamLimits(_Section):
    max_age_s: float = Field(gt=0)
    max_bytes: int = Field(default=-1)
    max_msgs: int = Field(default=-1)


class TopologyConfig(_Section):
    """Per-deployment knobs of the JetStream topology (see :mod:`streams.topology`)."""

    replicas: int = Field(default=1, ge=1, le=5)
    duplicate_window_s: float = Field(default=120.0, gt=0)
    storage: str = Field(default="file", pattern="^(file|memory)$")
    limits: dict[str, StreamLimits] = Field(
        default_factory=dict, description="stream name -> limits overriding the defaults"
    )
    store_bytes: int | None = Field(
        default=None, gt=0,
        description="the JetStream file store each server has (the chart's nats.jetstream.fileStore.size; "
                    "a number of bytes or a Kubernetes quantity such as 10Gi): each stream without a byte "
                    "limit of its own gets a share of it (streams.topology.STORE_SHARES), so a busy stream "
                    "drops its own oldest messages instead of filling the store and stopping every other "
                    "stream's writes")

    @field_validator("store_bytes", mode="before")
    @classmethod
    def _quantity(cls, v):
        return parse_quantity(v) if isinstance(v, str) else v


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_quantity(text: str) -> int:
    """Bytes of a Kubernetes storage quantity: ``10Gi``, ``500M``, ``1048576``."""
    t = text.strip()
    num = t.rstrip("kMGTi")
    unit = t[len(num):]
    try:
        if unit not in _UNITS:
            raise ValueError
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a storage size (e.g. 10Gi, 500M or a number of bytes)") from None


class EmbeddedNatsConfig(_Section):
    """The nats-server that ``infernex up`` / ``demo`` start themselves."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    store_dir: Path = Path(".infernex/nats")
    binary: Path | None = None


def key_lines(text: str) -> list[str]:
    """API keys from a key file's text: one per line, blank lines and ``#`` comments skipped."""
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
