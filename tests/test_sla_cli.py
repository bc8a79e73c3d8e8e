"""``infernex sla report|migrate|counts`` on a chDB store, and duration parsing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from consumers import sla_queries as Q
from consumers.sla_store import ChdbStore
from infernex.cli import app
from infernex.commands.sla import parse_duration


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("15m", 900), ("1h", 3600), ("2d", 172800),
                                           ("1h30m", 5400), ("45", 45), ("1.5h", 5400)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "h", "1x", "1h foo", "-5m"])
def test_parse_duration_rejects(bad):
    with pytest.raises(typer.BadParameter):
        parse_duration(bad)


@pytest.fixture
def chdb_env(tmp_path, monkeypatch):
    path = tmp_path / "chdb"
    monkeypatch.setenv("INFERNEX_SLA__CHDB_PATH", str(path))
    monkeypatch.setenv("INFERNEX_SLA__TARGETS__TTFT_S", "0.2")
    store = ChdbStore(path, "infernex")
    Q.migrate(store)
    now = time.time()
    rows = []
    for i in range(200):
        rows.append(json.dumps({
            "request_id": f"r{i}", "ts": now - 1800 + i, "pool": "pool-a" if i % 2 else "pool-b", "role": "pd",
            "model": "m", "prompt_tokens": 100, "output_tokens": 10, "cached_tokens": 25,
            "ttft_s": 0.1 if i % 4 else 0.3, "itl_s": 0.01, "e2e_s": 0.5, "status": "ok",
        }).encode())
    store.insert_json_each_row("request_records", rows)
    store.close()
    return path


def test_report_table_and_json(chdb_env):
    runner = CliRunner()
    res = runner.invoke(app, ["sla", "report", "--since", "1h"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "pool-a" in res.output and "pool-b" in res.output
    assert "TTFT 200 ms" in res.output
    res = runner.invoke(app, ["sla", "report", "--since", "1h", "--json", "--pool", "pool-b"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [(r["pool"], r["requests"]) for r in rows] == [("pool-b", 100)]
    assert rows[0]["attainment"] == pytest.approx(0.5)  # every 4th (all of them even) misses 0.2 s
    assert rows[0]["prefix_hit_rate"] == pytest.approx(0.25)
    res = runner.invoke(app, ["sla", "report", "--since", "10m"])
    assert res.exit_code == 0 and "no request records" in res.output
    res = runner.invoke(app, ["sla", "report", "--since", "soon"])
    assert res.exit_code != 0


def test_report_by_minute(chdb_env):
    res = CliRunner().invoke(app, ["sla", "report", "--since", "1h", "--by-minute", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert sum(r["requests"] for r in rows) == 200
    assert {r["pool"] for r in rows} == {"pool-a", "pool-b"}


def test_rollup_rebuild_and_report(chdb_env):
    runner = CliRunner()
    res = runner.invoke(app, ["sla", "rollup", "--since", "2h"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sla", "report", "--since", "2h", "--rollup", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["pool"]: r for r in json.loads(res.output)}
    assert rows["pool-b"]["requests"] == 100 and rows["pool-b"]["attainment"] == pytest.approx(0.5)
    res = runner.invoke(app, ["sla", "report", "--rollup", "--by-minute"])
    assert res.exit_code != 0


def test_migrate_and_counts(chdb_env):
    runner = CliRunner()
    res = runner.invoke(app, ["sla", "migrate"])
    assert res.exit_code == 0, res.output
    assert "applied: nothing" in res.output and f"schema version {Q.MIGRATIONS[-1].version}" in res.output
    res = runner.invoke(app, ["sla", "counts"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["request_records"] == 200



def test_planner_once_publishes_hints(chdb_env, nats_server, prefix, tmp_path, monkeypatch):
    import asyncio

    import yaml

    from consumers import bus
    from schemas import ScalingHint
    from schemas import subjects as S
    from schemas.config import NatsConfig

    profile = Path(__file__).resolve().parents[1] / "deploy" / "planner-profile.example.yaml"
    cfg = tmp_path / "infernex.yaml"
    cfg.write_text(yaml.safe_dump({"sla": {"planner": {"interval_s": 3600, "predictor": "constant", "pools": [
        {"pool": "pool-a", "profile_file": str(profile)}]}}}))
    monkeypatch.setenv("INFERNEX_NATS__SERVERS", nats_server.url)
    monkeypatch.setenv("INFERNEX_NATS__SUBJECT_PREFIX", prefix)
    runner = CliRunner()
    res = runner.invoke(app, ["--config", str(cfg), "streams", "apply"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["--config", str(cfg), "planner", "--once"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "pool-a/prefill: 1 -> 1" in res.output and "pool-a/decode" in res.output

    async def read_hints():
        nc = await bus.connect(NatsConfig(servers=[nats_server.url]))
        try:
            js = nc.jetstream()
            sub = await js.subscribe(S.with_prefix(prefix, S.ALL_AUTOSCALE_HINTS), deliver_policy="all")
            got = [ScalingHint.from_json((await sub.next_msg(timeout=10)).data) for _ in range(2)]
            await sub.unsubscribe()
            for spec_name in ("ROUTER", "ENGINE", "DIAGNOSIS", "AUTOSCALE", "DLQ", "KV_EVENTS", "DEVICE_TELEMETRY"):
                try:
                    await js.delete_stream(f"{prefix.upper()}_{spec_name}")
                except Exception:  # noqa: BLE001
                    pass
            return got
        finally:
            await nc.close()

    hints = asyncio.run(read_hints())
    assert {h.role for h in hints} == {"prefill", "decode"}
    # 100 pool-a records over the last hour: 100 / 3600 req/s needs one replica each
    assert all(h.desired == 1 and h.inputs["observed_rate"] == pytest.approx(100 / 3600) for h in hints)


def test_planner_without_pools_is_a_clear_error(chdb_env):
    res = CliRunner().invoke(app, ["planner", "--once"])
    assert res.exit_code == 2
    assert "no pools to plan" in res.output
