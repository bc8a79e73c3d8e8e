"""The SLA history SQL: schema migrations, row shapes, and the queries the report, the planner and
the dashboards share. One SQL for chDB and a ClickHouse server (parameters use ClickHouse's
``{name:Type}`` binding, which both backends support).

Dedupe: every table is a ``ReplacingMergeTree`` whose sorting key contains the event's identity
(request id, message id, or (pool, role, ts) for hints), and every query reads ``FINAL``, so a
batch redelivered after a crash counts once. The per-minute engine rollup only uses aggregates that
a duplicate cannot change (max, argMax/argMin by timestamp, uniqExact of sample timestamps).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from consumers.sla_store import SlaStore
from streams.planner import SlaTargets

# ---------------------------------------------------------------------------------------------
# migrations
# ---------------------------------------------------------------------------------------------

_TS = "DateTime64(3, 'UTC')"

#: latency histograms of the rollup: bucket i holds [HIST_MIN * HIST_RATIO**i, HIST_MIN * HIST_RATIO**(i+1))
#: (values below HIST_MIN in bucket 0, above the top in the last); quantiles from it are within
#: about half a bucket (~5 %) of the exact ones, and histograms of minutes merge by adding counts.
HIST_MIN = 1e-4
HIST_RATIO = 1.1
HIST_BUCKETS = 200


def _bucket(col: str) -> str:
    return (f"toUInt16(least({HIST_BUCKETS - 1}, greatest(0, floor(log(greatest(assumeNotNull({col}), {HIST_MIN}) "
            f"/ {HIST_MIN}) / log({HIST_RATIO})))))")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


#: templates: {db}, {ttl} (days), {raw_ttl} (days). Every statement is idempotent on its own.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "request records, engine metrics, diagnoses, scaling hints", (
        "CREATE DATABASE IF NOT EXISTS {db}",
        f"""CREATE TABLE IF NOT EXISTS {{db}}.request_records (
            request_id String,
            ts {_TS},
            pool LowCardinality(String),
            role LowCardinality(String),
            model LowCardinality(String),
            profile LowCardinality(String),
            pods Array(String),
            prefill_pod Nullable(String),
            decode_pod Nullable(String),
            prompt_tokens UInt32,
            output_tokens UInt32,
            cached_tokens UInt32,
            ttft_s Nullable(Float64),
            itl_s Nullable(Float64),
            e2e_s Nullable(Float64),
            status LowCardinality(String),
            http_status UInt16,
            error Nullable(String),
            best_overlap_blocks UInt32,
            chosen_overlap_blocks UInt32,
            retries UInt16,
            migrations UInt16,
            stream Bool,
            schema_version UInt16
        ) ENGINE = ReplacingMergeTree
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (pool, role, ts, request_id)
        TTL toDateTime(ts) + toIntervalDay({{ttl}})""",
        f"""CREATE TABLE IF NOT EXISTS {{db}}.engine_metrics (
            msg_id String,
            pod String,
            model LowCardinality(String),
            engine LowCardinality(String),
            role LowCardinality(String),
            ts {_TS},
            num_requests_running Float64,
            num_requests_waiting Float64,
            kv_cache_usage_perc Float64,
            prefix_cache_queries_total Float64,
            prefix_cache_hits_total Float64,
            prompt_tokens_total Float64,
            generation_tokens_total Float64,
            ttft_sum Float64, ttft_count Float64,
            itl_sum Float64, itl_count Float64,
            e2e_sum Float64, e2e_count Float64,
            queue_sum Float64, queue_count Float64
        ) ENGINE = ReplacingMergeTree
        PARTITION BY toYYYYMMDD(ts)
        ORDER BY (model, role, pod, engine, ts)
        TTL toDateTime(ts) + toIntervalDay({{raw_ttl}})""",
        f"""CREATE TABLE IF NOT EXISTS {{db}}.engine_metrics_1m (
            model LowCardinality(String),
            role LowCardinality(String),
            pod String,
            engine LowCardinality(String),
            minute DateTime('UTC'),
            samples AggregateFunction(uniqExact, {_TS}),
            running_max SimpleAggregateFunction(max, Float64),
            waiting_max SimpleAggregateFunction(max, Float64),
            kv_usage_max SimpleAggregateFunction(max, Float64),
            running_last AggregateFunction(argMax, Float64, {_TS}),
            waiting_last AggregateFunction(argMax, Float64, {_TS}),
            kv_usage_last AggregateFunction(argMax, Float64, {_TS}),
            prompt_first AggregateFunction(argMin, Float64, {_TS}),
            prompt_last AggregateFunction(argMax, Float64, {_TS}),
            generation_first AggregateFunction(argMin, Float64, {_TS}),
            generation_last AggregateFunction(argMax, Float64, {_TS}),
            prefix_queries_first AggregateFunction(argMin, Float64, {_TS}),
            prefix_queries_last AggregateFunction(argMax, Float64, {_TS}),
            prefix_hits_first AggregateFunction(argMin, Float64, {_TS}),
            prefix_hits_last AggregateFunction(argMax, Float64, {_TS})
        ) ENGINE = AggregatingMergeTree
        PARTITION BY toYYYYMM(minute)
        ORDER BY (model, role, pod, engine, minute)
        TTL minute + toIntervalDay({{ttl}})""",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.engine_metrics_1m_mv TO {db}.engine_metrics_1m AS
        SELECT model, role, pod, engine, toStartOfMinute(ts) AS minute,
            uniqExactState(ts) AS samples,
            max(num_requests_running) AS running_max,
            max(num_requests_waiting) AS waiting_max,
            max(kv_cache_usage_perc) AS kv_usage_max,
            argMaxState(num_requests_running, ts) AS running_last,
            argMaxState(num_requests_waiting, ts) AS waiting_last,
            argMaxState(kv_cache_usage_perc, ts) AS kv_usage_last,
            argMinState(prompt_tokens_total, ts) AS prompt_first,
            argMaxState(prompt_tokens_total, ts) AS prompt_last,
            argMinState(generation_tokens_total, ts) AS generation_first,
            argMaxState(generation_tokens_total, ts) AS generation_last,
            argMinState(prefix_cache_queries_total, ts) AS prefix_queries_first,
            argMaxState(prefix_cache_queries_total, ts) AS prefix_queries_last,
            argMinState(prefix_cache_hits_total, ts) AS prefix_hits_first,
            argMaxState(prefix_cache_hits_total, ts) AS prefix_hits_last
        FROM {db}.engine_metrics
        GROUP BY model, role, pod, engine, minute""",
        f"""CREATE TABLE IF NOT EXISTS {{db}}.diagnoses (
            msg_id String,
            finding_id String,
            node LowCardinality(String),
            device String,
            fault_mode LowCardinality(String),
            severity LowCardinality(String),
            status LowCardinality(String),
            action LowCardinality(String),
            summary String,
            remediation String,
            evidence String,
            first_seen {_TS},
            last_seen {_TS},
            pods Array(String)
        ) ENGINE = ReplacingMergeTree
        PARTITION BY toYYYYMM(last_seen)
        ORDER BY (node, device, last_seen, msg_id)
        TTL toDateTime(last_seen) + toIntervalDay({{ttl}})""",
        f"""CREATE TABLE IF NOT EXISTS {{db}}.scaling_hints (
            pool LowCardinality(String),
            role LowCardinality(String),
            ts {_TS},
            current UInt32,
            desired UInt32,
            reason String,
            predictor LowCardinality(String),
            mode LowCardinality(String),
            inputs String
        ) ENGINE = ReplacingMergeTree
        PARTITION BY toYYYYMM(ts)
        ORDER BY (pool, role, ts)
        TTL toDateTime(ts) + toIntervalDay({{ttl}})""",
    )),
    Migration(2, "per-minute request rollup for long windows", (
        f"""CREATE TABLE IF NOT EXISTS {{db}}.request_minutes (
            pool LowCardinality(String),
            role LowCardinality(String),
            minute DateTime('UTC'),
            version UInt64,
            requests UInt64,
            errors UInt64,
            attained UInt64,
            prompt_tokens UInt64,
            output_tokens UInt64,
            cached_tokens UInt64,
            ttft_sum Float64, ttft_n UInt64,
            itl_sum Float64, itl_n UInt64,
            ttft_k Array(UInt16), ttft_c Array(UInt64),
            itl_k Array(UInt16), itl_c Array(UInt64),
            e2e_k Array(UInt16), e2e_c Array(UInt64)
        ) ENGINE = ReplacingMergeTree(version)
        PARTITION BY toYYYYMM(minute)
        ORDER BY (pool, role, minute)
        TTL minute + toIntervalDay({{ttl}})""",
    )),
    Migration(3, "per-stage request fields: served stage, prefill TTFT, KV transfer, TPOT", (
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS served_stage LowCardinality(String) "
        "DEFAULT if(role = 'pd', if(prefill_pod IS NULL, 'decode', 'pd'), 'aggregated')",
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS prefill_ttft_s Nullable(Float64)",
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS kv_transfer_s Nullable(Float64)",
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS tpot_s Nullable(Float64)",
    )),
    Migration(4, "the router's share of a request's wait: admission queue and its own time", (
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS queue_s Nullable(Float64)",
        "ALTER TABLE {db}.request_records ADD COLUMN IF NOT EXISTS router_s Nullable(Float64)",
    )),
)

