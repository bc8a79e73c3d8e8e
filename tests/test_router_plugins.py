"""Table-driven tests of the strategy plugins, the profile format and the pure decision."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from router.core import Router, overlaps_from_index
from router.plugins import build_plugin
from router.plugins.base import Ctx
from router.profiles import build_strategy, builtin_names, load_strategy
from router.types import BackendState, RoutingRequest


def B(pod, **kw):
    kw.setdefault("model", "m")
    return BackendState(pod=pod, url=f"http://{pod}", **kw)


REQ = RoutingRequest(model="m", token_ids=list(range(65)), prompt_tokens=65)  # 4 blocks + 1 token


@pytest.mark.parametrize("type_name,params,backends,req,ctx_kw,expect", [
    ("model-filter", {}, [B("a"), B("b", model="x"), B("c", model="y", loras=frozenset({"m"}))], REQ, {}, ["a", "c"]),
    ("role-filter", {"roles": ["prefill"]}, [B("a"), B("p", role="prefill"), B("d", role="decode")], REQ, {}, ["p"]),
    ("role-filter", {}, [B("a"), B("p", role="prefill")], REQ, {}, ["a"]),
    ("pd-group-filter", {}, [B("a", group="g1"), B("b", group="g2")], REQ, {"group": "g2"}, ["b"]),
    ("pd-group-filter", {}, [B("a", group="g1"), B("b", group="g2")], REQ, {}, ["a", "b"]),
    ("healthy-filter", {}, [B("ok"), B("warn", health="warning"), B("crit", health="critical"),
                            B("open", circuit_open=True), B("drain", draining=True)], REQ, {}, ["ok", "warn"]),
    ("healthy-filter", {}, [B("a"), B("b")], RoutingRequest(model="m", exclude=frozenset({"a"})), {}, ["b"]),
    ("not-busy-filter", {"kv_usage_threshold": 0.9, "max_waiting": 4},
     [B("a", kv_usage=0.5), B("kv", kv_usage=0.95), B("q", waiting=4), B("pp", pending_prefill_tokens=300_000)],
     REQ, {}, ["a"]),
    ("lora-filter", {}, [B("a"), B("b", loras=frozenset({"sql"}))], RoutingRequest(model="m", lora="sql"), {}, ["b"]),
    ("lora-filter", {}, [B("a"), B("b")], REQ, {}, ["a", "b"]),
    ("pd-bucket-filter", {"buckets": [{"max_prompt_tokens": 100}, {}]},
     [B("p1", group="g1"), B("p2", group="g2")], REQ, {"prompt_tokens": 50}, ["p1"]),
    ("pd-bucket-filter", {"buckets": [{"max_prompt_tokens": 100}, {}]},
     [B("p1", group="g1"), B("p2", group="g2")], REQ, {"prompt_tokens": 500}, ["p2"]),
    ("pd-bucket-filter", {"buckets": [{"max_prompt_tokens": 100, "groups": ["g2"]}, {}]},
     [B("p1", group="g1"), B("p2", group="g2")], REQ, {"prompt_tokens": 5}, ["p2"]),
    ("pd-bucket-filter", {"buckets": [{"max_prompt_tokens": 100}, {}]},
     [B("p1", group="g1")], REQ, {"prompt_tokens": 500}, ["p1"]),  # one group serves every bucket
])
def test_filters(type_name, params, backends, req, ctx_kw, expect):
    f = build_plugin(type_name, parameters=params)
    assert [b.pod for b in f.apply(req, backends, Ctx(**ctx_kw))] == expect


@pytest.mark.parametrize("type_name,params,backends,ctx_kw,expect", [
    ("prefix-scorer", {}, [B("a"), B("b"), B("c")], {"request_blocks": 4, "overlap": {"a": 4, "b": 1}},
     [1.0, 0.25, 0.0]),
    ("prefix-scorer", {}, [B("a")], {"request_blocks": 0, "overlap": {"a": 3}}, [0.0]),
    ("kv-usage-scorer", {}, [B("a", kv_usage=0.0), B("b", kv_usage=0.75), B("c", kv_usage=1.5)], {}, [1.0, 0.25, 0.0]),
    ("queue-scorer", {}, [B("a", waiting=0), B("b", waiting=5), B("c", waiting=10)], {}, [1.0, 0.5, 0.0]),
    ("queue-scorer", {}, [B("a", waiting=3), B("b", waiting=3)], {}, [1.0, 1.0]),
    ("active-tokens-scorer", {}, [B("a", active_tokens=100), B("b", active_tokens=300)], {}, [1.0, 0.0]),
    ("inflight-scorer", {}, [B("a", inflight=2, waiting=9), B("b", inflight=6), B("c", inflight=10)], {},
     [1.0, 0.5, 0.0]),  # the router's own count, not the engines' reported queue
    # seed 001: 0.4(1-queue)+0.3(1-cpu)+0.3(1-mem)
    ("health-scorer", {"max_queue": 10}, [B("a", waiting=5, cpu_util=0.5, mem_util=0.2)], {},
     [0.4 * 0.5 + 0.3 * 0.5 + 0.3 * 0.8]),
    ("health-scorer", {"max_queue": 10, "max_running": 10}, [B("a", waiting=20, running=5, kv_usage=0.5)], {},
     [0.0 + 0.3 * 0.5 + 0.3 * 0.5]),
    ("health-scorer", {"warning_factor": 0.5}, [B("ok"), B("w", health="warning")], {}, [1.0, 0.5]),
    # cost = scale*max(prefill - credit*overlap, 0) + decode; a: 4+0 ->4-4=0, +4 = 4; b: 4 + 4 = 8
    ("dynamo-cost-scorer", {}, [B("a"), B("b")], {"request_blocks": 4, "block_size": 16, "overlap": {"a": 4}},
     [1.0, 0.0]),
    # prefill work = pending + uncached prompt tokens (+ one block): least / own
    ("prefill-load-scorer", {}, [B("a"), B("b")], {"block_size": 16, "prompt_tokens": 64, "overlap": {"b": 4}},
     [16 / 80, 1.0]),
    ("prefill-load-scorer", {}, [B("a"), B("b", pending_prefill_tokens=64)],
     {"block_size": 16, "prompt_tokens": 64, "overlap": {"b": 4}}, [1.0, 1.0]),  # b's queue eats its cache win
    ("prefill-load-scorer", {"queue_tokens": 100}, [B("a", waiting=2), B("b")], {"block_size": 16, "prompt_tokens": 64},
     [80 / 280, 1.0]),
    # decode_weight: uncached tokens x (1 + w x running requests); a cached prefix weighs nothing there
    ("prefill-load-scorer", {"decode_weight": 0.5}, [B("a", running=4), B("b")], {"block_size": 16, "prompt_tokens": 64},
     [80 / 208, 1.0]),
    ("prefill-load-scorer", {"decode_weight": 0.5}, [B("a", running=4), B("b")],
     {"block_size": 16, "prompt_tokens": 64, "overlap": {"a": 4}}, [1.0, 16 / 80]),
    ("prefill-load-scorer", {}, [B("a", running=4), B("b")], {"block_size": 16, "prompt_tokens": 64}, [1.0, 1.0]),
    # context_weight: + w x output tokens (REQ names none: output_tokens) x prompt tokens in flight there
    ("prefill-load-scorer", {"context_weight": 0.01, "output_tokens": 100}, [B("a", active_tokens=1000), B("b")],
     {"block_size": 16, "prompt_tokens": 64}, [80 / 1080, 1.0]),
    ("prefill-load-scorer", {"context_weight": 0.01}, [B("a", active_tokens=1000), B("b", active_tokens=500)],
     {"block_size": 16, "prompt_tokens": 64, "overlap": {"a": 4}}, [(80 + 2.56 * 500) / (16 + 2.56 * 1000), 1.0]),
    # (a's cached prompt saves 64 tokens of prefill; its extra 500 tokens in flight cost 1280 in decode)
])
def test_scorers(type_name, params, backends, ctx_kw, expect):
    s = build_plugin(type_name, parameters=params)
    got = s.score(REQ, backends, Ctx(**ctx_kw))
    assert got == pytest.approx(expect)
    assert all(0.0 <= x <= 1.0 for x in got)


def test_prefill_load_context_term_uses_the_requests_max_tokens_up_to_the_cap():
    s = build_plugin("prefill-load-scorer", parameters={"context_weight": 0.01, "max_output_tokens": 300})
    cands = [B("a", active_tokens=1000), B("b")]
    ctx = Ctx(block_size=16, prompt_tokens=64)
    short = RoutingRequest(model="m", prompt_tokens=64, max_tokens=10)
    long_ = RoutingRequest(model="m", prompt_tokens=64, max_tokens=100_000)
    assert s.score(short, cands, ctx) == pytest.approx([80 / (80 + 0.01 * 10 * 1000), 1.0])
    assert s.score(long_, cands, ctx) == pytest.approx([80 / (80 + 0.01 * 300 * 1000), 1.0])
    off = build_plugin("prefill-load-scorer", parameters={})
    assert off.score(long_, cands, ctx) == [1.0, 1.0]  # context in flight does not count by default


def test_dynamo_cost_formula():
    s = build_plugin("dynamo-cost-scorer", parameters={"prefill_load_scale": 2.0, "overlap_credit": 0.5})
    bs = [B("a", pending_prefill_tokens=32, active_tokens=64), B("b", kv_usage=0.5, num_gpu_blocks=10)]
    costs = s.costs(bs, Ctx(request_blocks=4, block_size=16, overlap={"a": 4, "b": 2}))
    # a: prefill = 4 + 2 = 6, minus 0.5*4 = 4 -> 2*4 = 8; decode = 64/16 + 4 = 8 -> 16
    # b: prefill = 4 - 0.5*2 = 3 -> 6; decode = 0.5*10 + 4 = 9 -> 15
    assert costs == pytest.approx([16.0, 15.0])


@pytest.mark.parametrize("type_name,params,totals,expect", [
    ("max-score-picker", {}, [0.1, 0.9, 0.5], {1}),
    ("max-score-picker", {}, [0.5, 0.5, 0.1], {0, 1}),
    ("softmax-picker", {"temperature": 0.0}, [0.1, 0.9, 0.5], {1}),
    ("random-picker", {}, [0.1, 0.9, 0.5], {0, 1, 2}),
    ("power-of-two-picker", {}, [0.1, 0.9, 0.5], {1, 2}),  # the worst never wins a pair
])
def test_pickers(type_name, params, totals, expect):
    p = build_plugin(type_name, parameters=params)
    cands = [B(f"p{i}") for i in range(len(totals))]
    seen = {p.pick(cands, totals, Ctx(rng=random.Random(i))) for i in range(200)}
    assert seen == expect


def test_softmax_temperature_spreads_by_score():
    p = build_plugin("softmax-picker", parameters={"temperature": 0.2})
    cands = [B("a"), B("b")]
    ctx = Ctx(rng=random.Random(7))
    counts = [0, 0]
    for _ in range(4000):
        counts[p.pick(cands, [1.0, 0.8], ctx)] += 1
    # p(a) = 1 / (1 + e^-1) ~ 0.73
    assert 0.68 < counts[0] / 4000 < 0.78


def test_round_robin_cycles():
    p = build_plugin("round-robin-picker")
    cands = [B("c"), B("a"), B("b")]
    picks = [cands[p.pick(cands, [0, 0, 0], Ctx())].pod for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


@pytest.mark.parametrize("spec,err", [
    ({"plugins": [{"type": "nope"}], "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "nope"}]}]},
     "unknown plugin type"),
    ({"plugins": [{"type": "model-filter"}], "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "x"}]}]},
     "unknown plugin 'x'"),
    ({"plugins": [{"type": "model-filter"}], "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "model-filter"}]}]},
     "exactly one picker"),
    ({"plugins": [{"type": "role-filter", "parameters": {"roles": ["chef"]}}, {"type": "random-picker"}],
      "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "random-picker"}]}]}, "roles"),
    ({"plugins": [{"type": "random-picker"}, {"type": "pd-profile-handler"}],
      "schedulingProfiles": [{"name": "prefill", "plugins": [{"pluginRef": "random-picker"}]}]}, "decode"),
    ({"plugins": [{"type": "random-picker"}], "schedulingProfiles": [
        {"name": "a", "plugins": [{"pluginRef": "random-picker"}]},
        {"name": "b", "plugins": [{"pluginRef": "random-picker"}]}]}, "exactly one profile"),
    ({"plugins": [{"type": "random-picker", "weight": 3}], "schedulingProfiles": []}, "plugins.0.weight"),
])
def test_bad_strategies_are_explained(spec, err):
    with pytest.raises(ValueError, match=err):
        build_strategy("t", spec)


def test_builtin_strategies_load():
    assert set(builtin_names()) >= {"random", "round-robin", "least-load", "kv-aware", "dynamo-cost", "pd-bucket",
                                    "pd-random-bucket", "pd-kv-aware"}
    for n in builtin_names():
        s = load_strategy(n)
        assert s.pd == n.startswith("pd-")


def test_strategy_file(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
  - {name: by-model, type: model-filter}
  - {name: prefix, type: prefix-scorer, parameters: {mode: approximate}}
  - {type: max-score-picker}
schedulingProfiles:
  - name: default
    plugins: [{pluginRef: by-model}, {pluginRef: prefix, weight: 2}, {pluginRef: max-score-picker}]
""")
    r = Router(str(f))
    assert r.strategy.approximate and r.strategy.needs_overlap
    d = r.decide(REQ, [B("a"), B("b")], overlap={"b": 2})
    assert d.target.pod == "b"
    with pytest.raises(ValueError, match="unknown strategy"):
        Router(str(tmp_path / "missing.yaml"))


