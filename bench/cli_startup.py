"""How long ``infernex --help`` (and a few other commands) take to answer, before and after.

    python bench/cli_startup.py [--before /path/to/old/checkout] [--runs 15]

Each case runs ``python -m infernex.cli ARGS`` in a fresh process with PYTHONPATH set to the
checkout; rounds alternate between the checkouts so machine load hits both alike. Prints the
median and the best wall time per case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [["--help"], ["--version"], ["trace-stats", "--help"], ["router", "--help"]]


def once(root: Path, args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "infernex.cli", *args], env=env, cwd=root, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, help="an older checkout to compare with")
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    roots = {"now": Path(__file__).resolve().parents[1]}
    if a.before:
        roots = {"before": a.before.resolve(), **roots}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.runs):
        for case in CASES:
            for label, root in roots.items():
                times.setdefault((label, " ".join(case)), []).append(once(root, case))
    print(f"{'checkout':<8} {'infernex ARGS':<22} {'median s':>9} {'best s':>7}")
    for (label, case), ts in times.items():
        print(f"{label:<8} {case:<22} {statistics.median(ts):9.3f} {min(ts):7.3f}")


if __name__ == "__main__":
    main()
