"""Does the index hold what the engines hold? Ours and Dynamo's, against the engines' own state.

    python bench/index_agreement.py [--pods 4] [--requests 1500] [--queries 200] [--gpu-blocks 400]

Simulated engines (``simulator.engine_core.EngineCore``, the prefix cache that emits vLLM's KV
events, with a small cache so blocks are evicted all the time) serve a workload of shared
system prompts and growing multi-turn conversations, each request on a random pod, and
one engine's cache reset half way (``AllBlocksCleared``). Each engine
step's events go out as a vLLM 0.33 frame on that pod's ZMQ PUB socket. Two subscribers read the
same sockets at the same time:

* ours: ``infernex bridge vllm-kv`` per pod -> a file-backed JetStream -> ``IndexerService``
  (as ``infernex indexer`` runs it);
* Dynamo's standalone indexer (``python -m dynamo.indexer``, ai-dynamo-runtime from
  ``--dynamo-python``, by default bench/peers.py's cached venv; ``none`` leaves it out).

When both have applied every frame, ``--queries`` token sequences (whole prompts, prompts cut at
a random length, prompts with a new tail, unseen text) are asked of both over HTTP, and each
pod's matched blocks are compared with the ground truth: the leading blocks of the query whose
hashes are in that engine's prefix cache now (``EngineCore.cached_block_hashes``).
Exit status 1 when our index disagrees with the engines on any query.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODEL = "bench-model"
DYNAMO_APPLIED = "dynamo_kvrouter_kv_cache_events_applied"


# ---------------------------------------------------------------- the workload (engines in virtual time)

class Workload:
    """Engines, the requests they served and what each was sent, all deterministic from ``seed``."""

    def __init__(self, pods: int, gpu_blocks: int, block_size: int, seed: int):
        from simulator.config import EngineConfig
        from simulator.engine_core import EngineCore

        self.rng = random.Random(seed)
        self.block_size = block_size
        self.engines = [EngineCore(EngineConfig(engine_id=f"pod-{i}", served_model_name=MODEL, block_size=block_size,
                                                num_gpu_blocks=gpu_blocks, max_model_len=gpu_blocks * block_size))
                        for i in range(pods)]
        self.now = [0.0] * pods
        r = self.rng
        self.systems = [self._tokens(r.randint(2, 24) * block_size + r.randrange(block_size)) for _ in range(12)]
        self.conversations: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.events = {"stored": 0, "removed": 0, "cleared": 0}
        self._n = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 30_000) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        r = self.rng
        if self.conversations and r.random() < 0.6:  # the next turn of a conversation
            c = r.randrange(len(self.conversations))
            self.conversations[c] = self.conversations[c] + self._tokens(r.randint(5, 120))
            return self.conversations[c]
        conv = r.choice(self.systems) + self._tokens(r.randint(10, 200))
        self.conversations.append(conv)
        if len(self.conversations) > 60:
            self.conversations.pop(0)
        return conv

    def serve(self, pod: int, prompt: list[int]):
        """One request on ``pod`` to its end; yields each step's events (non-empty lists)."""
        eng = self.engines[pod]
        self._n += 1
        budget = eng.num_blocks * self.block_size - len(prompt)
        eng.add_request(f"r{self._n}", prompt, max(1, min(8, budget - 1)), self.now[pod])
        self.prompts.append(prompt)
        while eng.has_work:
            res = eng.step(self.now[pod])
            self.now[pod] = max(self.now[pod] + 1e-4, res.end)
            events = res.events + eng.take_pending_events()
            if events:
                for e in events:
                    name = type(e).__name__
                    self.events["stored" if "Stored" in name else "removed" if "Removed" in name else "cleared"] += 1
                yield events

    def truth(self, tokens: list[int]) -> dict[str, int]:
        """Per pod, the leading full blocks of ``tokens`` in that engine's prefix cache now."""
        out = {}
        for i, eng in enumerate(self.engines):
            held = eng.cached_block_hashes()
            n = 0
            for key in eng.hasher.hash_blocks(tokens):
                if eng._external(key) not in held:
                    break
                n += 1
            out[f"pod-{i}"] = n
        return out


