"""Diagnosis bench: N simulated devices at 1 Hz through a real NATS into ``infernex diagnose``.

Starts an embedded nats-server, applies the topology under a prefix, runs ``infernex diagnose`` as
a child process (the real CLI), publishes one telemetry sample per device per second from
:class:`simulator.devices.SimulatedNode` s with faults injected at random times, and measures:

* telemetry-to-finding latency: receive time of each *open* finding minus the sample time of the
  telemetry that triggered it (``first_seen``; only rules without a ``for_s`` delay are injected);
* CPU share of the diagnose process (utime+stime from /proc over the publishing window, in % of one
  core), and whether it kept up (consumer backlog at the end).

    /work/venv/bin/python bench/diagnosis.py --devices 1000 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from consumers import bus  # noqa: E402
from infernex.embedded_nats import EmbeddedNats  # noqa: E402
from schemas import Diagnosis  # noqa: E402
from schemas import subjects as S  # noqa: E402
from schemas.config import NatsConfig  # noqa: E402
from simulator.devices import SimulatedNode  # noqa: E402
from streams.topology import build_topology  # noqa: E402

PREFIX = "bench"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def build_nodes(devices: int, seconds: int, start: float, faults: int, seed: int) -> list[SimulatedNode]:
    rng = random.Random(seed)
    nodes = []
    for i in range((devices + 7) // 8):
        kind = "npu" if i % 2 == 0 else "gpu"
        n = min(8, devices - 8 * i)
        nodes.append(SimulatedNode(f"node-{i:04d}", n, kind, seed=seed + i,
                                   pods={str(d): [f"pod-{i:04d}-{d}"] for d in range(n)}))
    for _ in range(faults):
        node = rng.choice(nodes)
        dev = rng.choice(node.devices)
        t = start + 5 + rng.uniform(0, max(1.0, seconds - 10))
        if node.kind == "npu":
            kind, params = rng.choice([("error_code", {"code": "0x80E01801"}), ("error_code", {"code": "0x80E18402"}),
                                       ("over_temperature", {"temp_c": 110}), ("hbm_ecc_burst", {"rate_per_s": 80}),
                                       ("power_spike", {})])
        else:
            kind, params = rng.choice([("xid", {"xid": 79}), ("xid", {"xid": 48}), ("power_spike", {}),
                                       ("over_temperature", {"temp_c": 100})])
        node.inject(dev, kind, start=t, duration=rng.uniform(5, 30), **params)
    return nodes


def service_p99(port: int, name: str) -> float | None:
    """Upper bound (ms) of the p99 bucket of one of the service's latency histograms."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    buckets = []
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            buckets = sorted((float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket"))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= 0.99 * total:
            return le * 1000
    return None


async def run(args) -> dict:
    store = tempfile.TemporaryDirectory(prefix="bench-diag-")
    server = EmbeddedNats(store.name)
    server.start()
    child = None
    try:
        cfg = NatsConfig(servers=[server.url], subject_prefix=PREFIX)
        nc = await bus.connect(cfg)
        js = nc.jetstream()
        await bus.apply_topology(js, build_topology(prefix=PREFIX))
        env = {**os.environ, "INFERNEX_NATS__SERVERS": server.url, "INFERNEX_NATS__SUBJECT_PREFIX": PREFIX}
        from infernex.embedded_nats import free_port

        mport = free_port()
        child = subprocess.Popen([sys.executable, "-m", "infernex.cli", "--log-level", "WARNING", "diagnose",
                                  "--durable", "bench", "--metrics-port", str(mport)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        # wait until the durable exists (the service is consuming)
        tele_stream = f"{PREFIX.upper()}_DEVICE_TELEMETRY"
        for _ in range(200):
            try:
                await js.consumer_info(tele_stream, "bench")
                break
            except Exception:  # noqa: BLE001 - not created yet
                if child.poll() is not None:
                    raise RuntimeError("diagnose exited: " + (child.stdout.read() or ""))
                await asyncio.sleep(0.1)
        latencies: list[float] = []
        statuses: dict[str, int] = {}

        async def on_diag(msg):
            now = time.time()
            d = Diagnosis.from_json(msg.data)
            statuses[d.status] = statuses.get(d.status, 0) + 1
            if d.status == "open" and d.fault_mode != "device_silent":
                latencies.append(now - d.first_seen)

        await nc.subscribe(S.with_prefix(PREFIX, S.ALL_DIAGNOSIS), cb=on_diag)
        start = time.time()
        nodes = build_nodes(args.devices, args.seconds, start, args.faults, args.seed)
        cpu0, wall0 = cpu_seconds(child.pid), time.monotonic()
        sent = 0
        late = 0
        for sec in range(args.seconds):
            due = start + sec
            delay = due - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late += 1
            for node in nodes:  # one node's exporter pushes its devices' samples, stamped now
                t = time.time()
                for s in node.sample(t):
                    await nc.publish(S.with_prefix(PREFIX, S.device_telemetry(s.node, s.device)), s.to_json())
                    sent += 1
                await nc.flush()  # on the wire now, not at the end of the round
        # let the consumer drain
        backlog = None
        for _ in range(100):
            info = await js.consumer_info(tele_stream, "bench")
            backlog = info.num_pending + info.num_ack_pending
            if backlog == 0:
                break
            await asyncio.sleep(0.1)
        cpu1, wall1 = cpu_seconds(child.pid), time.monotonic()
        await asyncio.sleep(1.0)
        svc_p99 = service_p99(mport, "infernex_diagnosis_latency_seconds")
        proc_p99 = service_p99(mport, "infernex_diagnosis_processing_seconds")
        await nc.drain()
        return {
            "devices": args.devices, "seconds": args.seconds, "samples_sent": sent, "publisher_late_seconds": late,
            "findings": statuses, "opens_measured": len(latencies),
            "latency_p50_ms": round(pct(latencies, 0.50) * 1000, 1),
            "latency_p99_ms": round(pct(latencies, 0.99) * 1000, 1),
            "latency_max_ms": round(max(latencies) * 1000, 1) if latencies else None,
            "service_sample_to_publish_p99_ms_le": svc_p99,
            "service_stored_to_publish_p99_ms_le": proc_p99,
            "diagnose_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 1),
            "backlog_at_end": backlog,
        }
    finally:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
        server.stop()
        store.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    for k, v in res.items():
        print(f"{k:32} {v}")


if __name__ == "__main__":
    main()
