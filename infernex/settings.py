"""The one settings object: environment (``INFERNEX_`` prefix, ``__`` for nesting) and an
optional YAML file, built once at the entry point and passed down, frozen.

Precedence: explicit arguments > environment > YAML file > defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from consumers.indexer import IndexerConfig
from consumers.sla_store import SlaConfig
from router.config import RouterConfig
from schemas.config import EmbeddedNatsConfig, NatsConfig, TopologyConfig
from simulator.config import SimSettings
from streams.diagnosis.rules import DiagnosisConfig


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None):
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        if path is not None:
            if not path.is_file():
                raise FileNotFoundError(f"settings file {path} does not exist")
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"settings file {path} must hold a mapping at the top")
            self._data = loaded

    def get_field_value(self, field, field_name):  # noqa: ANN001
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._data.items() if k in self.settings_cls.model_fields}


class Settings(BaseSettings):
    """Everything configurable. Later sections (router, indexer, sla ...) join here."""

    model_config = SettingsConfigDict(
        env_prefix="INFERNEX_", env_nested_delimiter="__", frozen=True, extra="forbid",
        enable_decoding=False,
    )

    nats: NatsConfig = Field(default_factory=NatsConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    embedded_nats: EmbeddedNatsConfig = Field(default_factory=EmbeddedNatsConfig)
    log_level: str = "INFO"
    data_dir: Path = Path(".infernex")
    api_key: SecretStr | None = None
    sla: SlaConfig = Field(default_factory=SlaConfig)
    indexer: IndexerConfig = Field(default_factory=IndexerConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    diagnosis: DiagnosisConfig = Field(default_factory=DiagnosisConfig)
    sim: SimSettings = Field(default_factory=SimSettings)

    _yaml_path: Path | None = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # noqa: ANN001
        path = os.environ.get("INFERNEX_CONFIG")
        yaml_source = _YamlSource(settings_cls, Path(path) if path else None)
        return (init_settings, env_settings, yaml_source, file_secret_settings)


class SettingsError(ValueError):
    """Invalid settings, told without the offending values (they may be secrets)."""


def _secrets(s: Settings) -> list[str]:
    r = s.router
    keys = [s.api_key, s.nats.token, s.nats.password, r.admin_key, r.engine_api_key, *r.api_keys,
            *(b.api_key for b in r.backends)]
    return [k.get_secret_value() for k in keys if k is not None]


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; ``config_file`` wins over ``$INFERNEX_CONFIG``. Errors never echo input
    values; the secrets loaded are registered for redaction in logs (:mod:`schemas.redact`)."""
    from schemas.redact import redact, register

    try:
        s = _load(config_file, **overrides)
    except ValidationError as exc:
        lines = [f"{e['msg']} (at {'.'.join(map(str, e['loc'])) or 'top level'})"
                 for e in exc.errors(include_url=False, include_input=False, include_context=False)]
        raise SettingsError(redact(f"{exc.error_count()} invalid setting(s): " + "; ".join(lines))) from None
    register(_secrets(s))
    return s


def redacted_dump(s: Settings) -> dict[str, Any]:
    """The settings as JSON data for display: secrets masked, credentials in URLs redacted."""
    from schemas.redact import redact_obj

    return redact_obj(s.model_dump(mode="json"))


def _load(config_file: Path | None = None, **overrides: Any) -> Settings:
    if config_file is not None:
        old = os.environ.get("INFERNEX_CONFIG")
        os.environ["INFERNEX_CONFIG"] = str(config_file)
        try:
            return Settings(**overrides)
        finally:
            if old is None:
                os.environ.pop("INFERNEX_CONFIG", None)
            else:
                os.environ["INFERNEX_CONFIG"] = old
    return Settings(**overrides)
