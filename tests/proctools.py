"""Helpers for tests that run ``infernex`` commands as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

INFERNEX = str(Path(sys.executable).parent / "infernex")


def stop_process(proc: subprocess.Popen) -> str:
    """Ctrl-C the process (kill it if it does not stop within 20 s); return its stdout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.stdout.read().decode(errors="replace") if proc.stdout else ""
