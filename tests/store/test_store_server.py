"""Read-only queries through the process that holds an embedded store.

In process: the server answers reads, refuses every kind of write (also when the client-side
check is bypassed), keeps the recorder's own session writable, and cleans up after itself.
End to end: `rollstream sql` and `rollstream report` work while a real recorder (`rollstream
service recorder`) records a run from the real broker, writes are refused, and after the
recorder stops (gracefully, or killed with its endpoint file left behind) the store is read
directly again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import store as st
from store import server as ss
from tests.store.recorded_run import publish, run_events

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("query", [
    "SELECT 1", "select 1;", "  (SELECT 1)", "-- columns: a\nSELECT 1 AS a", "/* c */ DESCRIBE TABLE events",
    "WITH x AS (SELECT 1) SELECT * FROM x", "SHOW TABLES", "EXPLAIN SELECT 1", "EXISTS TABLE events",
    "SELECT ';' AS semi, 'a\\'b;' AS quoted", "SELECT `a;b` FROM t", "SELECT 'INTO OUTFILE'",
])
def test_read_only_statements_pass(query: str) -> None:
    assert ss.check_read_only(query) is None


@pytest.mark.parametrize(("query", "why"), [
    ("INSERT INTO events SELECT * FROM events", "only read-only"),
    ("DROP TABLE events", "only read-only"),
    ("SYSTEM FLUSH LOGS", "only read-only"),
    ("-- SELECT\nALTER TABLE events DELETE WHERE 1", "only read-only"),
    ("SELECT 1; DROP TABLE events", "one statement"),
    ("SELECT 1 INTO OUTFILE '/tmp/x'", "INTO OUTFILE"),
    ("", "only read-only"),
])
def test_other_statements_are_refused(query: str, why: str) -> None:
    assert why in (ss.check_read_only(query) or "")


def raw_request(endpoint: ss.Endpoint, req: dict[str, Any]) -> Any:
    """Send one request frame as-is (no client-side checks)."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=30) as sock:
        ss.send_message(sock, req)
        return ss.recv_message(sock, ss.MAX_RESPONSE_BYTES)


def test_server_reads_refuses_writes_and_cleans_up(store_dsn: str, run_id: str) -> None:
    main = st.connect(store_dsn)
    st.apply_ddl(main)
    lock = threading.Lock()
    server = ss.StoreServer(store_dsn, lock, max_execution_s=2.0)
    server.endpoint.write_text('{"host": "127.0.0.1", "port": 1, "token": "stale", "pid": 1}')  # a crashed one's
    server.start()
    try:
        endpoint = ss.read_endpoint(server.endpoint)
        assert endpoint is not None and endpoint.port == server.port and endpoint.pid == os.getpid()
        assert stat.S_IMODE(server.endpoint.stat().st_mode) == 0o600
        client = ss.RemoteClient(endpoint)
        res = client.query("SELECT version, name, applied_at, map(1, 2) AS m FROM schema_migrations FINAL "
                           "WHERE version >= {v:UInt32} ORDER BY version", parameters={"v": 2})
        assert res.column_names == ("version", "name", "applied_at", "m")
        assert [r[:2] for r in res.result_rows] == [(v, p.name) for v, p in st.ddl_files() if v >= 2]
        assert isinstance(res.result_rows[0][2], str) and res.result_rows[0][3] == {1: 2}

        token = endpoint.token
        refusals = {
            "INSERT INTO schema_migrations (version, name) VALUES (999, 'x')": "only read-only",
            "SELECT 1; DROP TABLE schema_migrations": "one statement",
            "SELECT 1 INTO OUTFILE '/tmp/rollstream-should-not-exist'": "INTO OUTFILE",
            "SELECT 1 SETTINGS readonly = 0": "readonly",  # the engine's own refusal
            "SELECT sleep(3)": "Timeout exceeded",  # max_execution_time
        }
        for query, needle in refusals.items():
            resp = raw_request(endpoint, {"token": token, "query": query})
            assert resp["ok"] is False and needle in resp["error"], (query, resp)
            assert "\n" not in resp["error"]
        assert raw_request(endpoint, {"token": "guess", "query": "SELECT 1"})["ok"] is False
        with pytest.raises(ss.ServedStoreError, match="Unknown"):
            client.query("SELECT no_such_column FROM events")
        assert client.ping()  # the connection survives a failed query
        assert not Path("/tmp/rollstream-should-not-exist").exists()

        # the server's session is read-only; the recorder's own stays writable
        assert main.query("SELECT getSetting('readonly')").result_rows[0][0] == 0
        main.insert("recorder_lag", [[run_id, "g", st_now(), 1, 1, 1, 0]],
                    column_names=["run_id", "group_id", "ts", "lag_records", "partitions", "recorded_total",
                                  "skipped_total"])
        n = client.query("SELECT count() FROM recorder_lag WHERE run_id = {r:String}", parameters={"r": run_id})
        assert n.result_rows == [(1,)]
        assert server.served >= 3 and server.refused >= 4
    finally:
        server.close()
    assert not server.endpoint.exists()
    server.close()  # idempotent
    with pytest.raises(ss.ServedStoreError):  # an open connection is closed with the server
        client.query("SELECT 1")
    # in the process that holds the store, a reader opens it directly
    assert not getattr(st.connect_reader(store_dsn), "served", False)


def st_now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


# --------------------------------------------------------------------------- end to end


