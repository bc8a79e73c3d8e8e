"""Replay rebuilds the live folds' state at an instant, re-decides against it, and reports
a scripted incident in order."""

from __future__ import annotations

import asyncio
import time

from consumers import bus
from infernex.commands.replay import ALL_SUBJECTS, Window, fold_window
from infernex.incident import ReplayState, report_html, report_markdown
from infernex.settings import Settings
from schemas import (
    BlockRemoved,
    BlockStored,
    Diagnosis,
    EngineAnnouncement,
    KvEventBatch,
    PodReset,
    RequestRecord,
    subjects as S,
)
from streams.clock import ManualClock
from streams.kv_index import KvIndex


def _stored(tokens: list[int], hashes: list[int], parent=None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4)


async def test_state_at_an_instant_equals_the_live_fold(nc, nats_config, prefix, topology):
    js = nc.jetstream()
    live = KvIndex(ManualClock(0))
    batches = []
    for i in range(30):
        pod = f"pod-{i % 3}"
        evs = [_stored(list(range(i, i + 8)), [1000 + i * 2, 1001 + i * 2])]
        if i % 5 == 4:
            evs.append(BlockRemoved(block_hashes=[1000 + (i - 3) * 2 + 1]))
        if i == 20:
            evs = [PodReset()]
        batches.append(KvEventBatch(pod=pod, model="m", seq=i // 3, ts=float(i), events=evs))
    instant = None
    expected = None
    for i, b in enumerate(batches):
        await bus.publish(js, S.with_prefix(prefix, S.kv_events("m", b.pod)), b.to_json(), msg_id=b.msg_id)
        live.apply(b)
        if i == 17:
            await asyncio.sleep(0.05)
            instant = time.time()
            expected = live.fingerprint()
            await asyncio.sleep(0.05)
    settings = Settings(nats=nats_config)
    st = ReplayState()
    n = await fold_window(settings, Window(None, instant, None, ["kv.events.>"]), st)
    assert n == 18
    assert st.index.fingerprint() == expected
    # the whole history gives the final live state
    st_all = ReplayState()
    assert await fold_window(settings, Window(None, None, None, ALL_SUBJECTS), st_all) == 30
    assert st_all.index.fingerprint() == live.fingerprint()
    assert [e.kind for e in st_all.timeline] == ["engine-reset"]


async def test_scripted_incident_report_and_redecide(nc, nats_config, prefix, topology):
    js = nc.jetstream()
    now = time.time()

    async def pub(subject, event):
        await bus.publish(js, S.with_prefix(prefix, subject), event.to_json())
        await asyncio.sleep(0.01)

    for pod, dev in (("pod-a", "0"), ("pod-b", "1")):
        await pub(S.engine_announce(pod), EngineAnnouncement(pod=pod, url=f"http://{pod}:8000", model="m",
                                                           node="node-1", devices=[dev], ts=now, ttl_s=3600))
    # both hold the same prefix
    toks = list(range(100, 132))
    for pod in ("pod-a", "pod-b"):
        await pub(S.kv_events("m", pod), KvEventBatch(pod=pod, model="m", seq=0, ts=now, events=[
            BlockStored(block_hashes=list(range(8)), token_ids=toks, block_size=4)]))
    ok = dict(model="m", pool="default", prompt_tokens=32, output_tokens=10, itl_s=0.02, e2e_s=1.0)
    await pub(S.router_requests("default"), RequestRecord(request_id="r1", ts=now, pods=["pod-a"], ttft_s=0.2, **ok))
    # the NPU under pod-a fails
    await pub(S.diagnosis("node-1", "0"), Diagnosis(
        finding_id="f1", node="node-1", device="0", fault_mode="hbm_multi_bit_ecc", severity="critical",
        status="open", action="SeparateNPU", summary="multi-bit ECC 0x80E01801", first_seen=now, last_seen=now,
        pods=["pod-a"]))
    # a request that was already on pod-a breaches the SLA
    await pub(S.router_requests("default"), RequestRecord(request_id="r2", ts=now, pods=["pod-a"], ttft_s=5.0, **ok))
    # the router moves away
    await pub(S.router_requests("default"), RequestRecord(request_id="r3", ts=now, pods=["pod-b"], ttft_s=0.1, **ok))

    settings = Settings(nats=nats_config)
    st = ReplayState()
    await fold_window(settings, Window(None, None, None, ALL_SUBJECTS), st)
    kinds = [e.kind for e in sorted(st.timeline)]
    assert kinds == ["diagnosis", "sla-breach"], kinds
    md = report_markdown(st, None, None)
    assert md.index("hbm_multi_bit_ecc") < md.index("TTFT 5.000s")
    assert "First notable event: **diagnosis**" in md
    assert "Requests by first pod: pod-a 2, pod-b 1" in md
    assert md == report_markdown(st, None, None)  # deterministic
    page = report_html(md)
    assert page.startswith("<!doctype html>") and "hbm_multi_bit_ecc" in page and "<table>" in page

    # re-deciding at the end of the window avoids the pod on the failed device
    decision = st.decide({"model": "m", "prompt_token_ids": toks}, "kv-aware")
    assert decision["picked"] == "pod-b"
    filtered = {c["pod"]: c["filtered_by"] for s in decision["stages"] for c in s["candidates"] if c["filtered_by"]}
    assert "pod-a" in filtered