def queries(w: Workload, n: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    recent = w.prompts[-600:]
    out = []
    for k in range(n):
        kind = k % 4
        p = r.choice(recent)
        if kind == 0:
            out.append(list(p))
        elif kind == 1:
            out.append(p[:r.randint(1, len(p))])
        elif kind == 2:
            out.append(p[:r.randint(1, len(p))] + [r.randrange(100, 30_000) for _ in range(r.randint(1, 64))])
        else:
            out.append(r.choice(w.systems)[:r.randint(1, 200)] if k % 8 == 3 else
                       [r.randrange(100, 30_000) for _ in range(r.randint(16, 400))])
    return out


# ---------------------------------------------------------------- the two indexes

async def _get_metric_sum(http, url: str, prefix: str) -> float:
    text = (await http.get(url)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def main_async(args) -> int:
    import httpx
    import zmq

    from infernex.embedded_nats import EmbeddedNats, free_port
    from ingest_path import _dynamo_outcomes, bus_and_indexer, stop_procs
    from simulator.kv_events import block_removed, block_stored, encode_batch

    w = Workload(args.pods, args.gpu_blocks, args.block_size, args.seed)
    tmp = tempfile.mkdtemp(prefix="bench-agree-")
    server = EmbeddedNats(Path(tmp) / "store")
    server.start()
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    try:
        env, ix_port = await bus_and_indexer(server, tmp, procs)  # ingest_path's indexer role
        ports = [free_port() for _ in range(args.pods)]
        socks = []
        for p in ports:
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
            s.bind(f"tcp://127.0.0.1:{p}")
            socks.append(s)
        mports = [free_port() for _ in ports]
        for i, p in enumerate(ports):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "infernex.cli", "bridge", "vllm-kv", "--endpoint", f"tcp://127.0.0.1:{p}",
                 "--pod", f"pod-{i}", "--model", MODEL, "--metrics-port", str(mports[i])],
                env=env, stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / f"bridge-{i}.log", "w")))
        dyn_port = None
        if args.dynamo_python:
            dyn_port = free_port()
            workers = ",".join(f"{i}=tcp://127.0.0.1:{p}" for i, p in enumerate(ports))
            procs.append(subprocess.Popen([args.dynamo_python, "-m", "dynamo.indexer", "--port", str(dyn_port),
                                           "--block-size", str(args.block_size), "--workers", workers],
                                          stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "dynamo.log", "w")))
        seqs = [0] * args.pods

        def send(pod: int, events) -> None:
            frame = encode_batch(events, ts=time.time())
            socks[pod].send_multipart((b"kv@", seqs[pod].to_bytes(8, "big"), frame))
            seqs[pod] += 1

        # ZMQ drops what a PUB sends before a subscriber has joined: store a marker block on every
        # pod until both sides have seen one, then remove it, then the workload
        # (a new engine hash each time, all removed after: a pod that got the marker twice holds
        # two copies, which one removal would leave behind in our index, counted as copies)
        marker_tokens = list(range(1, args.block_size + 1))
        markers: list[int] = []
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                markers.append((1 << 62) + 7 + len(markers))
                for i in range(args.pods):
                    send(i, [block_stored([markers[-1]], None, marker_tokens, args.block_size)])
                await asyncio.sleep(0.1)
                try:
                    ok = True
                    for i, mp_ in enumerate(mports):
                        text = (await http.get(f"http://127.0.0.1:{mp_}/metrics")).text
                        ok &= ("infernex_kv_bridge_frames_total" in text and
                               f'infernex_kv_bridge_frames_total{{path="live",pod="pod-{i}"}} 0.0' not in text)
                    if dyn_port:
                        listeners = (await http.get(f"http://127.0.0.1:{dyn_port}/workers")).json()
                        ok &= len(listeners) == args.pods and await _get_metric_sum(
                            http, f"http://127.0.0.1:{dyn_port}/metrics", DYNAMO_APPLIED) >= args.pods * 2
                except (httpx.HTTPError, ValueError):
                    ok = False
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the subscribers never received a frame")
            for i in range(args.pods):
                send(i, [block_removed(list(markers))])
            ours_url = f"http://127.0.0.1:{ix_port}"

            async def counts() -> tuple[float, float]:
                async with httpx.AsyncClient() as c:
                    a = await _get_metric_sum(c, ours_url + "/metrics", "infernex_indexer_batches_total ")
                    b = await _get_metric_sum(c, f"http://127.0.0.1:{dyn_port}/metrics", DYNAMO_APPLIED) \
                        if dyn_port else 0.0
                return a, b

            last, still = await counts(), 0
            while still < 5:  # the warm-up's frames all applied (nothing new for 0.5 s)
                await asyncio.sleep(0.1)
                now = await counts()
                still = still + 1 if now == last else 0
                last = now
            base_ours, base_dyn = last

            t0 = time.perf_counter()
            frames = 0
            for k in range(args.requests):
                pod = w.rng.randrange(args.pods)
                for events in w.serve(pod, w.next_prompt()):
                    send(pod, events)
                    frames += 1
                if k == args.requests // 2:  # one engine's prefix cache reset (AllBlocksCleared) mid-run
                    w.engines[0].reset_prefix_cache()
                    send(0, w.engines[0].take_pending_events())
                    w.events["cleared"] += 1
                    frames += 1
                if k % 50 == 49:
                    await asyncio.sleep(0.01)  # let the sockets drain
            print(f"workload: {args.requests} requests on {args.pods} engines ({args.gpu_blocks} blocks each), "
                  f"{frames} frames, events {w.events}, {time.perf_counter() - t0:.1f} s", flush=True)
            print("cached blocks now: " + ", ".join(f"pod-{i} {len(e.cached_block_hashes())}"
                                                    for i, e in enumerate(w.engines)), flush=True)

            # wait until both have applied everything: ours counts batches, Dynamo events
            want_dyn = base_dyn + sum(w.events.values())
            deadline = time.monotonic() + args.timeout
            while True:
                got, dgot = await counts()
                if (got >= base_ours + frames and dgot >= want_dyn) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            print(f"applied: ours {got - base_ours:.0f} of {frames} frames"
                  + (f", dynamo {dgot - base_dyn:.0f} of {want_dyn - base_dyn:.0f} events" if dyn_port else
                     ", dynamo left out"), flush=True)
            held = {p: v["total_blocks"] for p, v in (await http.get(f"{ours_url}/v1/index/pods")).json()["pods"].items()}
            engines = {f"pod-{i}": len(e.cached_block_hashes()) for i, e in enumerate(w.engines)}
            print(f"  our index holds {held}: {'as' if held == engines else 'NOT as (not valid)'} the engines", flush=True)
            if dyn_port:  # (the count above is over every outcome: a rejected event counts as applied)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{dyn_port}", timeout=5) as dh:
                    outcomes = await _dynamo_outcomes(dh)
                bad = {k: v for k, v in outcomes.items() if not k.endswith(":ok")}
                print(f"  dynamo's events by outcome: {outcomes}"
                      + (f" (NOT VALID: it rejected {sum(bad.values()):.0f})" if bad else ""), flush=True)

            qs = queries(w, args.queries, args.seed + 1)
            agree = {"ours": 0, "dynamo": 0, "ours=dynamo": 0}
            shown = {"ours": 0, "dynamo": 0}
            matched_truth = 0
            for k, q in enumerate(qs):
                truth = w.truth(q)
                matched_truth += any(truth.values())
                r = await http.post(f"{ours_url}/v1/index/query", json={"model": MODEL, "token_ids": q})
                r.raise_for_status()
                pods = r.json()["pods"]
                ours = {p: pods.get(p, {}).get("matched_blocks", 0) for p in truth}
                agree["ours"] += ours == truth
                if ours != truth and shown["ours"] < 3:
                    shown["ours"] += 1
                    print(f"  ours differs: {len(q)} tokens, truth {truth}, ours {ours}")
                if dyn_port:
                    r = await http.post(f"http://127.0.0.1:{dyn_port}/query",
                                        json={"token_ids": q, "model_name": "default"})
                    r.raise_for_status()
                    dyn = dynamo_scores(r.json(), args.pods, args.block_size)
                    if k == 0:
                        print(f"  (dynamo's first answer: {json.dumps(r.json())[:300]})")
                    agree["dynamo"] += dyn == truth
                    agree["ours=dynamo"] += dyn == ours
                    if dyn != truth and shown["dynamo"] < 3:
                        shown["dynamo"] += 1
                        print(f"  dynamo differs: {len(q)} tokens, truth {truth}, dynamo {dyn}")
            n = len(qs)
            print(f"{n} queries ({matched_truth} with a cached prefix on some pod):")
            print(f"  ours   == engines: {agree['ours']}/{n}")
            if dyn_port:
                print(f"  dynamo == engines: {agree['dynamo']}/{n}")
                print(f"  ours   == dynamo:  {agree['ours=dynamo']}/{n}")
            return 0 if agree["ours"] == n else 1
    finally:
        stop_procs(procs)
        ctx.destroy(linger=0)
        server.stop()


