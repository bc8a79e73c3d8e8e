"""The alert for a KV index that skips the blocks engines report stored (their parent is not in the
index: lost frames, or events the bridge misreads), rendered from the chart and checked with
``promtool test rules``: it fires when most stored blocks are skipped and stays quiet when a few are;
the indexer exports the skipped blocks it counts (``kind="unknown_parent_blocks"``)."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from consumers.indexer import IndexerConfig, IndexerService
from deploytools import promtool_binary, render
from schemas import BlockStored, KvEventBatch
from schemas.config import NatsConfig


def _groups():
    return [g for d in render(None) if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]]


def test_promtool_fires_when_the_index_skips_most_stores(tmp_path):
    promtool = promtool_binary()
    if promtool is None:
        pytest.skip("promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)")
    groups = _groups()
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))

    def case(skipped_per_min: int, stored_per_min: int, fires: bool) -> dict:
        series = [{"series": 'infernex_indexer_anomalies_total{kind="unknown_parent_blocks"}',
                   "values": f"0+{skipped_per_min}x40"},
                  {"series": 'infernex_indexer_blocks_total{op="stored"}', "values": f"0+{stored_per_min}x40"}]
        exp = [{"exp_labels": {"severity": "warning"}, "exp_annotations": {
            "summary": "The KV index skips blocks engines report stored",
            "description": "The cache-indexer skipped 75% of the stored blocks of the last 10 minutes: their parent "
                           "block was not in the index (frames lost between an engine and its bridge and not "
                           "replayed, or events the bridge misreads). Prefix-aware routing works on a partial view. "
                           "See the bridges' infernex_kv_bridge_gaps_total and infernex tail 'kv.events.>'."}}]
        return {"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "30m", "alertname": "InferNexKVIndexSkipsStores", "exp_alerts": exp if fires else []}]}

    test = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [
        case(3000, 1000, True),  # three in four stored blocks skipped
        case(50, 1000, False),  # a few: a gap now and then, replayed or not
        case(0, 0, False)]}  # a quiet cluster
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_indexer_counts_the_blocks_it_skips():
    registry = CollectorRegistry()
    svc = IndexerService(IndexerConfig(), NatsConfig(), registry=registry)
    st = svc.index.apply(KvEventBatch(pod="p", model="m", seq=0, ts=1.0, events=[
        BlockStored(block_hashes=[1, 2, 3], parent_block_hash=99, token_ids=list(range(12)), block_size=4)]))
    svc._count(st)
    text = generate_latest(registry).decode()
    assert 'infernex_indexer_anomalies_total{kind="unknown_parent_blocks"} 3.0' in text
    assert 'infernex_indexer_anomalies_total{kind="unknown_parent"} 1.0' in text
