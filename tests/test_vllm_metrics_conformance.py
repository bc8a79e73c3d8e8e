"""vLLM's ``/metrics`` as vLLM 0.33 itself writes it (tests/fixtures/vllm/0.33.0/metrics*.prom, made
by the release's own PrometheusStatLogger in make_metrics_fixtures.py, and in prometheus_client's
multiprocess mode, as a server with two API servers serves it, in
make_metrics_multiproc_fixtures.py): the collector reads from it the load the script recorded, the
simulator exposes what the collector reads under vLLM's names, types and labels, and the
hand-written tests/fixtures/vllm-metrics.prom has vLLM's layout."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from consumers import metrics_collector as mc
from consumers.metrics_collector import parse_vllm_metrics
from fixtures.vllm import meta as kv_meta
from fixtures.vllm import metrics_meta, metrics_text
from simulator.cluster import EngineSpec, SimCluster
from simulator.config import EngineConfig
from streams.clock import ManualClock
from streams.load import LoadState

FIX = Path(__file__).parent / "fixtures"
META = metrics_meta()
MP_META = metrics_meta(multiproc=True)
# every exposition with what vLLM recorded into it: one API server, then several (multiprocess mode)
RECORDED = {**META["files"], **MP_META["files"]}
FILES = sorted(RECORDED)
MP_FILES = sorted(MP_META["files"])
# what the collector reads: its name maps and the info gauge it takes the block size and count from
READ = {*mc._GAUGES, *mc._COUNTERS, *mc._HISTOGRAMS, "vllm:cache_config_info"}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def layout(fam) -> dict[str, object]:
    """What a reader depends on besides the values: type, help, sample names, label names and,
    for a histogram, its bucket bounds."""
    return {
        "type": fam.type,
        "documentation": fam.documentation,
        "samples": sorted({s.name for s in fam.samples}),
        "labels": sorted({k for s in fam.samples for k in s.labels if k != "le"}),
        "buckets": sorted({s.labels["le"] for s in fam.samples if "le" in s.labels}, key=float),
    }


def differences(text: str, real: str, names: set[str] | None = None) -> list[str]:
    """Where the families of ``text`` (those in ``names``, default all ``vllm:`` ones) differ in
    layout from vLLM's real exposition ``real``."""
    got, want = families(text), families(real)
    out = []
    for name in sorted(names if names is not None else {n for n in got if n.startswith("vllm:")}):
        if name not in got:
            out.append(f"{name}: missing")
        elif name not in want:
            out.append(f"{name}: not a vLLM 0.33 metric")
        else:
            a, b = layout(got[name]), layout(want[name])
            out += [f"{name}: {k} {a[k]!r}, vLLM has {b[k]!r}" for k in a if a[k] != b[k]]
    return out


def _bucket_counts(observations: list[float], bounds: list[str]) -> dict[str, float]:
    return {le: float(sum(1 for x in observations if x <= float(le))) for le in bounds}


# --- the fixture itself ---------------------------------------------------------------------------

def test_the_fixture_is_from_the_release_wheel():
    assert META["vllm"] == "0.33.0" and META["wheel"] == kv_meta("0.33.0")["wheel"]
    assert META["wheel_sha256"] == kv_meta("0.33.0")["wheel_sha256"]
    assert META["files"]["metrics.prom"]["engines"] == [0]
    assert META["files"]["metrics-dp2.prom"]["engines"] == [0, 1]
    # every family the collector reads is in vLLM 0.33's exposition, except the older names it
    # also accepts (vLLM V0 and releases before 0.11)
    real = families(metrics_text())
    assert sorted(READ - set(real)) == ["vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits",
                                        "vllm:gpu_prefix_cache_queries", "vllm:time_per_output_token_seconds"]
    # the multiprocess-mode files: the same wheel, two API servers, the same scripted steps
    assert (MP_META["wheel"], MP_META["wheel_sha256"]) == (META["wheel"], META["wheel_sha256"])
    assert MP_META["steps"] == META["steps"] and MP_META["requests"] == META["requests"]
    assert {n: (f["api_servers"], f["engines"]) for n, f in MP_META["files"].items()} == {
        "metrics-multiproc.prom": (2, [0]), "metrics-multiproc-dp2.prom": (2, [0, 1]),
        "metrics-multiproc-dp2-idle.prom": (2, [0, 1]), "metrics-multiproc-start.prom": (2, [0])}
    for f in MP_META["files"].values():
        if f["same_stats_as"]:
            assert f["steps"] == META["files"][f["same_stats_as"]]["steps"]


