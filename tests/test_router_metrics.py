"""router.metrics: cheap counters/histograms expose the same samples as prometheus_client's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.metrics import FastMetrics

BUCKETS = (0, 1e-4, 1e-3, 0.01, 0.5, 1, 4096)


def samples(reg: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]),
                          st.floats(min_value=0, max_value=5000, allow_nan=False)), max_size=40))
def test_same_samples_as_prometheus_client(obs):
    ref, fast = CollectorRegistry(), CollectorRegistry()
    h_ref = Histogram("t_seconds", "doc", ["k"], registry=ref, buckets=BUCKETS)
    c_ref = Counter("t_events_total", "doc", ["k", "j"], registry=ref)
    fm = FastMetrics(fast)
    h_fast = fm.histogram("t_seconds", "doc", ["k"], buckets=BUCKETS)
    c_fast = fm.counter("t_events_total", "doc", ["k", "j"])
    for k, v in obs:
        h_ref.labels(k).observe(v)
        h_fast.labels(k).observe(v)
        c_ref.labels(k, "x").inc(v)
        c_fast.labels(k, "x").inc(v)
    got, want = samples(fast), samples(ref)
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v), key


def test_gauge_function_unlabelled_and_exposition():
    reg = CollectorRegistry()
    fm = FastMetrics(reg)
    n = {"v": 3}
    fm.gauge_function("t_inflight", "doc", lambda: n["v"])
    c = fm.counter("t_total", "doc")
    c.inc()
    c.inc(2)
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        fm.counter("t2_total", "doc", ["a"]).labels("x", "y")
    assert reg.get_sample_value("t_inflight") == 3
    n["v"] = 5
    assert reg.get_sample_value("t_inflight") == 5 and reg.get_sample_value("t_total") == 3
    text = generate_latest(reg).decode()
    assert "# TYPE t_total counter" in text and "t_total 3.0" in text and "t_inflight 5.0" in text


async def test_the_routers_event_loop_lag_shows_a_blocked_loop():
    """``infernex_router_event_loop_lag_seconds``: work that holds the router's loop for 0.3 s shows
    as one wake-up that late; a free loop's wake-ups stay within milliseconds."""
    import asyncio
    import time

    from router.app import RouterApp
    from router.config import RouterConfig, StaticBackend

    app = RouterApp(RouterConfig(strategy="round-robin", backends=[StaticBackend(pod="e", url="http://127.0.0.1:9", model="m")],
                                 bus=False, records=False))
    await app.start("127.0.0.1", 0)
    try:
        get = app.registry.get_sample_value
        name = "infernex_router_event_loop_lag_seconds"
        await asyncio.sleep(0.3)
        free = get(f"{name}_count")
        assert free >= 2 and get(f"{name}_bucket", {"le": "0.25"}) == free  # no wake-up 250 ms late
        before = get(f"{name}_sum")
        time.sleep(0.3)  # noqa: ASYNC251 - the loop held, as a long computation on it would
        await asyncio.sleep(0.15)
        late = get(f"{name}_count") - get(f"{name}_bucket", {"le": "0.25"})
        assert late == 1 and get(f"{name}_sum") - before >= 0.25
    finally:
        await app.stop(drain=False)
