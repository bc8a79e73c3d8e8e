"""Replay reproduces live routing decisions exactly.

A live router (real nats-server, fake engines) decides 200 requests while engine load, device
telemetry from simulated NPUs (utilisation and memory: the health score's cpu/mem terms) and
device faults (an ECC burst and an HBM error code, diagnosed by the real diagnosis engine into
warning and critical findings) change under it, and KV events give some
prompts a cached prefix. Every decision is then read back from JetStream and re-run from what was
recorded with it: the scores per scorer, totals and picks must be float-equal. The state rebuilt
from history once the load is quiet must also equal the live router's view (device telemetry
included), so replay without recorded inputs starts from the right state.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from consumers import bus
from consumers.redecide import attempts, compare, explain, redecide
from infernex.commands.replay import Window, fold_window
from infernex.incident import ReplayState
from infernex.settings import Settings
from router.app import RouterApp
from router.config import RouterConfig
from router.testing import FakeEngine, wait_for
from schemas import BlockStored, EngineAnnouncement, EngineMetrics, KvEventBatch
from schemas import subjects as S
from simulator.devices import SimulatedNode
from simulator.tokenizer import SimpleTokenizer
from streams.clock import ManualClock
from streams.diagnosis import DiagnosisEngine, build_ruleset

PODS = ("a", "b", "c", "d")
N = 200


async def pub(js, prefix, subject, event):
    await bus.publish(js, S.with_prefix(prefix, subject), event.to_json())


def _prompt(i: int) -> str:
    # four shared 64-token prefixes, each followed by a per-request tail
    return " ".join(f"p{i % 4}w{k}" for k in range(64)) + " " + " ".join(f"r{i}x{k}" for k in range(8 + i % 24))


async def test_two_hundred_live_decisions_replay_float_equal(nats_config, topology, nc, prefix):
    rng = random.Random(7)
    engines = [await FakeEngine(p, tokens=2).start() for p in PODS]
    app = RouterApp(RouterConfig(strategy="kv-aware", seed=3, records=True), nats_config)
    url = await app.start("127.0.0.1", 0)
    js = nc.jetstream()
    try:
        now = time.time()
        for e in engines:
            await pub(js, prefix, S.engine_announce(e.pod), EngineAnnouncement(
                pod=e.pod, url=e.url, model="m", ts=now, node="n1", devices=[str(PODS.index(e.pod))], ttl_s=3600))
        assert await wait_for(lambda: len(app.state.snapshot()) == 4, timeout=15)
        tok = SimpleTokenizer()
        for j, pod in enumerate(("b", "c")):  # prefixes 0 and 1 cached on b and c
            ids = tok.encode(_prompt(j))[:64]
            await pub(js, prefix, S.kv_events("m", pod), KvEventBatch(pod=pod, model="m", seq=0, ts=now, events=[
                BlockStored(block_hashes=[100 * (j + 1) + k for k in range(4)], token_ids=ids, block_size=16)]))

        # simulated NPUs (device i runs pod PODS[i]) with faults, diagnosed by the real engine: a
        # single-bit ECC burst on a's device (warning), an HBM uncorrectable-error code on d's (critical)
        sim = SimulatedNode("n1", 4, "npu", seed=5, pods={str(i): [p] for i, p in enumerate(PODS)}, load=0.7)
        sim.inject(0, "hbm_ecc_burst", 30, 40, rate_per_s=40)
        sim.inject(3, "error_code", 30, 40, code="0x80E01801")
        diag_clock = ManualClock(now)
        diag = DiagnosisEngine(build_ruleset(), diag_clock)

        async def churn(step: int) -> None:
            t = time.time()
            diag_clock.set(t)
            for pod in PODS:
                await pub(js, prefix, S.engine_metrics(pod), EngineMetrics(
                    pod=pod, model="m", ts=t, num_requests_running=rng.randint(0, 40),
                    num_requests_waiting=rng.randint(0, 12), kv_cache_usage_perc=round(rng.random(), 3)))
            for sample in sim.sample(step * 10.0):  # ten simulated seconds per step, stamped now
                sample = sample.model_copy(update={"ts": t})
                await pub(js, prefix, S.device_telemetry("n1", sample.device), sample)
                for d in diag.observe(sample):
                    await pub(js, prefix, S.diagnosis("n1", sample.device), d)

        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> str:
                async with s.post(url + "/v1/completions", json={"model": "m", "prompt": _prompt(i),
                                                                "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
                    return r.headers.get("X-Request-Id") or ""

            for step in range(N // 20):
                await churn(step)
                await asyncio.sleep(0.05)
                await asyncio.gather(*(one(step * 20 + k) for k in range(20)))  # concurrent: in-flight counts
        await app.records.flush()
        # quiet: the live view, to compare with the state rebuilt from history
        await asyncio.sleep(0.3)
        live = {b.pod: (b.waiting, b.running, b.kv_usage, b.cpu_util, b.mem_util, b.health)
                for b in app.state.snapshot()}
        instant = time.time()
    finally:
        await app.stop(drain=True)
        for e in engines:
            await e.stop()

    st = ReplayState()
    await fold_window(Settings(nats=nats_config), Window(None, instant, None,
                                                         ["router.>", "engine.>", "device.telemetry.>",
                                                          "diagnosis.>"]), st)
    hist = {b.pod: (b.waiting, b.running, b.kv_usage, b.cpu_util, b.mem_util, b.health)
            for b in st.cluster.snapshot()}
    assert hist == live  # device utilisation and memory included
    assert all(v[3] is not None and v[4] is not None for v in hist.values())

    t0 = time.perf_counter()
    replayed = forced = 0
    healths, picks = set(), set()
    for rid, recs in st.decisions.items():
        for stages in attempts(recs):
            dec, was_forced = redecide(stages)
            assert compare(stages, dec) == [], rid
            replayed += 1
            forced += was_forced
            healths.update(b.health for b in stages[0].inputs.backends)
            picks.add(stages[0].picked)
            ins = stages[0].inputs
            assert all(b.cpu_util is not None for b in ins.backends)
    assert replayed == N
    assert healths >= {"ok", "warning", "critical"} and len(picks) >= 3
    assert forced < N // 2  # most picks come from the scores, not from a recorded tie-break
    assert time.perf_counter() - t0 < 10

    # the check can fail: one backend's device utilisation changed changes the health scores
    stages = attempts(next(iter(st.decisions.values())))[0]
    ins = stages[0].inputs
    b0 = ins.backends[0]
    bent = ins.model_copy(update={"backends": [b0.model_copy(update={"cpu_util": 1.0 - (b0.cpu_util or 0.0) + 0.01})]
                                  + ins.backends[1:]})
    bent_stages = [stages[0].model_copy(update={"inputs": bent})] + stages[1:]
    assert any("health" in d or "picked" in d for d in compare(stages, redecide(bent_stages)[0]))

    # explain one prefix request: the cached pod's prefix score, and what least-load would do
    rid = next(r for r, recs in st.decisions.items()
               if any(c.overlap_blocks for c in recs[0].candidates) and recs[0].picked in ("b", "c"))
    ex = explain(st.decisions[rid][:1], other="least-load")
    assert ex["reproduced"] and ex["stages"][0]["picked"] in ("b", "c")
    assert ex["prefix"]["per_pod"][ex["stages"][0]["picked"]]["recorded"] >= 3
    assert ex["other_profile"]["profile"] == "least-load" and ex["other_profile"]["picked"] in PODS
