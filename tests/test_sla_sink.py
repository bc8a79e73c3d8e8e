"""The sink against a real nats-server: kill it mid-batch, restart, row counts equal what was
published; inserts that fail after landing are redelivered and still count once; malformed
messages go to the dead-letter subject and the sink keeps going."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from consumers import bus
from consumers import sla_queries as Q
from consumers.sla_sink import ROUTES, SlaSink, minute_runs
from consumers.sla_store import ChdbStore, SlaConfig
from schemas import Diagnosis, EngineMetrics, RequestRecord
from schemas import subjects as S

INFERNEX = [sys.executable, "-m", "infernex.cli"]


def _record(i: int, t0: float) -> RequestRecord:
    return RequestRecord(request_id=f"req-{i}", ts=t0 + i * 0.01, pool="pool-a", role="pd", model="m",
                         prompt_tokens=100 + i % 50, output_tokens=20, ttft_s=0.1, itl_s=0.02, e2e_s=0.5)


def _metrics(i: int, t0: float) -> EngineMetrics:
    return EngineMetrics(pod=f"pod-{i % 3}", model="m", role="decode", ts=t0 + i, num_requests_running=1,
                         num_requests_waiting=0, kv_cache_usage_perc=0.5)


def _diag(i: int, t0: float) -> Diagnosis:
    return Diagnosis(finding_id=f"f{i}", node="n1", device="0", fault_mode="over_temperature",
                     severity="warning", status="open", action="Observe", summary="hot",
                     first_seen=t0, last_seen=t0 + i)


async def _publish_records(js, prefix, lo, hi, t0):
    for i in range(lo, hi):
        r = _record(i, t0)
        await bus.publish(js, S.with_prefix(prefix, S.router_requests(r.pool)), r.to_json(), msg_id=r.request_id)


async def _wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _start_sink(nats_server, prefix, chdb_path, **sla_env):
    env = dict(os.environ)
    env.update({
        "INFERNEX_NATS__SERVERS": nats_server.url,
        "INFERNEX_NATS__SUBJECT_PREFIX": prefix,
        "INFERNEX_SLA__CHDB_PATH": str(chdb_path),
    })
    env.update({f"INFERNEX_SLA__{k.upper()}": str(v) for k, v in sla_env.items()})
    return subprocess.Popen(INFERNEX + ["sla-sink"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("consume", ["pull", "push"])
async def test_kill_mid_batch_then_restart_loses_and_duplicates_nothing(nats_server, nc, topology, prefix, tmp_path,
                                                                         consume):
    js = nc.jetstream()
    # a minute starts at record 750 (with push: inside the second batch, which the killed sink
    # acked); the minute before must be rolled up completely although no record published after
    # the kill falls into it
    t0 = (time.time() - 300) // 60 * 60 - 7.5
    router = f"{prefix.upper()}_ROUTER"
    chdb_path = tmp_path / "chdb"
    # batches of >= 500 rows get inserted and acked; the rest waits in the buffer (flush after 120 s,
    # no redelivery for 300 s, so this state lasts however slow the machine is). With push the
    # batches are 500, 500 and 250 stay buffered; pull fetches may return fewer rows under load
    published = 1250
    await _publish_records(js, prefix, 0, published, t0)
    suffix = "-push" if consume == "push" else ""
    durable = "sla-sink-requests" + suffix
    proc = _start_sink(nats_server, prefix, chdb_path, batch_rows=500, flush_interval_s=120, ack_wait_s=300,
                       consume=consume)
    try:
        async def mid_batch():
            nonlocal published
            try:
                info = await js.consumer_info(router, durable)
            except Exception:  # noqa: BLE001 - not created yet
                return None
            if info.ack_floor.stream_seq < 500:
                return None
            if info.num_ack_pending:  # a batch acked, later rows buffered (or being inserted)
                return info
            if info.num_pending == 0 and info.ack_floor.stream_seq == published:
                # the batches added up to everything published: 100 more stay in the buffer
                await _publish_records(js, prefix, published, published + 100, t0)
                published += 100
            return None

        await _wait_for(mid_batch, timeout=90, what="a batch acked and later rows buffered")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    info = await js.consumer_info(router, durable)
    assert info.ack_floor.stream_seq >= 500 and info.num_ack_pending > 0  # killed with rows unacked
    # the durable keeps its settings across restarts: let the unacked rows come back soon
    await js.add_consumer(router, info.config.evolve(ack_wait=2.0))

    # more traffic while the sink is down, including engine metrics, diagnoses and garbage
    await _publish_records(js, prefix, published, 3000, t0)
    for i in range(30):
        m = _metrics(i, t0)
        await bus.publish(js, S.with_prefix(prefix, S.engine_metrics(m.pod)), m.to_json(), msg_id=f"m{i}")
    for i in range(7):
        d = _diag(i, t0)
        await bus.publish(js, S.with_prefix(prefix, S.diagnosis(d.node, d.device)), d.to_json(), msg_id=f"d{i}")
    bad = [b"not json", b'{"request_id": ""}', b'{"pool": "x"}']
    for i, b in enumerate(bad):
        await bus.publish(js, S.with_prefix(prefix, S.router_requests("pool-a")), b, msg_id=f"bad{i}")

    proc = _start_sink(nats_server, prefix, chdb_path, batch_rows=500, flush_interval_s=0.5, ack_wait_s=2,
                       consume=consume)
    try:
        async def drained():
            total = 0
            for stream, durable in ((router, "sla-sink-requests"), (f"{prefix.upper()}_ENGINE", "sla-sink-metrics"),
                                    (f"{prefix.upper()}_DIAGNOSIS", "sla-sink-diagnoses")):
                try:
                    info = await js.consumer_info(stream, durable + suffix)
                except Exception:  # noqa: BLE001
                    return False
                if info.num_pending or info.num_ack_pending:
                    return False
                total += info.delivered.stream_seq
            return total > 0

        await _wait_for(drained, timeout=90, what="every message acked")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # the dead letters carry the reasons
    dlq = await js.subscribe(S.with_prefix(prefix, S.dead_letter(S.ROUTER)), deliver_policy="all")
    reasons = []
    for _ in bad:
        msg = await dlq.next_msg(timeout=10)
        reasons.append(msg.data.decode())
    assert all("RequestRecord" in r for r in reasons)
    await dlq.unsubscribe()

    store = ChdbStore(chdb_path, "infernex")
    try:
        counts = Q.table_counts(store)
        ids = store.rows("SELECT uniqExact(request_id) AS n FROM infernex.request_records")[0]["n"]
        rollup = Q.sla_summary_rollup(store, t0 - 60, t0 + 120)
    finally:
        store.close()
    assert counts == {"request_records": 3000, "engine_metrics": 30, "diagnoses": 7, "scaling_hints": 0}
    assert int(ids) == 3000
    assert [r["requests"] for r in rollup] == [3000]  # the per-minute rollup agrees


class _InsertThenFail:
    """A store whose first insert lands and then reports failure (a crash between insert and ack)."""

    def __init__(self, store):
        self.store = store
        self.database = store.database
        self.failed = False
        self.calls: list[tuple] = []  # inserts and rollup refreshes, in order (a failure message shows them)

    def insert_json_each_row(self, table, rows):
        self.store.insert_json_each_row(table, rows)
        self.calls.append(("insert", table, len(rows)))
        if not self.failed:
            self.failed = True
            raise RuntimeError("connection reset after insert")

    def command(self, sql, params=None):
        if "request_minutes" in sql:
            self.calls.append(("refresh", params.get("since"), params.get("until"), params.get("version")))
        return self.store.command(sql, params)

    def __getattr__(self, name):
        return getattr(self.store, name)


async def test_insert_that_failed_after_landing_is_redelivered_and_counted_once(nc, topology, prefix, tmp_path):
    js = nc.jetstream()
    t0 = time.time() - 300
    await _publish_records(js, prefix, 0, 400, t0)
    store = ChdbStore(tmp_path / "chdb", "infernex")
    try:
        Q.migrate(store)
        flaky = _InsertThenFail(store)
        cfg = SlaConfig(batch_rows=150, flush_interval_s=0.3, ack_wait_s=2)
        registry = CollectorRegistry()
        sink = SlaSink(js, flaky, cfg, topology=topology, prefix=prefix, registry=registry)
        stop = asyncio.Event()
        task = asyncio.create_task(sink.run(stop))

        seen: dict = {}

        async def done():
            # the sink counts rows as inserted before it refreshes their minutes and acks: wait for
            # the rollup too, so stopping the sink cannot cut the last refresh short
            seen.update(table=Q.table_counts(store)["request_records"], inserted=sink.inserted["request_records"])
            if not (seen["table"] == 400 and seen["inserted"] >= 400):
                return False
            seen["rollup"] = [r["requests"] for r in Q.sla_summary_rollup(store, t0 - 60, t0 + 120)]
            return seen["rollup"] == [400]

        try:
            await _wait_for(done, timeout=60, what="all rows and their rollup after the failed insert")
        except AssertionError as exc:
            db = store.database
            minutes = store.rows(f"SELECT minute, version, requests FROM {db}.request_minutes ORDER BY minute, version")
            per_minute = store.rows(f"SELECT toStartOfMinute(ts) AS minute, count() AS n FROM {db}.request_records "
                                    f"FINAL GROUP BY minute ORDER BY minute")
            raise AssertionError(f"{exc}; last seen {seen}; rollup rows {minutes}; records per minute {per_minute}; "
                                 f"store calls {flaky.calls}") from None
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        assert flaky.failed
        assert registry.get_sample_value("infernex_sla_sink_insert_errors_total", {"table": "request_records"}) == 1
        assert Q.table_counts(store)["request_records"] == 400
        raw = int(store.rows("SELECT count() AS n FROM infernex.request_records")[0]["n"])
        assert raw >= 400  # duplicates may sit in unmerged parts; FINAL counts them once
        # the per-minute rollup was refreshed after the redelivered insert too
        (roll,) = Q.sla_summary_rollup(store, t0 - 60, t0 + 120)
        assert roll["requests"] == 400
    finally:
        store.close()


class _FirstRollupBlocksThenFails:
    """A store whose first rollup refresh waits until released and then fails: the window in
    which a sink killed after inserting a batch has not yet refreshed the batch's minutes."""

    def __init__(self, store):
        self.store = store
        self.database = store.database
        self.entered = threading.Event()
        self.release = threading.Event()

    def command(self, sql, params=None):
        if "request_minutes" in sql and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never released the rollup refresh"
            raise RuntimeError("killed during the rollup refresh")
        return self.store.command(sql, params)

    def __getattr__(self, name):
        return getattr(self.store, name)


