"""The layout is the architecture (README): lower layers never import the composition root, and the
contract and the folds do no I/O. Checked on the source (imports anywhere in a module, also inside
functions), so a lazy import cannot slip past."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IO_MODULES = {"nats", "zmq", "httpx", "aiohttp", "socket", "asyncio", "requests", "clickhouse_connect", "chdb",
              "subprocess", "grpc", "uvloop", "kafka", "aiokafka"}


def imported(path: Path) -> set[str]:
    """Top-level package names ``path`` imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", modules("schemas", "streams", "consumers", "router", "simulator"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_layer_below_the_composition_root_imports_it(path):
    assert "infernex" not in imported(path), f"{path.relative_to(ROOT)} imports infernex (the CLI and launcher)"


@pytest.mark.parametrize("path", modules("schemas", "streams"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_contract_and_the_folds_do_no_io(path):
    bad = imported(path) & IO_MODULES
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_checks_see_imports():
    """The checker itself: a lazy import inside a function counts."""
    src = ROOT / "infernex" / "commands" / "simulate.py"
    assert {"simulator", "typer"} <= imported(src)
