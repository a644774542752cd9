from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

import store as st


def test_bad_dsns_are_one_line_errors() -> None:
    for dsn, needle in [
        ("mysql://x", "use chdb:///path"),
        ("chdb://", "need a path"),
        ("http://", "host:8123"),
    ]:
        with pytest.raises(st.StoreError, match=needle):
            st.connect(dsn)


def test_ddl_applies_twice_and_insert_query_work(store_dsn: str, run_id: str) -> None:
    client = st.connect(store_dsn)
    st.apply_ddl(client)
    again = st.apply_ddl(client)  # idempotent: nothing new, no error
    assert again == []
    versions = [
        r[0] for r in client.query("SELECT version FROM schema_migrations FINAL ORDER BY version").result_rows
    ]
    assert versions == [v for v, _ in st.ddl_files()]
    rows = [
        [
            f"rs.{run_id}.tasks",
            0,
            i,
            run_id,
            "tasks",
            "RolloutTask",
            f"g/{i}",
            f"e{i}",
            datetime.fromtimestamp(1.7e9 + i, UTC),
            0,
            "{}",
        ]
        for i in range(100)
    ]
    cols = [
        "topic",
        "partition",
        "offset",
        "run_id",
        "name",
        "kind",
        "key",
        "event_id",
        "ts",
        "policy_version",
        "payload",
    ]
    client.insert("events", rows, column_names=cols)
    client.insert("events", rows[:10], column_names=cols)  # a redelivered batch
    n = client.query("SELECT count() FROM events FINAL WHERE run_id = {r:String}", parameters={"r": run_id})
    assert n.result_rows[0][0] == 100
    top = client.query(
        "SELECT max(offset), uniqExact(key) FROM events FINAL WHERE run_id = {r:String}",
        parameters={"r": run_id},
    )
    assert top.result_rows[0] == (99, 100)
    assert st.ping(client)


def test_every_table_keeps_insert_tokens_and_an_apply_once_file_is_not_run_again(store_dsn: str) -> None:
    """009 gives each table a deduplication window (the recorder's retried batches are idempotent);
    it is marked ``-- apply once``: a later open does not run it again."""
    client = st.connect(store_dsn)
    st.apply_ddl(client)

    def windows() -> dict[str, str]:
        rows = client.query("SELECT name, extract(engine_full, 'non_replicated_deduplication_window = (\\d+)') "
                            "FROM system.tables WHERE database = currentDatabase() AND engine LIKE '%MergeTree' "
                            "AND name != 'schema_migrations'").result_rows
        return dict(rows)

    assert set(windows().values()) == {"1000"} and "events" in windows() and len(windows()) == 12
    client.command("ALTER TABLE recorder_lag MODIFY SETTING non_replicated_deduplication_window = 7")
    try:
        st.apply_ddl(client)
        assert windows()["recorder_lag"] == "7"  # 009 was not run again
    finally:
        client.command("ALTER TABLE recorder_lag MODIFY SETTING non_replicated_deduplication_window = 1000")


def test_store_in_use_by_another_process_is_a_clear_error(tmp_path: Path) -> None:
    """chDB allows one process per store directory: the second gets one clear line."""
    dsn = f"chdb://{tmp_path / 'busy'}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import store; c = store.connect({dsn!r}); print('open', flush=True); "
            "import time; time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import store\ntry:\n store.connect({dsn!r})\n"
                "except store.StoreError as e:\n print(e)",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "in use by another process" in probe.stdout, probe.stdout + probe.stderr
    finally:
        holder.kill()
        holder.wait()
