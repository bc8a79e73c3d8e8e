"""The one settings object: environment (``INFERNEX_`` prefix, ``__`` for nesting) and an
optional YAML file, built once at the entry point and passed down, frozen.

Precedence: explicit arguments > environment > YAML file > defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import difflib

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

from consumers.indexer_config import IndexerConfig
from consumers.sla_store import SlaConfig
from router.config import RouterConfig
from schemas.config import EmbeddedNatsConfig, NatsConfig, TopologyConfig
from simulator.config import SimSettings
from streams.diagnosis.rules import DiagnosisConfig


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
        if not path:
            return (init_settings, env_settings, file_secret_settings)
        file = Path(path)
        if not file.is_file():
            raise SettingsError(f"settings file {file} does not exist (check --config or $INFERNEX_CONFIG)")
        try:
            yaml_source = YamlConfigSettingsSource(settings_cls, yaml_file=file)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or "not valid YAML"
            raise SettingsError(f"settings file {file}{where}: {problem}") from None
        except (TypeError, ValueError):  # a list or a scalar at the top
            yaml_source = None
        if yaml_source is None or not isinstance(yaml_source.yaml_data, dict):
            raise SettingsError(f"settings file {file} must hold a mapping (section: values) at the top")
        return (init_settings, env_settings, yaml_source, file_secret_settings)


class SettingsError(ValueError):
    """Invalid settings, told in one line naming the file and key, never with the offending values
    (they may be secrets)."""


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
    except SettingsError as exc:
        raise SettingsError(redact(str(exc))) from None
    register(_secrets(s))
    return s


def redacted_dump(s: Settings) -> dict[str, Any]:
    """The settings as JSON data for display: secrets masked, credentials in URLs redacted."""
    from schemas.redact import redact_obj

    return redact_obj(s.model_dump(mode="json"))



def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the (nested) section at ``loc``, for "did you mean"."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _explain(exc: ValidationError, file: Path | None) -> str:
    """One line for the first problem (and a count of the others)."""
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    env = "INFERNEX_" + "__".join(str(p).upper() for p in loc)
    source = f"settings file {file}" if file is not None else "settings"
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _fields_at(Settings, loc[:-1]), n=1)
        hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)" if close else ""
        if env in os.environ:
            source = f"environment variable {env}"
        text = f"{source}: unknown key '{key}'{hint}"
    else:
        text = f"{source}: {key}: {first['msg']}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return text


def _load(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; ``config_file`` wins over ``$INFERNEX_CONFIG``.

    Raises :class:`SettingsError` with one line naming the file and the key, e.g.
    ``settings file x.yaml: unknown key 'routr' (did you mean 'router'?)``.
    """
    old = os.environ.get("INFERNEX_CONFIG")
    if config_file is not None:
        os.environ["INFERNEX_CONFIG"] = str(config_file)
    file = Path(os.environ["INFERNEX_CONFIG"]) if os.environ.get("INFERNEX_CONFIG") else None
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_explain(exc, file)) from None
    finally:
        if config_file is not None:
            if old is None:
                os.environ.pop("INFERNEX_CONFIG", None)
            else:
                os.environ["INFERNEX_CONFIG"] = old
