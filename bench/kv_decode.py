"""vLLM KV-event frame decoding, side by side: the decoder before vLLM-0.33 support against the
current one, on the same payloads, interleaved rounds, CPU time.

The "before" decoder is read from git (``--before REV``, default the commit before the
KvWire decoder landed) and loaded as a module of its own, so both run in this process on
identical bytes. Shapes: ``0.33`` (array batch of map events, what vLLM 0.33 sends), ``0.22``
(array batch of 0.22's twelve-field array events), ``array`` (0.11's arrays; SGLang's shape).
The old decoder could not read ``0.33`` at all (every frame was dead-lettered); its ``0.22``
figure is the cost of a shape it could read.

Usage: python bench/kv_decode.py [--frames 3000] [--rounds 7] [--stored 48] [--removed 48]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from consumers.kv_wire import FrameDecoder  # noqa: E402
from simulator.kv_events import block_removed, block_stored, encode_batch  # noqa: E402

BEFORE = "9d706c2"


def payloads(fmt: str, n: int, stored: int, removed: int, bs: int = 16, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(4096)]
    out = []
    for _ in range(min(n, 256)):
        toks = [rng.randrange(151_000) for _ in range(stored * bs)]
        events = [block_stored([rng.getrandbits(64) for _ in range(stored)], rng.choice(pool), toks, bs),
                  block_removed(rng.sample(pool, removed))]
        out.append(encode_batch(events, ts=time.time(), fmt=fmt))
    return [out[i % len(out)] for i in range(n)]


def load_before(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:consumers/kv_bridge.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kv-decode-before-")) / "kv_bridge_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kv_bridge_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.decode_frame


def per_frame_us(decode, frames: list[bytes]) -> float:
    t = time.process_time()
    for p in frames:
        decode(p)
    return (time.process_time() - t) / len(frames) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stored", type=int, default=48)
    ap.add_argument("--removed", type=int, default=48)
    ap.add_argument("--before", default=BEFORE)
    a = ap.parse_args()
    old = load_before(a.before)
    data = {f: payloads(f, a.frames, a.stored, a.removed) for f in ("0.33", "0.22", "array")}
    try:
        old(data["0.33"][0])
        old_reads_033 = True
    except Exception:  # noqa: BLE001 - the old decoder's FrameError
        old_reads_033 = False
    runs = {"before 0.22 (array events)": (old, "0.22"), "before array": (old, "array"),
            "now 0.33 (array batch of maps)": (FrameDecoder().decode, "0.33"),
            "now 0.22 (array events)": (FrameDecoder().decode, "0.22"),
            "now array": (FrameDecoder().decode, "array")}
    got: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):  # interleaved: every decoder once per round
        for name, (fn, fmt) in runs.items():
            got[name].append(per_frame_us(fn, data[fmt]))
    blocks = a.stored + a.removed
    print(f"{a.frames} frames x {a.rounds} rounds, {a.stored} stored + {a.removed} removed blocks per frame, "
          f"CPU time; before = git {a.before}; before reads 0.33 frames: {old_reads_033}")
    for name, xs in got.items():
        med = statistics.median(xs)
        print(f"{name:34s} median {med:7.2f} us/frame (min {min(xs):.2f}, max {max(xs):.2f}) "
              f"= {blocks / med * 1e6 / 1e6:.2f}M blocks/s")
    base = statistics.median(got["before 0.22 (array events)"])
    now = statistics.median(got["now 0.33 (array batch of maps)"])
    print(f"now on 0.33 vs before on its own shape (0.22): {base / now:.2f}x speed")


if __name__ == "__main__":
    main()