class FakeIndex:
    """Index view: pods holding a prefix of the request's blocks (``match_tokens`` contract)."""

    def __init__(self, held: dict[str, int], block_size: int = 16):
        self.held, self.bs = held, block_size

    def block_size(self, model):
        return self.bs

    def match_tokens(self, model, token_ids, pods=None):
        from types import SimpleNamespace

        n = len(token_ids) // self.bs
        return {p: SimpleNamespace(matched_blocks=min(k, n), predicted_blocks=0) for p, k in self.held.items()}


def test_kv_aware_prefers_the_pod_holding_the_prefix_and_explains():
    backends = [B(f"p{i}") for i in range(8)]
    r = Router("kv-aware", seed=1)
    d = r.decide(REQ, backends, FakeIndex({"p5": 4, "p2": 1}))
    assert d.ok and d.target.pod == "p5"
    assert d.best_overlap_blocks == 4 and d.chosen_overlap_blocks == 4
    st = d.stages[0]
    cand = {c.pod: c for c in st.candidates()}
    assert cand["p5"].scores["prefix"] == 1.0 and cand["p2"].scores["prefix"] == 0.25
    assert "p5" in d.reason and "overlap 4/4" in d.reason


class PredictingIndex(FakeIndex):
    """Index view whose pods hold ``(matched, of which predicted)`` blocks of every prompt."""

    def match_tokens(self, model, token_ids, pods=None):
        from types import SimpleNamespace

        return {p: SimpleNamespace(matched_blocks=m, predicted_blocks=pr) for p, (m, pr) in self.held.items()}