#: table -> (TTL expression column, which TTL setting); used to re-apply a changed TTL
TTL_TABLES = {
    "request_records": ("toDateTime(ts)", "ttl"),
    "engine_metrics": ("toDateTime(ts)", "raw_ttl"),
    "engine_metrics_1m": ("minute", "ttl"),
    "diagnoses": ("toDateTime(last_seen)", "ttl"),
    "scaling_hints": ("toDateTime(ts)", "ttl"),
    "request_minutes": ("minute", "ttl"),
}

TABLES = ("request_records", "engine_metrics", "engine_metrics_1m", "diagnoses", "scaling_hints", "request_minutes")


def migrate(store: SlaStore, *, ttl_days: int = 30, raw_metrics_ttl_days: int = 3) -> list[int]:
    """Apply the migrations not yet recorded; returns the versions applied now. Idempotent."""
    db = store.database
    store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    store.command(
        f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations (version UInt32, name String, "
        f"applied_at DateTime('UTC') DEFAULT now()) ENGINE = ReplacingMergeTree ORDER BY version"
    )
    done = {int(r["version"]) for r in store.rows(f"SELECT version FROM {db}.schema_migrations FINAL")}
    subst = {"db": db, "ttl": int(ttl_days), "raw_ttl": int(raw_metrics_ttl_days)}
    applied = []
    for m in MIGRATIONS:
        if m.version in done:
            continue
        for stmt in m.statements:
            store.command(stmt.format(**subst))
        store.command(
            f"INSERT INTO {db}.schema_migrations (version, name) VALUES ({{v:UInt32}}, {{n:String}})",
            {"v": m.version, "n": m.name},
        )
        applied.append(m.version)
    _apply_ttls(store, subst)
    return applied


def schema_version(store: SlaStore) -> int:
    rows = store.rows(f"SELECT max(version) AS v FROM {store.database}.schema_migrations FINAL")
    return int(rows[0]["v"]) if rows else 0


def _apply_ttls(store: SlaStore, subst: dict[str, Any]) -> None:
    """Re-apply TTLs whose configured number of days changed (without rewriting old parts)."""
    db = store.database
    rows = store.rows(
        "SELECT name, create_table_query AS q FROM system.tables WHERE database = {db:String}", {"db": db}
    )
    current = {r["name"]: r["q"] for r in rows}
    for table, (expr, key) in TTL_TABLES.items():
        days = subst[key]
        q = current.get(table, "")
        if not q:
            continue
        m = re.search(r"toIntervalDay\((\d+)\)", q)
        if m and int(m.group(1)) == days:
            continue
        store.command(
            f"ALTER TABLE {db}.{table} MODIFY TTL {expr} + toIntervalDay({days}) "
            f"SETTINGS materialize_ttl_after_modify = 0"
        )


def table_counts(store: SlaStore) -> dict[str, int]:
    """Exact (deduplicated) row counts of the event tables."""
    db = store.database
    out = {}
    for t in ("request_records", "engine_metrics", "diagnoses", "scaling_hints"):
        out[t] = int(store.rows(f"SELECT count() AS n FROM {db}.{t} FINAL")[0]["n"])
    return out


# ---------------------------------------------------------------------------------------------
# queries
# ---------------------------------------------------------------------------------------------

QUANTILES = (0.5, 0.9, 0.99)


def _window(since: float, until: float | None) -> tuple[str, dict[str, Any]]:
    if until is not None and until <= since:
        raise ValueError(f"empty time window: until ({until}) <= since ({since})")
    where = "ts >= toDateTime64({since:Float64}, 3, 'UTC')"
    params: dict[str, Any] = {"since": float(since)}
    if until is not None:
        where += " AND ts < toDateTime64({until:Float64}, 3, 'UTC')"
        params["until"] = float(until)
    return where, params


def _sla_columns(exact: bool) -> str:
    qf = "quantilesExactInclusive" if exact else "quantilesTDigest"
    qs = ", ".join(str(q) for q in QUANTILES)
    return f"""
        count() AS requests,
        sum(prompt_tokens) AS prompt_tokens_sum,
        sum(output_tokens) AS output_tokens_sum,
        countIf(status != 'ok') / count() AS error_rate,
        if(sum(prompt_tokens) > 0, sum(cached_tokens) / sum(prompt_tokens), 0) AS prefix_hit_rate,
        avg(prompt_tokens) AS isl,
        avg(output_tokens) AS osl,
        avg(ttft_s) AS ttft_mean,
        avg(itl_s) AS itl_mean,
        {qf}({qs})(ttft_s) AS ttft_q,
        {qf}({qs})(itl_s) AS itl_q,
        {qf}({qs})(e2e_s) AS e2e_q,
        countIf(status = 'ok'
                AND ifNull(ttft_s, 0) <= {{ttft_target:Float64}}
                AND ifNull(itl_s, 0) <= {{itl_target:Float64}}
                AND ifNull(e2e_s, 0) <= {{e2e_target:Float64}}) / count() AS attainment"""


def _targets(targets: SlaTargets | None) -> dict[str, float]:
    t = targets or SlaTargets()
    return {"ttft_target": t.ttft_s, "itl_target": t.itl_s, "e2e_target": t.e2e_s if t.e2e_s else 1e18}


def _pool_filter(pool: str | None, params: dict[str, Any]) -> str:
    if pool is None:
        return ""
    params["pool"] = pool
    return " AND pool = {pool:String}"


def _finish(row: dict[str, Any], seconds: float) -> dict[str, Any]:
    out = dict(row)
    for name in ("ttft", "itl", "e2e"):
        qs = out.pop(f"{name}_q") or []
        for q, v in zip(QUANTILES, qs):
            out[f"{name}_p{int(round(q * 100))}"] = _num(v)
    out["prompt_tokens"] = int(out.pop("prompt_tokens_sum"))
    out["output_tokens"] = int(out.pop("output_tokens_sum"))
    out["requests"] = int(out["requests"])
    for k in ("error_rate", "prefix_hit_rate", "isl", "osl", "ttft_mean", "itl_mean", "attainment"):
        out[k] = _num(out.get(k))
    out["req_per_s"] = out["requests"] / seconds
    out["tokens_per_s"] = (out["prompt_tokens"] + out["output_tokens"]) / seconds
    out["output_tokens_per_s"] = out["output_tokens"] / seconds
    return out


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) else f


