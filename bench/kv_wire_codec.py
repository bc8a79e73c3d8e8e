"""In-process cost of the two ``kv.events`` encodings, per batch: the bridge's encode (after
vLLM's frame is decoded) and the indexer's decode, JSON vs binary, interleaved, best of N
(on a shared machine the minimum is the least disturbed figure).

Then the same frames down each path the code has, per frame / batch: the bridge's Python decode
and encode, its compiled array walk and encode, its transcoder (one call for 32 frames); the
indexer's schema decode (``decode_batch``), its checked wire struct (``wire_batch``) and a whole
group of 32 (``fold_group``). Needs numba for the compiled rows.

    python bench/kv_wire_codec.py [--rounds 7] [--stored 32] [--removed 8]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest_path import _frames  # noqa: E402
from consumers.index_codec import decode_batch, fold_group, wire_batch  # noqa: E402
from consumers.kv_transcode import Transcoder  # noqa: E402
from consumers.kv_bridge import _json_enc  # noqa: E402
from consumers.kv_wire import FrameDecoder, OutBatch  # noqa: E402
from schemas import kv_binary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--stored", type=int, default=32)
    ap.add_argument("--removed", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    frames = _frames(random.Random(1), 256, args.stored, args.removed, args.block_size, 1.0)
    dec = FrameDecoder()
    outs = []
    for i in range(args.batches):
        n = dec.decode(frames[i % len(frames)])
        outs.append(OutBatch(f"pod-{i % 4}", "bench-model", 0, 0, i // 4, n.ts, n.events))
    enc = {"json": _json_enc.encode, "binary": kv_binary.encode}
    data = {k: [f(o) for o in outs] for k, f in enc.items()}
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for k in (("json", "binary") if r % 2 == 0 else ("binary", "json")):
            f = enc[k]
            t = time.process_time()
            for o in outs:
                f(o)
            e = (time.process_time() - t) / len(outs)
            t = time.process_time()
            for d in data[k]:
                decode_batch(d)
            d_ = (time.process_time() - t) / len(outs)
            best[(k, "encode")] = min(best.get((k, "encode"), 1e9), e)
            best[(k, "decode")] = min(best.get((k, "decode"), 1e9), d_)
    size = {k: sum(map(len, v)) / len(v) for k, v in data.items()}
    print(f"batch: {args.stored} stored + {args.removed} removed blocks, block_size {args.block_size}; "
          f"best of {args.rounds} interleaved rounds of {args.batches} batches")
    for k in enc:
        print(f"  {k:6s}: {size[k]:,.0f} B/batch; bridge encode {best[(k, 'encode')] * 1e6:.1f} us; "
              f"indexer decode {best[(k, 'decode')] * 1e6:.1f} us per batch")
    print(f"  binary / json: size {size['binary'] / size['json']:.2f}x, encode "
          f"{best[('binary', 'encode')] / best[('json', 'encode')]:.2f}x, decode "
          f"{best[('binary', 'decode')] / best[('json', 'decode')]:.2f}x")
    paths(frames, args.rounds)


def paths(frames: list[bytes], rounds: int, run: int = 32) -> None:
    """Each path of the bridge and the indexer on the same frames, interleaved, best of ``rounds``."""
    python, compiled = FrameDecoder(), FrameDecoder(compiled=True)
    tc = Transcoder("pod-0", "bench-model", 0, python.groups)

    def bridge(dec):
        def go():
            for i, f in enumerate(frames):
                n = dec.decode(f)
                kv_binary.encode(OutBatch("pod-0", "bench-model", 0, 0, i, n.ts, n.events))
        return go

    def transcode():
        for i in range(0, len(frames), run):
            tc.transcode(frames[i:i + run], i, 0)

    encoded = [b for i in range(0, len(frames), run) for b, _, _ in tc.transcode(frames[i:i + run], i, 0)]
    groups = [kv_binary.group(encoded[i:i + run]) for i in range(0, len(encoded), run)]
    cases = {
        "bridge: Python decode + encode": bridge(python),
        "bridge: compiled array walk + encode": bridge(compiled),
        f"bridge: transcoder ({run} frames a call)": transcode,
        "indexer: decode_batch (schema objects)": lambda: [decode_batch(b) for b in encoded],
        "indexer: wire_batch (checked wire struct)": lambda: [wire_batch(b) for b in encoded],
        f"indexer: fold_group ({run} batches a group)": lambda: [fold_group(g) for g in groups],
    }
    for f in cases.values():
        f()  # compile / warm
    best = dict.fromkeys(cases, 1e9)
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            t = time.process_time()
            cases[name]()
            best[name] = min(best[name], (time.process_time() - t) / len(frames))
    print(f"per frame / batch, best of {rounds} interleaved rounds of {len(frames)} frames:")
    for name, v in best.items():
        print(f"  {name:44s} {v * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