def test_kv_aware_counts_predicted_blocks_below_reported_ones():
    from router.plugins.scorers import PREDICTED_WORTH

    backends = [B("guessed"), B("reported"), B("none")]  # a tie would go to the first
    r = Router("kv-aware", seed=1)
    d = r.decide(REQ, backends, PredictingIndex({"reported": (4, 0), "guessed": (4, 4)}))
    cand = {c.pod: c for c in d.stages[0].candidates()}
    assert d.target.pod == "reported"  # the same prefix, reported by the engine, beats a guess
    assert cand["reported"].scores["prefix"] == 1.0
    assert cand["guessed"].scores["prefix"] == pytest.approx(PREDICTED_WORTH) and PREDICTED_WORTH < 1.0
    assert cand["none"].scores["prefix"] == 0.0
    # a guess alone still steers the request: the engine it was just sent to, before its events come
    d = r.decide(REQ, backends, PredictingIndex({"guessed": (4, 4)}))
    assert d.target.pod == "guessed" and d.chosen_overlap_blocks == 4
    assert d.stages[0].predicted == {"guessed": 4}


def test_kv_aware_balances_when_the_holder_is_loaded():
    backends = [B("hot", waiting=30, active_tokens=5000, kv_usage=0.8), B("cold")]
    d = Router("kv-aware", seed=1).decide(REQ, backends, FakeIndex({"hot": 1}))
    assert d.target.pod == "cold"  # 1/4 overlap is not worth a loaded pod


