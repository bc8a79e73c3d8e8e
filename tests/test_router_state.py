"""Pure state of the router: load / announcement folds, cluster view, breakers, rate limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RouterConfig, StaticBackend
from router.resilience import CircuitBreakers, RateLimiter
from router.state import ClusterState
from schemas import Diagnosis, EngineAnnouncement, EngineMetrics
from streams.backends import AnnouncedBackends
from streams.clock import ManualClock
from streams.load import LoadState

T0 = 1_700_000_000.0


def metrics(pod, ts, waiting=0.0, kv=0.1, engine="0"):
    return EngineMetrics(pod=pod, model="m", engine=engine, ts=ts, num_requests_running=1,
                         num_requests_waiting=waiting, kv_cache_usage_perc=kv)


def test_load_fold_latest_wins_sums_engines_and_goes_stale():
    clock = ManualClock(T0)
    ld = LoadState(clock, stale_after_s=10)
    assert ld.apply(metrics("a", T0, waiting=3))
    assert not ld.apply(metrics("a", T0 - 1, waiting=99))  # older snapshot ignored
    ld.apply(metrics("a", T0, waiting=2, kv=0.3, engine="1"))  # a second DP engine
    got = ld.get("a")
    assert got.waiting == 5 and got.running == 2 and abs(got.kv_usage - 0.2) < 1e-9
    clock.advance(11)
    assert ld.get("a") is None and ld.all() == {}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["0", "1"]),
                          st.floats(0, 100), st.floats(0, 50)), max_size=30))
def test_load_fold_restore_from_dump_is_the_same(events):
    clock = ManualClock(T0 + 100)
    ld = LoadState(clock, stale_after_s=1000)
    for pod, eng, dt, w in events:
        ld.apply(metrics(pod, T0 + dt, waiting=w, engine=eng))
    again = LoadState(clock, stale_after_s=1000)
    for m in ld.dump():
        again.apply(m)
    assert again.all() == ld.all()


def announce(pod, ts, state="up", ttl=30.0, pool="default"):
    return EngineAnnouncement(pod=pod, url=f"http://{pod}:8000", model="m", ts=ts, state=state, ttl_s=ttl, pool=pool)


def test_announcements_expire_and_go_down():
    clock = ManualClock(T0)
    ab = AnnouncedBackends(clock)
    ab.apply(announce("a", T0, ttl=5))
    ab.apply(announce("b", T0))
    ab.apply(announce("b", T0 - 10, state="down"))  # stale: ignored
    assert {a.pod for a in ab.alive()} == {"a", "b"}
    clock.advance(6)
    assert {a.pod for a in ab.alive()} == {"b"}
    ab.apply(announce("b", T0 + 6, state="down"))
    assert ab.alive() == []
    again = AnnouncedBackends(clock)
    for a in ab.dump():
        again.apply(a)
    assert again.dump() == ab.dump()


def test_cluster_state_merges_sources_and_keeps_counters():
    clock = ManualClock(T0)
    cfg = RouterConfig(backends=[StaticBackend(pod="s", url="http://s:1/", model="m")], bus=False)
    cs = ClusterState(cfg, clock=clock)
    cs.apply_announcement(announce("a", T0))
    cs.apply_announcement(announce("other", T0, pool="elsewhere"))
    assert {b.pod for b in cs.snapshot()} == {"s", "a"}
    assert cs.get("s").url == "http://s:1"
    a = cs.get("a")
    cs.started(a, 100, 100)
    cs.apply_announcement(announce("a", T0 + 1, state="draining"))
    assert cs.get("a") is a and a.inflight == 1 and a.draining  # same object, counters kept
    cs.first_token(a, 100)
    cs.finished(a, 100, 0)
    assert (a.inflight, a.active_tokens, a.pending_prefill_tokens) == (0, 0, 0)
    e0 = cs.epoch
    cs.apply_metrics(metrics("a", T0, waiting=7, kv=0.5))
    assert (a.waiting, a.kv_usage) == (7, 0.5)
    assert cs.epoch > e0  # load changed: cached scorer columns must not be reused
    e1 = cs.epoch
    cs.started(a, 10, 10)
    cs.finished(a, 10, 0)
    assert cs.epoch == e1  # the router's own counters are not load-only inputs
    d = Diagnosis(finding_id="f", node="n", device="d0", fault_mode="over_temperature", severity="warning",
                  status="open", action="Observe", summary="hot", first_seen=T0, last_seen=T0, pods=["a"])
    cs.apply_diagnosis(d)
    assert a.health == "warning" and cs.epoch > e1
    cs.apply_diagnosis(d.model_copy(update={"status": "resolved", "last_seen": T0 + 1}))
    assert a.health == "ok"
    clock.advance(32)
    cs.refresh()  # the announcement's TTL passed, metrics stale
    assert {b.pod for b in cs.snapshot()} == {"s"}


def test_circuit_breaker_opens_half_opens_and_closes():
    clock = ManualClock(T0)
    br = CircuitBreakers(failure_threshold=2, cooldown_s=10, clock=clock)
    assert not br.failure("a") and not br.is_open("a")
    assert br.failure("a") and br.is_open("a") and br.state("a") == "open"
    clock.advance(10)
    assert br.state("a") == "half-open" and not br.is_open("a")
    br.attempt("a")  # the single trial is under way
    assert br.is_open("a")
    assert br.failure("a") and br.is_open("a")  # trial failed: open again
    clock.advance(10)
    br.attempt("a")
    br.success("a")
    assert br.state("a") == "closed" and not br.is_open("a")
    br.failure("b")
    br.success("b")
    assert not br.failure("b")  # success reset the count


def test_rate_limiter_per_key_token_bucket():
    clock = ManualClock(T0)
    rl = RateLimiter(rate=2, burst=3, clock=clock)
    assert [rl.allow("k")[0] for _ in range(4)] == [True, True, True, False]
    ok, wait = rl.allow("k")
    assert not ok and 0 < wait <= 0.5
    assert rl.allow("other")[0]
    clock.advance(0.5)
    assert rl.allow("k")[0] and not rl.allow("k")[0]


async def test_record_sink_never_blocks_and_counts_drops():
    from prometheus_client import CollectorRegistry

    from router.records import RecordSink
    from schemas import RequestRecord, RoutingDecision

    reg = CollectorRegistry()
    sink = RecordSink("default", buffer=2, registry=reg)
    for i in range(3):
        sink.submit_request(RequestRecord(request_id=f"r{i}", ts=T0, pool="default", model="m"))
    built = []

    def lazy():
        built.append(1)
        return RoutingDecision(request_id="r", ts=T0, pool="default", model="m", profile="p", picked=None)

    sink.submit_decision(lazy, msg_id="d")
    assert sink.dropped == 2 and sink.queue.qsize() == 2 and built == []  # nothing built on the request path
    assert reg.get_sample_value("infernex_router_records_dropped_total", {"kind": "request"}) == 1
    assert reg.get_sample_value("infernex_router_records_dropped_total", {"kind": "decision"}) == 1
    subject, ev, msg_id = sink.queue.get_nowait()
    assert subject == "router.requests.default" and msg_id == "req:r0"


def test_device_telemetry_feeds_the_health_score_terms():
    from router.plugins import build_plugin
    from router.plugins.base import Ctx
    from router.types import RoutingRequest
    from schemas import DeviceTelemetry

    clock = ManualClock(T0)
    cs = ClusterState(RouterConfig(bus=False), clock=clock)
    cs.apply_announcement(EngineAnnouncement(pod="a", url="http://a", model="m", ts=T0, node="n1", devices=["0"]))
    cs.apply_announcement(EngineAnnouncement(pod="b", url="http://b", model="m", ts=T0, node="n2"))
    tel = dict(kind="npu", source="npu-smi", ts=T0, memory_total_mb=1000)
    cs.apply_device(DeviceTelemetry(node="n1", device="0", utilization_pct=80, memory_used_mb=500, **tel))
    cs.apply_device(DeviceTelemetry(node="n2", device="3", utilization_pct=10, memory_used_mb=100, pods=["b"], **tel))
    a, b = cs.get("a"), cs.get("b")
    assert (a.cpu_util, a.mem_util) == (0.8, 0.5) and (b.cpu_util, b.mem_util) == (0.1, 0.1)
    s = build_plugin("health-scorer").score(RoutingRequest(model="m"), [a, b], Ctx())
    assert s == pytest.approx([0.4 + 0.3 * 0.2 + 0.3 * 0.5, 0.4 + 0.3 * 0.9 + 0.3 * 0.9])
    clock.advance(31)
    cs.refresh()  # stale telemetry no longer counts
    assert cs.get("a") is None or cs.get("a").cpu_util is None
