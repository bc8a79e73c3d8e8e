"""The embedded nats-server does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import sys, time
from infernex.embedded_nats import EmbeddedNats
server = EmbeddedNats(sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state in /proc says it has exited
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_stops_when_its_parent_is_killed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "store")],
                             stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        assert _alive(pid)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _alive(pid)
        if alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, "nats-server kept running after its parent was SIGKILLed"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