def test_statuses_busy_no_model_and_filtered_candidates():
    r = Router("least-load", seed=1)
    busy = [B("a", kv_usage=0.99), B("b", waiting=100)]
    d = r.decide(REQ, busy)
    assert d.status == "busy" and d.target is None
    assert {c.pod: c.filtered_by for c in d.stages[0].candidates()} == {"a": "not-busy", "b": "not-busy"}
    assert r.decide(RoutingRequest(model="zzz"), busy).status == "no_model"
    assert r.decide(REQ, [B("a", health="critical")]).status == "no_backend"


def test_warning_lowers_but_does_not_exclude():
    d = Router("least-load", seed=1).decide(REQ, [B("w", health="warning"), B("ok")])
    assert d.target.pod == "ok"
    d = Router("least-load", seed=1).decide(REQ, [B("w", health="warning")])
    assert d.target.pod == "w"


def pd_cluster():
    return [B("p1", role="prefill", group="g1"), B("d1", role="decode", group="g1"),
            B("p2", role="prefill", group="g2"), B("d2", role="decode", group="g2"), B("agg")]


def test_pd_kv_aware_picks_prefill_by_prefix_and_decode_in_its_group():
    req = RoutingRequest(model="m", token_ids=list(range(640)), prompt_tokens=640)
    d = Router("pd-kv-aware", seed=3).decide(req, pd_cluster(), FakeIndex({"p2": 30}))
    assert d.ok and d.prefill.pod == "p2" and d.target.pod == "d2"
    # a short prompt is not worth a transfer: the decode pod does it all (llm-d's decider)
    d = Router("pd-kv-aware", seed=3).decide(REQ, pd_cluster(), FakeIndex({"p2": 4}))
    assert d.prefill is None and d.target.role == "decode"
    assert [s.stage for s in d.stages] == ["prefill", "decode"]