# --- the collector --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FILES)
def test_the_collector_reads_what_vllm_recorded(name):
    f = RECORDED[name]
    snaps = parse_vllm_metrics(metrics_text(name), "pod-1", 10.0)
    assert [(s.model, s.engine) for s in snaps] == [(META["config"]["served_model_name"], str(e))
                                                  for e in f["engines"]]
    ready = {str(r["data_parallel_rank"]): r for r in f["engine_ready_responses"]}
    for s in snaps:
        exp = f["expect"][s.engine]
        assert s.num_requests_running == exp["num_requests_running"]
        # vLLM's waiting gauge counts the requests waiting for capacity and the deferred ones
        assert s.num_requests_waiting == exp["num_requests_waiting"] == sum(
            exp["num_requests_waiting_by_reason"].values())
        assert s.kv_cache_usage_perc == exp["kv_cache_usage_perc"]
        assert s.prefix_cache_queries_total == exp["prefix_cache_queries_total"]
        assert s.prefix_cache_hits_total == exp["prefix_cache_hits_total"]
        assert s.prompt_tokens_total == exp["prompt_tokens_total"]
        assert s.generation_tokens_total == exp["generation_tokens_total"]
        assert s.block_size == ready[s.engine]["block_size"] == 16
        # the engine's own block count, not the front end's sum over its engines that vLLM labels it with
        assert s.num_gpu_blocks == ready[s.engine]["num_gpu_blocks"] == 2048
        for field in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
            h, obs = getattr(s, field), exp[field]
            assert (h.count, h.sum) == (len(obs), sum(obs)), field
            assert h.buckets == _bucket_counts(obs, list(h.buckets)), field
            assert h.buckets["+Inf"] == len(obs)


def test_vllm_labels_every_engine_with_the_front_ends_block_sum():
    """What the collector corrects for: with two data-parallel engines, vLLM 0.33 writes the sum of
    both engines' blocks into each engine's cache_config_info row."""
    info = [s for s in families(metrics_text("metrics-dp2.prom"))["vllm:cache_config_info"].samples]
    assert sorted(s.labels["engine"] for s in info) == ["0", "1"]
    assert {s.labels["num_gpu_blocks"] for s in info} == {"4096"}
    assert {s.labels["kv_cache_size_tokens"] for s in info} == {"32768"}  # this one stays per engine


@pytest.mark.parametrize("name", FILES)
def test_the_pod_load_from_vllms_exposition(name):
    """The load the router gets for the pod: its engines summed (kv usage averaged)."""
    f = RECORDED[name]
    load = LoadState(clock=ManualClock(100.0))
    for s in parse_vllm_metrics(metrics_text(name), "pod-1", 100.0):
        load.apply(s)
    pl = load.get("pod-1")
    exp = list(f["expect"].values())
    assert pl.running == sum(e["num_requests_running"] for e in exp)
    assert pl.waiting == sum(e["num_requests_waiting"] for e in exp)
    assert pl.kv_usage == pytest.approx(sum(e["kv_cache_usage_perc"] for e in exp) / len(exp))
    assert pl.num_gpu_blocks == sum(r["num_gpu_blocks"] for r in f["engine_ready_responses"])
    assert pl.block_size == 16


def test_the_collector_splits_an_uneven_block_sum():
    text = metrics_text("metrics-dp2.prom").replace('num_gpu_blocks="4096"', 'num_gpu_blocks="4097"')
    snaps = parse_vllm_metrics(text, "p", 1.0)
    assert [s.num_gpu_blocks for s in snaps] == [2049, 2048]


# --- several API servers: prometheus_client's multiprocess mode ----------------------------------

def test_what_multiprocess_mode_writes():
    """What differs from one API server's exposition (same steps, vLLM's code in both): no
    ``_created`` families, no ``pid`` label (every vLLM gauge here is ``mostrecent``), families
    grouped by the file they come from (counters, gauges, histograms), and the same values except
    ``iteration_tokens_total``, observed once per API server per step."""
    one, multi = families(metrics_text("metrics-dp2.prom")), families(metrics_text("metrics-multiproc-dp2.prom"))
    assert sorted(multi) == sorted(n for n in one if not n.endswith("_created"))
    kinds = [multi[n].type for n in multi]
    assert kinds == sorted(kinds, key=["counter", "gauge", "histogram"].index)
    assert not any("pid" in s.labels for f in multi.values() for s in f.samples)

    def values(fam) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples
                if not s.name.endswith("_created")}

    assert [n for n in multi if values(multi[n]) != values(one[n])] == ["vllm:iteration_tokens_total"]
    for n in multi:
        assert layout(multi[n]) == layout(one[n]), n