async def test_batch_is_acked_only_after_its_minutes_are_rolled_up(nc, topology, prefix, tmp_path):
    js = nc.jetstream()
    minute = (time.time() - 300) // 60 * 60
    t0 = minute - 1.495  # records 0..149 (the first batch) are the only ones in the minute before
    await _publish_records(js, prefix, 0, 450, t0)
    store = ChdbStore(tmp_path / "chdb", "infernex")
    try:
        Q.migrate(store)
        wrapped = _FirstRollupBlocksThenFails(store)
        cfg = SlaConfig(batch_rows=150, flush_interval_s=5, ack_wait_s=30)
        registry = CollectorRegistry()
        sink = SlaSink(js, wrapped, cfg, topology=topology, prefix=prefix, registry=registry)
        route = next(r for r in ROUTES if r.table == "request_records")
        stream, durable = sink.stream_of(route).name, sink.durable_name(route)
        stop = asyncio.Event()
        task = asyncio.create_task(sink.run(stop))
        try:
            await _wait_for(lambda: asyncio.to_thread(wrapped.entered.wait, 0.5), what="the first rollup refresh")
            # the first batch is in the table but its minute is not rolled up yet: nothing may be acked
            info = await js.consumer_info(stream, durable)
            assert info.ack_floor.stream_seq == 0 and info.num_ack_pending >= 150
            assert Q.table_counts(store)["request_records"] >= 150
            wrapped.release.set()

            async def settled():
                info = await js.consumer_info(stream, durable)
                return info.num_pending == 0 and info.num_ack_pending == 0 and info.ack_floor.stream_seq == 450

            await _wait_for(settled, what="every record acked after the failed rollup was redelivered")
        finally:
            wrapped.release.set()
            stop.set()
            await asyncio.wait_for(task, timeout=30)
        assert registry.get_sample_value("infernex_sla_sink_insert_errors_total", {"table": "request_minutes"}) == 1
        assert Q.table_counts(store)["request_records"] == 450
        exact = {(r["minute"], r["requests"]) for r in Q.sla_by_minute(store, t0 - 60, t0 + 120)}
        assert exact == {(int(minute) - 60, 150), (int(minute), 300)}
        rolled = {(m, Q.sla_summary_rollup(store, m, m + 60)[0]["requests"]) for m, _ in exact}
        assert rolled == exact  # the minute only the failed batch touched is rolled up too
    finally:
        store.close()


def test_minute_runs():
    assert minute_runs(set()) == []
    assert minute_runs({5, 3, 4, 9, 11, 10, 20}) == [(3, 5), (9, 11), (20, 20)]