def test_pd_decider_skips_remote_prefill_when_decode_holds_the_prompt():
    req = RoutingRequest(model="m", token_ids=list(range(640)), prompt_tokens=640)  # 40 blocks
    d = Router("pd-kv-aware", seed=3).decide(req, pd_cluster(), FakeIndex({"p1": 40, "d1": 39}))
    assert d.target.pod == "d1" and d.prefill is None and "skipped" in d.reason
    d = Router("pd-kv-aware", seed=3).decide(req, pd_cluster(), FakeIndex({"p1": 40, "d1": 10}))
    assert d.prefill.pod == "p1"


def test_pd_bucket_sends_short_and_long_prompts_to_different_groups():
    r = Router("pd-bucket", seed=1)
    short = RoutingRequest(model="m", prompt_tokens=100)
    long = RoutingRequest(model="m", prompt_tokens=5000)
    for _ in range(5):
        a, b = r.decide(short, pd_cluster()), r.decide(long, pd_cluster())
        assert (a.prefill.group, a.target.group) == ("g1", "g1")
        assert (b.prefill.group, b.target.group) == ("g2", "g2")
    rb = Router("pd-random-bucket", seed=1)
    assert {rb.decide(long, pd_cluster()).target.pod for _ in range(20)} == {"d2"}


def test_round_robin_and_random_spread():
    backends = [B(f"p{i}") for i in range(4)]
    rr = Router("round-robin")
    assert [rr.decide(REQ, backends).target.pod for _ in range(8)] == ["p0", "p1", "p2", "p3"] * 2
    rnd = Router("random", seed=5)
    assert {rnd.decide(REQ, backends).target.pod for _ in range(100)} == {"p0", "p1", "p2", "p3"}


def test_dynamo_cost_picks_lowest_cost():
    backends = [B("a", active_tokens=16 * 10), B("b", active_tokens=0)]
    r = Router("dynamo-cost")
    # a holds the prefix (saves 4 blocks of prefill) but has 10 blocks of decode load
    assert r.decide(REQ, backends, FakeIndex({"a": 4})).target.pod == "b"
    backends = [B("a", active_tokens=16 * 2), B("b", active_tokens=0)]
    assert r.decide(REQ, backends, FakeIndex({"a": 4})).target.pod == "a"


