"""``rollstream sql``: query the record of a run."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from cli.app import UserError, app, console, friendly, opt, out


def latest_run(runs_dir: Path) -> str:
    """The run of ``runs_dir`` whose config was written last."""
    runs = sorted((p for p in runs_dir.glob("*/config.yaml")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"no runs in {runs_dir}")
    return runs[-1].parent.name


def store_of(run: str, runs_dir: Path, *, must_exist: bool = True) -> str:
    """The DSN to read: --store / $ROLLSTREAM_STORE, else that of ``run`` (default: the latest run)
    as ``rollstream run`` recorded it (:func:`store.runs.record_dsn`). An embedded store
    that does not exist is an error unless ``must_exist`` is false (``--write`` creates one)."""
    import store as st
    from store.runs import record_dsn

    explicit = opt("store")
    if explicit:
        if st.check_dsn(explicit) == "chdb" and must_exist and not Path(st.chdb_path(explicit)).exists():
            raise UserError(f"no store at {st.chdb_path(explicit)} (from --store / ROLLSTREAM_STORE)")
        return str(explicit)
    rid = run or latest_run(runs_dir)
    dsn = record_dsn(runs_dir, rid)
    if st.check_dsn(dsn) == "chdb" and not Path(st.chdb_path(dsn)).exists():
        raise UserError(f"run {rid} has no store at {st.chdb_path(dsn)}")
    return dsn


@app.command("sql")
@friendly
def sql_cmd(
    query: str = typer.Argument(..., help="SQL (ClickHouse dialect), or - to read it from stdin; {name:Type} "
                                "placeholders take --param. A query starting with a -- comment goes after --."),
    run: str = typer.Option("", "--run", help="Run whose store to query (default: the latest run); "
                            "ignored with --store."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
    param: list[str] = typer.Option([], "--param", help="Query parameter name=value (repeatable)."),
    write: bool = typer.Option(False, "--write", help="Allow statements that change data."),
) -> None:
    """Query the record of a run (tables: events, samples, episodes, train_steps, evals, weights, dlq, ...; docs/analytics.md). Works during a run too: the run's recorder answers read-only queries.

    The store is --store / ROLLSTREAM_STORE when given, else the one the run's config names, else the run's embedded store <runs-dir>/<run>/store.
    """
    import contextlib
    import csv
    import json

    from rich.table import Table

    import store as st
    from store.server import check_read_only

    if fmt not in ("table", "csv", "json"):
        raise UserError(f"--format {fmt!r}: one of table, csv, json")
    if query == "-":
        query = sys.stdin.read()
        if not query.strip():
            raise UserError("no query on stdin")
    why = None if write else check_read_only(query)
    if why is not None:
        raise UserError(f"{why} without --write")
    params = {}
    for p in param:
        k, sep, v = p.partition("=")
        if not sep:
            raise UserError(f"--param {p!r}: expected name=value")
        params[k] = v
    dsn = store_of(run, runs_dir, must_exist=not write)
    # reads go through the running recorder when it holds the store; writes need the store itself
    client = st.connect(dsn) if write else st.connect_reader(dsn)
    served = getattr(client, "served", False)
    settings = {} if write or served else {"readonly": 2}
    if not write:
        query = query.rstrip().rstrip(";")  # the client appends SETTINGS/FORMAT clauses
    waiting = console.status("running the query...") if console.is_terminal else contextlib.nullcontext()
    try:
        with waiting:
            result = client.query(query, parameters=params or None, settings=settings)
    except Exception as e:
        text = str(e).strip()
        raise UserError(f"query failed: {text.splitlines()[0][:400] if text else type(e).__name__}") from None
    cols, rows = list(result.column_names), result.result_rows
    if fmt == "json":
        out.print(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str), markup=False)
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    else:
        table = Table()
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*(str(v) for v in r))
        out.print(table)
