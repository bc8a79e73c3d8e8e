"""Synthetic workloads: reproducible by seed, valid trace rows, and the sharing each kind promises."""

from __future__ import annotations

import math

import pytest

from simulator.workloads.generators import KINDS, WorkloadParams, generate
from simulator.workloads.trace import load_trace, trace_stats, write_trace


@pytest.mark.parametrize("kind", KINDS)
def test_reproducible_valid_and_sorted(kind, tmp_path):
    a = generate(kind, n=300, seed=7)
    b = generate(kind, n=300, seed=7)
    c = generate(kind, n=300, seed=8)
    assert a == b and a != c
    assert len(a) == 300
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    for r in a:
        assert len(r.hash_ids) == math.ceil(r.input_length / 512) and r.output_length >= 1
    path = tmp_path / f"{kind}.jsonl"
    write_trace(path, a)
    assert load_trace(path, block_tokens=512) == a
    assert trace_stats(a)["ideal_prefix_hit_rate"] > 0.3


def test_chat_turns_extend_the_previous_prompt():
    rows = generate("chat", n=400, seed=3)
    extended = 0
    for i, r in enumerate(rows):
        # a later turn of the same session contains this prompt's blocks as its prefix
        full = r.input_length // 512
        for later in rows[i + 1:]:
            if later.input_length > r.input_length and later.hash_ids[: len(r.hash_ids)] == r.hash_ids:
                extended += 1
                break
        assert full <= len(r.hash_ids)
    assert extended > 100


def test_system_prompt_and_doc_qa_share_prefix_blocks():
    for kind, params in (("system-prompt", WorkloadParams(n=200, seed=1, system_prompts=4)),
                         ("doc-qa", WorkloadParams(n=200, seed=1, documents=5))):
        rows = generate(kind, params)
        heads = {tuple(r.hash_ids[:2]) for r in rows if len(r.hash_ids) > 2}
        assert 1 <= len(heads) <= (4 if kind == "system-prompt" else 5), kind
        private = [r.hash_ids[-1] for r in rows]
        assert len(set(private)) == len(private)  # each request ends in its own block


def test_rate_and_block_size_and_errors():
    rows = generate("system-prompt", n=2000, seed=2, rate_rps=20.0, block_tokens=256)
    span_s = (rows[-1].timestamp - rows[0].timestamp) / 1000
    assert 2000 / span_s == pytest.approx(20.0, rel=0.15)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 256) for r in rows)
    with pytest.raises(ValueError, match="unknown workload kind"):
        generate("nope")
    with pytest.raises(ValueError):
        WorkloadParams(rate_rps=0)
