"""Every schema round-trips through JSON; malformed input is rejected naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CandidateScore,
    DeadLetter,
    DeviceTelemetry,
    Diagnosis,
    EngineAnnouncement,
    EngineMetrics,
    HistogramSnapshot,
    KvEventBatch,
    PodReset,
    RequestRecord,
    RoutingDecision,
    ScalingHint,
    ValidationFailure,
    decode_event,
)
from schemas.kv import normalize_block_hash

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
ts = st.floats(min_value=0, max_value=4e9, allow_nan=False)
small = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@st.composite
def stored(draw):
    bs = draw(st.integers(1, 8))
    n = draw(st.integers(1, 4))
    return BlockStored(
        block_hashes=draw(st.lists(u64, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | u64),
        token_ids=draw(st.lists(st.integers(0, 200_000), min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        medium=draw(st.sampled_from([None, "GPU", "CPU"])),
    )


kv_events = st.one_of(
    stored(),
    st.builds(BlockRemoved, block_hashes=st.lists(u64, min_size=1, max_size=4)),
    st.builds(AllBlocksCleared),
    st.builds(PodReset),
)

EVENTS = {
    KvEventBatch: st.builds(KvEventBatch, pod=names, model=names, seq=st.integers(0, 2**40), ts=ts,
                            epoch=st.integers(0, 100), dp_rank=st.integers(0, 8),
                            events=st.lists(kv_events, max_size=5)),
    EngineMetrics: st.builds(EngineMetrics, pod=names, model=names, ts=ts, num_requests_running=small,
                             num_requests_waiting=small, kv_cache_usage_perc=st.floats(0, 1),
                             time_to_first_token_seconds=st.none() | st.builds(
                                 HistogramSnapshot, sum=small, count=small,
                                 buckets=st.dictionaries(st.sampled_from(["0.1", "1.0", "+Inf"]), small))),
    DeviceTelemetry: st.builds(DeviceTelemetry, node=names, device=names, kind=st.sampled_from(["npu", "gpu"]),
                               source=st.sampled_from(["npu-smi", "dcgm", "sim"]), ts=ts,
                               temperature_c=st.none() | st.floats(0, 120),
                               error_codes=st.lists(st.sampled_from(["0x80E01801", "0x80CB800A"]), max_size=2),
                               xid_errors=st.lists(st.integers(1, 150), max_size=3)),
    Diagnosis: st.builds(Diagnosis, finding_id=names, node=names, device=names, fault_mode=names,
                         severity=st.sampled_from(["info", "warning", "critical"]),
                         status=st.sampled_from(["open", "updated", "resolved"]),
                         action=st.sampled_from(["RestartNPU", "SeparateNPU", "NotHandle"]),
                         summary=st.text(max_size=30), first_seen=ts, last_seen=ts,
                         evidence=st.dictionaries(names, st.integers() | st.text(max_size=5), max_size=3)),
    RequestRecord: st.builds(RequestRecord, request_id=names, ts=ts, pool=names, model=names,
                             pods=st.lists(names, max_size=2), ttft_s=st.none() | small,
                             status=st.sampled_from(["ok", "error"])),
    RoutingDecision: st.builds(RoutingDecision, request_id=names, ts=ts, pool=names, model=names, profile=names,
                               picked=st.none() | names,
                               candidates=st.lists(st.builds(CandidateScore, pod=names,
                                                             scores=st.dictionaries(names, st.floats(0, 1)),
                                                             total=st.floats(0, 1)), max_size=3)),
    ScalingHint: st.builds(ScalingHint, pool=names, role=st.sampled_from(["prefill", "decode"]), ts=ts,
                           current=st.integers(0, 100), desired=st.integers(0, 100), reason=st.text(max_size=20)),
    DeadLetter: st.builds(DeadLetter, stream=names, subject=names, reason=names, ts=ts, payload=st.text(max_size=20)),
    EngineAnnouncement: st.builds(EngineAnnouncement, pod=names, url=st.just("http://x:1"), model=names, ts=ts),
}


@pytest.mark.parametrize("model", list(EVENTS), ids=lambda m: m.__name__)
def test_round_trip(model):
    @settings(max_examples=40, deadline=None)
    @given(EVENTS[model])
    def check(event):
        data = event.to_json()
        back = decode_event(model, data)
        assert back == event
        assert json.loads(data)["schema_version"] == 1

    check()


@pytest.mark.parametrize(
    "model,payload,field",
    [
        (KvEventBatch, {"pod": "p", "model": "m", "ts": 1.0, "events": []}, "seq"),
        (KvEventBatch, {"pod": "", "model": "m", "seq": 0, "ts": 1.0, "events": []}, "pod"),
        (KvEventBatch, {"pod": "p", "model": "m", "seq": -1, "ts": 1.0, "events": []}, "seq"),
        (KvEventBatch, {"pod": "p", "model": "m", "seq": 0, "ts": 1.0, "events": [{"type": "bogus"}]}, "events.0"),
        (KvEventBatch, {"pod": "p", "model": "m", "seq": 0, "ts": 1.0,
                        "events": [{"type": "stored", "block_hashes": [1], "token_ids": [1], "block_size": 2}]},
         "events.0.stored"),
        (KvEventBatch, {"pod": "p", "model": "m", "seq": 0, "ts": 1.0, "extra": 1, "events": []}, "extra"),
        (EngineMetrics, {"pod": "p", "model": "m", "ts": 1, "num_requests_running": 1, "num_requests_waiting": 0,
                         "kv_cache_usage_perc": 1.5}, "kv_cache_usage_perc"),
        (DeviceTelemetry, {"node": "n", "device": "0", "kind": "tpu", "source": "sim", "ts": 1}, "kind"),
        (DeviceTelemetry, {"node": "n", "device": "0", "kind": "npu", "source": "sim", "ts": 1,
                           "health": "Fine"}, "health"),
        (Diagnosis, {"finding_id": "f", "node": "n", "device": "d", "fault_mode": "x", "severity": "fatal",
                     "status": "open", "action": "RestartNPU", "summary": "", "first_seen": 0, "last_seen": 0},
         "severity"),
        (RequestRecord, {"request_id": "r", "ts": 0, "pool": "p", "model": "m", "prompt_tokens": -3},
         "prompt_tokens"),
        (ScalingHint, {"pool": "p", "role": "router", "ts": 0, "current": 1, "desired": 1, "reason": ""}, "role"),
        (KvEventBatch, {"schema_version": 99, "pod": "p", "model": "m", "seq": 0, "ts": 1.0, "events": []},
         "schema_version"),
    ],
)
def test_malformed_is_rejected_naming_the_field(model, payload, field):
    with pytest.raises(ValidationFailure) as info:
        decode_event(model, json.dumps(payload))
    assert any(f.startswith(field) for f in info.value.fields), info.value.fields
    assert field.split(".")[0] in str(info.value)


def test_not_json_is_rejected():
    with pytest.raises(ValidationFailure, match="Invalid JSON"):
        decode_event(KvEventBatch, b"\x93\x01\x02")


@given(u64)
def test_block_hash_normalisation(h):
    assert normalize_block_hash(h) == h
    signed = h - (1 << 64) if h >= 1 << 63 else h
    assert normalize_block_hash(signed) == h
    assert normalize_block_hash(b"\xff" * 24 + h.to_bytes(8, "big")) == h


def test_block_hash_out_of_range():
    with pytest.raises(ValueError):
        normalize_block_hash(1 << 64)
    with pytest.raises(ValueError):
        normalize_block_hash(True)


def test_msg_id_identifies_pod_epoch_seq():
    b = KvEventBatch(pod="a.b", model="m", epoch=2, seq=7, ts=1.0, events=[])
    assert b.msg_id == "a.b:2:7"


def test_events_are_frozen():
    b = KvEventBatch(pod="a", model="m", seq=7, ts=1.0, events=[])
    with pytest.raises(Exception):
        b.seq = 8