STAGE_SQL = """
SELECT pool, stage, count() AS requests,
       {qf}({qs})(ttft) AS ttft_q, {qf}({qs})(tpot) AS tpot_q, {qf}({qs})(kv) AS kv_q,
       {qf}({qs})(router) AS router_q, {qf}({qs})(queue) AS queue_q,
       avg(ttft) AS ttft_mean, avg(tpot) AS tpot_mean, avg(kv) AS kv_mean, avg(router) AS router_mean,
       avg(queue) AS queue_mean,
       countIf(ok AND ifNull(ttft, 0) <= {{ttft_target:Float64}}) / count() AS ttft_attainment,
       countIf(ok AND ifNull(tpot, 0) <= {{itl_target:Float64}}) / count() AS tpot_attainment
FROM (
    -- the prefill stage of PD requests: the prefill pod's time to its token
    SELECT pool, 'prefill' AS stage, prefill_ttft_s AS ttft, CAST(NULL AS Nullable(Float64)) AS tpot,
           CAST(NULL AS Nullable(Float64)) AS kv, CAST(NULL AS Nullable(Float64)) AS router,
           CAST(NULL AS Nullable(Float64)) AS queue, status = 'ok' AS ok
    FROM {db}.request_records FINAL WHERE {where} AND served_stage = 'pd' AND prefill_ttft_s IS NOT NULL
    UNION ALL
    -- the decode stage (with or without a remote prefill): first token as the client saw it, TPOT, KV pull;
    -- the router's own time and its queue's wait, part of that first token's, count here (not on prefill)
    SELECT pool, 'decode' AS stage, ttft_s AS ttft, tpot_s AS tpot, kv_transfer_s AS kv, router_s AS router,
           queue_s AS queue, status = 'ok' AS ok
    FROM {db}.request_records FINAL WHERE {where} AND served_stage IN ('pd', 'decode')
    UNION ALL
    SELECT pool, 'aggregated' AS stage, ttft_s AS ttft, tpot_s AS tpot, CAST(NULL AS Nullable(Float64)) AS kv,
           router_s AS router, queue_s AS queue, status = 'ok' AS ok
    FROM {db}.request_records FINAL WHERE {where} AND served_stage = 'aggregated'
)
GROUP BY pool, stage ORDER BY pool, stage"""


