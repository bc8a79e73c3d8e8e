"""bench/ttft_floor.py's floor is what the simulated engine really takes: a request alone on an
idle engine reaches its first token exactly after the floor's prefill time, cold and with a
cached prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from simulator.config import EngineConfig
from simulator.engine_core import EngineCore

_spec = importlib.util.spec_from_file_location("ttft_floor", Path(__file__).resolve().parents[1] / "bench" / "ttft_floor.py")
ttft_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttft_floor)


def _first_token_time(core: EngineCore, prompt: list[int], rid: str, start: float) -> float:
    core.add_request(rid, prompt, 1, start)
    now = start
    while True:
        res = core.step(now)
        now = res.end
        if res.ttft:
            return res.ttft[0]


@pytest.mark.parametrize("n", [900, 20_000])
def test_floor_equals_the_engines_first_token_time(n):
    cfg = EngineConfig(engine_id="f", max_model_len=262144)
    bs = cfg.block_size
    core = EngineCore(cfg)
    prompt = [16 + (i * 7919) % 30_000 for i in range(n)]
    cold = _first_token_time(core, prompt, "cold", 0.0)
    assert cold == pytest.approx(ttft_floor.prefill_seconds(EngineCore(cfg), 0, n), rel=1e-9)
    # the same prompt again, longer: its first n tokens' blocks are cached (vLLM reuses whole blocks)
    longer = prompt + [17 + (i * 104729) % 30_000 for i in range(n)]
    warm = _first_token_time(core, longer, "warm", 1000.0)
    cached = (n // bs) * bs
    assert warm == pytest.approx(ttft_floor.prefill_seconds(EngineCore(cfg), cached, 2 * n), rel=1e-9)
    assert warm < ttft_floor.prefill_seconds(EngineCore(cfg), 0, 2 * n)
