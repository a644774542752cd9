"""``rollstream sql`` on a real (empty) store: ready queries by name, ``{run}`` from the run, the
latest run with a record, "0 rows"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.queries import QUERIES
from tests.cli.test_cli import cli, one_error_line


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``r1`` with a store, then ``r2``, started later, without one."""
    runs = tmp_path_factory.mktemp("runs")
    setup = subprocess.run([sys.executable, "-c", "import store as st; "
                            f"st.apply_ddl(st.connect(st.default_dsn({str(runs)!r}, 'r1')))"],
                           capture_output=True, text=True, timeout=120)
    assert setup.returncode == 0, setup.stderr
    for rid in ("r1", "r2"):
        (runs / rid).mkdir(exist_ok=True)
        (runs / rid / "config.yaml").write_text("{}\n")
        time.sleep(0.01)
    return runs


def test_a_ready_query_by_name_on_the_latest_run_with_a_record(runs: Path) -> None:
    res = cli("sql", "--query", "staleness", "--runs-dir", str(runs))  # r2 is newer but has no record
    assert res.returncode == 0, res.stderr
    assert "versions_behind" in res.stdout and res.stdout.rstrip().endswith("0 rows")


def test_an_unknown_query_name_lists_the_names(runs: Path) -> None:
    line = one_error_line(cli("sql", "--query", "stale", "r1", "--runs-dir", str(runs)))
    assert line == f"error: unknown query 'stale': one of {', '.join(QUERIES)}"


def test_run_fills_the_run_parameter(runs: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_STORE"}
    store = f"chdb://{runs / 'r1' / 'store'}"
    res = cli("sql", "SELECT {run} AS a, {run:String} AS b", "--store", store, "--run", "other", "--format", "csv",
              env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["a,b", "other,other"]
    line = one_error_line(cli("sql", "SELECT {run}", "--store", store, env=env))
    assert "the query takes {run}" in line


def test_a_query_of_its_own_format_gets_one_line(runs: Path) -> None:
    """The client appends its own FORMAT clause: a query's own is refused by name, not by a syntax error."""
    line = one_error_line(cli("sql", "SELECT 1 FORMAT TSV;", "--run", "r1", "--runs-dir", str(runs)))
    assert line == "error: the query ends with FORMAT TSV: leave it out and give --format table, csv or json instead"
    res = cli("sql", "SELECT 'FORMAT x' AS f", "--run", "r1", "--runs-dir", str(runs), "--format", "csv")
    assert res.returncode == 0 and res.stdout.splitlines() == ["f", "FORMAT x"], res.stderr
