"""Folding the KV events in worker processes (pods split among them) reaches the state one
sequential fold reaches, at the end of the history and at an instant inside it; and the
reader survives its consumer being deleted under it."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import sys
import threading
import time

from consumers.replay import partition_subjects, read_window_batches
from infernex.commands import replay as replay_cmd
from infernex.commands.replay import ALL_SUBJECTS, Window, fold_window
from infernex.incident import ReplayState
from infernex.settings import Settings
from schemas import (
    BlockRemoved,
    BlockStored,
    DeviceTelemetry,
    EngineMetrics,
    KvEventBatch,
    PodGone,
    PodReset,
    subjects as S,
)


def _history(pods: int, steps: int, seed: int = 7):
    """Per pod: chains of stored blocks, evictions, one engine reset, one sequence gap; one pod
    is deleted. Plus metrics and device samples."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        for p in range(pods):
            pod = f"pod-{p}"
            held = (p * 100_000 + step * 10, p * 100_000 + step * 10 + 1)
            evs = [BlockStored(block_hashes=list(held), parent_block_hash=None if step % 5 == 0 else held[0] - 9,
                               token_ids=[rng.randrange(1000) for _ in range(8)], block_size=4)]
            if step % 3 == 2:
                evs.append(BlockRemoved(block_hashes=[held[0] - 30]))
            if step == 7 and p == 1:
                evs = [PodReset()]
            if step == steps - 1 and p == 2:
                evs = [PodGone()]
            seq = step + (1 if step >= 5 and p == 3 else 0)  # pod-3 skips a batch: a gap
            b = KvEventBatch(pod=pod, model="m", seq=seq, ts=float(step), events=evs)
            out.append((S.kv_events("m", pod), b.to_json()))
            if step % 4 == 0:
                out.append((S.engine_metrics(pod), EngineMetrics(pod=pod, model="m", ts=float(step),
                                                                 num_requests_running=step % 7, num_requests_waiting=1,
                                                                 kv_cache_usage_perc=0.5).to_json()))
        out.append((S.device_telemetry("n", "0"), DeviceTelemetry(node="n", device="0", kind="npu", source="sim",
                                                                   ts=float(step), temperature_c=40 + step).to_json()))
    return out


def _summary(st: ReplayState) -> dict:
    state = st.state()
    return {"state": json.dumps(state, sort_keys=True), "fingerprint": st.index.fingerprint(),
            "timeline": sorted(st.timeline), "counts": dict(st.counts), "first": st.first_ts, "last": st.last_ts,
            "kv_pos": dict(st._kv_pos)}


async def test_parallel_fold_equals_sequential(nc, nats_config, prefix, topology, monkeypatch):
    js = nc.jetstream()
    msgs = _history(pods=6, steps=24)
    instant = None
    for i, (subject, data) in enumerate(msgs):
        await js.publish(S.with_prefix(prefix, subject), data)
        if i == len(msgs) // 2:
            await asyncio.sleep(0.05)
            instant = time.time()
            await asyncio.sleep(0.05)
    settings = Settings(nats=nats_config)

    groups, total = await partition_subjects(nc, topology, ["kv.events.>"], 2, prefix=prefix)
    assert total == 6 * 24 and len(groups) == 2
    assert sorted(s for g in groups for s in g) == sorted({S.kv_events("m", f"pod-{p}") for p in range(6)})

    for end in (None, instant):
        if end is not None:  # workers are forked where possible; spawned when this process runs threads
            monkeypatch.setattr(replay_cmd.threading, "active_count", lambda: 2)
        seq = ReplayState()
        n_seq = await fold_window(settings, Window(None, end, None, ALL_SUBJECTS), seq)
        par = ReplayState()
        par_stats: dict = {}
        n_par = await fold_window(settings, Window(None, end, None, ALL_SUBJECTS, workers=3), par, par_stats)
        assert n_par == n_seq and par_stats["processes"] == 4
        forkable = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
        assert par_stats["start_method"] == ("fork" if forkable else "spawn")
        assert n_seq == (len(msgs) if end is None else len(msgs) // 2 + 1)
        want, got = _summary(seq), _summary(par)
        assert got == want
        auto = ReplayState()  # automatic: this small history stays in one process
        stats: dict = {}
        assert await fold_window(settings, Window(None, end, None, ALL_SUBJECTS, workers=0), auto, stats) == n_seq
        assert stats["processes"] == 1 and _summary(auto) == want
        kinds = {e.kind for e in seq.timeline}
        assert {"engine-reset", "kv-gap"} <= kinds
        # pod-2 was deleted at the end: the tombstone survives the merge too
        assert ("pod-2" in par.index.pods()) == (end is not None)
    for spec in topology:
        left = [(c.name, c.config.filter_subject, c.config.filter_subjects, c.delivered, c.num_pending)
                for c in await js.consumers_info(spec.name)]
        assert left == [], spec.name


async def test_reader_recreates_a_deleted_consumer(nc, prefix, topology):
    js = nc.jetstream()
    subject = S.with_prefix(prefix, S.kv_events("m", "p"))
    n = 1000
    # ~40 kB each: far more than the server sends ahead under flow control
    big = [BlockStored(block_hashes=list(range(1, 401)), token_ids=[20_000 + i for i in range(6400)], block_size=16)]
    for i in range(0, n, 100):
        await asyncio.gather(*(js.publish(subject, KvEventBatch(pod="p", model="m", seq=j, ts=1.0,
                                                                events=big).to_json())
                               for j in range(i, i + 100)))
    stream = next(s.name for s in topology if s.name.endswith("KV_EVENTS"))
    seqs: list[int] = []
    deleted = False
    stats: dict[str, int] = {}
    async for run in read_window_batches(nc, topology, ["kv.events.>"], prefix=prefix, buffer=16, heartbeat_s=0.5,
                                         stats=stats):
        seqs.extend(KvEventBatch.from_bytes(m.data).seq for m in run)
        if not deleted and len(seqs) >= 50:
            # pull the consumer away mid-read: the reader notices the silence and resumes
            for name in [c.name async for c in _consumers(js, stream)]:
                await js.delete_consumer(stream, name)
            deleted = True
    assert deleted
    assert seqs == list(range(n))
    assert stats[stream] >= 1


async def _consumers(js, stream):
    for c in await js.consumers_info(stream):
        yield c


async def test_cli_state_with_workers_equals_one_process(nc, nats_config, prefix, topology):
    js = nc.jetstream()
    for subject, data in _history(pods=4, steps=10):
        await js.publish(S.with_prefix(prefix, subject), data)
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_config.servers[0], INFERNEX_NATS__SUBJECT_PREFIX=prefix)
    env.pop("INFERNEX_CONFIG", None)
    out = {}
    for workers in ("1", "2"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infernex.cli", "replay", "--workers", workers, "state", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, stderr.decode()
        out[workers] = json.loads(stdout)
    assert out["1"]["replayed_messages"] == out["2"]["replayed_messages"] == len(_history(pods=4, steps=10))
    assert out["1"] == out["2"]
    assert sorted(out["1"]["pods"]) == ["pod-0", "pod-1", "pod-3"]  # pod-2 was deleted
