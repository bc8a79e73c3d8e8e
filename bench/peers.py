"""Peer routers for the benches, each in its own virtual environment under a cache folder.

    python bench/peers.py sglang-router        # creates/updates the venv, prints its python

``peer_python("sglang-router")`` returns the interpreter of ``~/.cache/infernex-bench/sglang-router``
(``INFERNEX_BENCH_CACHE`` overrides the folder), creating the venv and ``pip install``-ing the
package from PyPI the first time, or ``None`` (with the reason printed) when that fails.
``peer_version`` reads the installed version, for the results.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = Path(os.environ.get("INFERNEX_BENCH_CACHE", Path.home() / ".cache" / "infernex-bench"))


def peer_python(package: str, module: str | None = None, *, venv: str | None = None) -> str | None:
    """``package`` may carry a version (``ai-dynamo-runtime==1.6.1``); ``venv`` names the folder
    (default: the package name)."""
    name = package.split("==")[0]
    venv = CACHE / (venv or name)
    py = venv / "bin" / "python"
    module = module or name.replace("-", "_")
    if py.exists() and subprocess.run([str(py), "-c", f"import {module}"], capture_output=True, check=False).returncode == 0:
        return str(py)
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", package], check=True, capture_output=True,
                       timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        print(f"{package}: cannot install into {venv} ({exc}; {err.decode(errors='replace')[-300:]}), skipped")
        return None
    return str(py)


DYNAMO = "ai-dynamo-runtime==1.6.1"  # the Dynamo release the recorded figures were measured against


def dynamo_python(arg: str | None) -> str | None:
    """A bench's ``--dynamo-python``: ``auto`` (the default) is this cache's venv with
    :data:`DYNAMO`, created on first use; ``none`` (or None) leaves Dynamo out; else a python path."""
    if arg in (None, "none", ""):
        return None
    if arg == "auto":
        return peer_python(DYNAMO, "dynamo", venv="ai-dynamo-runtime")
    return arg


def peer_version(py: str, package: str) -> str:
    out = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    for name in sys.argv[1:] or ["sglang-router"]:
        p = peer_python(name, "dynamo" if name.startswith("ai-dynamo-runtime") else None)
        print(name, p, p and peer_version(p, name.split("==")[0]))


def extract_ref(ref: str) -> str:
    """The tree of git ``ref`` of this repository in a temporary folder (the repository is not
    changed): benches run a router from that code beside the current one."""
    import tempfile

    d = tempfile.mkdtemp(prefix="infernex-ref-")
    arch = subprocess.run(["git", "-C", ROOT, "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=arch, check=True)
    return d
