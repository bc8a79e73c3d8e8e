"""The simulator models what PD is for: in an aggregated engine a long prompt's prefill chunks share
steps with the running decodes (token budget), stretching their inter-token latency; a decode
engine fed by KV transfers does not prefill; the transfer costs the blocks moved over the
connector link; the virtual-time fleet serves a workload both ways and the planner sizes the PD split."""

from __future__ import annotations

import pytest

from simulator.config import EngineConfig
from simulator.engine_core import EngineCore, RemotePrefill
from simulator.fleet import measure_profile, plan_split, poisson_workload, run_fleet

CFG = EngineConfig(model_profile="llama-3.1-8b", hardware="h100", max_num_batched_tokens=2048,
                   enable_prefix_caching=False, emit_kv_events=False)


def _itls_while_a_long_prompt_arrives(role: str) -> tuple[list[float], list[float]]:
    core = EngineCore(CFG.model_copy(update={"role": role}))
    remote = role == "kv_consumer"
    for i in range(8):
        kw = {"remote_prefill": RemotePrefill("p", 1000)} if remote else {}
        core.add_request(f"d{i}", [(i * 997 + k) % 30000 + 20 for k in range(1000)], 400, 0.0, **kw)
    t, before, during = 0.0, [], []
    arrived = False
    while core.has_work and t < 30:
        r = core.step(t)
        if r.idle:
            t = r.next_wakeup or t + 0.001
            continue
        t = r.end
        (during if arrived else before).extend(r.itl)
        if not arrived and len(before) >= 8 * 20:
            arrived = True
            kw = {"remote_prefill": RemotePrefill("p", 16000)} if remote else {}
            core.add_request("long", [(k * 31) % 30000 + 20 for k in range(16000)], 2, t, **kw)
        if arrived and len(during) >= 8 * 20:
            break
    return before, during


def test_a_long_prompt_stretches_itl_on_an_aggregated_engine_only():
    b_agg, d_agg = _itls_while_a_long_prompt_arrives("aggregated")
    b_dec, d_dec = _itls_while_a_long_prompt_arrives("kv_consumer")
    avg = lambda xs: sum(xs) / len(xs)
    # 16k prompt tokens in 2048-token chunks: ~8 steps carry a full chunk each
    assert max(d_agg) > 3 * avg(b_agg)
    assert avg(d_agg) > 1.3 * avg(b_agg)
    # the decode engine only pulls the KV: its steps stay decode steps
    assert max(d_dec) < 1.5 * avg(b_dec)


def test_kv_transfer_time_is_blocks_moved_over_the_link():
    core = EngineCore(CFG)
    fast = EngineCore(CFG.model_copy(update={"kv_link_gbps": 200.0}))
    per_block = CFG.block_size * core.kv_bytes_per_token / (CFG.hw.kv_link_gb_s * 1e9)
    lat = CFG.hw.kv_link_latency_ms / 1e3
    assert core.transfer_time(16) == pytest.approx(lat + per_block)
    assert core.transfer_time(17) == pytest.approx(lat + 2 * per_block)  # a partial block moves whole
    assert core.transfer_time(16000) == pytest.approx(lat + 1000 * per_block)
    assert fast.transfer_time(16000) - lat == pytest.approx((core.transfer_time(16000) - lat) * CFG.hw.kv_link_gb_s / 200)


def test_fleet_serves_both_ways_and_the_planner_splits_by_load():
    prof = measure_profile(CFG, [2048, 8192], [4096, 8192], [1, 8, 32])
    assert prof.prefill[0].throughput_tokens_per_s > 1000 and prof.decode
    # prompt-heavy load: more prefill; output-heavy: more decode
    p_long, _ = plan_split(8, 10, 8000, 50, 0.025, prof)
    p_short, _ = plan_split(8, 10, 500, 800, 0.025, prof)
    assert p_long > p_short
    arr = poisson_workload(3.0, 10, (4000, 6000), (20, 40), seed=3)
    agg = run_fleet(arr, CFG, mode="aggregated", engines=2)
    pd = run_fleet(arr, CFG, mode="pd", prefill=1, decode=1)
    for r in (agg, pd):
        assert len(r.outcomes) == len(arr) and all(o.done for o in r.outcomes)
        assert r.quantile("ttft", 0.5) > 0 and r.quantile("tpot", 0.5) > 0
    # PD decode steps carry no prefill chunks
    assert pd.quantile("tpot", 0.9) < agg.quantile("tpot", 0.9)
    # PD's TTFT includes the transfer and the decode's first step
    assert min(o.first_token - o.prefill_done for o in pd.outcomes) > 0
