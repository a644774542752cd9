"""``rollstream sql``: query the record of a run (SQL, or a ready query by name)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from cli.app import UserError, app, console, friendly, opt, out

_RUN_PARAM = re.compile(r"\{run(?::[^}]*)?\}")
"""A query's ``{run:Type}`` parameter, or ``{run}`` (short for ``{run:String}``)."""
_FORMAT_CLAUSE = re.compile(r"\bFORMAT\s+(\w+)\s*$", re.IGNORECASE)
"""A read query's own trailing ``FORMAT`` clause: the client appends its own (``--format`` picks the output)."""


def latest_run(runs_dir: Path) -> str:
    """The run of ``runs_dir`` started last that has a record (:func:`store.runs.latest_recorded_run`)."""
    from store.runs import latest_recorded_run

    rid = latest_recorded_run(runs_dir)
    if rid is None:
        some = [p.parent.name for p in runs_dir.glob("*/config.yaml")]
        why = f"none of its {len(some)} runs has a record yet" if some else "no runs there"
        raise UserError(f"no run to query in {runs_dir}: {why} (give --run RUN, or --store DSN)")
    return rid


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
    if st.check_dsn(dsn) == "chdb" and must_exist and not Path(st.chdb_path(dsn)).exists():
        raise UserError(f"run {rid} has no store at {st.chdb_path(dsn)}")
    return dsn


def _params(given: list[str]) -> dict[str, str]:
    params = {}
    for p in given:
        k, sep, v = p.partition("=")
        if not sep:
            raise UserError(f"--param {p!r}: expected name=value")
        params[k] = v
    return params


@app.command("sql")
@friendly
def sql_cmd(
    query: str = typer.Argument(None, help="SQL (ClickHouse dialect), or - to read it from stdin; {name:Type} "
                                "placeholders take --param, {run} (or {run:String}) is the run. A query starting "
                                "with a -- comment goes after --. With --query: the run (as --run)."),
    named: str = typer.Option("", "--query", help="Run a ready query of docs/analytics.md by name "
                              "(e.g. staleness, latency, curve); an unknown name lists them."),
    run: str = typer.Option("", "--run", help="Run to query, and the value of {run} (default: the latest run "
                            "of --runs-dir that has a record). With --store it only fills {run}."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
    param: list[str] = typer.Option([], "--param", help="Query parameter name=value (repeatable)."),
    write: bool = typer.Option(False, "--write", help="Allow statements that change data."),
) -> None:
    """Query the record of a run (tables: events, samples, episodes, train_steps, evals, weights, dlq, ...; docs/analytics.md), or run a ready query by name (--query). Works during a run too: the run's recorder answers read-only queries.

    The store is --store / ROLLSTREAM_STORE when given, else the one the run's config names, else the run's embedded store <runs-dir>/<run>/store. A table with no rows prints "0 rows".
    """
    import contextlib
    import csv
    import json

    from rich.table import Table

    import store as st
    from store.queries import UnknownQuery
    from store.queries import query as ready_query
    from store.server import check_read_only

    if fmt not in ("table", "csv", "json"):
        raise UserError(f"--format {fmt!r}: one of table, csv, json")
    if named:
        if query and run and query != run:
            raise UserError(f"--query {named} {query} --run {run}: give the run once")
        run = run or query or ""
        try:
            query = ready_query(named)
        except UnknownQuery as e:
            raise UserError(str(e)) from None
    elif query is None:
        raise UserError("no query: give SQL, - (read it from stdin) or --query NAME")
    elif query == "-":
        query = sys.stdin.read()
        if not query.strip():
            raise UserError("no query on stdin")
    why = None if write else check_read_only(query)
    if why is not None:
        raise UserError(f"{why} without --write")
    params = _params(param)
    if not run and not opt("store"):
        run = latest_run(runs_dir)
        if console.is_terminal:
            console.print(f"[dim]run {run} (the latest with a record)[/dim]")
    if _RUN_PARAM.search(query) and "run" not in params:
        if not run:
            raise UserError("the query takes {run}: name the run (--run RUN, or --param run=RUN)")
        query = query.replace("{run}", "{run:String}")
        params["run"] = run
    dsn = store_of(run, runs_dir, must_exist=not write)
    # reads go through the running recorder when it holds the store; writes need the store itself
    client = st.connect(dsn) if write else st.connect_reader(dsn)
    served = getattr(client, "served", False)
    settings = {} if write or served else {"readonly": 2}
    if not write:
        query = query.rstrip().rstrip(";")  # the client appends SETTINGS/FORMAT clauses
        own = _FORMAT_CLAUSE.search(query)
        if own:
            raise UserError(f"the query ends with FORMAT {own[1]}: leave it out and give --format table, csv "
                            "or json instead")
    waiting = console.status("running the query...") if console.is_terminal else contextlib.nullcontext()
    try:
        with waiting:
            result = client.query(query, parameters=params or None, settings=settings)
    except Exception as e:
        text = str(e).strip()
        raise UserError(f"query failed: {text.splitlines()[0][:400] if text else type(e).__name__}") from None
    cols, rows = list(result.column_names), result.result_rows
    if not cols and not rows:  # the embedded engine names no columns of an empty result: ask for them
        with contextlib.suppress(Exception):
            described = client.query(f"DESCRIBE (\n{query}\n)", parameters=params or None, settings=settings)
            cols = [str(r[0]) for r in described.result_rows]
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
        if cols:
            out.print(table)
        if not rows:
            out.print("0 rows")
