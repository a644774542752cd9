"""Every command finds the broker by one rule (docs/architecture.md, "Finding the broker"): here a
local broker known only through its stack home (``--home``), as ``rollstream stack up`` leaves it,
with no ``ROLLSTREAM_*`` variable in the commands' environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.probe import NO_BROKER

RECORD = """
import sys
import store as st
from schemas import events as ev
from store.rows import COLUMNS, event_row
run_id, path = sys.argv[1], sys.argv[2]
client = st.connect(f"chdb://{path}")
st.apply_ddl(client)
e = ev.RunStarted(run_id=run_id, config_json="{}", host="test")
row = event_row(f"rs.{run_id}.control", 0, 0, run_id, "control", None, e, None, e.ts)
client.insert("events", [row], column_names=COLUMNS["events"])
"""
"""Records one ``RunStarted`` of run ``argv[1]`` in a new embedded store at ``argv[2]``: the
smallest record ``replay into`` re-publishes."""


def clean_env() -> dict[str, str]:
    """This process's environment without a ``ROLLSTREAM_*`` variable (the jar cache's may stay)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_") or k == "ROLLSTREAM_CACHE"}


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", "--home", str(home), *args], capture_output=True,
                          text=True, env=dict(clean_env(), COLUMNS="200"), timeout=timeout)  # tables unwrapped


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def recorded_run(runs: Path) -> str:
    """A run id with a one-event record in ``runs/<id>/store`` (and an empty config.yaml)."""
    run_id = f"brk-{uuid.uuid4().hex[:8]}"
    (runs / run_id).mkdir(parents=True)
    (runs / run_id / "config.yaml").write_text("{}\n")
    res = subprocess.run([sys.executable, "-c", RECORD, run_id, str(runs / run_id / "store")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return run_id


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """``rollstream --home HOME stack up`` in a home of this module: ``(home, its broker's address)``;
    stopped with ``stack down`` afterwards (the shared test broker is never touched)."""
    home = tmp_path_factory.mktemp("stack") / "home"
    up = cli(home, "stack", "up", timeout=300)
    found = re.search(r"kafka: started at (\S+)", up.stdout)
    try:
        assert up.returncode == 0 and found, up.stdout + up.stderr
        yield home, found.group(1)
    finally:
        down = cli(home, "stack", "down")
        assert down.returncode == 0 and "kafka: stopped" in down.stdout, down.stdout + down.stderr


def test_replay_into_and_topics_find_the_broker_of_the_home(local_stack: tuple[Path, str], tmp_path: Path) -> None:
    home, address = local_stack
    runs = tmp_path / "runs"
    source = recorded_run(runs)
    new = f"{source}-copy"

    status = cli(home, "stack", "status")
    assert status.returncode == 0 and f"kafka: {address} (PLAINTEXT) — up" in status.stdout, status.stdout

    copied = cli(home, "replay", "into", source, new, "--runs-dir", str(runs), "--format", "json")
    assert copied.returncode == 0, copied.stdout + copied.stderr
    summary = json.loads(copied.stdout)
    assert summary["kafka"] == address and summary["total"] == 1 and summary["topics"]["control"] == 1

    # `topics` finds the same broker: the new run's topics, made by `replay into`, are there
    listed = cli(home, "topics", "list", new)
    assert listed.returncode == 0 and f"rs.{new}.control" in listed.stdout, listed.stdout + listed.stderr
    described = cli(home, "topics", "describe", new)
    assert described.returncode == 0, described.stderr
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in described.stdout.splitlines() if f"rs.{new}." in ln]
    assert ["control", f"rs.{new}.control", "1", "delete", "1"] in rows, described.stdout  # the message replayed


def test_without_a_broker_every_command_says_how_to_get_one(tmp_path: Path) -> None:
    home, runs = tmp_path / "home", tmp_path / "runs"  # a home where no broker was ever started
    source = recorded_run(runs)
    for args in (("replay", "into", source, f"{source}-copy", "--runs-dir", str(runs)),
                 ("topics", "list"),
                 ("service", "recorder", "--run", source, "--runs-dir", str(runs))):
        assert one_error_line(cli(home, *args)) == f"error: {NO_BROKER}", args
    assert not (home / "kafka").exists()  # none of them started one
