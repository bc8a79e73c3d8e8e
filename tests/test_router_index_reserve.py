"""The router sizes its embedded KV index for the capacity the engines report (``num_gpu_blocks``
in their metrics), so the tables do not grow, a rehash of the whole table that stalls every
request, while the engines fill their caches."""

from __future__ import annotations

import time

from router import server as router_server
from router.config import RouterConfig, StaticBackend
from router.server import RouterService
from schemas import EngineMetrics
from streams.clock import SystemClock
from streams.kv_index import KvIndex


def _service(n: int = 4) -> RouterService:
    cfg = RouterConfig(backends=[StaticBackend(pod=f"e{i}", url=f"http://127.0.0.1:{9 + i}", model="m")
                                 for i in range(n)], bus=False, records=False, strategy="kv-aware")
    return RouterService(cfg, index=KvIndex(SystemClock(), default_block_size=16))


def _report(svc: RouterService, pod: str, blocks: int) -> None:
    svc.state.apply_metrics(EngineMetrics(pod=pod, model="m", engine="0", ts=time.time(), num_requests_running=0,
                                          num_requests_waiting=0, kv_cache_usage_perc=0.0, num_gpu_blocks=blocks))


def test_the_index_is_sized_for_the_engines_reported_blocks_once_they_report_them():
    svc = _service()
    svc._reserve_index()
    assert "m" not in svc.index._models  # nothing reported yet: nothing sized
    for i in range(4):
        _report(svc, f"e{i}", 20_000)
    svc.state.refresh()
    svc._reserve_index()
    m = svc.index._models["m"]
    assert m.kt.shape[0] * 0.6 >= 80_000 and m.em.shape[0] * 0.6 >= 80_000
    kt = m.kt
    svc._reserve_index()
    assert svc.index._models["m"].kt is kt  # the same capacity again: not resized


def test_a_bogus_capacity_is_capped():
    svc = _service(1)
    _report(svc, "e0", 10**9)
    svc.state.refresh()
    svc._reserve_index()
    m = svc.index._models["m"]
    assert m.kt.shape[0] * 0.6 < 2 * router_server._RESERVE_MAX_BLOCKS
