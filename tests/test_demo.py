"""A short `infernex demo` run: everything starts, replays, reports and stops; kv-aware gets a
higher prefix-cache hit rate than round-robin on prefix-sharing traffic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from simulator.workloads.trace import TraceRow, write_trace


def _multi_turn(path: Path) -> Path:
    rows = []
    for c in range(7):  # 7 conversations over 4 engines: round-robin cannot stick by accident
        ids: list[int] = []
        for t in range(4):
            ids = ids + [c * 100 + t * 10 + k for k in range(3)]
            rows.append(TraceRow(timestamp=(t * 7 + c) * 250, input_length=len(ids) * 512, output_length=6,
                                 hash_ids=list(ids)))
    write_trace(path, sorted(rows, key=lambda r: r.timestamp))
    return path


def test_short_demo_run(tmp_path):
    trace = _multi_turn(tmp_path / "trace.jsonl")
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "infernex.cli", "demo", "--trace", str(trace), "--requests", "28", "--offset", "0",
         "--engines", "4", "--prefill", "1", "--decode", "1", "-s", "round-robin", "-s", "kv-aware", "-s",
         "pd-kv-aware", "--time-scale", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    data = {d["strategy"]: d for d in json.loads((out / "results.json").read_text())}
    assert set(data) == {"round-robin", "kv-aware", "pd-kv-aware"}
    assert data["round-robin"]["summary"]["ok"] == data["kv-aware"]["summary"]["ok"] == 28
    assert data["kv-aware"]["hit_rate"] > data["round-robin"]["hit_rate"] + 0.2
    assert data["kv-aware"]["overlap_share"] >= 0.9
    assert data["pd-kv-aware"]["summary"]["ok"] > 0
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"  # the run as time series
    validity = json.loads((out / "validity.json").read_text())
    assert set(validity["strategies"]) == {"round-robin", "kv-aware", "pd-kv-aware"}
    assert validity["verdict"].startswith("Live run valid" if validity["valid"] else "Live run NOT valid")
    head = json.loads((out / "headline.json").read_text())
    assert head["base"] == "round-robin" and head["best"] == "kv-aware" and head["ratio"] > 0
    assert "Virtual time" in r.stdout and "Headline" in r.stdout
    html = (out / "report.html").read_text()
    assert "kv-aware" in html and "data:image/png;base64," in html
    # the rest of the control plane ran too: records read back from ClickHouse per strategy, and
    # the closing incident was diagnosed and routed around
    cp = json.loads((out / "control-plane.json").read_text())
    sla = {row["strategy"]: row for row in cp["sla"]}
    assert sla["round-robin"]["requests"] == sla["kv-aware"]["requests"] == 28
    assert sla["kv-aware"]["prefix_hit_rate"] > sla["round-robin"]["prefix_hit_rate"]
    assert cp["tables"]["engine_metrics"] > 0 and cp["tables"]["diagnoses"] > 0
    inc = cp["incident"]
    assert inc["severity"] == "critical" and inc["remediation"]
    assert inc["ok"] == inc["requests"] > 0
    assert inc["sent_to_faulty_pod"] == 0
    assert any(f["finding_id"] == inc["finding"] and inc["pod"] in f["pods"] for f in cp["findings"])
    # ... and the report says so too
    assert "SLA history read back from ClickHouse" in html and "Diagnosis findings" in html
    assert "sent to faulty pod" in html
    # the PD sizing loop ran on the demo's ClickHouse: the planner's hints are there and they
    # resized the simulated pool; the report plots it and compares PD with aggregated goodput
    loop = cp["pd_loop"]
    assert cp["tables"]["scaling_hints"] >= loop["scaling_hints"] > 0
    assert loop["records"] > 0 and len(loop["intervals"]) == 16
    sizes = {(i["engines"]["prefill"], i["engines"]["decode"]) for i in loop["intervals"]}
    assert len(sizes) > 1  # the hints were applied: the pool changed shape
    assert loop["goodput"]["points"] and loop["goodput"]["aggregated_req_s"] >= 0
    assert (out / "pd-loop.png").read_bytes()[:4] == b"\x89PNG"
    assert "PD sizing loop" in html and "Goodput, PD (planner split) vs aggregated" in html
    assert "PD sizing loop" in r.stdout
    # everything it started is gone: no nats-server left on its store
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "nats") not in ps
