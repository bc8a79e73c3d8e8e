"""The replay client against the simulated vLLM engine: synthesized prompts that share trace
hash ids hit the engine's real prefix cache, as token ids and as text."""

from __future__ import annotations

import pytest

from simulator.workloads.client import replay
from simulator.workloads.synth import PromptSynthesizer
from simulator.workloads.trace import TraceRow

cluster_mod = pytest.importorskip("simulator.cluster")


def row(ts_ms, hash_ids, n, out):
    return TraceRow(timestamp=ts_ms, input_length=n, output_length=out, hash_ids=list(hash_ids))


@pytest.fixture(scope="module")
def engine():
    from simulator.config import EngineConfig

    spec = cluster_mod.EngineSpec(EngineConfig(engine_id="replay-0", block_size=16), kv_events=False)
    with cluster_mod.SimCluster([spec]) as cluster:
        yield cluster[0]


@pytest.mark.parametrize("mode", ["tokens", "text"])
async def test_shared_hash_ids_are_engine_cache_hits(engine, mode):
    engine.call(lambda e: e.core.reset_prefix_cache())
    seed = 11 if mode == "tokens" else 12  # distinct prompts per case
    rows = [row(0, [1, 2, 3], 1400, 4),
            row(1500, [1, 2, 9], 1300, 4),   # shares 1024 tokens with the first
            row(1500, [70, 71], 1000, 4)]    # shares nothing
    res = await replay(rows, engine.url, prompt_mode=mode, synthesizer=PromptSynthesizer(seed=seed), timeout_s=60)
    assert [r.status for r in res.requests] == ["ok", "ok", "ok"], [r.error for r in res.requests]
    a, b, c = res.requests
    assert a.cached_tokens == 0 and c.cached_tokens == 0
    assert b.cached_tokens == 1024
    assert [r.prompt_tokens for r in res.requests] == [1400, 1300, 1000]
    assert all(r.output_tokens == 4 and r.ttft_s > 0 and len(r.itl_s) >= 1 for r in res.requests)
    assert res.summary.hit_rate == pytest.approx(1024 / 3700)
    assert res.meta["model"] == "sim-model"
