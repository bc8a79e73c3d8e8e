"""What recording a decision's inputs (for exact replay) costs the router.

On the request path the router now copies every backend of the snapshot it decided on
(:func:`router.records.capture_backends`); the record itself (inputs mapping, prompt block keys,
JSON) is built later by the publisher task. This measures, side by side in one process, for a
kv-aware decision over N backends with a 1000-token prompt:

* ``decide``: ``Router.decide`` alone (what the request path paid before);
* ``decide + capture``: the same plus the synchronous capture (what it pays now), when the
  decision shares its load epoch with an earlier one, and when it does not (``new epoch``);
* ``record build``: the publisher's work per decision (inputs + keys + JSON), off the request path,
  and ``record build, before``: the same record without inputs;
* ``redecide``: replaying one recorded decision (:func:`consumers.redecide.redecide`).

Run: ``python -P bench/decision_inputs.py [--backends 64] [--rounds 7] [--n 2000]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumers.redecide import redecide  # noqa: E402
from router.core import Router  # noqa: E402
from router.records import BackendCapture, capture_backends, decision_inputs, decision_json  # noqa: E402
from router.types import BackendState, RoutingRequest  # noqa: E402
from schemas.records import RoutingDecision  # noqa: E402
from streams.clock import ManualClock  # noqa: E402
from streams.kv_index import KvIndex  # noqa: E402


def setup(n_backends: int):
    rng = random.Random(1)
    backends = [BackendState(pod=f"pod-{i}", url=f"http://p{i}", model="m", waiting=rng.randint(0, 9),
                             running=rng.randint(0, 40), kv_usage=rng.random(), cpu_util=rng.random(),
                             mem_util=rng.random(), inflight=rng.randint(0, 4), active_tokens=rng.randint(0, 9000))
                for i in range(n_backends)]
    index = KvIndex(ManualClock(0))
    toks = [rng.randrange(50_000) for _ in range(1000)]
    return backends, index, RoutingRequest(model="m", request_id="r", token_ids=toks, prompt_tokens=len(toks))


def per_call(fn, n: int) -> float:
    """CPU microseconds per call (process time: other processes on a busy machine do not count)."""
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    backends, index, req = setup(a.backends)
    router = Router("kv-aware", seed=0)

    def decide():
        return router.decide(req, backends, index, 0.0)

    cap_obj = BackendCapture()

    def decide_capture():  # decisions within one load epoch share the copy of the load fields
        d = router.decide(req, backends, index, 0.0)
        cap_obj(backends, 1)
        return d

    def decide_capture_new_epoch():  # every decision in a new epoch: everything copied
        d = router.decide(req, backends, index, 0.0)
        capture_backends(backends)
        return d

    d = decide()
    cap = capture_backends(backends)

    def build():
        inputs = decision_inputs(strategy=router.strategy, request=req, exclude=frozenset(), backends=cap,
                                 now=0.0, block_size=d.block_size, overlap=d.stages[0].overlap)
        return decision_json(request_id="r", ts=1.0, pool="p", model="m", profile=d.profile, stage=d.stages[0],
                             inputs=inputs)

    def build_before():  # the record as it was written before inputs were recorded
        return decision_json(request_id="r", ts=1.0, pool="p", model="m", profile=d.profile, stage=d.stages[0])

    rec = RoutingDecision.model_validate_json(build())

    def replay():
        return redecide([rec])

    rows: dict[str, list[float]] = {"decide": [], "decide + capture": [], "decide + capture, new epoch": [],
                                    "record build, before": [], "record build": [], "redecide": []}
    for _ in range(a.rounds):  # interleaved rounds: the machine's load hits every variant alike
        rows["decide"].append(per_call(decide, a.n))
        rows["decide + capture"].append(per_call(decide_capture, a.n))
        rows["decide + capture, new epoch"].append(per_call(decide_capture_new_epoch, a.n))
        rows["record build, before"].append(per_call(build_before, max(1, a.n // 4)))
        rows["record build"].append(per_call(build, max(1, a.n // 4)))
        rows["redecide"].append(per_call(replay, max(1, a.n // 4)))
    print(f"{a.backends} backends, 1000-token prompt, kv-aware; median of {a.rounds} rounds, CPU us per call")
    for k, v in rows.items():
        print(f"  {k:<28} {statistics.median(v):8.1f}")
    base = statistics.median(rows["decide"])
    for k in ("decide + capture", "decide + capture, new epoch"):
        now = statistics.median(rows[k])
        print(f"  request path, {k}: {now / base:.3f}x ({now - base:+.1f} us per decision)")
    before, now = statistics.median(rows["record build, before"]), statistics.median(rows["record build"])
    print(f"  publisher (off the request path): {now / before:.3f}x ({now - before:+.1f} us per decision)")
    print(f"  record size: {len(build())} bytes of JSON, {len(build_before())} before")


if __name__ == "__main__":
    main()