def test_candidate_records_round_scores_and_list_filtered_pods():
    from schemas.records import RoutingDecision

    r = Router("kv-aware", seed=1)
    bs = [B("a", waiting=1.0, kv_usage=0.123456789), B("b", waiting=3.0), B("c", health="critical")]
    d = r.decide(RoutingRequest(model="m", token_ids=list(range(64)), prompt_tokens=64), bs,
                 overlap={"a": 2, "b": 4})
    st = d.stages[0]
    rows = {c["pod"]: c for c in st.candidate_dicts()}
    assert rows["c"]["filtered_by"] == "healthy" and rows["c"]["scores"] == {}
    for i, b in enumerate(st.cands):
        row = rows[b.pod]
        assert row["total"] == pytest.approx(st.totals[i], abs=1e-6) and row["overlap_blocks"] == {"a": 2, "b": 4}[b.pod]
        assert row["scores"] == pytest.approx({k: v[i] for k, v in st.columns.items()}, abs=1e-6)
        assert all(len(repr(v).split(".")[-1]) <= 6 for v in row["scores"].values())
    rec = RoutingDecision.model_validate({"request_id": "r", "ts": 1.0, "pool": "p", "model": "m", "profile": "kv",
                                          "picked": "a", "candidates": st.candidate_dicts()})
    assert [c.pod for c in rec.candidates] == [c.pod for c in st.candidates()] == ["a", "b", "c"]
    from router.records import decision_json

    for stage in d.stages:  # the msgspec-written record is the model's JSON
        fast = RoutingDecision.from_json(decision_json(request_id="r", ts=1.0, pool="p", model="m", profile="kv",
                                                       stage=stage))
        assert fast == RoutingDecision(request_id="r", ts=1.0, pool="p", model="m", profile="kv", stage=stage.stage,
                                       picked=stage.picked.pod, reason=stage.reason, candidates=stage.candidates())
    st.totals[0] = float("nan")  # a broken scorer must not break the record
    assert st.candidate_dicts()[0]["total"] != st.candidate_dicts()[0]["total"]


@pytest.mark.parametrize("weights", [[], [0.0], [1.0], [0.5, 0.0, 0.5], [1, 2, 3, 4], [1, 1, 1, 1, 1],
                                     [3, 1, 1, 0.5, 0.5, 2], [1, 2, 0, 3, 4, 5, 6, 7]])
def test_weighted_sum_matches_a_pass_per_column(weights):
    from router.profiles import weighted_sum

    rnd = random.Random(len(weights))
    cols = [[rnd.random() for _ in range(9)] for _ in weights]
    got = weighted_sum(weights)(cols) if cols else []
    want = [sum(w * c[i] for w, c in zip(weights, cols)) for i in range(9)] if cols else []
    assert got == pytest.approx(want)


def test_load_epoch_reuses_load_only_columns_until_it_changes():
    r = Router("kv-aware", seed=1)
    bs = [B("a", waiting=1.0), B("b", waiting=3.0), B("c", waiting=2.0)]

    def queue_col(backends, epoch):
        d = r.decide(RoutingRequest(model="m", prompt_tokens=16), backends, load_epoch=epoch)
        st = d.stages[0]
        return dict(zip(st.pods, st.columns["queue"]))

    assert queue_col(bs, 7) == {"a": 1.0, "b": 0.0, "c": 0.5}
    bs[0].waiting = 5.0  # changed behind the epoch's back: the cached column is (knowingly) reused
    assert queue_col(bs, 7) == {"a": 1.0, "b": 0.0, "c": 0.5}
    assert queue_col(bs, 8) == pytest.approx({"a": 0.0, "b": 2 / 3, "c": 1.0})  # new epoch: recomputed
    assert queue_col(bs[1:], 8) == {"b": 0.0, "c": 1.0}  # other candidates: recomputed
    assert queue_col(bs, None) == queue_col(bs, 8)  # no epoch: always computed
    # columns that depend on the request or the router's own counters are never cached
    bs[1].active_tokens = 1000
    d = Router("kv-aware-active", seed=1).decide(RoutingRequest(model="m", prompt_tokens=16), bs, load_epoch=8)
    assert dict(zip(d.stages[0].pods, d.stages[0].columns["active"]))["b"] == 0.0
    r2 = Router("kv-aware-prefill", seed=1)
    bs[1].pending_prefill_tokens = 1000
    d = r2.decide(RoutingRequest(model="m", prompt_tokens=16), bs, load_epoch=8)
    assert dict(zip(d.stages[0].pods, d.stages[0].columns["prefill-load"]))["b"] == pytest.approx(32 / 1032)


