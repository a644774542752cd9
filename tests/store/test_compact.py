"""Compacting an embedded store (:mod:`store.compact`): the parts merges made obsolete leave the
disk, every row stays."""

from __future__ import annotations

from pathlib import Path

import store as st
from store.compact import drop_outdated_parts


def test_outdated_parts_are_deleted_and_every_row_stays(store_dsn: str, run_id: str) -> None:
    client = st.connect(store_dsn)
    table = f"compact_{run_id}"
    client.command(f"CREATE TABLE {table} (k UInt32, v String) ENGINE = MergeTree ORDER BY k")
    for i in range(6):  # six inserts, six parts; merged into one, five are outdated
        client.insert(table, [[i * 10 + j, "x" * 100] for j in range(10)], column_names=["k", "v"])
    client.command(f"OPTIMIZE TABLE {table} FINAL")
    parts = f"SELECT path, active FROM system.parts WHERE database = currentDatabase() AND table = '{table}'"
    before = client.query(parts).result_rows
    outdated = [Path(p) for p, active in before if not active]
    assert len(outdated) >= 5 and all(p.is_dir() for p in outdated)
    deleted, n_bytes = drop_outdated_parts(client, st.chdb_path(store_dsn))
    assert deleted >= len(outdated) and n_bytes > 0
    assert not any(p.exists() for p in outdated)
    assert [Path(p).is_dir() for p, active in before if active] == [True]
    assert client.query(f"SELECT count(), sum(k) FROM {table}").result_rows == [(60, sum(range(60)))]
    # merges run again afterwards
    client.insert(table, [[100, "y"]], column_names=["k", "v"])
    client.command(f"OPTIMIZE TABLE {table} FINAL")
    assert client.query(f"SELECT count() FROM system.parts WHERE database = currentDatabase() AND table = '{table}' "
                        "AND active").result_rows == [(1,)]
    client.command(f"DROP TABLE {table} SYNC")
