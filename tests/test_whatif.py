"""What-if simulation: the router's strategies over the engine model in virtual time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infernex.whatif import Fleet, simulate
from simulator.workloads import load_trace
from simulator.workloads.trace import TraceRow

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
if not TRACE.is_file():  # a checkout without ../shared: the same trace, bundled (gzipped)
    TRACE = Path(__file__).resolve().parents[1] / "simulator" / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"


def _conversations(n_convs=13, turns=5, blocks=6) -> list[TraceRow]:
    """Multi-turn chats: each turn extends the previous prompt; turns interleave in time (13
    conversations, so round-robin over 4 engines does not stick to one by accident)."""
    rows = []
    for c in range(n_convs):
        ids = []
        for t in range(turns):
            ids = ids + [c * 1000 + t * 10 + k for k in range(blocks)]
            rows.append(TraceRow(timestamp=(t * n_convs + c) * 400, input_length=len(ids) * 512,
                                 output_length=8, hash_ids=list(ids)))
    return sorted(rows, key=lambda r: r.timestamp)


def test_kv_aware_reuses_prefixes_and_round_robin_does_not():
    rows = _conversations()
    fleet = Fleet(aggregated=4, num_gpu_blocks=20000)
    rr = simulate(rows, "round-robin", fleet)
    kv = simulate(rows, "kv-aware", fleet)
    s_rr, s_kv = rr.summary(), kv.summary()
    assert s_rr.ok == s_kv.ok == len(rows)
    assert s_kv.hit_rate > 0.6 > s_rr.hit_rate
    assert kv.overlap_share >= 0.95
    assert s_kv.ttft_p50_s < s_rr.ttft_p50_s
    # every request produced its tokens and has a TTFT
    assert all(r.output_tokens == 8 and r.ttft_s is not None and r.e2e_s >= r.ttft_s for r in kv.rows)


def test_deterministic():
    rows = _conversations(n_convs=4, turns=3)
    a = simulate(rows, "kv-aware", Fleet(aggregated=3))
    b = simulate(rows, "kv-aware", Fleet(aggregated=3))
    assert [(r.backend, r.ttft_s, r.e2e_s) for r in a.rows] == [(r.backend, r.ttft_s, r.e2e_s) for r in b.rows]


def test_pd_profile_goes_prefill_then_decode():
    rows = _conversations(n_convs=3, turns=3)
    r = simulate(rows, "pd-kv-aware", Fleet(aggregated=0, pd_groups=1))
    s = r.summary()
    assert s.ok == len(rows)
    assert {x.backend for x in r.rows} <= {"pd0-decode-0", "pd0-decode-1"}
    with pytest.raises(ValueError, match="PD groups"):
        simulate(rows, "pd-kv-aware", Fleet(aggregated=2))


def test_oversized_prompt_is_rejected_like_vllm():
    rows = [TraceRow(timestamp=0, input_length=300_000, output_length=4, hash_ids=list(range(586)))]
    r = simulate(rows, "round-robin", Fleet(aggregated=1))
    assert r.rows[0].status == "error" and r.rows[0].http_status == 400 and "context length" in r.rows[0].error


@pytest.mark.skipif(not TRACE.is_file(), reason="shared trace not present")
def test_simulate_command_on_the_shared_trace(tmp_path):
    out = tmp_path / "sim"
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "simulate", "--trace", str(TRACE), "--limit", "60",
                        "-p", "round-robin", "-p", "kv-aware", "--engines", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert [d["strategy"] for d in data] == ["round-robin", "kv-aware"]
    assert all(d["summary"]["ok"] == 60 for d in data)
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert "kv-aware" in (out / "report.html").read_text()


def test_simulate_command_rejects_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": "x"}\n')
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "simulate", "--trace", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "line 2" in r.stdout + r.stderr