def sla_stages(store: SlaStore, since: float, until: float, *, targets: SlaTargets | None = None,
               pool: str | None = None, exact: bool = True) -> list[dict[str, Any]]:
    """Per (pool, stage): ``prefill`` (PD prefill pods: their TTFT), ``decode`` (PD decode pods:
    client TTFT, TPOT, KV-transfer time) and ``aggregated`` (TTFT, TPOT); p50/p90/p99, means, and
    the share within the TTFT and the ITL target (TPOT against the ITL target). ``router`` and
    ``queue`` (decode and aggregated rows): the router's own time before the engine had the request
    and its admission queue's wait, both part of the TTFT beside them."""
    where, params = _window(since, until)
    where += _pool_filter(pool, params)
    params.update(_targets(targets))
    qf = "quantilesExactInclusive" if exact else "quantilesTDigest"
    sql = STAGE_SQL.format(qf=qf, qs=", ".join(str(q) for q in QUANTILES), db=store.database, where=where)
    out = []
    for row in store.rows(sql, params):
        r = dict(row)
        for name in ("ttft", "tpot", "kv", "router", "queue"):
            qs = r.pop(f"{name}_q") or []
            for q, v in zip(QUANTILES, qs):
                r[f"{name}_p{int(round(q * 100))}"] = _num(v)
        for k in ("ttft_mean", "tpot_mean", "kv_mean", "router_mean", "queue_mean", "ttft_attainment",
                  "tpot_attainment"):
            r[k] = _num(r.get(k))
        r["requests"] = int(r["requests"])
        out.append(r)
    return out


