"""The chaos suite's figures: runs tests/test_chaos_*.py (real nats-server processes, simulated
engines with known caches) and prints one row per fault: survived, messages lost, recovery time.

    PYTHONPATH=. python bench/chaos.py

Recovery time is measured from the end of the last fault (server back, node back, indexer back,
poison published) to the moment every index equals every engine's cache (or, for poison, every
consumer has folded the valid event after the bad ones and the dead letters are counted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_chaos_nats_restart.py", "tests/test_chaos_cluster.py", "tests/test_chaos_indexer_kill.py",
         "tests/test_chaos_poison.py"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "chaos.jsonl"
        env = dict(os.environ, INFERNEX_CHAOS_RESULTS=str(out))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        took = time.monotonic() - t0
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    lines = proc.stdout.strip().splitlines()
    for line in lines:
        if line.startswith(("FAILED", "ERROR", "E  ")):
            print(line[:300])
    print(lines[-1] if lines else proc.stderr[-2000:])
    print(f"suite wall time: {took:.0f} s")
    print("| fault | survived | messages lost | recovery time | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("fault", "survived", "lost", "recovery_s"))
        print(f"| {r['fault']} | {'yes' if r['survived'] else 'NO'} | {r['lost']} | {r['recovery_s']:.2f} s | {notes} |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
