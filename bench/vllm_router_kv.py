"""A real third-party consumer of vLLM KV events on the simulator's wire: vllm-router's
``kv_aware`` policy in front of simulated engines, on a prefix-sharing workload.

vllm-router (PyPI ``vllm-router``, a Rust binary in the wheel) subscribes to each engine's ZMQ
KV events (``--kv-event-source WORKER_URL=ENDPOINT``, replay through
``--kv-event-replay-source``), indexes the blocks by their tokens, asks each engine's
``/v1/completions/render`` for a request's tokens and credits the cached prefix it finds
(``credited_prefix_tokens`` in its debug log, ``vllm_router_kv_placement_lookups_total`` on its
metrics). If the simulator's events differ from vLLM's, the router credits nothing.

The router runs from ``~/.cache/infernex-vllm-router`` (a venv made there on first use:
``pip download --no-deps vllm-router==VERSION`` into ``~/.cache/infernex-vllm-wheels``, then
installed with its few Python dependencies); nothing is added to the project's environment.

Usage::

    python bench/vllm_router_kv.py [--engines 2] [--systems 4] [--requests 32]
                                   [--formats 0.33,0.22] [--router-version 0.1.17]

Per KV-event format (one fresh cluster and router each) it prints the router's lookups (hit /
miss), the decisions that credited a cached prefix, the credited tokens, and the tokens the
engines really served from their prefix caches (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.cluster import EngineSpec, SimCluster  # noqa: E402
from simulator.config import EngineConfig  # noqa: E402

CACHE = Path(os.environ.get("INFERNEX_VLLM_ROUTER_HOME", "~/.cache/infernex-vllm-router")).expanduser()
WHEELS = Path(os.environ.get("INFERNEX_VLLM_WHEELS", "~/.cache/infernex-vllm-wheels")).expanduser()
MODEL = "sim-model"
BLOCK = 16
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CREDIT = re.compile(r"KV prefix decision.*?credited_prefix_tokens=(\d+)")


def router_binary(version: str) -> Path:
    """vllm-router from the cache folder, installed there on first use."""
    venv = CACHE / f"venv-{version}"
    exe = venv / "bin" / "vllm-router"
    if exe.exists():
        return exe
    WHEELS.mkdir(parents=True, exist_ok=True)
    wheels = sorted(WHEELS.glob(f"vllm_router-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(WHEELS),
                        f"vllm-router=={version}"], check=True)
        wheels = sorted(WHEELS.glob(f"vllm_router-{version}-*.whl"))
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheels[0])], check=True)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def run(fmt: str, exe: Path, a: argparse.Namespace, log_path: Path) -> dict:
    specs = [EngineSpec(EngineConfig(served_model_name=MODEL, engine_id=f"e{i}", block_size=BLOCK,
                                     num_gpu_blocks=a.gpu_blocks, kv_events_format=fmt),
                        kv_port=_free_port(), replay_port=_free_port()) for i in range(a.engines)]
    cluster = SimCluster(specs, time_scale=a.time_scale).start()
    port, mport = _free_port(), _free_port()
    args = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
            "--worker-urls", *[h.url for h in cluster], "--kv-event-block-size", str(BLOCK),
            "--kv-event-model", MODEL, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
            "--log-level", "debug"]
    for h in cluster:
        args += ["--kv-event-source", f"{h.url}={h.kv_endpoint}", "--kv-event-replay-source",
                 f"{h.url}={h.replay_endpoint}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    engine_cached = prompt_tokens = 0
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        rng = random.Random(a.seed)
        systems = [" ".join(f"s{k}w{rng.randrange(10_000)}" for _ in range(a.system_words)) for k in range(a.systems)]
        order = [i % a.systems for i in range(a.requests)]
        rng.shuffle(order)
        with httpx.Client(timeout=60) as http:
            for i, k in enumerate(order):
                prompt = systems[k] + f" user {i}: " + " ".join(f"q{rng.randrange(10_000)}" for _ in range(12))
                r = http.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
                r.raise_for_status()
                usage = r.json()["usage"]
                prompt_tokens += usage["prompt_tokens"]
                engine_cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                time.sleep(a.gap_s)  # let the step's KV events reach the router
            metrics = http.get(f"http://127.0.0.1:{mport}/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        cluster.stop()
    lookups = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'^vllm_router_kv_placement_lookups_total\{result="(\w+)"\} (\S+)', metrics, re.M)}
    credits = [int(x) for x in _CREDIT.findall(_ANSI.sub("", log_path.read_text()))]
    return {"format": fmt, "lookups_hit": int(lookups.get("hit", 0)), "lookups_miss": int(lookups.get("miss", 0)),
            "decisions": len(credits), "credited_decisions": sum(1 for c in credits if c > 0),
            "credited_tokens": sum(credits), "engine_cached_tokens": engine_cached, "prompt_tokens": prompt_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--formats", default="0.33,0.22", help="the simulator's --vllm-format per run")
    ap.add_argument("--router-version", default="0.1.17")
    ap.add_argument("--gpu-blocks", type=int, default=4096)
    ap.add_argument("--time-scale", type=float, default=50.0)
    ap.add_argument("--gap-s", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-dir", default=str(CACHE / "logs"))
    a = ap.parse_args()
    exe = router_binary(a.router_version)
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"vllm-router {a.router_version} ({exe}), policy kv_aware, {a.engines} simulated engines, "
          f"{a.requests} requests over {a.systems} shared system prompts of {a.system_words} words")
    for fmt in a.formats.split(","):
        r = run(fmt, exe, a, Path(a.log_dir) / f"vllm-router-{fmt}.log")
        print(f"simulator --vllm-format {fmt}: router lookups hit {r['lookups_hit']} / miss {r['lookups_miss']}; "
              f"decisions crediting a cached prefix {r['credited_decisions']}/{r['decisions']}, "
              f"credited_prefix_tokens {r['credited_tokens']}; engines served {r['engine_cached_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens from cache")


if __name__ == "__main__":
    main()