def dynamo_scores(body: dict, pods: int, block_size: int) -> dict[str, int]:
    """Dynamo's ``/query`` answer as ``{pod-i: matched blocks}``: ``scores`` maps a worker id to
    its matched tokens (blocks x block size), or to ``{dp_rank: tokens}``; pods it leaves out
    matched nothing."""
    out = {f"pod-{i}": 0 for i in range(pods)}
    for wid, v in (body.get("scores") or {}).items():
        if isinstance(v, dict):
            v = max(v.values(), default=0)
        out[f"pod-{int(str(wid).split(':')[0])}"] = int(v) // block_size
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--gpu-blocks", type=int, default=400, help="each engine's KV cache, blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--dynamo-python", default="auto",
                    help="python of a venv with ai-dynamo-runtime; auto: bench/peers.py's cached venv; none: leave out")
    args = ap.parse_args()
    from peers import dynamo_python, peer_version

    args.dynamo_python = dynamo_python(args.dynamo_python)
    if args.dynamo_python:
        print(f"peer: ai-dynamo-runtime {peer_version(args.dynamo_python, 'ai-dynamo-runtime')} (python -m dynamo.indexer)")
    try:
        import uvloop

        code = uvloop.run(main_async(args))
    except ImportError:
        code = asyncio.run(main_async(args))
    sys.exit(code)


if __name__ == "__main__":
    main()