def test_multiprocess_mode_leaves_out_the_gauges_never_set():
    """What the collector must cope with: a ``mostrecent`` gauge that no API server has set (an
    engine before its first scheduler stats) has no sample (its family is there, HELP and TYPE
    only); the engine's counters are, at 0."""
    start = families(metrics_text("metrics-multiproc-start.prom"))
    gauges = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert {g: start[g].samples for g in gauges} == {g: [] for g in gauges}
    assert [(s.labels["engine"], s.value) for s in start["vllm:prompt_tokens"].samples] == [("0", 0.0)]
    idle = families(metrics_text("metrics-multiproc-dp2-idle.prom"))
    for g in gauges:
        assert {s.labels["engine"] for s in idle[g].samples} == {"0"}, g
    assert {s.labels["engine"] for s in idle["vllm:prompt_tokens"].samples} == {"0", "1"}
    assert {s.labels["engine"] for s in idle["vllm:cache_config_info"].samples} == {"0", "1"}


@pytest.mark.parametrize("name", [n for n in MP_FILES if MP_META["files"][n]["same_stats_as"]])
def test_several_api_servers_read_as_one(name):
    """The collector gets from two API servers' merged exposition exactly what it gets from one
    API server that recorded the same steps."""
    single = MP_META["files"][name]["same_stats_as"]
    multi = [s.model_dump() for s in parse_vllm_metrics(metrics_text(name), "pod-1", 10.0)]
    one = [s.model_dump() for s in parse_vllm_metrics(metrics_text(single), "pod-1", 10.0)]
    assert multi == one


async def test_a_just_started_server_with_several_api_servers_is_up():
    """Before its first request the exposition has no load gauges; the target is up, its engine idle."""
    collector = mc.MetricsCollector([mc.Target("http://vllm/metrics", "pod-1")], js=None,
                                    registry=CollectorRegistry())
    text = metrics_text("metrics-multiproc-start.prom")
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda req: httpx.Response(200, text=text))) as client:
        (snap,) = await collector.scrape(client, collector.targets[0])
    assert collector.status["http://vllm/metrics"].up
    assert (snap.num_requests_running, snap.num_requests_waiting, snap.kv_cache_usage_perc) == (0, 0, 0)
    assert (snap.block_size, snap.num_gpu_blocks) == (16, 2048)


# --- the simulator --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim_metrics():
    cfg = EngineConfig(served_model_name="Qwen/Qwen3-8B", num_gpu_blocks=2048, block_size=16)
    c = SimCluster([EngineSpec(cfg)], time_scale=20).start()
    try:
        url = c[0].url
        r = httpx.post(url + "/v1/completions", json={"prompt": "metrics please", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        yield httpx.get(url + "/metrics", timeout=30).text
    finally:
        c.stop()


def test_the_simulator_exposes_what_the_collector_reads_as_vllm_does(sim_metrics):
    real = families(metrics_text())
    assert differences(sim_metrics, metrics_text(), READ & set(real)) == []
    info = families(sim_metrics)["vllm:cache_config_info"].samples[0].labels
    assert (info["block_size"], info["num_gpu_blocks"], info["kv_cache_size_tokens"]) == ("16", "2048", "32768")
    # the collector reads the simulator as it reads vLLM
    (snap,) = parse_vllm_metrics(sim_metrics, "sim", 1.0)
    assert (snap.model, snap.block_size, snap.num_gpu_blocks) == ("Qwen/Qwen3-8B", 16, 2048)
    assert snap.generation_tokens_total >= 3 and snap.time_to_first_token_seconds.count >= 1


def test_every_vllm_metric_of_the_simulator_is_vllms(sim_metrics):
    sim = families(sim_metrics)
    assert differences(sim_metrics, metrics_text()) == []
    labels = {s.labels["finished_reason"] for s in sim["vllm:request_success"].samples}
    assert labels == {"stop", "length", "abort", "error", "repetition"}
    # the simulator's own metrics keep their own prefix
    assert all(n.startswith(("vllm:", "infernex_sim_")) for n in sim)


# --- the hand-written fixture the collector's other tests read ----------------------------------

def test_the_hand_written_fixture_has_vllms_layout():
    hand = (FIX / "vllm-metrics.prom").read_text()
    assert differences(hand, metrics_text()) == []
    got = families(hand)
    real = families(metrics_text())
    # the same cache_config_info labels (the values are the fixture's own)
    assert layout(got["vllm:cache_config_info"]) == layout(real["vllm:cache_config_info"])
    for name in ("vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds"):
        assert f"{name}_created" in got and got[f"{name}_created"].type == "gauge"
