"""llm-d ``EndpointPickerConfig`` files load as InferNex strategies: every llm-d plugin named in
the issue maps onto ours with its weight, profiles keep their roles, and the decisions follow
(table-driven over backend states); unknown plugins are errors naming the file and the line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.core import Router
from router.profiles import load_strategy, load_strategy_file
from router.types import BackendState, RoutingRequest

# written the way llm-d's guides write them (inference-scheduling and pd-disaggregation)
LLMD_AGGREGATED = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters:
    hashBlockSize: 64
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: max-score-picker
  parameters:
    maxNumOfEndpoints: 1
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""

LLMD_PD = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-header-handler
- type: prefix-cache-scorer
  parameters:
    hashBlockSize: 5
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: queue-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: pd-profile-handler
  parameters:
    threshold: 100
    hashBlockSize: 5
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 50
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 50
"""


def write(tmp_path: Path, text: str, name="epp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def b(pod, role="aggregated", model="m", **kw) -> BackendState:
    return BackendState(pod=pod, url=f"http://{pod}:8000", model=model, role=role, **kw)


def test_aggregated_config_maps_plugins_and_weights(tmp_path):
    st = load_strategy_file(write(tmp_path, LLMD_AGGREGATED))
    assert not st.pd
    prof = st.profiles["default"]
    assert [f.type_name for f in prof.filters] == ["model-filter", "healthy-filter"]
    assert [(s.type_name, w) for s, w in prof.scorers] == [("queue-scorer", 2), ("kv-usage-scorer", 2),
                                                          ("prefix-scorer", 3)]
    prefix = prof.scorers[2][0]
    assert prefix.params.mode == "approximate"  # llm-d's prefix-cache-scorer learns from its own routing
    assert prof.picker.type_name == "max-score-picker"
    assert st.needs_overlap and st.approximate


@pytest.mark.parametrize("backends, overlap, want", [
    # the prefix holder wins over an idle pod (3 x 1.0 vs 2 x queue + 2 x kv)
    ([b("a", waiting=4, kv_usage=0.5), b("b")], {"a": 10}, "a"),
    # no prefix anywhere: the least queued and least KV-full pod
    ([b("a", waiting=4), b("b", waiting=1, kv_usage=0.9), b("c", waiting=1, kv_usage=0.1)], {}, "c"),
    # another model's pod and an unhealthy pod are never picked, whatever they hold
    ([b("a", model="x"), b("b", health="critical"), b("c", waiting=9)], {"a": 10, "b": 10}, "c"),
])
def test_aggregated_decisions(tmp_path, backends, overlap, want):
    r = Router(load_strategy_file(write(tmp_path, LLMD_AGGREGATED)), seed=1)
    req = RoutingRequest(model="m", token_ids=list(range(161)), prompt_tokens=161)
    d = r.decide(req, backends, overlap=overlap)
    assert d.ok and d.target.pod == want


def test_pd_config_maps_roles_threshold_and_drops_the_header_handler(tmp_path):
    st = load_strategy_file(write(tmp_path, LLMD_PD))
    assert st.pd and set(st.profiles) == {"prefill", "decode"}
    assert st.handler.params.threshold_tokens == 100 and st.handler.params.same_group is False
    pre, dec = st.profiles["prefill"], st.profiles["decode"]
    assert [(f.type_name, getattr(f.params, "roles", None)) for f in pre.filters] == [
        ("model-filter", None), ("healthy-filter", None), ("role-filter", ["prefill"])]
    assert dec.filters[-1].params.roles == ["decode", "aggregated"]  # llm-d: decode or "both"
    assert [(s.type_name, w) for s, w in pre.scorers] == [("prefix-scorer", 50), ("queue-scorer", 1)]


@pytest.mark.parametrize("prompt, decode_holds, want_prefill", [
    (800, 0, "p1"),     # long and uncached: disaggregate, prefill on the less loaded prefill pod
    (800, 45, None),    # decode pod holds all but 80 tokens (< threshold 100): no remote prefill
    (60, 0, None),      # shorter than the threshold: the decode pod does it all
])
def test_pd_decisions(tmp_path, prompt, decode_holds, want_prefill):
    r = Router(load_strategy_file(write(tmp_path, LLMD_PD)), seed=1)
    backends = [b("p0", "prefill", waiting=5), b("p1", "prefill"), b("d0", "decode"), b("x0", "aggregated",
                                                                                         waiting=50)]
    req = RoutingRequest(model="m", token_ids=list(range(prompt)), prompt_tokens=prompt)
    d = r.decide(req, backends, overlap={"d0": decode_holds} if decode_holds else {})
    assert d.ok and d.target.pod in {"d0", "x0"}
    assert (d.prefill.pod if d.prefill else None) == want_prefill


def test_profile_names_come_from_the_handler_parameters(tmp_path):
    text = LLMD_PD.replace("- name: prefill\n", "- name: pre\n").replace("- name: decode\n", "- name: dec\n")
    text = text.replace("    threshold: 100\n", "    threshold: 100\n    prefillProfile: pre\n    decodeProfile: dec\n")
    st = load_strategy_file(write(tmp_path, text))
    assert set(st.profiles) == {"prefill", "decode"}


def test_unknown_plugin_names_file_and_line(tmp_path):
    text = LLMD_AGGREGATED.replace("- type: kv-cache-utilization-scorer", "- type: lora-affinity-magic")
    p = write(tmp_path, text, "mine.yaml")
    with pytest.raises(ValueError) as ei:
        load_strategy_file(p)
    msg = str(ei.value)
    assert f"{p}:5:" in msg and "'lora-affinity-magic'" in msg and "prefill-header-handler" in msg
    # the same for our own format, and for a reference to a plugin that is not declared
    ours = "plugins:\n  - {name: m, type: max-score-picker}\n  - {name: z, type: zzz-scorer}\n" \
           "schedulingProfiles:\n  - {name: d, plugins: [{pluginRef: m}]}\n"
    with pytest.raises(ValueError, match=rf"{tmp_path}/o.yaml:3: unknown plugin type 'zzz-scorer'"):
        load_strategy_file(write(tmp_path, ours, "o.yaml"))
    bad_ref = LLMD_PD.replace("  - pluginRef: decode-filter", "  - pluginRef: nowhere-filter")
    with pytest.raises(ValueError, match=r"r.yaml:\d+: profile 'decode' references unknown plugin 'nowhere-filter'"):
        load_strategy_file(write(tmp_path, bad_ref, "r.yaml"))


def test_builtin_strategies_still_load_unchanged():
    for name in ("kv-aware", "pd-kv-aware", "round-robin"):
        st = load_strategy(name)
        assert st.profiles


def test_cli_reports_an_unknown_llmd_plugin_in_one_line(tmp_path):
    p = write(tmp_path, LLMD_PD.replace("- type: decode-filter", "- type: by-magic-filter"), "pd.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "infernex.cli", "router", "--no-bus", "--profile", str(p)],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert r.returncode == 2
    assert f"{p}:12: unknown plugin type 'by-magic-filter'" in " ".join((r.stderr + r.stdout).split())
    assert "Traceback" not in r.stderr