def test_a_prompt_of_whole_blocks_reuses_one_block_less_as_vllm():
    """vLLM always computes the last prompt token: a prompt of exactly 4 blocks reuses 3."""
    idx = FakeIndex({"p1": 4})
    whole = RoutingRequest(model="m", token_ids=list(range(64)), prompt_tokens=64)
    assert overlaps_from_index(idx, whole, approximate=False) == {"p1": 3}
    longer = RoutingRequest(model="m", token_ids=list(range(65)), prompt_tokens=65)
    assert overlaps_from_index(idx, longer, approximate=False) == {"p1": 4}


def test_lora_and_cache_salt_select_their_own_cached_blocks():
    """Blocks cached under a LoRA adapter or a cache salt are reusable only by requests with
    the same adapter and salt (the real index, keys from the stored events)."""
    from schemas.kv import BlockStored, KvEventBatch
    from streams.clock import ManualClock
    from streams.kv_index import KvIndex
    from streams.kv_keys import extra_salt

    toks = list(range(1000, 1064))  # 4 blocks of 16
    idx = KvIndex(ManualClock(0))

    def store(pod, **kw):
        idx.apply(KvEventBatch(pod=pod, model="base", seq=0, ts=1.0, events=[
            BlockStored(block_hashes=[pod_hash * 10 + i for i in range(4)], token_ids=toks, block_size=16,
                        **kw)]))

    pod_hash = 1
    store("plain")
    pod_hash = 2
    store("lora", lora_id=7, lora_name="sql-adapter",
          block_salts=[extra_salt(("sql-adapter",), "sql-adapter")] * 4)  # vLLM: (lora_name,) on every block
    pod_hash = 3
    store("salted", block_salts=[extra_salt(("s3cr3t",)), 0, 0, 0])  # cache_salt: first block only

    def matched(**kw):
        r = RoutingRequest(model="base", token_ids=toks + [1], prompt_tokens=65, **kw)
        return overlaps_from_index(idx, r, approximate=False)

    assert matched() == {"plain": 4}
    assert matched(lora="sql-adapter") == {"lora": 4}
    assert matched(cache_salt="s3cr3t") == {"salted": 4}
    assert matched(lora="other") == {} and matched(cache_salt="other") == {}


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 90), st.sampled_from([None, "ad1"]), st.sampled_from([None, "s"]), st.integers(0, 5))
def test_prehashed_prompt_keys_read_the_same_overlap_as_the_tokens(n_tokens, lora, salt, seed):
    """The router hashes a prompt's block keys once and reads the index with them in approximate
    mode: the same overlap per pod as reading it with the token ids (the last prompt token is not
    reusable, adapters and salts seed the keys), whatever the length."""
    from streams.clock import ManualClock
    from streams.kv_index import KvIndex, block_keys
    from streams.kv_keys import request_salt

    rnd = random.Random(seed)
    ids = [rnd.randrange(50) for _ in range(n_tokens)]
    idx = KvIndex(ManualClock(), default_block_size=4)
    for pod in ("a", "b"):  # predicted prefixes of different lengths, under the same adapter and salt
        cut = rnd.randrange(n_tokens + 1)
        idx.record_route("m", pod, keys=block_keys(ids[:cut], 4, lora=lora, salt=request_salt(salt)))
    idx.record_route("m", "c", token_ids=ids)  # without the adapter: matches only plain requests
    req = RoutingRequest(model="m", token_ids=ids, prompt_tokens=n_tokens, lora=lora, cache_salt=salt)
    want = overlaps_from_index(idx, req, approximate=True)
    req.prompt_keys = (4, block_keys(ids, 4, lora=lora, salt=request_salt(salt)))
    assert overlaps_from_index(idx, req, approximate=True) == want
