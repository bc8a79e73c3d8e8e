"""Processes for the live dashboard test: InferNex services started as ``infernex`` subprocesses
and a real Prometheus scraping them. Every process is stopped by :class:`Processes` on exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Callable

import httpx

INFERNEX = [sys.executable, "-m", "infernex.cli"]


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int, tries: int = 50) -> int:
    """A base port such that base .. base+n-1 are all free right now."""
    for _ in range(tries):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


class Processes:
    """Starts subprocesses with logs in a directory; stops them all (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir = log_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.log_dir, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def infernex(self, name: str, *args: str) -> subprocess.Popen:
        return self.start(name, [*INFERNEX, *args])

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            details = "\n".join(f"--- {n} exited {rc}:\n{self.log(n)}" for n, rc in dead.items())
            raise AssertionError(f"processes exited: {sorted(dead)}\n{details}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, on_tick: Callable[[], None] | None = None,
             interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if on_tick is not None:
            on_tick()
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Prometheus:
    """A real Prometheus server (the Debian package's binary) with a given config."""

    def __init__(self, binary: str, procs: Processes, workdir: Path):
        self.binary = binary
        self.procs = procs
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, config_path: Path) -> None:
        self.procs.start("prometheus", [
            self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ])

    def ready(self) -> bool:
        return http_ok(f"{self.url}/-/ready")

    def query(self, expr: str) -> dict:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def has_series(self, metric: str) -> bool:
        return bool(self.query(f'count({{__name__="{metric}"}})')["result"])

    def declared(self, metric: str) -> bool:
        """Some scraped target declares the metric (its HELP/TYPE lines), samples or not."""
        names = [metric]
        for suffix in ("_bucket", "_sum", "_count", "_total"):
            if metric.endswith(suffix):
                names.append(metric[: -len(suffix)])
        for name in names:
            r = httpx.get(f"{self.url}/api/v1/metadata", params={"metric": name}, timeout=10).json()
            if r.get("data"):
                return True
        return False

    def targets(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def rules(self) -> list[dict]:
        groups = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]
