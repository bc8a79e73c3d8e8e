"""``replay explain`` compares a decision's recorded block keys with the rebuilt index only when
both were made by the same block-key function (a record from before the digest-chained keys would
read 0 blocks everywhere, a silently wrong answer)."""

from __future__ import annotations

import msgspec

from consumers.replay import ReplayMsg
from infernex.incident import ReplayState, explain_request
from router.profiles import load_strategy
from router.records import BACKEND_FIELDS, capture_backends, decision_inputs, strategy_settings
from router.types import BackendState, RoutingRequest
from schemas import subjects as S
from schemas.kv import BlockStored, KvEventBatch
from schemas.records import RoutingDecision, unpack_keys
from streams.kv_keys import KEY_SCHEME

TOKENS = list(range(1000, 1065))  # 4 full blocks of 16 and one token


def _history() -> ReplayState:
    st = ReplayState()
    batch = KvEventBatch(pod="b", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2, 3, 4], token_ids=TOKENS[:64], block_size=16)])
    st.apply_many([ReplayMsg(1.0, "", 1, S.kv_events("m", "b"), batch.to_json())])
    return st


def _decision(**change) -> RoutingDecision:
    backends = [BackendState(pod=p, url="", model="m") for p in ("a", "b")]
    req = RoutingRequest(model="m", request_id="r1", token_ids=TOKENS, prompt_tokens=len(TOKENS))
    inputs = decision_inputs(strategy=load_strategy("kv-aware"), request=req, exclude=set(),
                             backends=capture_backends(backends), now=2.0, block_size=16,
                             overlap={"b": 4})
    assert inputs["backends"]["columns"] == BACKEND_FIELDS and len(unpack_keys(inputs["prefix_keys"])) == 4
    inputs.update(change)
    # as the bus carries it (JSON), then read back as replay reads it
    raw = msgspec.json.encode({"request_id": "r1", "ts": 2.0, "pool": "p", "model": "m", "profile": "kv-aware",
                               "picked": "b", "inputs": inputs})
    return RoutingDecision.model_validate_json(raw)


def test_recorded_keys_of_this_scheme_are_read_from_the_rebuilt_index():
    d = _decision()
    assert d.inputs.key_scheme == KEY_SCHEME
    assert d.inputs.strategy == strategy_settings(load_strategy("kv-aware"))
    ex = explain_request(_history(), [d])
    assert ex["prefix"]["per_pod"] == {"a": {"recorded": 0, "index_at_t": 0}, "b": {"recorded": 4, "index_at_t": 4}}
    assert "index_left_out" not in ex["prefix"]


def test_keys_recorded_before_the_scheme_was_named_are_not_compared():
    ex = explain_request(_history(), [_decision(key_scheme=None)])
    # not "0 blocks in the index" (what reading old keys would say), but why there is no figure
    assert ex["prefix"]["per_pod"] == {"a": {"recorded": 0}, "b": {"recorded": 4}}
    assert "key scheme 1" in ex["prefix"]["index_left_out"] and f"uses {KEY_SCHEME}" in ex["prefix"]["index_left_out"]
