"""The replay commands an operator runs after an incident, against a real nats-server: explain a
request by id (tables and JSON, another profile's pick), re-decide it by id, reports scoped to one
pool, and ``tail`` showing the history of a wildcard that spans subjects."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import aiohttp
import pytest

from consumers import bus
from router.app import RouterApp
from router.config import RouterConfig
from router.testing import FakeEngine, wait_for
from schemas import BlockStored, DeviceTelemetry, Diagnosis, EngineAnnouncement, KvEventBatch
from schemas import subjects as S
from simulator.tokenizer import SimpleTokenizer
from streams.topology import build_topology, history_filters, subject_intersection

EXE = [sys.executable, "-m", "infernex.cli"]
PROMPT = " ".join(f"w{k}" for k in range(70))


def test_subject_intersection_and_history_filters():
    assert subject_intersection("router.requests.>", "router.>") == "router.requests.>"
    assert subject_intersection("router.*.p", "router.requests.>") == "router.requests.p"
    assert subject_intersection("kv.events.>", "engine.>") is None
    assert subject_intersection("a.b", "a.b.c") is None
    assert subject_intersection("a.>", "a") is None
    topo = build_topology()
    assert sorted(f for _, f in history_filters(topo, "router.>")) == ["router.decisions.>", "router.requests.>"]
    assert [(s.name, f) for s, f in history_filters(topo, "engine.metrics.p1")] == [("ENGINE", "engine.metrics.p1")]
    assert history_filters(topo, "nothing.here") == []


def cli(args, env, timeout=60):
    return subprocess.run(EXE + args, env=env, capture_output=True, text=True, timeout=timeout)


async def run_cli(args, env):
    """The CLI in this process (a thread: the commands run their own event loop), to spare a Python
    start per command; ``tail`` (signal handlers) runs as a real process."""
    from typer.testing import CliRunner

    from infernex.cli import app

    res = await asyncio.to_thread(CliRunner().invoke, app, args, env=env)
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)


async def pub(js, prefix, subject, event):
    await bus.publish(js, S.with_prefix(prefix, subject), event.to_json())


@pytest.fixture
async def history(nats_config, topology, nc, prefix, tmp_path):
    """Two pools routed by two routers: 'agg' (pods a, b; b caches the prompt's prefix, a's device
    has a warning) served 6 requests, 'other' (pod c) 3."""
    js = nc.jetstream()
    engines = {p: await FakeEngine(p, tokens=2).start() for p in ("a", "b", "c")}
    apps = {pool: RouterApp(RouterConfig(pool=pool, strategy="kv-aware", seed=1, records=True), nats_config)
            for pool in ("agg", "other")}
    urls = {pool: await app.start("127.0.0.1", 0) for pool, app in apps.items()}
    rids: dict[str, list[str]] = {"agg": [], "other": []}
    try:
        now = time.time()
        for pod, pool in (("a", "agg"), ("b", "agg"), ("c", "other")):
            await pub(js, prefix, S.engine_announce(pod), EngineAnnouncement(
                pod=pod, url=engines[pod].url, model="m", pool=pool, ts=now, node="n1", devices=[f"npu-{pod}"],
                ttl_s=3600))
        ids = SimpleTokenizer().encode(PROMPT)[:64]
        await pub(js, prefix, S.kv_events("m", "b"), KvEventBatch(pod="b", model="m", seq=0, ts=now, events=[
            BlockStored(block_hashes=[1, 2, 3, 4], token_ids=ids, block_size=16)]))
        for pod in ("a", "b", "c"):
            await pub(js, prefix, S.device_telemetry("n1", f"npu-{pod}"), DeviceTelemetry(
                node="n1", device=f"npu-{pod}", kind="npu", source="sim", ts=now, utilization_pct=40,
                memory_used_mb=20000, memory_total_mb=65536))
        await pub(js, prefix, S.diagnosis("n1", "npu-a"), Diagnosis(
            finding_id="f1", node="n1", device="npu-a", fault_mode="hbm_ecc_burst", severity="warning",
            status="open", action="RestartNPU", summary="ECC", first_seen=now, last_seen=now))
        assert await wait_for(lambda: len(apps["agg"].state.snapshot()) == 2
                              and apps["agg"].state.get("a").health == "warning"
                              and apps["agg"].index.match_tokens("m", ids).get("b") is not None, timeout=15)
        async with aiohttp.ClientSession() as s:
            for pool, n in (("agg", 6), ("other", 3)):
                for i in range(n):
                    async with s.post(urls[pool] + "/v1/completions",
                                      json={"model": "m", "prompt": PROMPT + f" q{i}", "max_tokens": 2}) as r:
                        assert r.status == 200, await r.text()
                        rids[pool].append(r.headers["X-Request-Id"])
        for app in apps.values():
            await app.records.flush()
    finally:
        for app in apps.values():
            await app.stop(drain=True)
        for e in engines.values():
            await e.stop()
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_config.servers[0], INFERNEX_NATS__SUBJECT_PREFIX=prefix)
    return env, rids


def _counts(md: str) -> dict[str, int]:
    out = {}
    section = md.split("## Counts", 1)[1].split("##", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[1].isdigit():
            out[cells[0]] = int(cells[1])
    return out


async def test_explain_decide_report_and_tail(history, tmp_path):
    env, rids = history
    rid = rids["agg"][0]

    r = await run_cli(["replay", "explain", rid, "--json", "--profile", "least-load"], env)
    assert r.returncode == 0, r.stderr
    ex = json.loads(r.stdout)
    assert ex["reproduced"] and ex["differences"] == []
    st = ex["stages"][0]
    assert st["picked"] == "b" and {c["pod"] for c in st["candidates"]} == {"a", "b"}
    assert st["best_alternative"]["pod"] == "a" and "prefix" in st["best_alternative"]["behind_on"]
    assert ex["prefix"]["per_pod"]["b"] == {"recorded": 4, "index_at_t": 4}
    assert ex["prefix"]["per_pod"]["a"] == {"recorded": 0, "index_at_t": 0}
    assert [f["pod"] for f in ex["findings"]] == ["a"] and ex["findings"][0]["severity"] == "warning"
    assert ex["backends"]["a"]["health"] == "warning" and ex["backends"]["a"]["cpu_util"] == 0.4
    # the state rebuilt from history at that instant agrees with what the router read
    assert all("history_differs" not in b for b in ex["backends"].values())
    assert ex["other_profile"]["profile"] == "least-load" and ex["other_profile"]["picked"] in ("a", "b")

    r = await run_cli(["replay", "explain", rid], env)
    assert r.returncode == 0, r.stderr
    if os.environ.get("INFERNEX_SHOW_EXPLAIN"):
        print(r.stdout)
    assert "reproduced exactly" in r.stdout and "best alternative a" in r.stdout and "hbm_ecc_burst" in r.stdout

    r = await run_cli(["replay", "decide", rid], env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["reproduced"] and d["picked"] == "b"
    body = tmp_path / "req.json"
    body.write_text(json.dumps({"model": "m", "prompt": PROMPT}))
    r = await run_cli(["replay", "decide", str(body), "--pool", "agg"], env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)  # a new request against the pool's state at the end: b holds the prefix
    assert d["picked"] == "b" and {c["pod"] for c in d["stages"][0]["candidates"]} == {"a", "b"}

    r = await run_cli(["replay", "explain", "no-such-request"], env)
    assert r.returncode == 1 and "no routing decision" in r.stderr and "Traceback" not in r.stderr

    for args, want in ((["--pool", "agg"], 6), (["--pool", "other"], 3)):
        out = tmp_path / f"rep{want}"
        r = await run_cli(["replay", "report", "--out", str(out), *args], env)
        assert r.returncode == 0, r.stderr
        md = (out / "report.md").read_text()
        c = _counts(md)
        assert c["RequestRecord"] == want and c["RoutingDecision"] == want, c
        pods = 2 if want == 6 else 1
        assert c["EngineAnnouncement"] == pods and c["DeviceTelemetry"] == pods
        assert c.get("Diagnosis", 0) == (1 if want == 6 else 0)
    r = await run_cli(["replay", "report", "--out", str(tmp_path / "x"), "--role", "nonsense"], env)
    assert r.returncode == 2 and "--role must be one of" in r.stderr

    r = await run_cli(["replay", "state", "--pool", "other"], env)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["pods"]) == {"c"}

    # tail: the stored history of a wildcard spanning router.requests and router.decisions
    r = cli(["tail", "router.>", "-n", "18"], env, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert sum("RequestRecord" in ln for ln in lines) == 9 and sum("RoutingDecision" in ln for ln in lines) == 9


def test_incident_report_links_decisions_worth_explaining():
    from consumers.replay import ReplayMsg
    from infernex.incident import ReplayState, report_markdown
    from schemas import RequestRecord, RoutingDecision

    st = ReplayState(pool="agg")
    msgs = []
    for i, (best, chosen, status, pool) in enumerate([(4, 0, "ok", "agg"), (0, 0, "ok", "agg"),
                                                      (0, 0, "error", "agg"), (4, 0, "ok", "other")]):
        rid = f"r{i}"
        d = RoutingDecision(request_id=rid, ts=100.0 + i, pool=pool, model="m", profile="kv-aware", picked="a")
        r = RequestRecord(request_id=rid, ts=100.0 + i, pool=pool, model="m", pods=["a"], best_overlap_blocks=best,
                          chosen_overlap_blocks=chosen, status=status, http_status=200 if status == "ok" else 502)
        msgs += [ReplayMsg(100.0 + i, "ROUTER", 2 * i + 1, S.router_decisions(pool), d.to_json()),
                 ReplayMsg(100.0 + i, "ROUTER", 2 * i + 2, S.router_requests(pool), r.to_json())]
    st.apply_many(msgs)
    md = report_markdown(st, None, None)
    section = md.split("## Routing decisions to look at", 1)[1].split("##", 1)[0]
    assert "`infernex replay explain r0`" in section and "`infernex replay explain r2`" in section
    assert "r1`" not in section and "r3" not in md  # an ordinary request, and another pool's


def test_scope_narrows_subjects_and_judges_messages():
    from consumers.replay_scope import PodMeta, Scope, keep_message
    from schemas import EngineMetrics, RequestRecord, ScalingHint

    sc = Scope(pool="agg", role="pd")
    assert sc.subjects(["router.>", "autoscale.hints.>", "kv.events.>", "engine.>"]) == [
        "router.requests.agg", "router.decisions.agg", "autoscale.hints.agg.prefill", "autoscale.hints.agg.decode",
        "kv.events.>", "engine.>"]
    assert Scope(model="m").subjects(["kv.events.>"]) == ["kv.events.m.>"]
    metas = {"p1": PodMeta("agg", "m", "prefill", "n1", ("0",)), "a1": PodMeta("agg", "m", "aggregated", "n1", ("1",)),
             "o1": PodMeta("other", "m", "decode", "n2", ("0",))}
    em = EngineMetrics(pod="p1", model="m", ts=1.0, num_requests_running=0, num_requests_waiting=0,
                       kv_cache_usage_perc=0).to_json()
    assert keep_message(sc, S.engine_metrics("p1"), em, metas)
    assert not keep_message(sc, S.engine_metrics("a1"), em, metas)  # aggregated, not PD
    assert not keep_message(sc, S.engine_metrics("o1"), em, metas)  # another pool
    assert not keep_message(sc, S.engine_metrics("unknown"), em, metas)
    assert keep_message(sc, S.device_telemetry("n1", "0"), b"{}", metas)  # p1's device
    assert not keep_message(sc, S.device_telemetry("n1", "1"), b"{}", metas)
    rec = RequestRecord(request_id="r", ts=1.0, pool="agg", model="m", role="pd").to_json()
    assert keep_message(sc, S.router_requests("agg"), rec, metas)
    agg_rec = RequestRecord(request_id="r", ts=1.0, pool="agg", model="m").to_json()
    assert not keep_message(sc, S.router_requests("agg"), agg_rec, metas)
    hint = ScalingHint(pool="agg", role="aggregated", ts=1.0, current=1, desired=2, reason="x").to_json()
    assert not keep_message(sc, S.autoscale_hints("agg", "aggregated"), hint, metas)
    assert keep_message(Scope(), S.engine_metrics("anything"), em, {})
