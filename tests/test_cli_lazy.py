"""``infernex --help`` imports no command module (issue 21: it took 1.4-1.7 s), and the
lazy registry names every command the modules register, with their real help."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import typer

from infernex import commands

HEAVY = ["infernex.commands.backbone", "infernex.settings", "pydantic", "nats", "numpy", "numba", "rich.markdown",
         "chdb", "aiohttp", "starlette", "yaml"]


def _modules_after(args: list[str]) -> set[str]:
    code = ("import sys, json\nfrom infernex.cli import app\n"
            f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_help_and_version_import_nothing_heavy():
    for args in (["--help"], ["--version"], []):
        loaded = _modules_after(args)
        assert not [m for m in HEAVY if m in loaded], (args, [m for m in HEAVY if m in loaded])
        assert not [m for m in loaded if m.startswith("infernex.commands.")], args


def test_a_command_imports_only_its_module():
    loaded = _modules_after(["trace-stats", "--help"])
    assert "infernex.commands.workloads" in loaded
    assert {m for m in loaded if m.startswith("infernex.commands.")} == {"infernex.commands.workloads"}


def test_registry_matches_what_the_modules_register():
    registered: dict[str, str] = {}
    for mod in pkgutil.iter_modules(commands.__path__):
        module = importlib.import_module(f"infernex.commands.{mod.name}")
        if hasattr(module, "register"):
            sub = typer.Typer()
            module.register(sub)
            for name in typer.main.get_group(sub).commands:
                registered[name] = mod.name
    missing = sorted(set(registered) - set(commands.COMMANDS))
    assert not missing, f"add these to infernex.commands.COMMANDS: {[(n, registered[n]) for n in missing]}"
    stale = sorted(set(commands.COMMANDS) - set(registered))
    assert not stale, f"COMMANDS names commands no module registers: {stale}"
    wrong = {n: (m, registered[n]) for n, (m, _) in commands.COMMANDS.items() if registered[n] != m}
    assert not wrong, wrong
    assert all(len(h) <= 64 for _, h in commands.COMMANDS.values())


def test_lazy_commands_run_and_typos_suggest():
    from typer.testing import CliRunner

    from infernex.cli import app

    r = CliRunner().invoke(app, ["streams", "--help"])
    assert r.exit_code == 0 and "apply" in r.output and "info" in r.output
    r = CliRunner().invoke(app, ["routr"])
    assert r.exit_code == 2 and "Did you mean 'router'" in r.output
    r = CliRunner().invoke(app, ["--help"])
    assert all(name in r.output for name in commands.COMMANDS)
