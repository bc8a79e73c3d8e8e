"""SLA per stage: the router's records say which stage served a request (PD prefill + decode, a PD
decode pod alone, aggregated) with the prefill stage's TTFT, the KV-transfer time and TPOT;
migration 3 adds the columns (old rows get their stage from role and prefill_pod); ``sla report
--stages`` reads them back."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from typer.testing import CliRunner

from consumers import sla_queries as Q
from consumers.sla_store import ChdbStore
from infernex.cli import app
from router.config import RouterConfig, StaticBackend
from router.pd_protocol import PdConnectorConfig
from router.server import RouterService
from schemas.records import RequestRecord
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig


class Capture:
    def __init__(self):
        self.records: list[RequestRecord] = []

    def submit_request(self, r, msg_id=None):
        self.records.append(r() if callable(r) else r)

    def submit_decision(self, d, msg_id=None):
        pass


def test_router_records_carry_the_serving_stage():
    def cfg(eid, role):
        return EngineConfig(engine_id=eid, served_model_name="m", role=role, num_gpu_blocks=1024)

    c = SimCluster([EngineSpec(cfg("p0", "prefill"), kv_events=False), EngineSpec(cfg("d0", "decode"), kv_events=False),
                    EngineSpec(cfg("a0", "aggregated"), kv_events=False)], time_scale=20).start()
    try:
        async def run():
            out = {}
            for name, strategy, backends in (
                    ("pd", "pd-bucket", [StaticBackend(pod="p0", url=c[0].url, model="m", role="prefill", group="g"),
                                         StaticBackend(pod="d0", url=c[1].url, model="m", role="decode", group="g")]),
                    ("agg", "round-robin", [StaticBackend(pod="a0", url=c[2].url, model="m")])):
                cap = Capture()
                svc = RouterService(RouterConfig(backends=backends, bus=False, seed=1, strategy=strategy,
                                                 tokenizer=None, pd=PdConnectorConfig()), records=cap)
                await svc.start("127.0.0.1", 0)
                try:
                    async with aiohttp.ClientSession() as s:
                        body = {"model": "m", "prompt": list(range(100, 900)), "max_tokens": 6, "stream": True}
                        async with s.post(svc.url + "/v1/completions", json=body) as r:
                            assert r.status == 200
                            await r.read()
                    for _ in range(100):
                        if cap.records:
                            break
                        await asyncio.sleep(0.02)
                finally:
                    await svc.stop()
                out[name] = cap.records
            return out

        recs = asyncio.run(run())
    finally:
        c.stop()
    [pd], [agg] = recs["pd"], recs["agg"]
    assert pd.role == "pd" and pd.served_stage == "pd" and pd.prefill_pod == "p0" and pd.decode_pod == "d0"
    assert 0 < pd.prefill_ttft_s < pd.ttft_s  # the prefill stage is part of what the client waited
    assert pd.kv_transfer_s is not None and 0 < pd.kv_transfer_s <= pd.ttft_s - pd.prefill_ttft_s + 1e-6
    assert pd.tpot_s is not None and pd.tpot_s > 0 and pd.output_tokens == 6
    assert agg.served_stage == "aggregated" and agg.prefill_ttft_s is None and agg.kv_transfer_s is None
    assert agg.tpot_s is not None and agg.tpot_s > 0
    # the router's share of the wait: no admission queue here, and its own time a part of the TTFT
    for r in (pd, agg):
        assert r.queue_s == 0.0
        assert r.router_s is not None and 0 < r.router_s < r.ttft_s
    assert pd.router_s < pd.prefill_ttft_s  # taken at the prefill's send, not after it


def _rec(i, now, **kw):
    base = {"request_id": f"r{i}", "ts": now - 600 + i, "pool": "pool-a", "model": "m", "prompt_tokens": 1000,
            "output_tokens": 11, "e2e_s": 1.0, "status": "ok"}
    return json.dumps({**base, **kw}).encode()


def store_at_version(tmp_path, version: int) -> ChdbStore:
    """A fresh store with the migrations up to ``version`` applied (a store an older release made)."""
    store = ChdbStore(tmp_path / "chdb", "infernex")
    old = Q.MIGRATIONS
    Q.MIGRATIONS = tuple(m for m in old if m.version <= version)
    try:
        Q.migrate(store)
    finally:
        Q.MIGRATIONS = old
    return store


def test_migration_3_gives_old_rows_their_stage(tmp_path):
    store = store_at_version(tmp_path, 2)
    try:
        now = time.time()
        store.insert_json_each_row("request_records", [
            _rec(0, now, role="pd", prefill_pod="p0", decode_pod="d0", ttft_s=0.5, itl_s=0.02),
            _rec(1, now, role="pd", decode_pod="d0", ttft_s=0.1, itl_s=0.02),
            _rec(2, now, role="aggregated", ttft_s=0.3, itl_s=0.05)])
        assert Q.migrate(store) == [3, 4]
        rows = store.rows("SELECT request_id, served_stage, tpot_s FROM infernex.request_records FINAL "
                          "ORDER BY request_id")
        assert [(r["request_id"], r["served_stage"], r["tpot_s"]) for r in rows] == [
            ("r0", "pd", None), ("r1", "decode", None), ("r2", "aggregated", None)]
        assert Q.migrate(store) == []  # idempotent
    finally:
        store.close()


def test_migration_4_adds_the_routers_share_and_old_rows_read_none(tmp_path):
    store = store_at_version(tmp_path, 3)
    try:
        now = time.time()
        store.insert_json_each_row("request_records", [_rec(0, now, ttft_s=0.3)])
        assert Q.migrate(store) == [4]
        rec = RequestRecord(request_id="r1", ts=now - 500, pool="pool-a", model="m", ttft_s=0.3, queue_s=0.05,
                            router_s=0.0007)
        store.insert_json_each_row("request_records", [rec.model_dump_json().encode()])
        rows = store.rows("SELECT request_id, queue_s, router_s FROM infernex.request_records FINAL ORDER BY request_id")
        assert [(r["request_id"], r["queue_s"], r["router_s"]) for r in rows] == [
            ("r0", None, None), ("r1", pytest.approx(0.05), pytest.approx(0.0007))]
        assert Q.migrate(store) == []
    finally:
        store.close()


@pytest.fixture
def chdb_env(tmp_path, monkeypatch):
    path = tmp_path / "chdb"
    monkeypatch.setenv("INFERNEX_SLA__CHDB_PATH", str(path))
    monkeypatch.setenv("INFERNEX_SLA__TARGETS__TTFT_S", "1.0")
    monkeypatch.setenv("INFERNEX_SLA__TARGETS__ITL_S", "0.05")
    store = ChdbStore(path, "infernex")
    Q.migrate(store)
    now = time.time()
    rows = []
    for i in range(40):  # PD: prefill 0.4 s, client TTFT 0.6 s, KV 0.05 s, TPOT 0.03 s (every 4th: 0.09 s)
        rows.append(_rec(i, now, role="pd", served_stage="pd", prefill_pod="p0", decode_pod="d0", ttft_s=0.6,
                         prefill_ttft_s=0.4, kv_transfer_s=0.05, tpot_s=0.09 if i % 4 == 0 else 0.03,
                         router_s=0.0008, queue_s=0.1))
    for i in range(40, 50):  # PD, prefill skipped: the decode pod did it all
        rows.append(_rec(i, now, role="pd", served_stage="decode", decode_pod="d0", ttft_s=0.2, tpot_s=0.03))
    for i in range(50, 80):  # aggregated: long prompts stretch TPOT (chunked prefill interference)
        rows.append(_rec(i, now, role="aggregated", served_stage="aggregated", ttft_s=1.5 if i % 2 else 0.5,
                         tpot_s=0.08, router_s=0.002 if i % 3 == 0 else 0.0005, queue_s=0.0))
    store.insert_json_each_row("request_records", rows)
    store.close()
    return path


def test_sla_report_stages(chdb_env):
    runner = CliRunner()
    res = runner.invoke(app, ["sla", "report", "--since", "1h", "--stages", "--json"])
    assert res.exit_code == 0, res.output
    by = {r["stage"]: r for r in json.loads(res.output)}
    assert set(by) == {"prefill", "decode", "aggregated"}
    assert by["prefill"]["requests"] == 40 and by["prefill"]["ttft_p50"] == pytest.approx(0.4)
    assert by["prefill"]["tpot_p50"] is None
    d = by["decode"]
    assert d["requests"] == 50 and d["kv_p50"] == pytest.approx(0.05) and d["kv_mean"] == pytest.approx(0.05)
    assert d["tpot_p50"] == pytest.approx(0.03) and d["tpot_attainment"] == pytest.approx(40 / 50)
    a = by["aggregated"]
    assert a["requests"] == 30 and a["tpot_attainment"] == 0.0 and a["ttft_attainment"] == pytest.approx(0.5)
    # the router's share: on the stages the client waited on (prefill none), rows without it left out
    assert by["prefill"]["router_p50"] is None and by["prefill"]["queue_mean"] is None
    assert d["router_p50"] == pytest.approx(0.0008) and d["queue_mean"] == pytest.approx(0.1)  # 40 of 50 say
    assert a["router_p50"] == pytest.approx(0.0005) and a["router_p99"] == pytest.approx(0.002)
    assert a["queue_p90"] == 0.0
    res = runner.invoke(app, ["sla", "report", "--since", "1h", "--stages"], env={"COLUMNS": "260"})
    assert res.exit_code == 0 and "KV transfer" in res.output and "prefill" in res.output
    assert "router" in res.output and "0.5/2.0/2.0" in res.output
