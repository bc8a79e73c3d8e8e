"""CPU per request of the router's request path in-process, without sockets: what bench/router.py's
HTTP figure holds besides HTTP, measured with far less noise, side by side with older code.

    python -P bench/router_path.py [--strategies kv-aware,round-robin] [--requests 4000] [--reps 5]
        [--prompt-chars 7400] [--before-ref REF] [--router-tokenizer tests/fixtures/tokenize] [--fresh]

Per request, as ``RouterService`` does it for a non-streamed completion: the body decoded, the
routing request (tokenizing the prompt for strategies that read prefixes), the decision (block
keys, the embedded index's query, the strategy's filters and scorers), the route noted (the
predicted blocks) and the backend's counts started; 64 requests stay in flight. The prompts are
bench/router.py's (one of 8 shared documents, 80% of the text, then a fresh question) over 8
backends that send no KV events, so every prefix the index knows is a prediction. Each rep is a
fresh router (2,000 requests to warm it, then ``--requests`` timed; the 4,000 prompts in turn, or
with ``--fresh`` a new prompt each time). Each tree (this one, and
``--before-ref`` extracted with ``git archive``) runs in its own process, reps interleaved. The
figure is process CPU time per request: min and median over reps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import asyncio, importlib.util, json, os, sys, time
tree, strategy, n, chars, tok, fresh = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6], sys.argv[7] == "1"
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("tsp", os.path.join(sys.argv[5], "tokenizer_speed.py"))
tsp = importlib.util.module_from_spec(spec); spec.loader.exec_module(tsp)
sys.path.insert(0, tree)  # (the prompt module puts its own tree first)
import logging; logging.disable(logging.WARNING)
import msgspec
from infernex.commands.router import _parse_backend
from router.app import RouterApp
from router.config import RouterConfig
from router.server import RouterService, _Flow
from simulator.tokenizer import warm_up as warm_tokenizer
from streams.kv_index import warm_up

cfg = RouterConfig().model_copy(update={"bus": False, "strategy": strategy, "backends": [
    _parse_backend(f"fake-{i}=http://127.0.0.1:{9000 + i}@m") for i in range(8)], **({"tokenizer": tok} if tok else {})})
app = RouterApp(cfg)
warm_up(); warm_tokenizer()
svc = RouterService(cfg, state=app.state, index=app.index, registry=app.registry, records=None)
raws = [msgspec.json.encode({"model": "m", "prompt": p, "max_tokens": 2}) for p in tsp.make_prompts(2000 + n if fresh else 4000, chars)]
inflight = []
picks = {}

def one(i):
    raw = raws[i % len(raws)]
    body = msgspec.json.decode(raw)
    rreq = svc._routing_request("completions", body, f"r{i}", len(raw))
    flow = _Flow(rid=f"r{i}", kind="completions", path="/v1/completions", body=body, stream=False,
                 arrival=0.0, t0=0.0, rreq=rreq, raw=raw)
    d = svc._decide(rreq, flow)
    svc._note_route(flow, d)
    svc._started(d.target, rreq.prompt_tokens, rreq.prompt_tokens)
    inflight.append((d.target, rreq.prompt_tokens))
    if len(inflight) > 64:
        b, pt = inflight.pop(0)
        svc._finished(b, pt, 0)
    picks[d.target.pod] = picks.get(d.target.pod, 0) + 1

for i in range(2000):
    one(i)
picks.clear()
t = time.process_time()
for i in range(2000, 2000 + n):
    one(i)
import router
assert os.path.dirname(os.path.dirname(os.path.abspath(router.__file__))) == os.path.abspath(tree), router.__file__
print(json.dumps({"us": (time.process_time() - t) / n * 1e6, "picks": sorted(picks.values())}))
"""


def run_one(tree: str, strategy: str, n: int, chars: int, tokenizer: str | None = None, fresh: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", _CHILD, tree, strategy, str(n), str(chars),
                          os.path.join(ROOT, "bench"), tokenizer or "", "1" if fresh else "0"], capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{tree} {strategy}: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="kv-aware,round-robin")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-chars", type=int, default=7400)
    ap.add_argument("--before-ref", default=None, help="also run the code at this git ref, reps interleaved")
    ap.add_argument("--router-tokenizer", default=None,
                    help="tokenize with this tokenizer.json (or its folder), e.g. tests/fixtures/tokenize, instead of the toy one")
    ap.add_argument("--fresh", action="store_true",
                    help="no prompt comes twice (each question new), instead of 4,000 prompts in turn")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    trees = [("this tree", ROOT)]
    if args.before_ref:
        from peers import extract_ref

        trees.append((f"@{args.before_ref}", extract_ref(args.before_ref)))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for strategy in args.strategies.split(","):
        got: dict[str, list[float]] = {label: [] for label, _ in trees}
        spread = {}
        for _ in range(args.reps):
            for label, tree in trees:
                r = run_one(tree, strategy, args.requests, args.prompt_chars,
                            args.router_tokenizer and os.path.abspath(args.router_tokenizer), args.fresh)
                got[label].append(r["us"])
                spread[label] = r["picks"]
        for label, _ in trees:
            xs = got[label]
            print(f"{strategy:<12} {label:<16} CPU per request: min {min(xs):6.1f} us, median {statistics.median(xs):6.1f} us "
                  f"over {args.reps} reps of {args.requests} (requests per backend in the last: {spread[label]})")


if __name__ == "__main__":
    main()