def sla_summary(store: SlaStore, since: float, until: float, *, targets: SlaTargets | None = None,
                pool: str | None = None, exact: bool = True) -> list[dict[str, Any]]:
    """TTFT/ITL/e2e p50/p90/p99, throughput, error rate, prefix hit rate and SLA attainment per
    (pool, role) over ``[since, until)``. Rates are per second of the window."""
    where, params = _window(since, until)
    where += _pool_filter(pool, params)
    params.update(_targets(targets))
    sql = (f"SELECT pool, role, {_sla_columns(exact)} FROM {store.database}.request_records FINAL "
           f"WHERE {where} GROUP BY pool, role ORDER BY pool, role")
    return [_finish(r, until - since) for r in store.rows(sql, params)]


def sla_by_minute(store: SlaStore, since: float, until: float | None = None, *,
                  targets: SlaTargets | None = None, pool: str | None = None,
                  exact: bool = True) -> list[dict[str, Any]]:
    """The same figures per (pool, role, minute); ``minute`` is the epoch second it starts at."""
    where, params = _window(since, until)
    where += _pool_filter(pool, params)
    params.update(_targets(targets))
    sql = (f"SELECT pool, role, toUnixTimestamp(toStartOfMinute(ts)) AS minute, {_sla_columns(exact)} "
           f"FROM {store.database}.request_records FINAL WHERE {where} "
           f"GROUP BY pool, role, minute ORDER BY pool, role, minute")
    out = []
    for r in store.rows(sql, params):
        r["minute"] = int(r["minute"])
        out.append(_finish(r, 60.0))
    return out


