"""Every CLI failure a newcomer meets is one line on stderr that says what to do, no traceback
(issue 21). Each case runs the real ``infernex`` process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from infernex.embedded_nats import free_port

EXE = [sys.executable, "-m", "infernex.cli"]


def run(args, env=None, timeout=60):
    return subprocess.run(EXE + args, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(r, code: int) -> str:
    """Assert a one-line error with exit ``code``; return the line."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_pub_missing_file_is_one_line():
    line = one_line_error(run(["pub", "kv.events.m.p", "@/nonexistent.json"]), 2)
    assert "cannot read /nonexistent.json" in line and "No such file" in line and "stdin" in line


def test_up_on_busy_port_is_one_line(busy_port, tmp_path):
    r = run(["up", "--port", str(busy_port), "--store-dir", str(tmp_path / "store")])
    line = one_line_error(r, 1)
    assert f"port {busy_port}" in line and "already in use" in line and "--port 0" in line
    assert "nats-server" not in r.stdout  # no server banner


def test_router_on_busy_port_is_one_line(busy_port):
    r = run(["router", "--host", "127.0.0.1", "--port", str(busy_port), "--no-bus",
             "--backend", "p0=http://127.0.0.1:9@m"])
    line = one_line_error(r, 1)
    assert f"port {busy_port}" in line and "already in use" in line


def test_unreachable_nats_names_the_reason_and_the_fix():
    port = free_port()
    r = run(["streams", "info"], env={"INFERNEX_NATS__SERVERS": f"nats://127.0.0.1:{port}",
                                      "INFERNEX_NATS__CONNECT_TIMEOUT_S": "0.5"})
    line = one_line_error(r, 1)
    head = f"cannot connect to NATS at nats://127.0.0.1:{port}: "
    assert head in line
    reason = line.split(head, 1)[1]
    assert reason and reason[0] not in " (" and ("refused" in reason.lower() or "failed" in reason.lower()), line
    assert "infernex up" in line and "INFERNEX_NATS__SERVERS" in line
    assert "WARNING" not in r.stderr  # retries of the first connect are not streamed


@pytest.mark.parametrize("yaml_text, key, hint", [
    ("routr:\n  port: 9000\n", "'routr'", "did you mean 'router'"),
    ("router:\n  strtegy: kv-aware\n", "'router.strtegy'", "did you mean 'router.strategy'"),
    ("sla:\n  targets:\n    ttft: 0.5\n", "'sla.targets.ttft'", "did you mean 'sla.targets.ttft_s'"),
    ("nats:\n  server: [nats://x:4222]\n", "'nats.server'", "did you mean 'nats.servers'"),
])
def test_unknown_config_keys_are_rejected_at_every_level(tmp_path, yaml_text, key, hint):
    cfg = tmp_path / "infernex.yaml"
    cfg.write_text(yaml_text)
    line = one_line_error(run(["--config", str(cfg), "streams", "info"]), 2)
    assert str(cfg) in line and f"unknown key {key}" in line and hint in line, line
    # the same through $INFERNEX_CONFIG, and through the router's own --config
    line = one_line_error(run(["streams", "info"], env={"INFERNEX_CONFIG": str(cfg)}), 2)
    assert str(cfg) in line and key in line
    line = one_line_error(run(["router", "--config", str(cfg), "--no-bus"]), 2)
    assert key in line


def test_config_file_missing_or_not_a_mapping(tmp_path):
    line = one_line_error(run(["--config", str(tmp_path / "nope.yaml"), "streams", "info"]), 2)
    assert "nope.yaml does not exist" in line
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    assert "must hold a mapping" in one_line_error(run(["--config", str(bad), "streams", "info"]), 2)
    broken = tmp_path / "broken.yaml"
    broken.write_text("router: [\n")
    assert "broken.yaml line" in one_line_error(run(["--config", str(broken), "streams", "info"]), 2)


def test_tail_since_takes_the_same_durations_as_sla_report():
    # a bad value is a usage error before any connection is tried (NATS is unreachable here)
    env = {"INFERNEX_NATS__SERVERS": f"nats://127.0.0.1:{free_port()}", "INFERNEX_NATS__CONNECT_TIMEOUT_S": "0.3"}
    bad = run(["tail", "kv.events.>", "--since", "1x30"], env=env)
    assert bad.returncode == 2 and "1h30m" in bad.stderr and "Traceback" not in bad.stderr
    good = run(["tail", "kv.events.>", "--since", "1h30m"], env=env)
    assert good.returncode == 1 and "cannot connect to NATS" in good.stderr  # --since accepted


def test_version():
    from infernex import __version__

    for args in (["--version"], ["version"]):
        r = run(args)
        assert r.returncode == 0 and r.stdout.strip() == f"infernex {__version__}", r.stdout + r.stderr
