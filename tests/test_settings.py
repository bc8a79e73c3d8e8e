from __future__ import annotations

import pytest

from infernex.settings import Settings, load_settings


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
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.yaml")
