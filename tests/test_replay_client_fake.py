"""The replay client against a small fake OpenAI SSE server: TTFT, ITL, cached tokens from
``usage``, open-loop timing, the concurrency cap, and every kind of failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.workloads.client import ReplayError, replay
from simulator.workloads.synth import PromptSynthesizer
from simulator.workloads.testing import FakeOpenAI
from simulator.workloads.trace import TraceRow, write_trace

SHARED = Path(__file__).parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
if not SHARED.is_file():  # a checkout without ../shared: the same trace, bundled (gzipped)
    SHARED = Path(__file__).resolve().parents[1] / "simulator" / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"


def row(ts_ms, hash_ids, n, out):
    return TraceRow(timestamp=ts_ms, input_length=n, output_length=out, hash_ids=list(hash_ids))


@pytest.fixture
def server():
    srv = FakeOpenAI(ttft_s=0.1, itl_s=0.01).start()
    yield srv
    srv.stop()


async def test_records_ttft_itl_and_cached_tokens(server):
    rows = [row(0, [10, 11, 12], 1400, 5),
            row(1000, [10, 11, 99], 1300, 4),   # shares two 512-token blocks with the first
            row(1000, [50], 100, 3)]
    synth = PromptSynthesizer()
    res = await replay(rows, server.url, model="m", synthesizer=synth, timeout_s=30)
    r0, r1, r2 = res.requests
    assert [r.status for r in res.requests] == ["ok", "ok", "ok"]
    for r, src in zip(res.requests, rows):
        assert r.ttft_s >= 0.1 and r.ttft_s < 10
        assert r.output_tokens == src.output_length
        assert len(r.itl_s) == src.output_length - 1 and all(g >= 0.005 for g in r.itl_s)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
        assert r.prompt_tokens == src.input_length and r.backend == "fake-0"
    assert (r0.cached_tokens, r1.cached_tokens, r2.cached_tokens) == (0, 1024, 0)
    # the server saw exactly the synthesized prompts, as token ids, with usage requested
    got = {x.index: x for x in server.received}
    for i, src in enumerate(rows):
        assert got[i].token_ids == synth.token_ids(src, request_key=i)
        assert got[i].body["stream_options"] == {"include_usage": True} and got[i].body["max_tokens"] == src.output_length
        assert got[i].body["model"] == "m" and got[i].body["stream"] is True
    s = res.summary
    assert (s.ok, s.errors, s.timeouts, s.usage_reported) == (3, 0, 0, 3)
    assert s.hit_rate == pytest.approx(1024 / 2800)
    assert s.cached_tokens == 1024 and s.output_tokens == 12
    assert s.ttft_p50_s == pytest.approx(sorted(r.ttft_s for r in res.requests)[1])
    assert s.itl_p50_s >= 0.005 and s.throughput_rps > 0


async def test_open_loop_and_concurrency_cap():
    with FakeOpenAI(ttft_s=0.05, ttft_by_index={0: 1.0}) as srv:
        rows = [row(0, [1], 100, 2), row(100, [2], 100, 2)]
        open_loop = await replay(rows, srv.url, model="m", timeout_s=30)
        a, b = open_loop.requests
        assert b.start_s < a.end_s  # sent on schedule although the first is still running
        assert b.scheduled_s == pytest.approx(0.1)
        capped = await replay(rows, srv.url, model="m", concurrency=1, timeout_s=30, run_id="capped")
        a, b = capped.requests
        assert b.start_s >= a.end_s - 1e-3  # waited for the only slot
        assert capped.summary.max_start_lag_s >= 0.5
        fast = await replay(rows, srv.url, model="m", time_scale=0.0, timeout_s=30)
        assert fast.requests[1].scheduled_s == 0.0


async def test_failures_are_recorded_and_the_run_goes_on():
    faults = {1: "http500", 2: "abort", 3: "stream_error", 4: "slow", 5: "truncate", 6: "http400"}
    with FakeOpenAI(ttft_s=0.02, slow_s=30.0, faults=faults) as srv:
        rows = [row(0, [i], 64, 4) for i in range(8)]
        res = await replay(rows, srv.url, model="m", timeout_s=3.0)
    by = {r.index: r for r in res.requests}
    assert by[0].status == "ok" and by[7].status == "ok"
    assert by[1].status == "error" and by[1].http_status == 500 and "injected failure 500" in by[1].error
    assert by[6].status == "error" and by[6].http_status == 400
    assert by[2].status == "error" and "RemoteProtocolError" in by[2].error
    assert by[3].status == "error" and "engine died" in by[3].error
    assert by[4].status == "timeout" and by[4].ttft_s is None
    assert by[5].status == "error" and "before [DONE]" in by[5].error
    s = res.summary
    assert (s.ok, s.errors, s.timeouts) == (2, 5, 1)
    assert s.error_kinds["http 500"] == 1 and s.error_kinds["timeout"] == 1
    assert s.ttft_p99_s is not None  # computed over the ok requests only


async def test_unreachable_server_and_model_discovery(tmp_path):
    with FakeOpenAI() as srv:
        port = srv.port
        res = await replay([row(0, [1], 10, 2)], srv.url, timeout_s=30)  # model from /v1/models
        assert res.meta["model"] == "fake-model" and srv.received[0].body["model"] == "fake-model"
    down = f"http://127.0.0.1:{port}"
    res = await replay([row(0, [1], 10, 2), row(0, [2], 10, 2)], down, model="m", timeout_s=5)
    assert [r.status for r in res.requests] == ["error", "error"]
    assert all("Connect" in r.error for r in res.requests)
    with pytest.raises(ReplayError, match="could not discover a model"):
        await replay([row(0, [1], 10, 2)], down, timeout_s=5)


async def test_text_and_chat_prompts_tokenize_to_the_synthesized_ids():
    synth = PromptSynthesizer()
    rows = [row(0, [10, 11], 1000, 2), row(300, [10, 11, 12], 1100, 2)]
    with FakeOpenAI(ttft_s=0.02) as srv:
        text = await replay(rows, srv.url, model="m", prompt_mode="text", synthesizer=synth, timeout_s=30)
        assert isinstance(srv.received[0].body["prompt"], str)
        assert [x.token_ids for x in srv.received] == [synth.token_ids(r, request_key=i) for i, r in enumerate(rows)]
        assert text.requests[1].cached_tokens == 992  # 1000 tokens seen, cached in 16-token chunks
        chat = await replay(rows, srv.url, model="m", api="chat", synthesizer=synth, timeout_s=30)
        assert chat.meta["prompt_mode"] == "text" and srv.received[-1].path == "/v1/chat/completions"
        assert srv.received[-1].token_ids == synth.token_ids(rows[1], request_key=1)
        assert [r.output_tokens for r in chat.requests] == [2, 2]


def test_cli_replays_a_trace_file_and_writes_results(tmp_path):
    from infernex.cli import app

    if SHARED.is_file():
        trace = SHARED
    else:
        trace = tmp_path / "t.jsonl"
        write_trace(trace, [row(i * 10, [1, 2, i + 3], 1400, 3) for i in range(5)])
    out = tmp_path / "res.json"
    with FakeOpenAI(ttft_s=0.01, itl_s=0.001) as srv:
        result = CliRunner().invoke(app, ["replay-trace", "--trace", str(trace), "--url", srv.url, "--limit", "5",
                                          "--time-scale", "0.001", "--out", str(out), "--no-progress",
                                          "--model", "m"])
        assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["requests"]) == 5 and data["summary"]["ok"] == 5
    assert data["meta"]["trace"] == str(trace) and data["meta"]["time_scale"] == 0.001
    assert all(r["ttft_s"] > 0 for r in data["requests"])
    assert "TTFT p50" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    result = CliRunner().invoke(app, ["replay-trace", "--trace", str(bad), "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "line 1" in result.output


def test_cli_gen_workload_is_reproducible(tmp_path):
    from infernex.cli import app

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        r = CliRunner().invoke(app, ["gen-workload", "--kind", "chat", "--n", "200", "--seed", "1", "-o", str(p)])
        assert r.exit_code == 0, r.output
    assert a.read_bytes() == b.read_bytes() and len(a.read_text().splitlines()) == 200
    r = CliRunner().invoke(app, ["trace-stats", str(a), "--check-blocks"])
    assert r.exit_code == 0 and '"requests": 200' in r.output


async def test_stop_cancels_in_flight_and_returns_the_partial_result():
    import asyncio

    with FakeOpenAI(ttft_s=0.02, ttft_by_index={1: 30.0}) as srv:
        rows = [row(0, [1], 10, 2), row(0, [2], 10, 2), row(60_000, [3], 10, 2)]
        stop = asyncio.Event()
        done = []
        task = asyncio.create_task(replay(rows, srv.url, model="m", timeout_s=60, stop=stop, on_result=done.append))
        for _ in range(400):  # wait until the first finished and the second is in flight
            if done and len(srv.received) >= 2:
                break
            await asyncio.sleep(0.05)
        stop.set()
        res = await asyncio.wait_for(task, 20)
    assert res.meta["stopped"] is True and res.meta["unsent"] == 1
    assert [r.status for r in res.requests] == ["ok", "cancelled"]
    assert res.summary.cancelled == 1 and res.summary.ok == 1


async def test_result_file_round_trips(tmp_path):
    from simulator.workloads.client import ReplayResult

    with FakeOpenAI(ttft_s=0.01) as srv:
        res = await replay([row(0, [1], 40, 3)], srv.url + "/v1", model="m", timeout_s=30)
    path = tmp_path / "out" / "r.json"
    res.write(path)
    back = ReplayResult.read(path)
    assert back == res and back.requests[0].output_tokens == 3


async def test_several_urls_take_the_requests_in_turn_in_arrival_order():
    servers = [FakeOpenAI(ttft_s=0.01, itl_s=0.001).start() for _ in range(2)]
    try:
        rows = [row(100 * (5 - i), [i], 50, 2) for i in range(6)]  # arrival order is the reverse of the list
        res = await replay(rows, [s.url for s in servers], model="m", timeout_s=30)
        assert [r.status for r in res.requests] == ["ok"] * 6 and res.meta["url"] == [s.url for s in servers]
        by_arrival = sorted(range(6), key=lambda i: rows[i].timestamp)
        assert sorted(x.index for x in servers[0].received) == sorted(by_arrival[0::2])
        assert sorted(x.index for x in servers[1].received) == sorted(by_arrival[1::2])
        with pytest.raises(ReplayError, match="no URL"):
            await replay(rows, [], model="m")
    finally:
        for s in servers:
            s.stop()
