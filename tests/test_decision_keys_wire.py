"""A decision's block keys on the wire: the router writes them packed (base64 of little-endian
uint64), readers take that and the older JSON-integer form alike, and a malformed string is a
validation failure naming the field (so the consumer dead-letters it) rather than wrong keys."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.profiles import load_strategy
from router.records import capture_backends, decision_inputs
from router.types import BackendState, RoutingRequest
from schemas import ValidationFailure, decode_event
from schemas.records import RoutingDecision, pack_keys, unpack_keys
from streams.kv_index import block_key_array, block_keys

U64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(st.lists(U64, max_size=300))
def test_packed_keys_read_back_exactly(keys):
    text = pack_keys(keys)
    assert unpack_keys(text) == keys
    assert pack_keys(np.array(keys, dtype=np.uint64)) == text  # the router's arrays pack the same bytes


def test_packed_form_is_little_endian_base64_and_smaller_than_json():
    keys = [1, 2**64 - 1, 2**63]
    assert pack_keys(keys) == "AQAAAAAAAAD//////////wAAAAAAAACA"
    rng = random.Random(7)
    many = [rng.getrandbits(64) for _ in range(2000)]
    assert len(pack_keys(many)) < 0.6 * len(msgspec.json.encode(many))


def _raw(prefix_keys) -> bytes:
    return msgspec.json.encode({"request_id": "r1", "ts": 2.0, "pool": "p", "model": "m", "profile": "kv-aware",
                                "picked": "a", "inputs": {"now": 2.0, "strategy": {}, "prefix_keys": prefix_keys}})


def test_both_wire_forms_decode_to_the_same_keys():
    keys = [5, 2**64 - 2, 0, 123456789]
    packed = decode_event(RoutingDecision, _raw(pack_keys(keys)))
    plain = decode_event(RoutingDecision, _raw(keys))  # records written before the packed form
    assert isinstance(packed, RoutingDecision) and packed.inputs.prefix_keys == keys
    assert plain.inputs.prefix_keys == keys and packed == plain


@pytest.mark.parametrize("bad, why", [("not base64!", "not base64"), ("AQID", "whole number"), ("é", "not base64")])
def test_a_malformed_packed_string_is_a_validation_failure(bad, why):
    with pytest.raises(ValidationFailure) as exc:
        decode_event(RoutingDecision, _raw(bad))
    assert "prefix_keys" in str(exc.value) and why in str(exc.value)


def test_decision_inputs_pack_the_keys_the_index_uses():
    ids = list(range(1000, 1000 + 16 * 6 + 3))
    backends = [BackendState(pod=p, url="", model="m") for p in ("a", "b")]
    req = RoutingRequest(model="m", request_id="r1", token_ids=ids, prompt_tokens=len(ids))
    kw = dict(strategy=load_strategy("kv-aware"), request=req, exclude=set(), backends=capture_backends(backends),
              now=2.0, block_size=16, overlap={})
    want = list(block_keys(ids[:-1], 16))
    hashed = block_key_array(ids, 16)  # the whole prompt's keys, as the router holds them
    for inputs in (decision_inputs(**kw), decision_inputs(**kw, prompt_keys=hashed)):
        assert isinstance(inputs["prefix_keys"], str)
        assert unpack_keys(inputs["prefix_keys"]) == want and len(want) == 6
