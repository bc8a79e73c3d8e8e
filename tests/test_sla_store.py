"""SLA store: migrations, dedupe, and the SQL figures checked against numpy on the same data.

The same suite runs on chDB and, when ``INFERNEX_CLICKHOUSE_URL`` is set, on a ClickHouse server.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import numpy as np
import pytest

from consumers import sla_queries as Q
from consumers.sla_store import ChdbStore, ClickHouseStore, SlaConfig, StoreError, open_store
from schemas import EngineMetrics, RequestRecord
from streams.planner import SlaTargets

CH_URL = os.environ.get("INFERNEX_CLICKHOUSE_URL")


@pytest.fixture(params=["chdb", "clickhouse"])
def store(request, tmp_path):
    if request.param == "chdb":
        s = ChdbStore(tmp_path / "chdb", "infernex_test")
    else:
        if not CH_URL:
            pytest.skip("INFERNEX_CLICKHOUSE_URL is not set: no ClickHouse server to run the suite against")
        s = ClickHouseStore(CH_URL, user=os.environ.get("INFERNEX_CLICKHOUSE_USER", "default"),
                            database="infernex_t" + uuid.uuid4().hex[:8])
    Q.migrate(s)
    yield s
    if request.param == "clickhouse":
        s.command(f"DROP DATABASE IF EXISTS {s.database}")
    s.close()


def records(n: int, t0: float, *, pool="pool-a", role="pd", seed=1, span_s=300.0) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        status = "error" if rng.random() < 0.05 else "ok"
        prompt = int(rng.integers(50, 2000))
        out.append(RequestRecord(
            request_id=f"{pool}-{seed}-{i}", ts=t0 + rng.random() * span_s, pool=pool, role=role, model="m",
            prompt_tokens=prompt, output_tokens=int(rng.integers(1, 500)),
            cached_tokens=int(rng.integers(0, prompt)),
            ttft_s=None if status == "error" else float(rng.lognormal(-1.5, 0.6)),
            itl_s=None if status == "error" else float(rng.lognormal(-3.5, 0.3)),
            e2e_s=None if status == "error" else float(rng.lognormal(1.0, 0.5)),
            status=status,
        ))
    return out


def insert(store, recs) -> None:
    store.insert_json_each_row("request_records", [r.model_dump_json().encode() for r in recs])


def test_migrations_are_versioned_and_idempotent(store):
    assert Q.schema_version(store) == Q.MIGRATIONS[-1].version
    assert Q.migrate(store) == []  # nothing left to apply
    tables = {r["name"] for r in store.rows(
        "SELECT name FROM system.tables WHERE database = {db:String}", {"db": store.database})}
    assert set(Q.TABLES) | {"schema_migrations"} <= tables


def test_rows_still_insert_after_the_table_gains_a_column(store):
    """A column added while this store is open (a migration after it inserted) must not break its
    inserts: the new column takes its default."""
    t0 = time.time() - 600
    insert(store, records(3, t0, seed=7))  # (an embedded store reads the table's columns here)
    store.command(f"ALTER TABLE {store.database}.request_records ADD COLUMN IF NOT EXISTS added_later "
                  "Nullable(Float64)")
    insert(store, records(3, t0, seed=8))
    rows = store.rows(f"SELECT count() AS n, countIf(added_later IS NULL) AS d FROM {store.database}.request_records")
    assert int(rows[0]["n"]) == 6 and int(rows[0]["d"]) == 6


def test_ttl_change_is_applied(store):
    Q.migrate(store, ttl_days=9, raw_metrics_ttl_days=2)
    q = {r["name"]: r["q"] for r in store.rows(
        "SELECT name, create_table_query AS q FROM system.tables WHERE database = {db:String}",
        {"db": store.database})}
    assert "toIntervalDay(9)" in q["request_records"]
    assert "toIntervalDay(2)" in q["engine_metrics"]


def test_redelivered_rows_count_once(store):
    t0 = time.time() - 600
    recs = records(500, t0)
    insert(store, recs)
    insert(store, recs[100:300])  # a batch redelivered after a crash, split differently
    insert(store, recs[250:260])
    assert Q.table_counts(store)["request_records"] == 500


def test_percentiles_and_rates_match_numpy(store):
    t0 = time.time() - 900
    recs = records(3000, t0, span_s=600) + records(800, t0, pool="pool-b", role="aggregated", seed=2,
                                                    span_s=600)
    insert(store, recs)
    targets = SlaTargets(ttft_s=0.3, itl_s=0.035)
    rows = {(r["pool"], r["role"]): r for r in Q.sla_summary(store, t0, t0 + 600, targets=targets)}
    assert set(rows) == {("pool-a", "pd"), ("pool-b", "aggregated")}
    for (pool, role), row in rows.items():
        mine = [r for r in recs if r.pool == pool]
        assert row["requests"] == len(mine)
        for key in ("ttft", "itl", "e2e"):
            vals = np.array([getattr(r, f"{key}_s") for r in mine if getattr(r, f"{key}_s") is not None])
            for q in (50, 90, 99):
                assert row[f"{key}_p{q}"] == pytest.approx(np.percentile(vals, q), rel=1e-9), (pool, key, q)
        assert row["error_rate"] == pytest.approx(np.mean([r.status != "ok" for r in mine]))
        assert row["prefix_hit_rate"] == pytest.approx(
            sum(r.cached_tokens for r in mine) / sum(r.prompt_tokens for r in mine))
        assert row["req_per_s"] == pytest.approx(len(mine) / 600)
        assert row["tokens_per_s"] == pytest.approx(sum(r.prompt_tokens + r.output_tokens for r in mine) / 600)
        ok = [r.status == "ok" and r.ttft_s <= 0.3 and r.itl_s <= 0.035 for r in mine]
        assert row["attainment"] == pytest.approx(np.mean(ok))
    # approximate percentiles stay close
    approx = {(r["pool"], r["role"]): r for r in Q.sla_summary(store, t0, t0 + 600, targets=targets, exact=False)}
    assert approx[("pool-a", "pd")]["ttft_p90"] == pytest.approx(rows[("pool-a", "pd")]["ttft_p90"], rel=0.05)


def test_by_minute_matches_numpy(store):
    t0 = (int(time.time()) // 60 - 10) * 60.0
    recs = records(1200, t0, span_s=300)
    insert(store, recs)
    rows = Q.sla_by_minute(store, t0, t0 + 300, pool="pool-a")
    assert [r["minute"] for r in rows] == [int(t0) + 60 * i for i in range(5)]
    for row in rows:
        mine = [r for r in recs if row["minute"] <= r.ts < row["minute"] + 60]
        assert row["requests"] == len(mine)
        vals = [r.ttft_s for r in mine if r.ttft_s is not None]
        assert row["ttft_p99"] == pytest.approx(np.percentile(vals, 99))
        assert row["req_per_s"] == pytest.approx(len(mine) / 60)
    assert Q.sla_by_minute(store, t0, t0 + 300, pool="nope") == []


def test_engine_rollup_survives_duplicates(store):
    t0 = (int(time.time()) // 60 - 5) * 60.0
    rows = []
    for pod in ("p0", "p1"):
        for i in range(12):  # one sample every 5 s for one minute
            m = EngineMetrics(pod=pod, model="m", role="decode", ts=t0 + 5 * i, num_requests_running=i,
                              num_requests_waiting=12 - i, kv_cache_usage_perc=i / 20,
                              prompt_tokens_total=1000 + 100 * i, generation_tokens_total=50 * i,
                              prefix_cache_queries_total=10 * i, prefix_cache_hits_total=4 * i)
            d = m.model_dump(exclude={"time_to_first_token_seconds", "inter_token_latency_seconds",
                                      "e2e_request_latency_seconds", "request_queue_time_seconds"})
            d["msg_id"] = f"{pod}-{i}"
            rows.append(json.dumps(d).encode())
    store.insert_json_each_row("engine_metrics", rows)
    store.insert_json_each_row("engine_metrics", rows[5:15])  # duplicates
    assert Q.table_counts(store)["engine_metrics"] == 24
    (r,) = Q.engine_by_minute(store, t0, t0 + 60)
    assert r["pods"] == 2
    assert r["running_max"] == 22  # 11 per pod
    assert r["prompt_tokens_per_s"] == pytest.approx(2 * 1100 / 60)
    assert r["generation_tokens_per_s"] == pytest.approx(2 * 550 / 60)
    assert r["prefix_hit_rate"] == pytest.approx(0.4)


def test_empty_window_is_an_error(store):
    with pytest.raises(ValueError, match="empty time window"):
        Q.sla_summary(store, 100.0, 100.0)


def test_second_owner_of_a_chdb_path_gets_a_clear_error(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "owned"
    s = ChdbStore(path, "x")
    try:
        code = (f"from consumers.sla_store import ChdbStore, StoreError\n"
                f"try:\n    ChdbStore({str(path)!r}, 'x')\nexcept StoreError as e:\n    print('ERR', e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert "ERR cannot open chDB" in out.stdout and "One process owns" in out.stdout, out.stdout + out.stderr
    finally:
        s.close()


def test_config_requires_url_for_server_backend():
    with pytest.raises(ValueError, match="needs sla.url"):
        SlaConfig(backend="clickhouse")
    cfg = SlaConfig(backend="clickhouse", url="http://127.0.0.1:1", password="hunter2")
    assert "hunter2" not in repr(cfg)
    with pytest.raises(StoreError):
        open_store(cfg)


def test_minute_rollup_matches_raw_and_stays_exact_on_redelivery(store):
    t0 = (int(time.time()) // 60 - 30) * 60.0
    recs = records(2000, t0, span_s=600)
    insert(store, recs)
    targets = SlaTargets(ttft_s=0.3, itl_s=0.035)
    Q.refresh_minutes(store, t0, t0 + 600, targets=targets)
    raw = {r["pool"]: r for r in Q.sla_summary(store, t0, t0 + 600, targets=targets)}
    roll = {r["pool"]: r for r in Q.sla_summary_rollup(store, t0, t0 + 600)}
    assert set(roll) == set(raw) == {"pool-a"}
    a, b = raw["pool-a"], roll["pool-a"]
    for key in ("requests", "prompt_tokens", "output_tokens"):
        assert a[key] == b[key]
    for key in ("error_rate", "prefix_hit_rate", "attainment", "isl", "osl", "ttft_mean", "itl_mean", "req_per_s"):
        assert a[key] == pytest.approx(b[key]), key
    for key in ("ttft_p50", "ttft_p90", "itl_p90", "e2e_p50"):
        assert b[key] == pytest.approx(a[key], rel=0.06), key  # log-bucket histogram
    # redelivered duplicates and a refresh change nothing; a late record in an old minute is picked up
    insert(store, recs[:500])
    Q.refresh_minutes(store, t0, t0 + 600, targets=targets)
    assert Q.sla_summary_rollup(store, t0, t0 + 600)[0]["requests"] == 2000
    late = records(1, t0 + 5, seed=99, span_s=1)
    insert(store, late)
    Q.refresh_minutes(store, late[0].ts, late[0].ts, targets=targets)
    assert Q.sla_summary_rollup(store, t0, t0 + 600)[0]["requests"] == 2001
    assert Q.sla_summary_rollup(store, t0, t0 + 60)[0]["requests"] == len(
        [r for r in recs + late if r.ts < t0 + 60])


def test_minute_refresh_counts_a_part_that_starts_in_the_minutes_last_second(store):
    """A batch whose first record falls in the last second of a minute: the refresh of that minute
    must count its records. ClickHouse 26.9 skipped them when the window's end was a DateTime bound
    (seen in the SLA sink as a rollup short by the records of one batch, 1 run in about 40)."""
    m = (int(time.time()) // 60 - 30) * 60.0
    recs = [RequestRecord(request_id=f"r{i}", ts=m + 58.18 + i * 0.01, pool="pool-a", role="pd", model="m")
            for i in range(400)]  # records 0-181 in minute m, the rest in the next
    insert(store, recs[:150])
    insert(store, recs[150:300])  # a second part, starting at m + 59.68
    Q.refresh_minutes(store, m, m)
    assert Q.sla_summary_rollup(store, m, m + 60)[0]["requests"] == 182
    insert(store, recs[300:])
    insert(store, recs[:150])  # redelivered: duplicates in a part of their own
    Q.refresh_minutes(store, m, m)
    Q.refresh_minutes(store, m + 60, m + 60)
    assert [r["requests"] for r in Q.sla_summary_rollup(store, m, m + 60)] == [182]
    assert [r["requests"] for r in Q.sla_summary_rollup(store, m, m + 120)] == [400]


def test_latest_minute_refresh_wins_even_if_the_clock_went_back(store):
    t0 = (int(time.time()) // 60 - 30) * 60.0
    recs = records(40, t0, span_s=50)
    insert(store, recs[:10])
    Q.refresh_minutes(store, t0, t0, version=2**62)  # written by a process whose clock ran ahead
    insert(store, recs[10:])
    Q.refresh_minutes(store, t0, t0)  # this clock is behind that version
    assert Q.sla_summary_rollup(store, t0, t0 + 60)[0]["requests"] == 40


def test_histogram_quantiles_track_numpy():
    rng = np.random.default_rng(5)
    for sample in (rng.lognormal(-1.5, 0.6, 5000), rng.lognormal(-3.5, 0.3, 300), np.array([0.2] * 10)):
        idx = np.clip(np.floor(np.log(np.maximum(sample, Q.HIST_MIN) / Q.HIST_MIN) / np.log(Q.HIST_RATIO)), 0,
                      Q.HIST_BUCKETS - 1).astype(int)
        keys, counts = np.unique(idx, return_counts=True)
        got = Q.hist_quantiles(list(keys), list(counts))
        for q, v in zip(Q.QUANTILES, got):
            assert v == pytest.approx(np.percentile(sample, q * 100), rel=Q.HIST_RATIO - 1), q
    assert Q.hist_quantiles([], []) == [None, None, None]
