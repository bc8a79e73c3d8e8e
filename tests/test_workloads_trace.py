"""Trace loader: reads the shared Mooncake trace as it is, any file of the format, and names
the line and field of every malformed record."""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path

import pytest

from simulator.workloads.trace import TraceFormatError, TraceRow, iter_trace, load_trace, trace_stats, write_trace

SHARED = Path(__file__).parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
if not SHARED.is_file():  # a checkout without ../shared: the same trace, bundled (gzipped)
    SHARED = Path(__file__).resolve().parents[1] / "simulator" / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"


def _raw_lines(path: Path) -> list[dict]:
    import gzip

    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.skipif(not SHARED.is_file(), reason=f"shared trace not present at {SHARED}")
def test_reads_the_shared_trace_fast_and_exactly():
    t0 = time.perf_counter()
    rows = load_trace(SHARED, block_tokens=512)
    elapsed = time.perf_counter() - t0
    raw = _raw_lines(SHARED)
    assert len(rows) == len(raw) > 0
    assert elapsed < 1.0, f"loading took {elapsed:.2f}s"
    for r, d in zip(rows, raw):
        assert (r.timestamp, r.input_length, r.output_length, r.hash_ids) == (
            d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"])
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
    assert [r.timestamp for r in iter_trace(SHARED)][:50] == [d["timestamp"] for d in raw[:50]]
    assert len(load_trace(SHARED, limit=7)) == 7


def test_other_files_of_the_format_jsonl_json_array_gzip_and_extra_fields(tmp_path):
    recs = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [5, 6], "session": "a"},
            {"timestamp": 12.5, "input_length": 10, "output_length": 1, "hash_ids": [7]}]
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n" + "\n".join(json.dumps(r) for r in recs) + "\n\n")
    arr = tmp_path / "t.json"
    arr.write_text(json.dumps(recs, indent=2))
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in recs))
    expected = [TraceRow(timestamp=0, input_length=600, output_length=3, hash_ids=[5, 6]),
                TraceRow(timestamp=12.5, input_length=10, output_length=1, hash_ids=[7])]
    for path in (jl, arr, gz):
        assert load_trace(path) == expected, path
    out = tmp_path / "w.jsonl"
    assert write_trace(out, expected) == 2
    assert load_trace(out) == expected


def test_malformed_lines_are_reported_with_line_and_field(tmp_path):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    lines = [
        good,                                                                           # 1
        '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": [1]}',  # 2
        "",                                                                             # 3 blank: skipped
        '{"timestamp": 1, "input_length": 5, "output_length": 1}',                       # 4 missing field
        '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [1]}',      # 5 negative
        '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}',  # 6 bad element
        '{"timestamp": 1, "input_length": 5,',                                          # 7 broken JSON
        good,                                                                           # 8
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert err.lines == [2, 4, 5, 6, 7]
    fields = {i.line: i.field for i in err.issues}
    assert fields == {2: "timestamp", 4: "hash_ids", 5: "input_length", 6: "hash_ids[1]", 7: None}
    text = str(err)
    assert "line 2, field 'timestamp'" in text and "line 7: not valid JSON" in text and str(path) in text
    # streaming stops at the first bad line, after yielding the good ones before it
    it = iter_trace(path)
    assert next(it).input_length == 5
    with pytest.raises(TraceFormatError) as first:
        next(it)
    assert first.value.lines == [2]


def test_block_count_check_and_array_element_numbers(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2, 3]},
                                {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}]))
    assert len(load_trace(path)) == 2  # block counts are only checked on request
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, block_tokens=512)
    assert info.value.lines == [2] and info.value.issues[0].field == "hash_ids"
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")


def test_trace_stats_ideal_hit_rate():
    rows = [TraceRow(timestamp=0, input_length=1024, output_length=1, hash_ids=[1, 2]),
            TraceRow(timestamp=1000, input_length=1024, output_length=1, hash_ids=[1, 3]),
            TraceRow(timestamp=2000, input_length=1024, output_length=1, hash_ids=[4, 2])]
    st = trace_stats(rows, 512)
    # only the second request reuses a prefix (block 1); block 2 in the third is not a prefix
    assert st["ideal_prefix_hit_rate"] == pytest.approx(512 / 3072)
    assert st["unique_blocks"] == 4 and st["duration_s"] == 2.0


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_rows = st.builds(TraceRow,
                  timestamp=st.one_of(st.integers(0, 10**9), st.floats(0, 1e9, allow_nan=False)),
                  input_length=st.integers(0, 10**6), output_length=st.integers(0, 10**5),
                  hash_ids=st.lists(st.integers(0, 2**62), max_size=20))


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(_rows, max_size=20))
def test_write_then_load_round_trips(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(path, rows)
    back = load_trace(path)
    assert [(float(r.timestamp), r.input_length, r.output_length, r.hash_ids) for r in back] == \
        [(float(r.timestamp), r.input_length, r.output_length, r.hash_ids) for r in rows]
