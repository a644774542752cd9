"""Every table of a record as sorted JSON rows, to compare two records of one run table by table
(the live recorder's and ``rollstream record``'s): one SQL query per store, runnable through
``rollstream sql`` (a second embedded store needs a process of its own)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

SKIPPED_TABLES = {"recorder_lag": "the live recorder's lag measurements: the recorder's own rows, not the topics'"}
"""Tables left out of the comparison, and why."""
SKIPPED_COLUMNS = {("events", "ingested_at"): "when the row was stored",
                   ("schema_migrations", "applied_at"): "when the store applied the DDL file"}
"""Columns left out of the comparison (they say when a store wrote, not what), and why."""

COLUMNS_QUERY = ("SELECT table, name FROM system.columns WHERE database = currentDatabase() AND table IN "
                 "(SELECT name FROM system.tables WHERE database = currentDatabase() AND engine LIKE '%MergeTree') "
                 "ORDER BY table, position")
"""``(table, column)`` of every table of a store (views left out: they are queries over the tables)."""


def columns_of(rows: list[Any]) -> dict[str, list[str]]:
    """Table -> its columns, from the rows of :data:`COLUMNS_QUERY` (tuples or dicts)."""
    out: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        table, name = (r["table"], r["name"]) if isinstance(r, dict) else r
        out[table].append(name)
    return dict(out)


def dump_query(columns: dict[str, list[str]], run_id: str) -> str:
    """One query: ``(table, row)`` for every row of every table (``FINAL``: the record as it reads)
    of ``run_id`` (tables with a ``run_id`` column), ``row`` the row's compared columns as JSON."""
    parts = []
    for table, cols in sorted(columns.items()):
        if table in SKIPPED_TABLES:
            continue
        keep = ", ".join(f"`{c}`" for c in cols if (table, c) not in SKIPPED_COLUMNS)
        where = f" WHERE run_id = '{run_id}'" if "run_id" in cols else ""
        parts.append(f"SELECT '{table}' AS table, formatRowNoNewline('JSONEachRow', {keep}) AS row "
                     f"FROM `{table}` FINAL{where}")
    return " UNION ALL ".join(parts) + " ORDER BY table, row"


def by_table(rows: list[Any]) -> dict[str, list[str]]:
    """Table -> its sorted JSON rows, from the rows of :func:`dump_query` (tuples or dicts)."""
    out: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        table, row = (r["table"], r["row"]) if isinstance(r, dict) else r
        out[table].append(row)
    return {t: sorted(v) for t, v in out.items()}
