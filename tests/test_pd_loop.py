"""The PD sizing loop closed on one machine: a pool started 1P3D under a prompt-heavy ramp; hints
read from the SLA history (chDB) resize it; attainment recovers; the hints are in ClickHouse."""

from __future__ import annotations

import asyncio

from consumers import sla_queries as Q
from consumers.pd_loop import run_loop
from consumers.sla_store import ChdbStore
from streams.planner import SlaTargets


def test_wrong_ratio_is_resized_and_attainment_recovers(tmp_path):
    store = ChdbStore(tmp_path / "chdb", "infernex")
    Q.migrate(store)
    try:
        rep = asyncio.run(run_loop(store, intervals=10, interval_s=20.0, start=(1, 3), low=1.0, high=5.0,
                                   isl=(5000, 7000), osl=(50, 150), targets=SlaTargets(ttft_s=2.0, itl_s=0.025),
                                   engines_max=6, log=None))
        counts = Q.table_counts(store)
        hints = Q.recent_hints(store, 0)
    finally:
        store.close()
    iv = rep.intervals
    assert counts["scaling_hints"] == 2 * len(iv) == rep.hint_rows
    assert counts["request_records"] == rep.record_rows > 0
    assert max(i.engines["prefill"] for i in iv) > 1  # the planner grew the starved prefill side
    worst = min(range(len(iv)), key=lambda k: iv[k].attainment)
    assert iv[worst].attainment < 0.8 and worst < len(iv) - 1
    assert iv[-1].attainment > iv[worst].attainment + 0.3  # it recovers under the same load
    # current replicas in the hints are what ran (announced), so they follow the applied hints
    by_role = {}
    for h in hints:
        by_role.setdefault(h["role"], []).append(h)
    for role, hs in by_role.items():
        for prev, nxt in zip(hs, hs[1:]):
            assert nxt["current"] == prev["desired"], (role, prev, nxt)
