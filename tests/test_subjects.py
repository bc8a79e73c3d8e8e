from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects as S
from schemas.registry import CHANNELS, CORE_ONLY, model_for_subject
from streams.topology import DEFAULT_STREAMS, stream_for_subject, subject_matches


@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40))
def test_escape_is_one_safe_token_and_reversible(value):
    tok = S.escape_token(value)
    assert tok and not any(c in tok for c in ". *>\t\r\n")
    assert S.unescape_token(tok) == value


def test_examples():
    assert S.kv_events("Qwen/Qwen3-8B", "pod-1.ns") == "kv.events.Qwen%2FQwen3-8B.pod-1%2Ens"
    assert S.device_telemetry("node-a", "3") == "device.telemetry.node-a.3"
    assert S.autoscale_hints("pool-1", "prefill") == "autoscale.hints.pool-1.prefill"
    assert S.dead_letter("kv-events") == "dlq.kv-events"
    assert S.with_prefix("t1", "kv.events.>") == "t1.kv.events.>"
    with pytest.raises(ValueError):
        S.with_prefix("bad prefix", "x")
    with pytest.raises(ValueError):
        S.escape_token("")


def test_percent_itself_is_escaped():
    assert S.unescape_token(S.escape_token("50%")) == "50%"
    assert S.escape_token("50%") == "50%25"


@pytest.mark.parametrize(
    "subject,expected",
    [
        (S.kv_events("m.1", "p.2"), {"kind": "kv.events", "model": "m.1", "pod": "p.2"}),
        (S.engine_metrics("p.2"), {"kind": "engine.metrics", "pod": "p.2"}),
        (S.diagnosis("n", "d"), {"kind": "diagnosis", "node": "n", "device": "d"}),
        (S.router_requests("pool"), {"kind": "router.requests", "pool": "pool"}),
        (S.router_sync("a.b"), {"kind": "router.sync", "pool": "a.b"}),
        (S.autoscale_hints("p", "decode"), {"kind": "autoscale.hints", "pool": "p", "role": "decode"}),
    ],
)
def test_parse_inverts_builders(subject, expected):
    assert S.parse(subject) == expected


def test_parse_rejects_foreign_subjects():
    with pytest.raises(ValueError, match="not an InferNex subject"):
        S.parse("foo.bar")


def test_every_channel_lives_in_a_stream_but_the_core_only_ones():
    for kind, (model, template, _) in CHANNELS.items():
        concrete = template.format(model="m", pod="p", node="n", device="d", pool="x", role="prefill", stream="s")
        assert model_for_subject(concrete) is model
        stored = stream_for_subject(DEFAULT_STREAMS, concrete) is not None
        assert stored != (kind in CORE_ONLY), kind


@pytest.mark.parametrize(
    "pattern,subject,ok",
    [("kv.events.>", "kv.events.m.p", True), ("kv.events.>", "kv.events", False),
     ("a.*.c", "a.b.c", True), ("a.*.c", "a.b.d", False), ("a.b", "a.b.c", False)],
)
def test_subject_matches(pattern, subject, ok):
    assert subject_matches(pattern, subject) is ok