def refresh_minutes(store: SlaStore, since: float, until: float, *, targets: SlaTargets | None = None,
                    version: int | None = None) -> None:
    """Recompute the per-minute rollup of every minute touching ``[since, until]`` from the
    deduplicated records (``FINAL``); a newer ``version`` replaces the older row of a minute, so
    refreshing again after late or redelivered records is exact. The version is ``version`` (default:
    now in microseconds) or one above the highest stored, whichever is larger, so the latest refresh
    wins even if the clock went back (e.g. between a crashed sink and its restart). ``attained``
    counts requests within ``targets`` as they are now; latencies are kept as log-bucket histograms."""
    params: dict[str, Any] = _targets(targets)
    # whole minutes, as DateTime64 bounds computed here: compared with a DateTime (seconds) bound,
    # ClickHouse 26.9 (chDB 4.4) skips the rows of a part that starts within the last second before
    # it (its index analysis rounds the part's first ts up), so a refresh right after such a part
    # landed counted the minute short, and nothing refreshed it again (tests/test_sla_store.py)
    first, end = math.floor(since / 60.0) * 60.0, (math.floor(until / 60.0) + 1) * 60.0
    params.update({"since": first, "until": end,
                   "version": int(version if version is not None else time.time() * 1e6)})
    hists = ",\n".join(
        f"sumMapIf([{_bucket(f'{n}_s')}], [toUInt64(1)], isNotNull({n}_s)) AS {n}_h" for n in ("ttft", "itl", "e2e"))
    store.command(f"""
        INSERT INTO {store.database}.request_minutes
        SELECT pool, role, minute, version, requests, errors, attained, prompt_tokens, output_tokens,
            cached_tokens, ttft_sum, ttft_n, itl_sum, itl_n,
            ttft_h.1, ttft_h.2, itl_h.1, itl_h.2, e2e_h.1, e2e_h.2
        FROM (
            SELECT pool, role, toStartOfMinute(ts) AS minute,
                greatest({{version:UInt64}},
                         (SELECT max(version) + 1 FROM {store.database}.request_minutes)) AS version,
                count() AS requests,
                countIf(status != 'ok') AS errors,
                countIf(status = 'ok'
                        AND ifNull(ttft_s, 0) <= {{ttft_target:Float64}}
                        AND ifNull(itl_s, 0) <= {{itl_target:Float64}}
                        AND ifNull(e2e_s, 0) <= {{e2e_target:Float64}}) AS attained,
                sum(prompt_tokens) AS prompt_tokens, sum(output_tokens) AS output_tokens,
                sum(cached_tokens) AS cached_tokens,
                sum(ifNull(ttft_s, 0)) AS ttft_sum, countIf(isNotNull(ttft_s)) AS ttft_n,
                sum(ifNull(itl_s, 0)) AS itl_sum, countIf(isNotNull(itl_s)) AS itl_n,
                {hists}
            FROM {store.database}.request_records FINAL
            WHERE ts >= toDateTime64({{since:Float64}}, 3, 'UTC') AND ts < toDateTime64({{until:Float64}}, 3, 'UTC')
            GROUP BY pool, role, minute
        )""", params)


def hist_quantiles(keys: list[int], counts: list[int], qs=QUANTILES) -> list[float | None]:
    """Quantiles of a rollup histogram: the bucket holding the rank, interpolated geometrically."""
    pairs = sorted(zip((int(k) for k in keys), (int(c) for c in counts)))
    total = sum(c for _, c in pairs)
    if total == 0:
        return [None for _ in qs]
    out = []
    for q in qs:
        rank = q * (total - 1)  # 0-based, as numpy's linear method
        cum = 0
        for k, c in pairs:
            if rank < cum + c:
                frac = (rank - cum + 0.5) / c
                out.append(HIST_MIN * HIST_RATIO ** (k + frac))
                break
            cum += c
        else:
            k = pairs[-1][0]
            out.append(HIST_MIN * HIST_RATIO ** (k + 1))
    return out


