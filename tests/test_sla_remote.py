"""``infernex sla report`` while ``sla-sink`` holds the chDB directory (issue 21: "Cannot lock
file" with advice to "query through that process" and no way to): the report goes through the
running sink over NATS by itself; without a sink it is one line saying what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from consumers import sla_queries as Q
from consumers.sla_remote import _allowed
from consumers.sla_store import ChdbStore

EXE = [sys.executable, "-m", "infernex.cli"]


def _seed(path):
    store = ChdbStore(path, "infernex")
    Q.migrate(store)
    now = time.time()
    store.insert_json_each_row("request_records", [json.dumps({
        "request_id": f"r{i}", "ts": now - 600 + i, "pool": "pool-a", "role": "pd", "model": "m",
        "prompt_tokens": 100, "output_tokens": 10, "cached_tokens": 25, "ttft_s": 0.1, "itl_s": 0.01,
        "e2e_s": 0.5, "status": "ok"}).encode() for i in range(40)])
    store.close()


def test_report_goes_through_the_running_sink(tmp_path, nats_server, prefix):
    path = tmp_path / "chdb"
    _seed(path)
    env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_server.url, INFERNEX_NATS__SUBJECT_PREFIX=prefix,
               INFERNEX_SLA__CHDB_PATH=str(path))
    subprocess.run(EXE + ["streams", "apply"], env=env, check=True, capture_output=True, timeout=60)
    sink = subprocess.Popen(EXE + ["sla-sink"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        started = []
        while not any("Ctrl-C to stop" in ln for ln in started):  # the sink holds the store from here
            line = sink.stderr.readline()
            assert line, "".join(started)
            started.append(line)
        deadline = time.time() + 60
        r = None
        while time.time() < deadline:
            r = subprocess.run(EXE + ["sla", "report", "--since", "1h", "--json"], env=env, capture_output=True,
                               text=True, timeout=60)
            if r.returncode == 0:
                break
            assert sink.poll() is None, sink.stderr.read()
            time.sleep(0.5)
        assert r.returncode == 0, r.stderr
        assert "through the running sla-sink" in r.stderr  # it had to: the sink holds the lock
        rows = json.loads(r.stdout)
        assert [(x["pool"], x["requests"]) for x in rows] == [("pool-a", 40)]
        r = subprocess.run(EXE + ["sla", "counts"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["request_records"] == 40, r.stderr
        r = subprocess.run(EXE + ["sla", "report", "--since", "1h30m", "--by-minute", "--json"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and sum(x["requests"] for x in json.loads(r.stdout)) == 40, r.stderr
    finally:
        sink.terminate()
        sink.wait(timeout=30)


def test_locked_store_without_a_sink_is_one_line(tmp_path, nats_server, prefix):
    path = tmp_path / "chdb"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from consumers.sla_store import ChdbStore; s = ChdbStore(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)"), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = dict(os.environ, INFERNEX_NATS__SERVERS=nats_server.url, INFERNEX_NATS__SUBJECT_PREFIX=prefix,
                   INFERNEX_SLA__CHDB_PATH=str(path))
        r = subprocess.run(EXE + ["sla", "report"], env=env, capture_output=True, text=True, timeout=60)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "another process holds it" in lines[0] and "no sla-sink answers" in lines[0]
        assert "infernex sla-sink" in lines[0]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("sql, ok", [
    ("SELECT 1", True), ("  with x AS (SELECT 1) SELECT * FROM x", True), ("SELECT 1;", True),
    ("DROP TABLE infernex.request_records", False), ("SELECT 1; DROP TABLE t", False),
    ("INSERT INTO t VALUES (1)", False), ("ALTER TABLE t DELETE WHERE 1", False),
])
def test_only_reads_are_answered(sql, ok):
    assert (_allowed(sql) is None) is ok
