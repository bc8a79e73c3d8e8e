from __future__ import annotations

import pytest

from infernex.settings import Settings, SettingsError, load_settings


def test_env_and_yaml_and_secrets(tmp_path, monkeypatch):
    cfg = tmp_path / "infernex.yaml"
    cfg.write_text("nats:\n  servers: [nats://yaml:4222]\n  user: alice\n  password: hunter2\ntopology:\n  replicas: 3\n")
    s = load_settings(cfg)
    assert s.nats.servers == ["nats://yaml:4222"]
    assert s.topology.replicas == 3
    assert s.nats.password.get_secret_value() == "hunter2"
    text = repr(s) + str(s) + s.model_dump_json()
    assert "hunter2" not in text
    # environment beats the file
    monkeypatch.setenv("INFERNEX_NATS__SERVERS", "nats://a:1,nats://b:2")
    monkeypatch.setenv("INFERNEX_NATS__TOKEN", "s3cret")
    s = load_settings(cfg)
    assert s.nats.servers == ["nats://a:1", "nats://b:2"]
    assert s.nats.user == "alice"
    assert "s3cret" not in repr(s)


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(Exception):
        s.log_level = "DEBUG"


def test_bad_settings_name_the_field(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("topology:\n  replicas: 9\n")
    with pytest.raises(Exception, match="replicas"):
        load_settings(cfg)
    with pytest.raises(SettingsError, match="missing.yaml does not exist"):
        load_settings(tmp_path / "missing.yaml")


def test_every_settings_section_rejects_unknown_keys():
    """A new section whose model allows extra keys would swallow typos silently (issue 21)."""
    from pydantic import BaseModel

    seen: list[str] = []

    def walk(model: type[BaseModel], path: str) -> None:
        seen.append(path or "<top>")
        assert model.model_config.get("extra") == "forbid", f"{path or 'Settings'} ({model.__name__}) must forbid extra"
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{path}.{name}" if path else name)

    walk(Settings, "")
    assert {"nats", "router", "sla", "indexer", "sim"} <= set(seen)


def test_unknown_key_named_with_file_and_suggestion(tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("router:\n  strtegy: kv-aware\n")
    with pytest.raises(SettingsError, match=r"x\.yaml: unknown key 'router\.strtegy' \(did you mean 'router\.strategy'\?\)"):
        load_settings(cfg)