def sla_summary_rollup(store: SlaStore, since: float, until: float, *,
                       pool: str | None = None) -> list[dict[str, Any]]:
    """:func:`sla_summary` over whole minutes from the rollup: fast over days of history;
    percentiles within ~5 % (histograms); attainment against the targets the rollup was computed
    with."""
    if until <= since:
        raise ValueError(f"empty time window: until ({until}) <= since ({since})")
    params: dict[str, Any] = {"since": float(since), "until": float(until)}
    where = ("minute >= toStartOfMinute(toDateTime({since:Float64}, 'UTC')) "
             "AND minute < toStartOfMinute(toDateTime({until:Float64}, 'UTC'))")
    where += _pool_filter(pool, params)
    sql = f"""
        SELECT pool, role,
            sum(requests) AS n_requests,
            sum(prompt_tokens) AS prompt_tokens_sum,
            sum(output_tokens) AS output_tokens_sum,
            sum(errors) / sum(requests) AS error_rate,
            if(sum(prompt_tokens) > 0, sum(cached_tokens) / sum(prompt_tokens), 0) AS prefix_hit_rate,
            sum(prompt_tokens) / sum(requests) AS isl,
            sum(output_tokens) / sum(requests) AS osl,
            if(sum(ttft_n) > 0, sum(ttft_sum) / sum(ttft_n), NULL) AS ttft_mean,
            if(sum(itl_n) > 0, sum(itl_sum) / sum(itl_n), NULL) AS itl_mean,
            sumMap(ttft_k, ttft_c) AS ttft_h,
            sumMap(itl_k, itl_c) AS itl_h,
            sumMap(e2e_k, e2e_c) AS e2e_h,
            sum(attained) / sum(requests) AS attainment
        FROM {store.database}.request_minutes FINAL
        WHERE {where}
        GROUP BY pool, role ORDER BY pool, role"""
    seconds = (until // 60 - since // 60) * 60 or 60.0
    out = []
    for r in store.rows(sql, params):
        r["requests"] = r.pop("n_requests")
        for name in ("ttft", "itl", "e2e"):
            keys, counts = r.pop(f"{name}_h")
            r[f"{name}_q"] = hist_quantiles(keys, counts)
        out.append(_finish(r, seconds))
    return out


def engine_by_minute(store: SlaStore, since: float, until: float | None = None) -> list[dict[str, Any]]:
    """Per (model, role, minute): pods reporting, peak running/waiting/KV usage, token rates and the
    prefix-cache hit rate, from the per-minute rollup."""
    params: dict[str, Any] = {"since": float(since)}
    where = "minute >= toStartOfMinute(toDateTime({since:Float64}, 'UTC'))"
    if until is not None:
        where += " AND minute < toDateTime({until:Float64}, 'UTC')"
        params["until"] = float(until)
    sql = f"""
        SELECT model, role, toUnixTimestamp(minute) AS minute,
            count() AS pods, sum(running_max) AS running_max, sum(waiting_max) AS waiting_max,
            max(kv_usage_max) AS kv_usage_max,
            sum(prompt_delta) / 60 AS prompt_tokens_per_s,
            sum(generation_delta) / 60 AS generation_tokens_per_s,
            if(sum(queries_delta) > 0, sum(hits_delta) / sum(queries_delta), 0) AS prefix_hit_rate
        FROM (
            SELECT model, role, pod, engine, minute,
                max(running_max) AS running_max, max(waiting_max) AS waiting_max,
                max(kv_usage_max) AS kv_usage_max,
                argMaxMerge(prompt_last) - argMinMerge(prompt_first) AS prompt_delta,
                argMaxMerge(generation_last) - argMinMerge(generation_first) AS generation_delta,
                argMaxMerge(prefix_queries_last) - argMinMerge(prefix_queries_first) AS queries_delta,
                argMaxMerge(prefix_hits_last) - argMinMerge(prefix_hits_first) AS hits_delta
            FROM {store.database}.engine_metrics_1m
            WHERE {where}
            GROUP BY model, role, pod, engine, minute
        )
        GROUP BY model, role, minute ORDER BY model, role, minute"""
    rows = store.rows(sql, params)
    for r in rows:
        r["minute"] = int(r["minute"])
        r["pods"] = int(r["pods"])
    return rows


def recent_hints(store: SlaStore, since: float) -> list[dict[str, Any]]:
    rows = store.rows(
        f"SELECT pool, role, toFloat64(ts) AS ts, current, desired, reason, predictor, mode, inputs "
        f"FROM {store.database}.scaling_hints FINAL WHERE ts >= toDateTime64({{since:Float64}}, 3, 'UTC') "
        f"ORDER BY pool, role, ts",
        {"since": float(since)},
    )
    for r in rows:
        r["inputs"] = json.loads(r["inputs"]) if r["inputs"] else {}
        r["current"], r["desired"] = int(r["current"]), int(r["desired"])
    return rows

