"""Chaos (d): poison messages of every kind (oversized, truncated, wrong types, huge numbers,
huge epoch) on every subject family, against every consumer at once (indexer, router feeds
with the embedded KV index, diagnosis, SLA sink), on a real nats-server.

Each bad message gets exactly one dead letter (bounded, deduplicated across the consumers that
reject it); every consumer acks it, skips it and goes on to fold the valid event after it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry

from chaos_tools import record, until
from consumers import bus
from consumers import sla_queries as Q
from consumers.diagnosis import DiagnosisService
from consumers.indexer import IndexerConfig, IndexerService
from consumers.sla_sink import SlaSink
from consumers.sla_store import ChdbStore, SlaConfig
from router.config import RouterConfig
from router.feeds import BusFeeds
from router.state import ClusterState
from schemas import (DeadLetter, Diagnosis, EngineAnnouncement, EngineMetrics, KvEventBatch, RequestRecord,
                     decode_event)
from schemas import subjects as S
from schemas.kv import BlockStored
from schemas.scaling import ScalingHint
from streams.clock import SystemClock
from streams.diagnosis import build_ruleset
from streams.diagnosis.rules import DiagnosisConfig
from streams.kv_index import KvIndex
from test_diagnosis_helpers import sample

FAST = {"timing": {"hold_s": 2, "update_interval_s": 600, "stale_after_s": 120}}


def valid_events(now: float) -> dict[str, tuple[str, object]]:
    """One valid event per subject family: family -> (subject, event)."""
    return {
        "kv.events": (S.kv_events("m", "good"), KvEventBatch(pod="good", model="m", seq=0, ts=now, events=[
            BlockStored(block_hashes=[1, 2], token_ids=list(range(8)), block_size=4)])),
        "device.telemetry": (S.device_telemetry("n1", "0"), sample(now)),
        "engine.metrics": (S.engine_metrics("good"), EngineMetrics(pod="good", model="m", ts=now, num_requests_running=1,
                                                                 num_requests_waiting=0, kv_cache_usage_perc=0.1)),
        "engine.announce": (S.engine_announce("good"),
                            EngineAnnouncement(pod="good", url="http://127.0.0.1:9", model="m", ts=now)),
        "diagnosis": (S.diagnosis("n1", "0"), Diagnosis(
            finding_id="f1", node="n1", device="0", fault_mode="over_temperature", severity="warning",
            status="open", action="NotHandle", summary="warm", first_seen=now, last_seen=now)),
        "router.requests": (S.router_requests("pool"), RequestRecord(request_id="r-good", ts=now, pool="pool",
                                                                     model="m")),
        "autoscale.hints": (S.autoscale_hints("pool", "decode"), ScalingHint(
            pool="pool", role="decode", ts=now, current=1, desired=2, reason="load")),
    }


def poisons(family: str, event, max_payload: int) -> list[tuple[str, bytes]]:
    good = json.loads(event.to_json())
    first_str = next(k for k, v in good.items() if isinstance(v, str))
    out = [
        # nats-server's default max_payload is 1 MiB: 960 KiB of garbage, whose unbounded letter
        # (base64, +33%) would not fit; the letter must stay small whatever the server allows
        ("oversized", bytes(range(256)) * ((min(max_payload, 1 << 20) - 64 * 1024) // 256)),
        ("truncated", event.to_json()[: len(event.to_json()) // 2]),
        ("wrong types", json.dumps({**good, first_str: 12345}).encode()),
        ("huge number", json.dumps({**good, "schema_version": 10 ** 30}).encode()),
    ]
    if family == "kv.events":
        out.append(("huge epoch", json.dumps({**good, "epoch": 10 ** 30}).encode()))
    return out


async def test_poison_of_every_kind_on_every_family_one_letter_each_and_no_consumer_stuck(
        nats_config, nc, prefix, topology, tmp_path):
    js = nc.jetstream()
    reg = {k: CollectorRegistry() for k in ("indexer", "router", "diag", "sla")}
    indexer = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="poison",
                                           snapshot_on_stop=False), nats_config, registry=reg["indexer"])
    router_index = KvIndex(SystemClock())
    state = ClusterState(RouterConfig())
    feeds = BusFeeds(nc, state, prefix=prefix, index=router_index, registry=reg["router"])
    diag = DiagnosisService(nats_config, DiagnosisConfig(durable="diag-poison", start="all", tick_s=0.2),
                            rules=build_ruleset(FAST), registry=reg["diag"], topology=topology)
    store = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(store)
    sink = SlaSink(js, store, SlaConfig(batch_rows=1, flush_interval_s=0.2), topology=topology, prefix=prefix,
                   registry=reg["sla"])
    stop = asyncio.Event()
    sink_task = None
    try:
        await indexer.start()
        await feeds.start()
        await diag.start()
        sink_task = asyncio.create_task(sink.run(stop))
        now = time.time()
        bad = 0
        t0 = time.monotonic()
        for family, (subject, event) in valid_events(now).items():
            for _kind, data in poisons(family, event, nc.max_payload):
                await bus.publish(js, S.with_prefix(prefix, subject), data)
                bad += 1
        for family, (subject, event) in valid_events(now).items():
            await bus.publish(js, S.with_prefix(prefix, subject), event.to_json())

        # every consumer went past its poison and folded the valid event after it
        await until(lambda: "good" in indexer.index.pods(), 30, "the indexer to apply the valid batch")
        await until(lambda: "good" in router_index.pods(), 30, "the router's index to apply the valid batch")
        await until(lambda: any(b.pod == "good" for b in state.snapshot()), 30, "the router to see the engine")
        await until(lambda: (reg["diag"].get_sample_value("infernex_diagnosis_telemetry_total",
                                                          {"result": "ok"}) or 0) >= 1, 30, "diagnosis telemetry")
        await until(lambda: sink.inserted["request_records"] >= 1 and sink.inserted["scaling_hints"] >= 1
                    and sink.inserted["diagnoses"] >= 1 and sink.inserted["engine_metrics"] >= 1, 30,
                    "the SLA sink to insert the valid rows")

        # one dead letter per bad message, whichever and however many consumers rejected it
        dlq = f"{prefix.upper()}_DLQ"

        async def letters() -> int:
            return (await js.stream_info(dlq)).state.messages

        await until(letters, 30, "dead letters")
        await until(lambda: True, 0.1, "")
        await asyncio.sleep(1.0)  # late duplicates would show up now
        got = await letters()
        recovered = time.monotonic() - t0
        assert got == bad, f"{got} dead letters for {bad} bad messages"
        sub = await js.pull_subscribe(S.with_prefix(prefix, "dlq.>"), durable="check", stream=dlq)
        msgs = await sub.fetch(bad, timeout=5)
        seen = set()
        for m in msgs:
            assert len(m.data) < 32 * 1024  # bounded, however large the original
            letter = decode_event(DeadLetter, m.data)
            assert letter.payload_size is not None and len(letter.payload_sha256 or "") == 64
            seen.add((letter.stream, letter.stream_seq))
        assert len(seen) == bad
        # nothing looped: the indexer read each message once, no re-reads
        assert reg["indexer"].get_sample_value("infernex_indexer_consumer_resyncs_total") == 0
        for name, r in reg.items():
            assert (r.get_sample_value("infernex_dead_letter_publish_failures_total") or 0) == 0, name
        record("poison of every kind on every subject family (29 messages, 4 consumers)", True, 0, recovered,
               dead_letters=got)
    finally:
        stop.set()
        if sink_task is not None:
            await asyncio.wait_for(sink_task, 30)
        await diag.stop()
        await feeds.stop()
        await indexer.stop()
        store.close()


async def test_a_failed_dead_letter_never_loops_the_indexer(nats_config, nc, prefix, topology):
    """No DLQ stream at all: the bad message's letter cannot be stored; it is counted as a failure,
    the message is skipped once, and the valid batch after it is applied."""
    js = nc.jetstream()
    await js.delete_stream(f"{prefix.upper()}_DLQ")
    reg = CollectorRegistry()
    indexer = IndexerService(IndexerConfig(http_port=None, nats_query=False, durable="noloop",
                                           snapshot_on_stop=False), nats_config, registry=reg)
    await indexer.start()
    try:
        subj = S.with_prefix(prefix, S.kv_events("m", "good"))
        await bus.publish(js, subj, b"\x00" * (nc.max_payload - 1024))
        ok = valid_events(time.time())["kv.events"][1]
        await bus.publish(js, subj, ok.to_json())
        await until(lambda: "good" in indexer.index.pods(), 30, "the valid batch after the poison")
        assert reg.get_sample_value("infernex_dead_letter_publish_failures_total",
                                    {"stream": "kv-events", "consumer": "noloop"}) == 1
        assert reg.get_sample_value("infernex_indexer_consumer_resyncs_total") == 0
    finally:
        await indexer.stop()


def test_pub_refuses_a_huge_epoch_in_one_line(nats_config):
    """``infernex pub`` validates before publishing: one line naming the field, exit 2."""
    bad = json.dumps({"pod": "p", "model": "m", "epoch": 10 ** 30, "seq": 0, "ts": 1.0, "events": []})
    env = {"INFERNEX_NATS__SERVERS": nats_config.servers[0], "PATH": "/usr/bin:/bin"}
    import os

    env = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "pub", "kv.events.m.p", bad], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "epoch" in r.stderr and "Traceback" not in r.stderr + r.stdout
