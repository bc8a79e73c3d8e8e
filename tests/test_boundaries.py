"""streams/ and schemas/ hold pure code: no module there may import an I/O library."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IO_LIBS = {
    "nats", "faststream", "zmq", "aiohttp", "httpx", "requests", "urllib3", "starlette", "uvicorn", "fastapi",
    "chdb", "clickhouse_connect", "kubernetes", "aiokafka", "socket", "asyncio", "subprocess", "consumers",
    "router", "simulator", "infernex",
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_pure_packages_import_no_io():
    offenders = {}
    for pkg in ("streams", "schemas"):
        for path in (ROOT / pkg).rglob("*.py"):
            bad = imported_roots(path) & IO_LIBS
            if bad:
                offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_guard_catches_an_offender(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom nats.js import api\n")
    assert "nats" in imported_roots(f) & IO_LIBS


def test_every_package_has_an_ownership_docstring():
    for pkg in ("schemas", "streams", "consumers", "router", "simulator", "infernex"):
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
        assert doc and "May import" in doc, pkg


def test_no_layer_below_the_composition_root_imports_it():
    """infernex/ is the CLI and the launcher: nothing in the layers it composes imports it (imports
    inside functions count too)."""
    offenders = {}
    for pkg in ("schemas", "streams", "consumers", "router", "simulator"):
        for path in (ROOT / pkg).rglob("*.py"):
            if "infernex" in imported_roots(path):
                offenders[str(path.relative_to(ROOT))] = "infernex"
    assert offenders == {}


def test_guard_sees_a_lazy_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def run():\n    from infernex.demo import main\n    return main\n")
    assert "infernex" in imported_roots(f)
