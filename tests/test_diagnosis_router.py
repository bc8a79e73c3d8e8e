"""End to end without a network: simulator -> diagnosis engine -> router state -> decide.
A pod on a Critical device gets no new requests; it comes back once the finding resolves."""

from __future__ import annotations

from router.core import Router
from router.state import ClusterState
from router.types import BackendState, RoutingRequest
from simulator.devices import SimulatedNode
from streams.clock import ManualClock
from streams.diagnosis import DiagnosisEngine, build_ruleset

T0 = 1_000.0


def test_pod_on_critical_device_gets_no_new_requests():
    clock = ManualClock(T0)
    engine = DiagnosisEngine(build_ruleset({"timing": {"hold_s": 5}}), clock)
    node = SimulatedNode("n1", 3, "npu", seed=2, pods={"0": ["pod-a"], "1": ["pod-b"], "2": ["pod-c"]})
    node.inject(0, "error_code", start=T0 + 10, duration=30, code="0x80E01801")  # UCE: critical
    state = ClusterState(clock=clock)
    for pod in ("pod-a", "pod-b", "pod-c"):
        state.add_static(BackendState(pod=pod, url=f"http://{pod}:8000", model="m", node="n1"))
    router = Router("least-load", seed=1)

    def picks(n=30):
        out = []
        for i in range(n):
            dec = router.decide(RoutingRequest(model="m", request_id=str(i), prompt_tokens=64), state.snapshot(),
                                now=clock.now())
            assert dec.ok, dec.reason
            out.append(dec.target.pod)
            state.started(dec.target, 64, 64)  # load so least-load spreads the requests
        for b in state.snapshot():
            b.inflight = b.active_tokens = b.pending_prefill_tokens = 0
        return out

    def run(start, seconds):
        for i in range(seconds):
            clock.set(start + i)
            for s in node.sample(start + i):
                for d in engine.observe(s):
                    state.apply_diagnosis(d)

    run(T0, 5)
    assert set(picks()) == {"pod-a", "pod-b", "pod-c"}
    run(T0 + 5, 20)
    assert state.get("pod-a").health == "critical"
    during = picks()
    assert "pod-a" not in during and set(during) == {"pod-b", "pod-c"}
    run(T0 + 25, 70)  # code gone at T0+40, finding resolved after clear_after_s + hold_s
    assert state.get("pod-a").health == "ok"
    assert "pod-a" in picks()
