"""Secrets never leave: components run with planted secrets (NATS URL password, client API keys,
admin key, engine key, a backend URL with credentials) and every byte they print or answer is
searched for them."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from schemas.redact import RedactingFilter, install_log_redaction, redact, redact_url, register

PLANTED = {
    "nats_pw": "PLANTEDnatsPw0",
    "client_key": "PLANTED-client-key-1",
    "admin_key": "PLANTED-admin-key-2",
    "engine_key": "PLANTED-engine-key-3",
    "backend_pw": "PLANTEDbackendPw4",
    "wrong_key": "PLANTED-wrong-key-5",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_clean(text: str, *names: str) -> None:
    for name in names or PLANTED:
        assert PLANTED[name] not in text, f"{name} leaked: ...{text[max(0, text.find(PLANTED[name]) - 80):][:200]}"


def env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("INFERNEX_")}
    e.update(extra)
    return e


# -- the functions -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("cannot connect to NATS at nats://user:pw123@host:4222", "cannot connect to NATS at nats://user:***@host:4222"),
    ("nats://s3cr3ttoken@host:4222", "nats://***@host:4222"),
    ("http://10.0.0.5:8000/v1/models", "http://10.0.0.5:8000/v1/models"),
    ("GET http://h/x?api_key=abc123&n=1", "GET http://h/x?api_key=***&n=1"),
    ("Authorization: Bearer abc.def-123", "Authorization: *** ***"),
    ("[type=list_type, input_value='k-1234', input_type=str]", "[type=list_type, input_value=***, input_type=str]"),
    ("password=hunter22 user=bob", "password=*** user=bob"),
    ("key sk-abcdefghijklmnop1234", "key sk-***"),
])
def test_redact(text, expected):
    assert redact(text) == expected


def test_registered_values_and_url_helper():
    register(["opaque-value-987"])
    assert redact("the key is opaque-value-987 here") == "the key is *** here"
    assert redact_url("https://u:p@x.example/p?token=t0k3n") == "https://u:***@x.example/p?token=***"


def test_log_filter_redacts_messages_args_and_tracebacks():
    buf = io.StringIO()
    lg = logging.getLogger("test_secrets.isolated")
    lg.propagate = False
    h = logging.StreamHandler(buf)
    lg.addHandler(h)
    install_log_redaction(lg)
    assert any(isinstance(f, RedactingFilter) for f in h.filters)
    try:
        lg.warning("connect to %s failed", "nats://u:PLANTEDnatsPw0@h:4222")
        try:
            raise ValueError("bad header Bearer PLANTED-client-key-1")
        except ValueError:
            lg.exception("request failed")
    finally:
        lg.removeHandler(h)
    out = buf.getvalue()
    assert "nats://u:***@h:4222" in out and "ValueError" in out
    assert_clean(out)


# -- the components, as processes ----------------------------------------------------------------

def test_cli_nats_url_password_and_settings_errors_are_redacted():
    url = f"nats://bob:{PLANTED['nats_pw']}@127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "--log-level", "DEBUG", "router", "--port", "0"],
                       env=env(INFERNEX_NATS__SERVERS=url, INFERNEX_NATS__CONNECT_TIMEOUT_S="0.5"),
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "cannot connect to NATS at nats://bob:***@127.0.0.1" in out.replace("\n", "")
    assert_clean(out)
    # a secret that fails validation is not echoed (pydantic's input_value)
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "router", "--no-bus"],
                       env=env(INFERNEX_ROUTER__API_KEYS=PLANTED["client_key"],
                               INFERNEX_ROUTER__ADMIN_KEY=json.dumps({"x": PLANTED["admin_key"]})),
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "invalid setting" in out and "api_keys" in out
    assert_clean(out)


def test_settings_dump_masks_secrets(monkeypatch):
    from infernex.settings import load_settings, redacted_dump

    monkeypatch.setenv("INFERNEX_NATS__SERVERS", f"nats://bob:{PLANTED['nats_pw']}@h:4222")
    monkeypatch.setenv("INFERNEX_ROUTER__ENGINE_API_KEY", PLANTED["engine_key"])
    monkeypatch.setenv("INFERNEX_ROUTER__ADMIN_KEY", PLANTED["admin_key"])
    s = load_settings()
    dump = json.dumps(redacted_dump(s))
    assert "nats://bob:***@h:4222" in dump
    assert_clean(dump)
    assert_clean(repr(s) + str(s))


def test_router_with_planted_secrets_prints_and_answers_none(tmp_path):
    """The router at DEBUG with client, admin and engine keys and a backend URL holding a password:
    requests with a wrong key, an admin call, a dead backend; stdout, stderr and every answer grepped."""
    port = free_port()
    dead = f"http://user:{PLANTED['backend_pw']}@127.0.0.1:{free_port()}"
    keys = tmp_path / "keys"
    keys.write_text(PLANTED["client_key"] + "\n")
    conf = tmp_path / "settings.yaml"
    conf.write_text(json.dumps({"router": {"backends": [{"pod": "dead", "url": dead, "model": "m"}]}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "infernex.cli", "--log-level", "DEBUG", "--config", str(conf), "router", "--no-bus",
         "--port", str(port)],
        env=env(INFERNEX_ROUTER__API_KEYS_FILE=str(keys), INFERNEX_ROUTER__ADMIN_KEY=PLANTED["admin_key"],
                INFERNEX_ROUTER__ENGINE_API_KEY=PLANTED["engine_key"], INFERNEX_ROUTER__CONNECT_TIMEOUT_S="0.3"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    answers = []
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=1).read()
                break
            except OSError:
                assert time.monotonic() < end and proc.poll() is None, "router did not start"
                time.sleep(0.1)

        def req(path, key=None, body=None):
            h = {"Content-Type": "application/json"}
            if key:
                h["Authorization"] = f"Bearer {key}"
            r = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None, headers=h)
            try:
                with urllib.request.urlopen(r, timeout=20) as resp:
                    data = resp.read().decode()
                    answers.append(str(resp.headers) + data)
                    return resp.status, data
            except urllib.error.HTTPError as e:
                data = e.read().decode()
                answers.append(str(e.headers) + data)
                return e.code, data

        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert req("/v1/chat/completions", PLANTED["wrong_key"], chat)[0] == 401
        assert req("/v1/chat/completions", None, chat)[0] == 401
        assert req("/v1/chat/completions", PLANTED["client_key"], chat)[0] in (502, 503)  # the dead backend
        status, data = req("/v1/router/backends", PLANTED["admin_key"])
        assert status == 200 and "user:***@127.0.0.1" in data
        assert req("/v1/router/backends", PLANTED["client_key"])[0] == 401
        assert req("/v1/models", PLANTED["client_key"])[0] == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    text = out.decode(errors="replace") + err.decode(errors="replace") + "\n".join(answers)
    assert "dead" in text  # the run did log about the dead backend
    assert_clean(text)