def rollstream(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def start_recorder(runs: Path, run_id: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "cli", "service", "recorder", "--run", run_id,
                                 "--runs-dir", str(runs), "--set", "store.lag_report_every_s=0.5"],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)


def wait_served(endpoint_file: Path, proc: subprocess.Popen[bytes], expect_events: int, log: Path) -> None:
    """Until the recorder serves queries and has recorded ``expect_events`` events."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"recorder exited: {log.read_text()[-2000:]}"
        endpoint = ss.read_endpoint(endpoint_file)
        if endpoint is not None:
            try:
                n = ss.RemoteClient(endpoint, timeout_s=30).query("SELECT count() FROM events").result_rows[0][0]
                if n >= expect_events:
                    return
            except ss.ServedStoreError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"recorder did not serve {expect_events} events: {log.read_text()[-2000:]}")


def sql_json(query: str, runs: Path, run_id: str, env: dict[str, str], *params: str,
             stdin: bool = False) -> list[dict[str, Any]]:
    """`rollstream sql` (the query after ``--``, or on stdin) as JSON rows."""
    args = ["sql", "--run", run_id, "--runs-dir", str(runs), "--format", "json",
            *[a for p in params for a in ("--param", p)], *(["-"] if stdin else ["--", query])]
    res = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=180, input=query if stdin else None)
    assert res.returncode == 0, res.stderr
    rows: list[dict[str, Any]] = json.loads(res.stdout)
    return rows


def test_sql_and_report_during_a_run(tmp_path: Path, bootstrap: str, run_id: str) -> None:
    runs = tmp_path / "runs"
    (runs / run_id).mkdir(parents=True)
    (runs / run_id / "config.yaml").write_text(f"run:\n  runs_dir: {runs}\n")
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    events = [e for e in run_events(run_id) if type(e).__name__ != "RunFinished"]  # the run goes on
    sent = asyncio.run(publish(bootstrap, run_id, events))
    store = Path(st.chdb_path(st.default_dsn(runs, run_id)))
    endpoint_file = ss.endpoint_path(store)
    assert endpoint_file == runs / run_id / "store.endpoint"
    log = tmp_path / "recorder.log"
    status_q = "SELECT status, count() AS n FROM samples GROUP BY status ORDER BY status"
    expected_status = [{"status": s, "n": n} for s, n in
                       [("dead_letter", 1), ("dropped_stale", 1), ("filtered", 1), ("scored", 1), ("trained", 9)]]

    recorder = start_recorder(runs, run_id, env, log)
    try:
        wait_served(endpoint_file, recorder, sent, log)
        # reads go through the recorder, transparently
        assert sql_json(status_q, runs, run_id, env) == expected_status
        docs_query = ("-- columns: stage, samples, mean_s\nSELECT stage, count() AS samples, round(avg(s), 4) AS mean_s\n"
                      "FROM samples ARRAY JOIN ['gen', 'reward'] AS stage, [gen_s, reward_s] AS s\n"
                      "WHERE run_id = {run:String} AND s IS NOT NULL GROUP BY stage ORDER BY stage;")
        assert sql_json(docs_query, runs, run_id, env, f"run={run_id}") == sql_json(
            docs_query, runs, run_id, env, f"run={run_id}", stdin=True) == [
            {"stage": "gen", "samples": 12, "mean_s": 1.25}, {"stage": "reward", "samples": 12, "mean_s": 0.05}]
        lag = sql_json("SELECT count() AS n FROM recorder_lag", runs, run_id, env)
        assert lag[0]["n"] >= 1
        # writes are not served; a failing query is one line
        assert "in use by another process" in one_error_line(rollstream(
            "sql", "--write", "INSERT INTO schema_migrations (version, name) VALUES (999, 'x')", "--run", run_id,
            "--runs-dir", str(runs), env=env))
        assert "one statement" in one_error_line(rollstream(
            "sql", "SELECT 1; DROP TABLE events", "--run", run_id, "--runs-dir", str(runs), env=env))
        assert "query failed" in one_error_line(rollstream(
            "sql", "SELECT nope FROM events", "--run", run_id, "--runs-dir", str(runs), env=env))
        # the report reads the live record too
        rep = rollstream("report", run_id, "--runs-dir", str(runs), env=env, timeout=300)
        assert rep.returncode == 0, rep.stderr
        assert f"{run_id}: 2 steps done" in rep.stdout and (runs / run_id / "report" / "index.html").is_file()
    finally:
        recorder.send_signal(signal.SIGTERM)
        assert recorder.wait(timeout=60) == 0, log.read_text()[-2000:]
    assert not endpoint_file.exists()  # removed at a graceful stop
    assert sql_json(status_q, runs, run_id, env) == expected_status  # direct access again

    # a recorder killed outright leaves its endpoint file behind: readers are not fooled by it
    recorder = start_recorder(runs, run_id, env, log)
    try:
        wait_served(endpoint_file, recorder, sent, log)
    finally:
        recorder.kill()
        recorder.wait(timeout=60)
    assert endpoint_file.exists()
    assert sql_json(status_q, runs, run_id, env) == expected_status


def test_sql_from_an_empty_stdin_is_one_line(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "cli", "sql", "--runs-dir", str(tmp_path), "-"], cwd=ROOT,
                         capture_output=True, text=True, input="  \n", timeout=120)
    assert "no query on stdin" in one_error_line(res)
